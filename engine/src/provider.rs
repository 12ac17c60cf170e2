//! Shards from somewhere other than this process: the host's cache daemon.
//!
//! The engine defines the seam; `ramjet-transport` implements it with a client of the
//! host daemon (`ramjet serve`), which owns the node-local cache and the peer ring. A
//! [`Stream`](crate::Stream) with a provider asks it for every whole shard and verifies what
//! comes back; if the provider fails, the stream falls back to its own cache and the origin.

use bytes::Bytes;

use crate::cache::ShardId;
use crate::error::Result;

/// Where a shard's bytes came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchedFrom {
    /// This host's cache.
    CacheLocal,
    /// Another host's cache (the shard's owner in the ring).
    CachePeer,
    /// The object store.
    Origin,
}

impl FetchedFrom {
    /// Every place a shard is fetched from, in report order.
    pub const ALL: [FetchedFrom; 3] = [FetchedFrom::CacheLocal, FetchedFrom::CachePeer, FetchedFrom::Origin];

    /// Stable name (`cache_local`, `cache_peer`, `origin`).
    pub fn name(self) -> &'static str {
        match self {
            FetchedFrom::CacheLocal => "cache_local",
            FetchedFrom::CachePeer => "cache_peer",
            FetchedFrom::Origin => "origin",
        }
    }

    /// Parses [`FetchedFrom::name`].
    pub fn parse(s: &str) -> Option<FetchedFrom> {
        Self::ALL.into_iter().find(|x| x.name() == s)
    }

    /// Index into per-source arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One whole shard, named by its dataset and content.
#[derive(Debug, Clone)]
pub struct ShardRequest<'a> {
    /// URL of the dataset's manifest object.
    pub manifest_url: &'a str,
    /// Shard index in the manifest.
    pub shard: u32,
    /// The shard's content identity (from the manifest).
    pub id: ShardId,
    /// The shard is part of this node's own share, the same every epoch (a node-affine deal of
    /// a sticky order): the host daemon keeps it in its own cache and reads it from the origin,
    /// not from the shard's owner on the ring.
    pub keep: bool,
    /// With `keep`: another node reads this shard too (a cut between two nodes' windows splits
    /// it), so the daemon fetches it through another daemon (the cluster reads it from the
    /// origin once) and keeps it all the same: the daemon of node `reader` of job `job` when
    /// given, else its ring owner.
    pub split: bool,
    /// With `split`: the node of the job's deal that reads the shard from the origin (the node
    /// of its first partition), when that is not this consumer's node.
    pub reader: Option<u32>,
    /// The consumer's job ([`Heartbeat::job`]), which names `reader`'s node among the
    /// daemons' consumers.
    pub job: &'a str,
}

/// A shard as a provider delivers it (not yet verified by the caller).
#[derive(Debug, Clone)]
pub struct Fetched {
    /// The whole shard.
    pub bytes: Bytes,
    /// Where it came from.
    pub from: FetchedFrom,
}

/// A supplier of whole shards. Blocking: the stream calls it from a blocking task.
pub trait ShardProvider: Send + Sync + std::fmt::Debug {
    /// Fetches one whole shard.
    fn fetch(&self, req: &ShardRequest<'_>) -> Result<Fetched>;

    /// Tells the provider that the bytes it delivered for `req` failed verification, so it
    /// drops its copy instead of serving it again.
    fn report_corrupt(&self, req: &ShardRequest<'_>);

    /// Tells the provider how this consumer is doing ([`Heartbeat`]; a stream sends one every
    /// [`HEARTBEAT_EVERY`]). A provider that keeps no such record ignores it.
    fn heartbeat(&self, _beat: &Heartbeat) -> Result<crate::pace::BeatReply> {
        Ok(Default::default())
    }
}

/// The host daemon's answer to a heartbeat: this consumer's share of the host's budgets
/// ([`crate::tune::shares`]), which its loader's tuner applies.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HostGrant {
    /// Decode jobs this consumer may run at once.
    pub decode_threads: u32,
    /// Bytes of prefetched and decoded batches it may hold.
    pub memory_bytes: u64,
    /// Consumers sharing the host.
    pub consumers: u32,
}

/// How often a stream with a provider reports its [`Heartbeat`].
pub const HEARTBEAT_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// One consumer's report to its host daemon: who it is, where it is in its epoch, how fast it
/// goes and where its wait goes (`crate::stall`). Small (well under a kilobyte), sent every
/// [`HEARTBEAT_EVERY`]; the daemon drops a consumer that stops sending.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Heartbeat {
    /// The consumer, unique on its host: `<pid>/<rank>.<worker>`.
    pub consumer: String,
    /// The job: `RAMJET_JOB`, else `SLURM_JOB_ID`, else the first dataset's name.
    pub job: String,
    /// The first source's manifest URL.
    pub dataset: String,
    /// Process id.
    pub pid: u32,
    /// Rank and ranks.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// DataLoader worker in the rank, and workers per rank.
    pub worker: u32,
    /// Workers per rank.
    pub workers: u32,
    /// The epoch it reads.
    pub epoch: u64,
    /// Samples of that epoch delivered to it.
    pub position: u64,
    /// Samples in its share of the epoch (0 when unknown).
    pub epoch_len: u64,
    /// Samples delivered since it started.
    pub samples: u64,
    /// Samples per second over the last interval.
    pub samples_per_s: f64,
    /// Batches handed to the training loop since it started (its steps; 0 for a stream read
    /// sample by sample).
    #[serde(default)]
    pub batches: u64,
    /// Its step time: seconds per batch over the last interval, or, when no batch came in
    /// it, the seconds since the last one (a stalled rank's step time grows); 0 before the
    /// first batch.
    #[serde(default)]
    pub step_s: f64,
    /// Share of its time spent waiting for data, since it started.
    pub data_wait_share: f64,
    /// Shares of its time by stage (`origin`, `peer`, `daemon`, `cache`, `decode`,
    /// `not_waiting`: `crate::stall::NAMES`), since it started.
    pub split: std::collections::BTreeMap<String, f64>,
    /// Seconds since it started.
    pub elapsed_s: f64,
    /// Decode jobs its loader runs at once now (0: no loader decodes for it); consumers that
    /// decode share the host's decode budget.
    #[serde(default)]
    pub decode_threads: u32,
    /// Asks the daemon for the job's pace across its ranks in its answer
    /// ([`crate::pace::JobPace`]); absent from older loaders: false, and they get the older
    /// answers.
    #[serde(default)]
    pub pace: bool,
    /// Samples its loader found corrupt (undecodable) and left out of their batches
    /// (`on_corrupt="skip"`), since it started; absent from older loaders: 0.
    #[serde(default)]
    pub samples_skipped: u64,
    /// Its node in its job's node-affine deal (`None`: the job deals position by position, or
    /// an older loader). A daemon finds the daemon of a job's node by it (a split shard's
    /// reader).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
}

/// Reports this consumer's [`Heartbeat`] to `provider` every [`HEARTBEAT_EVERY`] until the
/// task is aborted (its stream dropped). A report that fails is logged once and retried at the
/// next beat: the daemon may be restarting, and the stream goes on without it.
pub(crate) async fn report_heartbeats(
    provider: std::sync::Arc<dyn ShardProvider>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    who: Heartbeat,
) {
    let mut last = (std::time::Instant::now(), 0u64, 0u64);
    let mut warned = false;
    // The first beat goes at once (after the loader's first look), so the host's budget is
    // split among its consumers from their start.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    loop {
        let s = metrics.snapshot();
        let now = std::time::Instant::now();
        let dt = now.duration_since(last.0).as_secs_f64().max(1e-9);
        let mut beat = who.clone();
        beat.epoch = s.epoch;
        beat.position = if s.epoch_len > 0 { s.position } else { s.samples };
        beat.epoch_len = s.epoch_len;
        beat.samples = s.samples;
        beat.samples_per_s = s.samples.saturating_sub(last.1) as f64 / dt;
        beat.batches = s.batches;
        beat.samples_skipped = s.samples_skipped;
        beat.step_s = match s.batches.saturating_sub(last.2) {
            0 => metrics.since_last_batch_s(),
            steps => dt / steps as f64,
        };
        beat.data_wait_share = s.stall.get("data_wait_share").copied().unwrap_or(0.0);
        beat.split = crate::stall::NAMES
            .iter()
            .map(|n| {
                (
                    n.to_string(),
                    s.stall.get(&format!("wait_share_{n}")).copied().unwrap_or(0.0),
                )
            })
            .collect();
        beat.elapsed_s = s.elapsed_s;
        beat.decode_threads = metrics.decode_threads.load(std::sync::atomic::Ordering::Relaxed) as u32;
        last = (now, s.samples, s.batches);
        let p = provider.clone();
        let r = tokio::task::spawn_blocking(move || p.heartbeat(&beat)).await;
        match r {
            Ok(Ok(reply)) => {
                warned = false;
                let now = std::time::Instant::now();
                if let Some(g) = reply.grant {
                    *metrics.grant.lock().expect("grant lock") = Some((now, g));
                }
                if let Some(j) = reply.job {
                    *metrics.pace.lock().expect("pace lock") = Some((now, j));
                }
            }
            Ok(Err(e)) if !warned => {
                warned = true;
                tracing::debug!(error = %e, "heartbeat to the host daemon failed; retrying at the next beat");
            }
            _ => {}
        }
        tokio::time::sleep(HEARTBEAT_EVERY).await;
    }
}

impl Heartbeat {
    /// The fixed part of a consumer's heartbeat: its identity.
    pub fn identity(dataset: &str, t: &crate::order::Topology) -> Heartbeat {
        let pid = std::process::id();
        Heartbeat {
            consumer: format!("{pid}/{}.{}", t.rank, t.worker),
            job: Self::job_name(dataset),
            dataset: dataset.to_string(),
            pid,
            rank: t.rank as u32,
            world: t.world as u32,
            worker: t.worker as u32,
            workers: t.workers as u32,
            pace: true,
            ..Default::default()
        }
    }

    /// The job a consumer of `dataset` belongs to: `RAMJET_JOB`, else `SLURM_JOB_ID`, else the
    /// dataset's name.
    pub fn job_name(dataset: &str) -> String {
        std::env::var("RAMJET_JOB")
            .or_else(|_| std::env::var("SLURM_JOB_ID"))
            .unwrap_or_else(|_| {
                let base = dataset.trim_end_matches('/').trim_end_matches("manifest.json");
                base.trim_end_matches('/')
                    .rsplit('/')
                    .next()
                    .unwrap_or(dataset)
                    .to_string()
            })
    }
}
