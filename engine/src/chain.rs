//! The fetch chain of one whole shard, shared by a consumer's stream and the host daemon.
//!
//! A chain is a list of [`Step`]s tried in order until one delivers: the node-local cache,
//! the cache again under the host-wide download lock, an [`Upstream`] (for a stream: the host
//! daemon; for a daemon: the shard's owner peer), and the origin. Bytes from an upstream are
//! verified here against the manifest before they are used; an upstream that fails or lies is
//! told ([`Upstream::outcome`]) and the chain moves on. What to keep in the cache afterwards is
//! the caller's choice (a stream writes its copy in the background, a daemon only the shards it
//! owns), so [`Got`] carries the download lock for that write.
//!
//! ```text
//!  stream:  [Upstream(host daemon)] -> Cache -> CacheLocked -> Origin     (stream/source.rs)
//!  daemon:  Cache -> [Upstream(owner peer)] -> Origin                    (transport daemon/fetch.rs)
//! ```

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

use crate::cache::{Cache, FetchGuard, ShardId};
use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::provider::FetchedFrom;

/// The shard a chain fetches, and how the origin is read.
pub struct ShardAt<'a> {
    /// Its dataset.
    pub ds: &'a Dataset,
    /// Its index in the manifest.
    pub shard: usize,
    /// Its identity (checksum and size).
    pub id: ShardId,
    /// Bytes per ranged GET from the origin.
    pub range_bytes: u64,
    /// Ranged GETs in flight from the origin.
    pub ranges_in_flight: usize,
}

/// A boxed future, as an [`Upstream`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why an upstream could not deliver, in its own error type (a caller downcasts it back).
pub type UpstreamError = Box<dyn std::error::Error + Send + Sync>;

/// What became of an upstream's answer.
pub enum Outcome {
    /// It delivered bytes that verified (from where it says).
    Delivered(FetchedFrom),
    /// It could not deliver (the error says why).
    Failed(UpstreamError),
    /// It delivered bytes that failed verification.
    Corrupt(Error),
}

/// What [`Upstream::fetch`] returns: the whole shard, unverified, and where it came from.
pub type UpstreamFetch<'a> = BoxFuture<'a, std::result::Result<(Bytes, FetchedFrom), UpstreamError>>;

/// A holder of whole shards asked before the origin.
pub trait Upstream: Send + Sync {
    /// The whole shard, unverified, and where it came from.
    fn fetch<'a>(&'a self, at: &'a ShardAt<'a>) -> UpstreamFetch<'a>;
    /// How its answer for `at` turned out (for its health, its counters and its own copy).
    fn outcome(&self, at: &ShardAt<'_>, outcome: Outcome);
}

/// One place a chain looks.
pub enum Step<'a> {
    /// The node-local cache (verified as it is read).
    Cache(&'a Cache),
    /// The cache again, holding the shard's host-wide download lock, so that of the processes
    /// on a host only one goes on to the origin; the others wait and find the copy it leaves.
    CacheLocked(&'a Cache),
    /// A holder of whole shards (verified here).
    Upstream(&'a dyn Upstream),
    /// The origin: the shard's object, in parallel ranged GETs, verified.
    Origin,
}

/// A delivered shard.
pub struct Got {
    /// Its bytes, verified.
    pub bytes: Bytes,
    /// Where they came from.
    pub from: FetchedFrom,
    /// An [`Upstream`] delivered them (`from` is then where that upstream got them).
    pub via_upstream: bool,
    /// The download lock taken by [`Step::CacheLocked`], held until the caller has written its
    /// cache copy (others on the host wait for it rather than fetch again).
    pub lock: Option<FetchGuard>,
}

/// Fetches `at` through `steps`, in order. Counts a cache miss when it goes to the origin.
pub async fn fetch(steps: &[Step<'_>], at: &ShardAt<'_>, metrics: &Metrics) -> Result<Got> {
    let mut lock = None;
    for step in steps {
        match step {
            Step::Cache(cache) => {
                if let Some(bytes) = cache_get(cache, at.id).await? {
                    return Ok(Got {
                        bytes,
                        from: FetchedFrom::CacheLocal,
                        via_upstream: false,
                        lock,
                    });
                }
            }
            Step::CacheLocked(cache) => {
                lock = download_lock(cache, at.id).await?;
                if let Some(bytes) = cache_get(cache, at.id).await? {
                    return Ok(Got {
                        bytes,
                        from: FetchedFrom::CacheLocal,
                        via_upstream: false,
                        lock,
                    });
                }
            }
            Step::Upstream(up) => match up.fetch(at).await {
                Ok((bytes, from)) => match verify(at, bytes.clone()).await {
                    Ok(()) => {
                        up.outcome(at, Outcome::Delivered(from));
                        return Ok(Got {
                            bytes,
                            from,
                            via_upstream: true,
                            lock,
                        });
                    }
                    Err(e) => up.outcome(at, Outcome::Corrupt(e)),
                },
                Err(e) => up.outcome(at, Outcome::Failed(e)),
            },
            Step::Origin => {
                Metrics::add(&metrics.cache_misses, 1);
                let bytes = at
                    .ds
                    .fetch_shard_parallel(at.shard, at.range_bytes, at.ranges_in_flight, metrics)
                    .await?;
                return Ok(Got {
                    bytes,
                    from: FetchedFrom::Origin,
                    via_upstream: false,
                    lock,
                });
            }
        }
    }
    Err(Error::invalid(
        at.ds.manifest_url(),
        format!("shard {}: no step of the fetch chain delivered it", at.shard),
    ))
}

/// Runs a blocking piece of the chain on the runtime's blocking pool.
pub async fn blocking<T: Send + 'static>(what: &str, f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(if e.is_panic() {
            Error::from_panic(what, &*e.into_panic())
        } else {
            Error::Internal {
                thread: what.to_string(),
                reason: "cancelled before it ran".into(),
            }
        })
    })
}

async fn cache_get(cache: &Cache, id: ShardId) -> Result<Option<Bytes>> {
    let c = cache.clone();
    blocking("cache task", move || c.get(id)).await
}

async fn verify(at: &ShardAt<'_>, bytes: Bytes) -> Result<()> {
    let (ds, shard) = (at.ds.clone(), at.shard);
    blocking("verify task", move || ds.check_shard(shard, &bytes)).await
}

/// The shard's host-wide download lock, polled: the holder (this process or another) may be
/// minutes into a download, and a blocking-pool thread asleep in `flock` meanwhile would be
/// one fewer for the work that frees it (the pool is shared by the whole process).
pub async fn download_lock(cache: &Cache, id: ShardId) -> Result<Option<FetchGuard>> {
    download_lock_within(cache, id, fetch_lock_wait()).await
}

/// How long [`download_lock`] waits for another holder: `RAMJET_FETCH_LOCK_WAIT_MS`, 120 s
/// unless set (a 64 MiB shard downloads in about a minute at 1 MB/s).
pub fn fetch_lock_wait() -> std::time::Duration {
    std::time::Duration::from_millis(
        std::env::var("RAMJET_FETCH_LOCK_WAIT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(120_000),
    )
}

/// [`download_lock`] with its limit given: `None` when another holder kept the lock past
/// `limit`. The caller then fetches without it (the shard is fetched twice on this host, and
/// nothing waits on a holder that may be stuck; the cache's inserts are atomic, so two copies
/// never mix).
pub async fn download_lock_within(
    cache: &Cache,
    id: ShardId,
    limit: std::time::Duration,
) -> Result<Option<FetchGuard>> {
    let start = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(2);
    let mut said = start;
    loop {
        let c = cache.clone();
        if let Some(g) = blocking("cache task", move || c.try_fetch_lock(id)).await? {
            return Ok(Some(g));
        }
        let waited = start.elapsed();
        if waited >= limit {
            tracing::warn!(
                shard = %id.file_name(),
                waited_ms = waited.as_millis() as u64,
                "another process has held this shard's download lock past RAMJET_FETCH_LOCK_WAIT_MS: fetching it without the lock"
            );
            return Ok(None);
        }
        if said.elapsed() >= std::time::Duration::from_secs(15) {
            said = std::time::Instant::now();
            tracing::info!(shard = %id.file_name(), waited_s = waited.as_secs(), "waiting for another process's download of this shard");
        }
        tokio::time::sleep(pause.min(limit - waited)).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
}
