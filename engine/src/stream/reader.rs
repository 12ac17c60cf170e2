//! Random access: one sample read on its own, by its index in a source's dataset, as a
//! map-style dataset needs. A [`SampleReader`] reads from a whole shard held in memory, the
//! disk cache (a pinned `CachedShard`, two reads), or two ranged GETs while the whole shard
//! loads in the background. It shares nothing with a [`Stream`](super::Stream) but the
//! opened sources, cache and chain ([`Shared`]): it has no order, no epoch and no prefetcher.
//! (The global shuffle reads its samples in batches: `prefetch`.)

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::fetch::{fetch_sample_ranged, fetch_shard};
use super::shared::{slice_record, CachedReader, Live, Opened, Shared, Source};
use super::{Sample, StreamConfig};
use crate::error::{Error, Location, Result};
use crate::metrics::Metrics;
use crate::order::SampleRef;

/// Random access to the samples of one or more datasets (the sources of a [`StreamConfig`]),
/// by index. Call it from an ordinary thread; network reads run on the process runtime.
pub struct SampleReader {
    /// The process's network runtime.
    rt: tokio::runtime::Handle,
    shared: Arc<Shared>,
    /// Open readers of cached shard files: a sample then costs its two reads, not three more
    /// to open the shard. Each is a `CachedShard`, pinned against eviction while held here.
    readers: RefCell<HashMap<(u32, u32), CachedReader>>,
    /// Whole shards held in memory, and the slots of their background loads.
    resident: Arc<std::sync::Mutex<Resident>>,
    loads: Arc<tokio::sync::Semaphore>,
}

impl Opened for SampleReader {
    fn shared(&self) -> &Shared {
        &self.shared
    }
}

impl Drop for SampleReader {
    fn drop(&mut self) {
        // Shards loaded for random access are copied into the cache in the background: let
        // those copies finish, so the next reader finds them.
        self.shared.wait_inserts(&self.rt);
    }
}

/// Whole shards held in memory for random access ([`SampleReader::get`]).
#[derive(Default)]
struct Resident {
    shards: HashMap<(u32, u32), Live>,
    /// In the order they arrived: the oldest is dropped first.
    arrived: std::collections::VecDeque<(u32, u32)>,
    bytes: u64,
    loading: std::collections::HashSet<(u32, u32)>,
}

impl Resident {
    fn insert(&mut self, key: (u32, u32), live: Live, max: u64) {
        let n = live.bytes.len() as u64;
        while self.bytes + n > max {
            let Some(old) = self.arrived.pop_front() else { break };
            if let Some(l) = self.shards.remove(&old) {
                self.bytes -= l.bytes.len() as u64;
            }
        }
        if self.shards.insert(key, live).is_none() {
            self.arrived.push_back(key);
            self.bytes += n;
        }
    }
}

/// Open shard readers kept by one reader.
const OPEN_READERS_MAX: usize = 64;

impl SampleReader {
    /// Opens every source's manifest and the cache; nothing is read until asked for. The
    /// order, topology, epochs and resume settings of `cfg` play no part.
    pub fn open(cfg: StreamConfig) -> Result<SampleReader> {
        let loads = Arc::new(tokio::sync::Semaphore::new(cfg.shards_in_flight_max.max(1)));
        Ok(SampleReader {
            rt: crate::rt::handle()?,
            shared: Shared::open(&cfg)?,
            readers: Default::default(),
            resident: Default::default(),
            loads,
        })
    }

    /// One sample, by its index in source `source`'s dataset (random access, as a map-style
    /// dataset needs): from a whole shard held in memory, else from the disk cache (two reads),
    /// else with two ranged GETs while the whole shard loads in the background (through the
    /// host daemon, the disk cache or the origin, verified), so each shard crosses the network
    /// once and the following samples of it are local. At most `resident_bytes_max` of shards
    /// are held; the oldest go first.
    pub fn get(&self, source: usize, global_index: u64) -> Result<Sample> {
        let (id, src) = self.locate(source, global_index)?;
        Ok(Sample {
            epoch: 0,
            position: 0,
            id,
            global_index,
            record: self.read_random(id)?,
            schema: src.schema.clone(),
        })
    }

    /// Samples `indices` of source `source`, in the order asked (repeats allowed): what is held
    /// in memory or in the disk cache is read there; the rest is fetched one whole shard per
    /// shard touched, all shards at once (at most `shards_in_flight_max` in flight), each
    /// checked against the manifest, and kept in memory within the resident budget. An index
    /// past the end is an error naming it, before anything is fetched.
    pub fn get_many(&self, source: usize, indices: &[u64]) -> Result<Vec<Sample>> {
        let located: Vec<(SampleRef, Arc<crate::format::Schema>)> = indices
            .iter()
            .map(|&g| self.locate(source, g).map(|(id, src)| (id, src.schema.clone())))
            .collect::<Result<_>>()?;
        let mut records: Vec<Option<Bytes>> = Vec::with_capacity(located.len());
        let mut missing: std::collections::BTreeMap<u32, Vec<(usize, u64)>> = Default::default();
        for (k, (id, _)) in located.iter().enumerate() {
            let rec = self.read_local(*id)?;
            if rec.is_none() {
                missing.entry(id.shard).or_default().push((k, id.index as u64));
            }
            records.push(rec);
        }
        if !missing.is_empty() {
            let (shared, slots) = (self.shared.clone(), self.loads.clone());
            let fetched = self.rt.block_on(async move {
                let jobs = missing.into_iter().map(|(shard, wanted)| {
                    let (shared, slots) = (shared.clone(), slots.clone());
                    async move {
                        let _slot = slots.acquire_owned().await.expect("semaphore open");
                        let got = fetch_shard(shared.clone(), source, shard as usize).await;
                        (shard, wanted, got)
                    }
                });
                futures::future::join_all(jobs).await
            });
            let max = self.shared.cfg.resident_bytes_max;
            for (shard, wanted, got) in fetched {
                let url = self.shared.sources[source].shard_url(shard as usize);
                let bytes = got?;
                let view = crate::format::ShardView::parse(&bytes, &url)?;
                for (k, i) in wanted {
                    records[k] = Some(bytes.slice_ref(view.record(i)?));
                }
                if bytes.len() as u64 <= max {
                    let header = view.header().clone();
                    let live = Live {
                        bytes,
                        header,
                        uses_left: 0,
                    };
                    self.resident
                        .lock()
                        .expect("not poisoned")
                        .insert((source as u32, shard), live, max);
                }
            }
        }
        Ok(located
            .into_iter()
            .zip(indices)
            .zip(records)
            .map(|(((id, schema), &global_index), record)| Sample {
                epoch: 0,
                position: 0,
                id,
                global_index,
                record: record.expect("every record read or fetched"),
                schema,
            })
            .collect())
    }

    /// [`SampleReader::get`] when the sample is local (a shard held in memory or in the disk cache):
    /// `Ok(None)` when reading it would need the network. It never waits on I/O beyond a
    /// local read, so a caller may run it inline.
    pub fn get_local(&self, source: usize, global_index: u64) -> Result<Option<Sample>> {
        let (id, src) = self.locate(source, global_index)?;
        let Some(record) = self.read_local(id)? else {
            return Ok(None);
        };
        Ok(Some(Sample {
            epoch: 0,
            position: 0,
            id,
            global_index,
            record,
            schema: src.schema.clone(),
        }))
    }

    fn locate(&self, source: usize, global_index: u64) -> Result<(SampleRef, &Source)> {
        let src = self
            .shared
            .sources
            .get(source)
            .ok_or_else(|| Error::invalid(format!("source {source}"), "no such source"))?;
        let (shard, index) = src.ds.manifest().locate(global_index)?.ok_or_else(|| {
            Error::invalid(
                format!("{} sample {global_index}", src.ds.manifest_url()),
                format!("the dataset has {} samples", src.ds.manifest().samples),
            )
        })?;
        let id = SampleRef {
            source: source as u32,
            shard: shard as u32,
            index: index as u32,
        };
        Ok((id, src))
    }

    /// [`SampleReader::get`]'s read of one record.
    fn read_random(&self, id: SampleRef) -> Result<Bytes> {
        if let Some(rec) = self.read_local(id)? {
            return Ok(rec);
        }
        self.load_in_background((id.source, id.shard));
        let rec = self.rt.block_on(fetch_sample_ranged(&self.shared, id))?;
        Metrics::add(&self.shared.metrics.ranged_samples, 1);
        Ok(rec)
    }

    /// `id`'s record from a whole shard held in memory, else from the disk cache; `None` when
    /// neither has it.
    fn read_local(&self, id: SampleRef) -> Result<Option<Bytes>> {
        let held = self
            .resident
            .lock()
            .expect("not poisoned")
            .shards
            .get(&(id.source, id.shard))
            .cloned();
        if let Some(live) = held {
            Metrics::add(&self.shared.metrics.resident_samples, 1);
            return slice_record(&live, id, &self.shared).map(Some);
        }
        Ok(self.read_cached(id))
    }

    /// Starts loading a whole shard into [`Resident`], unless it is there, loading, or larger
    /// than the budget. At most `shards_in_flight_max` load at once.
    fn load_in_background(&self, key: (u32, u32)) {
        let max = self.shared.cfg.resident_bytes_max;
        let Ok(id) = self.shared.sources[key.0 as usize].id(key.1 as usize) else {
            return;
        };
        if id.bytes > max {
            return;
        }
        {
            let mut r = self.resident.lock().expect("not poisoned");
            if r.shards.contains_key(&key) || !r.loading.insert(key) {
                return;
            }
        }
        let (shared, resident, slots) = (self.shared.clone(), self.resident.clone(), self.loads.clone());
        self.rt.spawn(async move {
            let _slot = slots.acquire_owned().await.expect("semaphore open");
            let got = fetch_shard(shared.clone(), key.0 as usize, key.1 as usize).await;
            let url = shared.sources[key.0 as usize].shard_url(key.1 as usize);
            let live = got.and_then(|bytes| {
                let head = bytes
                    .get(..64)
                    .ok_or_else(|| Error::corrupt(Location::object(&url), "shorter than its header"))?;
                let header = crate::format::Header::parse(head, &url)?;
                Ok(Live {
                    bytes,
                    header,
                    uses_left: 0,
                })
            });
            let mut r = resident.lock().expect("not poisoned");
            r.loading.remove(&key);
            match live {
                Ok(live) => r.insert(key, live, max),
                // The samples of this shard go on being read one by one; a later read retries.
                Err(e) => tracing::warn!(shard = %url, error = %e, "loading a whole shard for random access failed"),
            }
        });
    }

    /// `id`'s record from the cached copy of its shard (two reads), or `None` when the shard is
    /// not cached or the record there is damaged (its reader is then forgotten, and the caller
    /// reads the sample from the origin).
    fn read_cached(&self, id: SampleRef) -> Option<Bytes> {
        let r = self.cached_reader(id)?;
        match r.1.read_record(id.index as u64) {
            Ok(rec) => {
                Metrics::add(&self.shared.metrics.cache_bytes, rec.len() as u64);
                Some(Bytes::from(rec))
            }
            Err(_) => {
                self.readers.borrow_mut().remove(&(id.source, id.shard));
                None
            }
        }
    }

    /// An open reader of the cached copy of `id`'s shard, if the cache has one.
    fn cached_reader(&self, id: SampleRef) -> Option<CachedReader> {
        let key = (id.source, id.shard);
        if let Some(r) = self.readers.borrow().get(&key) {
            return Some(r.clone());
        }
        let cache = self.shared.cache.as_ref()?;
        let sid = self.shared.sources[id.source as usize].id(id.shard as usize).ok()?;
        // Pinned against eviction while this reader holds it (at most `OPEN_READERS_MAX`).
        let shard = cache.shard(sid).ok()??;
        let reader = shard.records().ok()?;
        let r = Arc::new((shard, reader));
        let mut readers = self.readers.borrow_mut();
        if readers.len() >= OPEN_READERS_MAX {
            readers.clear();
        }
        readers.insert(key, r.clone());
        Some(r)
    }
}
