//! The daemon's counters and latency histograms (`/stats` JSON; `/metrics` is rendered from
//! the same document by `crate::prometheus`), and the dashboard's documents.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use ramjet_engine::FetchedFrom;
use serde::{Deserialize, Serialize};

/// Live counters of one daemon.
#[derive(Debug)]
pub struct Stats {
    /// Shards served, by source.
    pub reads: [AtomicU64; 3],
    /// Bytes served, by source.
    pub bytes: [AtomicU64; 3],
    /// Requests that joined a fetch already in flight (singleflight).
    pub coalesced: AtomicU64,
    /// Waiters that gave up on a flight and read the origin themselves.
    pub singleflight_timeouts: AtomicU64,
    /// Requests for a shard that failed (error sent to the requester).
    pub failures: AtomicU64,
    /// Peer connections refused by the handshake (no key, wrong key, bad protocol).
    pub auth_refused: AtomicU64,
    /// Peer connections that completed the handshake.
    pub handshakes: AtomicU64,
    /// Requests refused: unknown manifest, bad URL, shard not in the manifest.
    pub requests_refused: AtomicU64,
    /// Shards served to peers.
    pub peer_served: AtomicU64,
    /// Bytes served to peers.
    pub peer_served_bytes: AtomicU64,
    /// Bytes fetched from peers (each flight's delivery once, however many requests it served).
    pub peer_fetched_bytes: AtomicU64,
    /// Shards whose bytes from a peer failed verification.
    pub peer_corrupt: AtomicU64,
    /// Local readers that reported a corrupt copy.
    pub local_corrupt: AtomicU64,
    /// Sealed shared copies of cached shards made (`daemon::local`, shared shards).
    pub shared_copies: AtomicU64,
    /// Local requests answered with a shared copy made for an earlier one.
    pub shared_hits: AtomicU64,
    /// Connections closed on accept because their class's budget (or their address's share
    /// of it) was full, by class: local, peer, handshake, http.
    pub connections_refused: [AtomicU64; 4],
    /// When a refusal of each class was last logged (ms since start of the process's clock),
    /// so a flood is logged once a second, not once a connection.
    refusal_logged_ms: [AtomicU64; 4],
    latency: [Mutex<Histogram<u64>>; 3],
}

impl Default for Stats {
    fn default() -> Self {
        let h = || Mutex::new(Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"));
        Stats {
            reads: Default::default(),
            bytes: Default::default(),
            coalesced: AtomicU64::new(0),
            singleflight_timeouts: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            auth_refused: AtomicU64::new(0),
            handshakes: AtomicU64::new(0),
            requests_refused: AtomicU64::new(0),
            peer_served: AtomicU64::new(0),
            peer_served_bytes: AtomicU64::new(0),
            peer_fetched_bytes: AtomicU64::new(0),
            peer_corrupt: AtomicU64::new(0),
            local_corrupt: AtomicU64::new(0),
            shared_copies: AtomicU64::new(0),
            shared_hits: AtomicU64::new(0),
            connections_refused: Default::default(),
            refusal_logged_ms: Default::default(),
            latency: [h(), h(), h()],
        }
    }
}

impl Stats {
    /// Records one shard read: its source, size and latency. Recorded per shard (megabytes),
    /// so the histogram lock is far off the per-byte path.
    pub fn record(&self, src: FetchedFrom, bytes: u64, took: Duration) {
        self.reads[src.index()].fetch_add(1, Relaxed);
        self.bytes[src.index()].fetch_add(bytes, Relaxed);
        let us = (took.as_micros() as u64).clamp(1, 600_000_000);
        let mut h = self.latency[src.index()].lock().expect("histogram lock");
        let _ = h.record(us);
    }

    /// Whether a refusal of class `i` should be logged now (at most once a second per class).
    pub fn refusal_log_due(&self, i: usize) -> bool {
        static T0: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        let now = T0.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64 + 1_000;
        let last = self.refusal_logged_ms[i].load(Relaxed);
        now >= last + 1_000
            && self.refusal_logged_ms[i]
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }

    fn latency_of(&self, src: FetchedFrom) -> Latency {
        let h = self.latency[src.index()].lock().expect("histogram lock");
        Latency {
            count: h.len(),
            p50_us: h.value_at_quantile(0.5),
            p90_us: h.value_at_quantile(0.9),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
        }
    }
}

/// Latency summary of one source, in microseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Latency {
    /// Reads recorded.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest.
    pub max_us: u64,
}

/// One peer's health as this daemon sees it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerHealth {
    /// Reachable at the last attempt (or never tried).
    pub healthy: bool,
    /// Shards fetched from it.
    pub fetched: u64,
    /// Failed fetches (connect, refused, timeout, corrupt).
    pub failures: u64,
    /// The last failure.
    pub last_error: Option<String>,
}

/// The `/ready` document: whether this daemon can serve its share of the ring now.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReadyDoc {
    /// This daemon's ring name.
    pub node: String,
    /// Ring version.
    pub ring_version: u64,
    /// Ring members.
    pub members: Vec<String>,
    /// This daemon is a member and every other member completed an authenticated handshake.
    pub ready: bool,
    /// Every other member: `null` when it completed the handshake in the last probe (at most a
    /// few seconds ago), else why it did not (connection refused, timed out, a different key).
    pub peers: BTreeMap<String, Option<String>>,
    /// Why not ready, in words (empty when ready).
    pub problems: Vec<String>,
}

/// The `/stats` document.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct StatsDoc {
    /// This daemon's ring name (`host:port`), or `local` without peers.
    pub node: String,
    /// Seconds since start.
    pub uptime_s: f64,
    /// Ring version.
    pub ring_version: u64,
    /// Ring members.
    pub members: Vec<String>,
    /// Whether the ring version is frozen.
    pub frozen: bool,
    /// A membership change waiting for unfreeze.
    pub pending_members: Option<Vec<String>>,
    /// Shards served, by source name.
    pub reads: BTreeMap<String, u64>,
    /// Bytes served, by source name.
    pub bytes: BTreeMap<String, u64>,
    /// Read latency, by source name.
    pub latency: BTreeMap<String, Latency>,
    /// Requests coalesced into a flight already running.
    pub singleflight_coalesced: u64,
    /// Waiters that timed out on a flight.
    pub singleflight_timeouts: u64,
    /// Failed requests.
    pub failures: u64,
    /// Refused peer connections.
    pub auth_refused: u64,
    /// Peer connections that completed the handshake.
    #[serde(default)]
    pub handshakes: u64,
    /// Refused requests.
    pub requests_refused: u64,
    /// Shards served to peers.
    pub peer_served: u64,
    /// Bytes served to peers.
    pub peer_served_bytes: u64,
    /// Bytes fetched from peers, once a flight: with `origin_bytes`, the bytes into the node.
    #[serde(default)]
    pub peer_fetched_bytes: u64,
    /// Peer deliveries that failed verification.
    pub peer_corrupt: u64,
    /// Local reports of corrupt copies.
    pub local_corrupt: u64,
    /// Sealed shared copies of cached shards made for the host's consumers to map.
    #[serde(default)]
    pub shared_copies: u64,
    /// Local requests answered with a shared copy made for an earlier one.
    #[serde(default)]
    pub shared_hits: u64,
    /// Connections closed on accept because their class (or their address's share of it)
    /// was full, by class (`local`, `peer`, `handshake`, `http`).
    #[serde(default)]
    pub connections_refused: BTreeMap<String, u64>,
    /// GET requests this daemon sent to the origin.
    pub origin_requests: u64,
    /// Bytes this daemon fetched from the origin.
    pub origin_bytes: u64,
    /// Shards in the cache.
    pub cache_shards: u64,
    /// Bytes in the cache.
    pub cache_bytes: u64,
    /// The cache budget.
    pub cache_limit_bytes: u64,
    /// Peers, by name.
    pub peers: BTreeMap<String, PeerHealth>,
    /// What the host's tuners chose and why: the origin controls of this daemon (its
    /// whole-shard fetches are the host's), the host's budgets and each decoding consumer's
    /// grant.
    #[serde(default)]
    pub tuner: TunerDoc,
}

/// `/stats` `tuner`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TunerDoc {
    /// Each origin's request control (`s3://bucket`), as `metrics()` shows it.
    pub origins: BTreeMap<String, ramjet_engine::tune::OriginState>,
    /// The host's decode budget (decode jobs at once, all consumers together).
    pub decode_threads: u64,
    /// The host's memory budget for prefetched and decoded batches.
    pub host_memory_bytes: u64,
    /// Each decoding consumer's share now.
    pub grants: BTreeMap<String, ramjet_engine::HostGrant>,
}

impl StatsDoc {
    /// Fills the per-source parts from live counters.
    pub fn fill(&mut self, s: &Stats) {
        for src in FetchedFrom::ALL {
            self.reads.insert(src.name().into(), s.reads[src.index()].load(Relaxed));
            self.bytes.insert(src.name().into(), s.bytes[src.index()].load(Relaxed));
            self.latency.insert(src.name().into(), s.latency_of(src));
        }
        self.singleflight_coalesced = s.coalesced.load(Relaxed);
        self.singleflight_timeouts = s.singleflight_timeouts.load(Relaxed);
        self.failures = s.failures.load(Relaxed);
        self.auth_refused = s.auth_refused.load(Relaxed);
        self.handshakes = s.handshakes.load(Relaxed);
        self.requests_refused = s.requests_refused.load(Relaxed);
        self.peer_served = s.peer_served.load(Relaxed);
        self.peer_served_bytes = s.peer_served_bytes.load(Relaxed);
        self.peer_fetched_bytes = s.peer_fetched_bytes.load(Relaxed);
        self.peer_corrupt = s.peer_corrupt.load(Relaxed);
        self.local_corrupt = s.local_corrupt.load(Relaxed);
        self.shared_copies = s.shared_copies.load(Relaxed);
        self.shared_hits = s.shared_hits.load(Relaxed);
        for (i, class) in ["local", "peer", "handshake", "http"].into_iter().enumerate() {
            self.connections_refused
                .insert(class.into(), s.connections_refused[i].load(Relaxed));
        }
    }
}

/// One point of a consumer's history (one heartbeat).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobPoint {
    /// Seconds ago.
    pub age_s: f64,
    /// Samples per second then.
    pub samples_per_s: f64,
    /// Its data-wait share then (since it started).
    pub data_wait_share: f64,
}

/// A consumer as its host daemon knows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    /// The ring name of the daemon it reports to.
    pub node: String,
    /// Seconds since its last heartbeat.
    pub seen_s_ago: f64,
    /// Its last heartbeat.
    pub beat: ramjet_engine::Heartbeat,
    /// Its heartbeats of the last minutes (only on the daemon's own `/jobs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<JobPoint>,
}

pub use ramjet_engine::pace::{JobSkew, RankPace};

/// A daemon's read rates over one interval.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RatePoint {
    /// Seconds ago (the end of the interval).
    pub age_s: f64,
    /// Bytes/s served to this host's loaders from its own cache.
    pub cache_local: f64,
    /// Bytes/s served to this host's loaders from peers' caches.
    pub cache_peer: f64,
    /// Bytes/s served to this host's loaders from the origin.
    pub origin: f64,
    /// Bytes/s this daemon fetched from the origin (for its own loaders and its peers).
    pub origin_fetched: f64,
    /// Bytes/s this daemon served to its peers.
    pub to_peers: f64,
}

/// What one daemon tells the dashboard about itself (over the peer channel for the others).
/// Bounded to fit one control frame: [`RATES_MAX`] points and [`SUMMARY_JOBS_MAX`] consumers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeSummary {
    /// Its ring name.
    pub node: String,
    /// Seconds since it started.
    pub uptime_s: f64,
    /// Its ring version.
    pub ring_version: u64,
    /// Its member list.
    pub members: Vec<String>,
    /// Its ring version is frozen (a training epoch runs).
    pub frozen: bool,
    /// A membership change waits for the unfreeze.
    pub pending_members: bool,
    /// It is in its own member list and every peer it knows was reachable at the last try.
    pub ready: bool,
    /// Bytes in its cache.
    pub cache_bytes: u64,
    /// Its cache budget.
    pub cache_limit_bytes: u64,
    /// Shards in its cache.
    pub cache_shards: u64,
    /// Shards served to its loaders, by source.
    pub reads: BTreeMap<String, u64>,
    /// Bytes served to its loaders, by source.
    pub bytes: BTreeMap<String, u64>,
    /// Bytes it fetched from the origin.
    pub origin_bytes: u64,
    /// GETs it sent to the origin.
    pub origin_requests: u64,
    /// Requests that joined a fetch in flight (singleflight).
    pub singleflight_coalesced: u64,
    /// Corrupt copies caught: peers' deliveries that failed verification, and loaders'
    /// reports of corrupt copies.
    pub corrupt_caught: u64,
    /// Failed requests.
    pub failures: u64,
    /// Read rates, oldest first.
    pub rates: Vec<RatePoint>,
    /// Its host's consumers.
    pub jobs: Vec<JobView>,
}

/// Rate points in a [`NodeSummary`] (5 minutes at one per 5 s).
pub const RATES_MAX: usize = 60;
/// Consumers in a [`NodeSummary`] (those heard from last are kept).
pub const SUMMARY_JOBS_MAX: usize = 64;

/// A ring member as the dashboard shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    /// Its ring name.
    pub name: String,
    /// `ready`, `up`, `frozen` or `down` (did not answer: `error` says why).
    pub state: String,
    /// Why it is down.
    pub error: Option<String>,
    /// What it said.
    pub summary: Option<NodeSummary>,
}

/// The whole cluster, as `/cluster` serves it (the dashboard's data).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterDoc {
    /// The daemon that gathered it.
    pub served_by: String,
    /// Seconds since the Unix epoch, when gathered.
    pub at_unix_s: f64,
    /// Every ring member (of the serving daemon's ring), in ring order.
    pub nodes: Vec<NodeView>,
    /// Every consumer of every node that answered.
    pub jobs: Vec<JobView>,
    /// The cluster's origin fetches, bytes/s, over the last interval.
    pub origin_bytes_per_s: f64,
    /// Bytes/s served to loaders, by source, over the last interval (the cluster's sum).
    pub read_bytes_per_s: BTreeMap<String, f64>,
    /// Members down.
    pub down: usize,
    /// Each job's ranks side by side: step time, samples per second and the step-time skew
    /// (`crate::skew`), over every node's consumers.
    #[serde(default)]
    pub skew: Vec<JobSkew>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_render_as_json_and_prometheus() {
        let s = Stats::default();
        s.record(FetchedFrom::Origin, 100, Duration::from_millis(20));
        s.record(FetchedFrom::CachePeer, 50, Duration::from_millis(2));
        let mut d = StatsDoc::default();
        d.fill(&s);
        assert_eq!(d.reads["origin"], 1);
        assert_eq!(d.bytes["cache_peer"], 50);
        let l = &d.latency["origin"];
        assert!(l.count == 1 && (19_000..=21_000).contains(&l.p50_us), "{l:?}");
        let back: StatsDoc = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert_eq!(back.reads, d.reads);
    }
}
