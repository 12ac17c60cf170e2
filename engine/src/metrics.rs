//! Counters every other module reports into, and their snapshot.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Live counters. Cheap to update from any thread (relaxed atomics).
#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    /// Bytes fetched from the origin.
    pub origin_bytes: AtomicU64,
    /// Requests sent to the origin (GETs, ranged or whole).
    pub origin_requests: AtomicU64,
    /// Shards read whole from the local cache.
    pub cache_hits: AtomicU64,
    /// Bytes read from the local cache.
    pub cache_bytes: AtomicU64,
    /// Shards not found in the local cache.
    pub cache_misses: AtomicU64,
    /// Shards admitted into the local cache.
    pub cache_inserts: AtomicU64,
    /// Shards not admitted (budget full of higher-priority or in-use shards, or a write failed).
    pub cache_rejects: AtomicU64,
    /// Shards evicted.
    pub cache_evictions: AtomicU64,
    /// Cached shards found corrupt on read (deleted and re-fetched).
    pub cache_corrupt: AtomicU64,
    /// Samples fetched individually with ranged GETs (fast first batch, random access).
    pub ranged_samples: AtomicU64,
    /// Times the prefetcher stopped at a closed first-batch gate ([`crate::Stream::open_gated`]).
    pub first_gate_waits: AtomicU64,
    /// Batch buffers allocated after the loader's working set was (a consumer holding more
    /// batches than the pool keeps; pinned memory then synchronises the GPU's streams).
    pub host_buffer_late_allocs: AtomicU64,
    /// Batch buffers freed after the working set was allocated.
    pub host_buffer_late_frees: AtomicU64,
    /// Whole-shard fetches that joined one already in flight in this process (another
    /// dataset, loader or random access wanted the same shard).
    pub shards_coalesced: AtomicU64,
    /// Samples read by random access from a whole shard held in memory.
    pub resident_samples: AtomicU64,
    /// Samples delivered to the consumer.
    pub samples: AtomicU64,
    /// Sample bytes delivered.
    pub sample_bytes: AtomicU64,
    /// Nanoseconds the consumer waited for data.
    pub wait_ns: AtomicU64,
    /// Time to the first delivered sample, in nanoseconds (0 until then).
    pub first_sample_ns: AtomicU64,
    /// Nanoseconds the training loop waited for a batch (loader only).
    pub batch_wait_ns: AtomicU64,
    /// Batches handed to the training loop (loader only): its steps.
    pub batches: AtomicU64,
    /// When the first and the last batch were handed out, nanoseconds since creation.
    pub first_batch_ns: AtomicU64,
    /// See [`Metrics::first_batch_ns`].
    pub last_batch_ns: AtomicU64,
    /// Images decoded (loader only).
    pub images_decoded: AtomicU64,
    /// Samples left out of delivered batches because their image did not decode (loader only).
    pub samples_skipped: AtomicU64,
    /// Samples read but left out of an epoch by aspect-ratio buckets: each consumer yields the
    /// same batch count, and what its buckets hold past that sits the epoch out (loader only).
    pub samples_left_out: AtomicU64,
    /// Shards delivered by the host daemon, by source (see [`crate::FetchedFrom`]).
    pub provider_shards: [AtomicU64; 3],
    /// Bytes delivered by the host daemon.
    pub provider_bytes: AtomicU64,
    /// Daemon requests that failed (or delivered unsound bytes) and were read directly.
    pub provider_failures: AtomicU64,
    /// The GPU decode path's planner, when a loader decodes for the GPU: its routes and split
    /// are part of the snapshot ([`crate::image::gpu_batch::Planner::metrics`]).
    pub decode: std::sync::OnceLock<std::sync::Arc<crate::image::gpu_batch::Planner>>,
    /// Nanoseconds the consumer's wait went to each stage, and those it did not wait, in
    /// [`crate::stall::NAMES`] order (loader only; see [`crate::stall`]).
    pub stall_ns: [AtomicU64; crate::stall::PARTS],
    /// Nanoseconds the stream's reader waited for the prefetcher, by the source of what ended
    /// each wait ([`crate::stall::WaitOn`]'s first four).
    pub read_blocked_ns: [AtomicU64; crate::stall::SOURCES],
    /// The epoch of the last batch handed to the consumer (loader only).
    pub consumer_epoch: AtomicU64,
    /// Samples of that epoch this consumer has been handed (loader only).
    pub consumer_position: AtomicU64,
    /// Samples in this consumer's share of that epoch (loader only; 0 when unknown).
    pub consumer_epoch_len: AtomicU64,
    /// The origin's request control this stream's requests go through
    /// ([`crate::tune::Origin`]): its state is part of the snapshot (`tune_origin_*`).
    pub origin: std::sync::OnceLock<std::sync::Arc<crate::tune::Origin>>,
    /// The host daemon's last grant to this consumer, with when it came
    /// ([`crate::provider::HostGrant`]).
    pub grant: std::sync::Mutex<Option<(Instant, crate::provider::HostGrant)>>,
    /// The host daemon's last word on this consumer's job's pace across its ranks, with when
    /// it came ([`crate::pace::JobPace`]).
    pub pace: std::sync::Mutex<Option<(Instant, crate::pace::JobPace)>>,
    /// The loader's decode jobs allowed at once now (0: no loader), sent in heartbeats.
    pub decode_threads: AtomicU64,
    /// What the loader's tuner chose and why (`tune_*` in the snapshot; [`crate::tune`]).
    pub tune: std::sync::Mutex<std::collections::BTreeMap<&'static str, serde_json::Value>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            origin_bytes: AtomicU64::new(0),
            origin_requests: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            cache_bytes: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            cache_inserts: AtomicU64::new(0),
            cache_rejects: AtomicU64::new(0),
            cache_evictions: AtomicU64::new(0),
            cache_corrupt: AtomicU64::new(0),
            ranged_samples: AtomicU64::new(0),
            first_gate_waits: AtomicU64::new(0),
            host_buffer_late_allocs: AtomicU64::new(0),
            host_buffer_late_frees: AtomicU64::new(0),
            shards_coalesced: AtomicU64::new(0),
            resident_samples: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            sample_bytes: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            first_sample_ns: AtomicU64::new(0),
            batch_wait_ns: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            first_batch_ns: AtomicU64::new(0),
            last_batch_ns: AtomicU64::new(0),
            images_decoded: AtomicU64::new(0),
            samples_skipped: AtomicU64::new(0),
            samples_left_out: AtomicU64::new(0),
            provider_shards: Default::default(),
            provider_bytes: AtomicU64::new(0),
            provider_failures: AtomicU64::new(0),
            decode: std::sync::OnceLock::new(),
            pace: Default::default(),
            stall_ns: Default::default(),
            read_blocked_ns: Default::default(),
            consumer_epoch: AtomicU64::new(0),
            consumer_position: AtomicU64::new(0),
            origin: std::sync::OnceLock::new(),
            grant: Default::default(),
            decode_threads: AtomicU64::new(0),
            tune: Default::default(),
            consumer_epoch_len: AtomicU64::new(0),
        }
    }
}

/// A consistent-enough copy of the counters, with derived rates.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct MetricsSnapshot {
    /// Seconds since the metrics were created.
    pub elapsed_s: f64,
    /// Bytes from the origin.
    pub origin_bytes: u64,
    /// Requests to the origin.
    pub origin_requests: u64,
    /// Shard reads served by the local cache.
    pub cache_hits: u64,
    /// Bytes from the local cache.
    pub cache_bytes: u64,
    /// Shard reads that missed the local cache.
    pub cache_misses: u64,
    /// Shards admitted.
    pub cache_inserts: u64,
    /// Shards not admitted.
    pub cache_rejects: u64,
    /// Shards evicted.
    pub cache_evictions: u64,
    /// Corrupt cached shards found (and re-fetched).
    pub cache_corrupt: u64,
    /// Samples fetched with ranged GETs.
    pub ranged_samples: u64,
    /// See [`Metrics::first_gate_waits`].
    pub first_gate_waits: u64,
    /// See [`Metrics::host_buffer_late_allocs`].
    pub host_buffer_late_allocs: u64,
    /// See [`Metrics::host_buffer_late_frees`].
    pub host_buffer_late_frees: u64,
    /// See [`Metrics::shards_coalesced`].
    pub shards_coalesced: u64,
    /// Samples read by random access from a whole shard held in memory.
    pub resident_samples: u64,
    /// Samples delivered.
    pub samples: u64,
    /// Sample bytes delivered.
    pub sample_bytes: u64,
    /// Seconds the consumer waited for data.
    pub wait_s: f64,
    /// Seconds to the first sample.
    pub first_sample_s: f64,
    /// cache_hits / (cache_hits + cache_misses).
    pub hit_rate: f64,
    /// Samples per second since creation.
    pub samples_per_s: f64,
    /// Sample bytes per second since creation.
    pub bytes_per_s: f64,
    /// Seconds the training loop waited for batches.
    pub batch_wait_s: f64,
    /// Batches handed to the training loop (its steps; loader only).
    pub batches: u64,
    /// Mean seconds from one batch handed out to the next (the consumer's step time, its
    /// training included), since the first batch; 0 before the second.
    pub step_s: f64,
    /// Images decoded.
    pub images_decoded: u64,
    /// Samples skipped as undecodable.
    pub samples_skipped: u64,
    /// Samples aspect-ratio buckets left out of their epoch.
    pub samples_left_out: u64,
    /// Shards the host daemon delivered from its own cache.
    pub daemon_cache_local: u64,
    /// Shards the host daemon delivered from a peer's cache.
    pub daemon_cache_peer: u64,
    /// Shards the host daemon delivered from the origin.
    pub daemon_origin: u64,
    /// Bytes the host daemon delivered.
    pub daemon_bytes: u64,
    /// Daemon requests that failed and were read directly.
    pub daemon_failures: u64,
    /// The GPU decode path's routes and split (`decode_*`; empty without it).
    #[serde(flatten)]
    pub decode: std::collections::BTreeMap<String, f64>,
    /// Where the consumer's wait went: `wait_<stage>_s` and `wait_share_<stage>` for each of
    /// origin, peer, daemon, cache, decode and not_waiting, and `data_wait_share`
    /// ([`crate::stall`]; loader only, zeros otherwise).
    #[serde(flatten)]
    pub stall: std::collections::BTreeMap<String, f64>,
    /// The epoch of the last batch handed out (loader only).
    pub epoch: u64,
    /// Samples of that epoch handed out (loader only).
    pub position: u64,
    /// Samples in this consumer's share of the epoch (0 when unknown).
    pub epoch_len: u64,
    /// What the tuners chose and why: `tune_decode_threads`, `tune_prefetch_batches` (with
    /// `_reason` and `_pinned`), `tune_host_share` and the origin's `tune_origin_*`
    /// ([`crate::tune`]).
    #[serde(flatten)]
    pub tune: std::collections::BTreeMap<String, serde_json::Value>,
    /// The job's pace across its ranks, from the host daemon's last answer while under
    /// [`PACE_STALE`] old (`job_scope`, `job_ranks_seen`, `job_step_s_min` / `_median` /
    /// `_max`, `job_skew`, `job_slowest_rank`, `job_samples_per_s_min` / `_max`, `job_ranks`,
    /// `job_rank_step_s` and `step_vs_median`: [`crate::pace::JobPace::metrics`]; empty without a daemon).
    #[serde(flatten)]
    pub job: std::collections::BTreeMap<String, serde_json::Value>,
}

/// A job pace older than this is not shown (the daemon answers every heartbeat, 2 s apart).
pub const PACE_STALE: std::time::Duration = std::time::Duration::from_secs(10);

impl Metrics {
    /// Records the first sample's time, once.
    pub fn mark_first_sample(&self) {
        let ns = self.started.elapsed().as_nanos().max(1) as u64;
        let _ = self.first_sample_ns.compare_exchange(0, ns, Relaxed, Relaxed);
    }

    /// A batch was handed to the training loop now.
    pub fn batch_handed(&self) {
        let ns = self.started.elapsed().as_nanos().max(1) as u64;
        if self.batches.fetch_add(1, Relaxed) == 0 {
            self.first_batch_ns.store(ns, Relaxed);
        }
        self.last_batch_ns.store(ns, Relaxed);
    }

    /// Mean seconds between batches handed out, since the first (0 before the second).
    fn step_s(&self) -> f64 {
        let n = self.batches.load(Relaxed);
        let span = self
            .last_batch_ns
            .load(Relaxed)
            .saturating_sub(self.first_batch_ns.load(Relaxed));
        if n < 2 {
            0.0
        } else {
            span as f64 / 1e9 / (n - 1) as f64
        }
    }

    /// Seconds since the last batch was handed out (0 before the first).
    pub fn since_last_batch_s(&self) -> f64 {
        match self.last_batch_ns.load(Relaxed) {
            0 => 0.0,
            t => (self.started.elapsed().as_nanos() as u64).saturating_sub(t) as f64 / 1e9,
        }
    }

    /// Adds `n` to a counter.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    /// Sets one of the tuner's figures (`key` without its `tune_` prefix).
    pub fn set_tune(&self, key: &'static str, v: impl Into<serde_json::Value>) {
        self.tune.lock().expect("tune lock").insert(key, v.into());
    }

    fn tune_snapshot(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        let mut m: std::collections::BTreeMap<String, serde_json::Value> = self
            .tune
            .lock()
            .expect("tune lock")
            .iter()
            .map(|(k, v)| (format!("tune_{k}"), v.clone()))
            .collect();
        if let Some(o) = self.origin.get() {
            if let Ok(serde_json::Value::Object(st)) = serde_json::to_value(o.state()) {
                m.extend(st.into_iter().map(|(k, v)| (format!("tune_origin_{k}"), v)));
            }
        }
        m
    }

    fn pace_snapshot(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        match &*self.pace.lock().expect("pace lock") {
            Some((at, p)) if at.elapsed() < PACE_STALE => p.metrics(),
            _ => Default::default(),
        }
    }

    /// A snapshot.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let g = |c: &AtomicU64| c.load(Relaxed);
        let elapsed_s = self.started.elapsed().as_secs_f64();
        let (hits, misses) = (g(&self.cache_hits), g(&self.cache_misses));
        MetricsSnapshot {
            elapsed_s,
            origin_bytes: g(&self.origin_bytes),
            origin_requests: g(&self.origin_requests),
            cache_hits: hits,
            cache_bytes: g(&self.cache_bytes),
            cache_misses: misses,
            cache_inserts: g(&self.cache_inserts),
            cache_rejects: g(&self.cache_rejects),
            cache_evictions: g(&self.cache_evictions),
            cache_corrupt: g(&self.cache_corrupt),
            ranged_samples: g(&self.ranged_samples),
            first_gate_waits: g(&self.first_gate_waits),
            host_buffer_late_allocs: g(&self.host_buffer_late_allocs),
            host_buffer_late_frees: g(&self.host_buffer_late_frees),
            shards_coalesced: g(&self.shards_coalesced),
            resident_samples: g(&self.resident_samples),
            samples: g(&self.samples),
            sample_bytes: g(&self.sample_bytes),
            wait_s: g(&self.wait_ns) as f64 / 1e9,
            first_sample_s: g(&self.first_sample_ns) as f64 / 1e9,
            hit_rate: if hits + misses == 0 {
                0.0
            } else {
                hits as f64 / (hits + misses) as f64
            },
            samples_per_s: g(&self.samples) as f64 / elapsed_s.max(1e-9),
            bytes_per_s: g(&self.sample_bytes) as f64 / elapsed_s.max(1e-9),
            batch_wait_s: g(&self.batch_wait_ns) as f64 / 1e9,
            batches: g(&self.batches),
            step_s: self.step_s(),
            images_decoded: g(&self.images_decoded),
            samples_skipped: g(&self.samples_skipped),
            samples_left_out: g(&self.samples_left_out),
            daemon_cache_local: g(&self.provider_shards[0]),
            daemon_cache_peer: g(&self.provider_shards[1]),
            daemon_origin: g(&self.provider_shards[2]),
            daemon_bytes: g(&self.provider_bytes),
            daemon_failures: g(&self.provider_failures),
            decode: self.decode.get().map(|p| p.metrics()).unwrap_or_default(),
            stall: crate::stall::split(&std::array::from_fn(|i| g(&self.stall_ns[i]))),
            epoch: g(&self.consumer_epoch),
            position: g(&self.consumer_position),
            epoch_len: g(&self.consumer_epoch_len),
            tune: self.tune_snapshot(),
            job: self.pace_snapshot(),
        }
    }
}
