//! What a [`Stream`](super::Stream) and a [`SampleReader`](super::SampleReader) share: the
//! opened sources (datasets and schemas), the node-local cache and its filler, the fetch chain
//! this consumer belongs to, the counters, and the budgets of cache copies in flight. Opened
//! once by [`Shared::open`]; both types hold it by `Arc`, and the fetch steps (`fetch`) take it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::fetch;
use super::StreamConfig;
use crate::cache::{Cache, ShardId};
use crate::dataset::Dataset;
use crate::error::{Error, Location, Result};
use crate::format::{IndexEntry, Schema, ShardReader, INDEX_ENTRY_LEN};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::order::{SampleRef, SourceShape};

pub(super) struct Source {
    pub(super) ds: Dataset,
    pub(super) schema: Arc<Schema>,
}

impl Source {
    /// Shard `shard`'s identity in the cache (its size and checksum).
    pub(super) fn id(&self, shard: usize) -> Result<ShardId> {
        let (bytes, checksum) = self.ds.manifest().shard_bytes_checksum(shard)?;
        Ok(ShardId { checksum, bytes })
    }

    /// URL of shard `shard` at the origin (the dataset's URL when the shard table cannot say).
    pub(super) fn shard_url(&self, shard: usize) -> String {
        match self.ds.manifest().shard(shard) {
            Ok(info) => self.ds.store().url(&info.key),
            Err(_) => format!("{} shard {shard}", self.ds.manifest_url()),
        }
    }
}

/// The sources' bytes and samples per shard, on average (each at least 1).
fn shard_averages(sources: &[Source]) -> (u64, f64) {
    let (bytes, samples, shards) = sources.iter().fold((0u64, 0u64, 0u64), |(b, k, n), s| {
        let m = s.ds.manifest();
        (b + m.bytes, k + m.samples, n + m.shard_count() as u64)
    });
    (
        bytes.checked_div(shards).unwrap_or(1).max(1),
        (samples as f64 / shards.max(1) as f64).max(1.0),
    )
}

/// Unit of the pending-insert budget (a semaphore permit per MiB).
pub(super) const INSERT_PERMIT_BYTES: u64 = 1 << 20;

/// Public in name only: the module is private, so nothing outside `stream` can name it, and
/// [`Opened`] cannot be implemented outside it.
pub struct Shared {
    /// Bytes of shards delivered whose cache copy is still pending, in MiB permits: the
    /// copies queue behind a slow disk without holding delivery back, up to this budget.
    pub(super) inserts: Arc<tokio::sync::Semaphore>,
    pub(super) insert_permits: u32,
    /// Writes the cache copies, at low priority.
    pub(super) filler: Option<&'static crate::cache::Filler>,
    pub(super) sources: Vec<Source>,
    pub(super) cache: Option<Cache>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) cfg: StreamConfig,
    pub(super) shapes: Vec<SourceShape>,
    /// Which fetch chain this stream fetches through (its host-daemon client and its cache
    /// directory): whole-shard fetches coalesce in the process only between streams of the
    /// same chain (streams that stand for different hosts, as in the cluster benchmark, never
    /// share one).
    pub(super) chain: u64,
    /// Indexes of cached shards read one sample at a time, when every source's fits in
    /// `index_bytes_max` (`None` otherwise).
    pub(super) indexes: Option<std::sync::Mutex<HeldIndexes>>,
    /// Shards whose samples read one at a time from the origin are tied to the manifest
    /// (`fetch::vouch`).
    pub(super) vouched: std::sync::Mutex<fetch::Vouched>,
    /// Whole shards held ahead of the consumer, sized from rates.
    pub(super) ahead: super::ahead::Ahead,
    /// Shards of this node's own share ([`Self::keeps_share`]) that another node reads too (a
    /// cut between two nodes' windows of a round splits them), as the prefetcher's walk finds
    /// them, each with the daemon that the host daemon asks for it (so the origin serves it
    /// once for the cluster); the host daemon keeps them. At most two a round. A shard this
    /// node reads from the origin for the others (its reader) is not here.
    pub(super) split_shards: std::sync::Mutex<std::collections::HashMap<(u32, u32), super::split::SplitVia>>,
    /// The job's name ([`crate::provider::Heartbeat::job_name`]), which names a split shard's
    /// reader node to the host daemon.
    pub(super) job: String,
}

impl Shared {
    /// Whether this stream's shards are its node's own share, the same every epoch: a
    /// node-affine deal over several nodes of a sticky order. The host daemon then keeps them.
    pub(super) fn keeps_share(&self) -> bool {
        let order = &self.cfg.order;
        order.shares == crate::order::Shares::Sticky
            && crate::order::DealRule::for_job(order, &self.cfg.topology).nodes > 1
    }

    /// How the host daemon asks for shard `shard` of source `source` when another node reads
    /// it too ([`Self::split_shards`]); `None` for any other shard.
    pub(super) fn split_via(&self, source: usize, shard: usize) -> Option<super::split::SplitVia> {
        let m = self.split_shards.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&(source as u32, shard as u32)).copied()
    }

    /// Checks `cfg`, reads every source's manifest (in parallel, while the cache opens), and
    /// opens the cache. Nothing is fetched yet.
    pub(super) fn open(cfg: &StreamConfig) -> Result<Arc<Shared>> {
        cfg.check()?;
        let opened_at = Instant::now();
        let rt = crate::rt::handle()?;
        let metrics = Arc::new(Metrics::default());
        // Every source's manifest is read (and connections for the first batch opened) while
        // the cache opens: on a 20 ms link each round trip before the first batch shows, and
        // the cache's start (its folders, its I/O core) is local work that can overlap them.
        let opening: Vec<_> = cfg
            .sources
            .iter()
            .map(|sc| {
                let url = sc.url.clone();
                rt.spawn(async move { Dataset::open_to_stream(&url).await })
            })
            .collect();
        let cache = match &cfg.cache {
            Some(c) => Some(Cache::open(c.clone(), crate::io::detect()?, metrics.clone())?),
            None => None,
        };
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(ms = ms(opened_at), "stream: cache open");
        let mut sources = Vec::new();
        for (sc, opened) in cfg.sources.iter().zip(opening) {
            let ds = match rt.block_on(opened) {
                Ok(ds) => ds?,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(e) => return Err(Error::io(&sc.url, std::io::Error::other(e))),
            };
            sources.push(Source {
                schema: Arc::new(ds.manifest().schema.clone()),
                ds,
            });
        }
        tracing::debug!(ms = ms(opened_at), "stream: manifests read");
        if let Some(o) = sources.iter().find_map(|s| s.ds.store().origin()) {
            let _ = metrics.origin.set(o);
        }
        // Nothing here is per shard without a filter: the order reads the shards' counts as it
        // reaches them. A filter reads every shard's columns once (`select.rs`).
        let mut shapes: Vec<SourceShape> = Vec::with_capacity(sources.len());
        for (s, sc) in sources.iter().zip(&cfg.sources) {
            let (counts, version) = rt.block_on(super::select::source_counts(&s.ds, cfg.filter.as_deref()))?;
            shapes.push(SourceShape {
                version,
                counts,
                weight: sc.weight,
            });
        }
        // A shard larger than the whole budget takes all of it (permits are clamped).
        let insert_permits = (cfg.prefetch_bytes_max / INSERT_PERMIT_BYTES + 1).min(u32::MAX as u64) as u32;
        let chain = {
            let provider = cfg
                .provider
                .as_ref()
                .map_or(0, |p| Arc::as_ptr(p) as *const () as usize);
            let dir = cfg.cache.as_ref().map(|c| c.dir.clone());
            xxhash_rust::xxh3::xxh3_64(format!("{provider}\0{dir:?}").as_bytes())
        };
        // 24 bytes of index per sample: held for every shard read one sample at a time from the
        // cache, when they all fit.
        let index_bytes = sources
            .iter()
            .map(|s| s.ds.manifest().samples.saturating_mul(INDEX_ENTRY_LEN))
            .fold(0u64, u64::saturating_add);
        let indexes = (index_bytes <= cfg.index_bytes_max).then(Default::default);
        let (shard_bytes, shard_samples) = shard_averages(&sources);
        let ahead = super::ahead::Ahead::new(
            cfg.prefetch_bytes_max,
            shard_bytes,
            shard_samples,
            cfg.shards_in_flight_max,
            cfg.prefetch_tuned && super::ahead::tuned_by_env(),
            metrics.clone(),
        );
        Ok(Arc::new(Shared {
            ahead,
            split_shards: Default::default(),
            job: crate::provider::Heartbeat::job_name(cfg.sources.first().map_or("", |s| s.url.as_str())),
            indexes,
            vouched: Default::default(),
            chain,
            inserts: Arc::new(tokio::sync::Semaphore::new(insert_permits as usize)),
            insert_permits,
            filler: match &cache {
                Some(_) => Some(crate::cache::Filler::process()?),
                None => None,
            },
            sources,
            cache,
            metrics,
            shapes,
            cfg: cfg.clone(),
        }))
    }

    /// The sources' bytes per shard, on average (at least 1): what a shard in flight or in
    /// the prefetch channel holds.
    pub(super) fn avg_shard_bytes(&self) -> u64 {
        shard_averages(&self.sources).0
    }

    /// Waits (at most a minute: a stuck disk does not hang the caller) for the cache copies
    /// already handed to the background, so a shard fetched here is in the cache for the next
    /// reader. Call it from a thread that is not one of the runtime's.
    pub(super) fn wait_inserts(&self, rt: &tokio::runtime::Handle) {
        let _ = rt.block_on(async {
            tokio::time::timeout(
                std::time::Duration::from_secs(60),
                self.inserts.acquire_many(self.insert_permits),
            )
            .await
        });
    }
}

/// Indexes of cached shards held by a stream, by (source, shard).
/// An open reader of a cached shard file, pinned against eviction while held.
pub(super) type CachedReader = Arc<(crate::cache::CachedShard, ShardReader<std::fs::File>)>;

/// What a [`Stream`](super::Stream) and a [`SampleReader`](super::SampleReader) both answer
/// about what they opened: the sources, their datasets and schemas, shard URLs, the counters.
pub trait Opened {
    /// The handle both hold.
    #[doc(hidden)]
    fn shared(&self) -> &Shared;

    /// Number of sources.
    fn sources(&self) -> usize {
        self.shared().sources.len()
    }

    /// Source `s`'s dataset.
    fn dataset(&self, s: usize) -> &Dataset {
        &self.shared().sources[s].ds
    }

    /// Source `s`'s schema.
    fn schema(&self, s: usize) -> Arc<Schema> {
        self.shared().sources[s].schema.clone()
    }

    /// URL of a shard of a source.
    fn shard_url(&self, source: u32, shard: u32) -> String {
        self.shared().sources[source as usize].shard_url(shard as usize)
    }

    /// Counters so far.
    fn metrics(&self) -> MetricsSnapshot {
        self.shared().metrics.snapshot()
    }

    /// The live counters (shared with the prefetcher, or the reader's background loads).
    fn metrics_handle(&self) -> Arc<Metrics> {
        self.shared().metrics.clone()
    }
}

pub(super) type HeldIndexes = HashMap<(u32, u32), Arc<Vec<u8>>>;

#[derive(Clone)]
pub(super) struct Live {
    pub(super) bytes: Bytes,
    pub(super) header: crate::format::Header,
    pub(super) uses_left: u64,
}

/// A record out of a live shard. The whole shard was verified when it was loaded (cache read
/// or origin fetch), so only the index entry's bounds are checked here: hashing every record
/// again would read every byte twice.
///
/// Called once per sample from the consumer's module. `#[inline]`, so that the release
/// build's codegen units do not keep it out of line there (moved here without it, the warm
/// epoch measured 1.07x and 1.13x of the build before; with it, 1.04x).
#[inline]
pub(super) fn slice_record(live: &Live, id: SampleRef, shared: &Shared) -> Result<Bytes> {
    let o = crate::format::Header::entry_offset(id.index as u64) as usize;
    let e = IndexEntry::parse(&live.bytes[o..o + INDEX_ENTRY_LEN as usize]);
    if let Err(err) = e.check_bounds(&live.header, live.bytes.len() as u64, &Location::sample("", 0)) {
        let url = shared.sources[id.source as usize].shard_url(id.shard as usize);
        return Err(Error::corrupt(Location::sample(url, id.index as u64), err.to_string()));
    }
    Ok(live.bytes.slice(e.offset as usize..(e.offset + e.len) as usize))
}
