//! The daemon's counters and latency histograms, rendered as `/stats` JSON and `/metrics`
//! Prometheus text.

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
    /// Requests refused: unknown manifest, bad URL, shard not in the manifest.
    pub requests_refused: AtomicU64,
    /// Shards served to peers.
    pub peer_served: AtomicU64,
    /// Bytes served to peers.
    pub peer_served_bytes: AtomicU64,
    /// Shards whose bytes from a peer failed verification.
    pub peer_corrupt: AtomicU64,
    /// Local readers that reported a corrupt copy.
    pub local_corrupt: AtomicU64,
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
            requests_refused: AtomicU64::new(0),
            peer_served: AtomicU64::new(0),
            peer_served_bytes: AtomicU64::new(0),
            peer_corrupt: AtomicU64::new(0),
            local_corrupt: AtomicU64::new(0),
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
    /// Every other member: `null` when it completed the handshake just now, else why it did
    /// not (connection refused, timed out, a different key).
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
    /// Refused requests.
    pub requests_refused: u64,
    /// Shards served to peers.
    pub peer_served: u64,
    /// Bytes served to peers.
    pub peer_served_bytes: u64,
    /// Peer deliveries that failed verification.
    pub peer_corrupt: u64,
    /// Local reports of corrupt copies.
    pub local_corrupt: u64,
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
        self.requests_refused = s.requests_refused.load(Relaxed);
        self.peer_served = s.peer_served.load(Relaxed);
        self.peer_served_bytes = s.peer_served_bytes.load(Relaxed);
        self.peer_corrupt = s.peer_corrupt.load(Relaxed);
        self.local_corrupt = s.local_corrupt.load(Relaxed);
        for (i, class) in ["local", "peer", "handshake", "http"].into_iter().enumerate() {
            self.connections_refused
                .insert(class.into(), s.connections_refused[i].load(Relaxed));
        }
    }

    /// Prometheus text exposition.
    pub fn prometheus(&self) -> String {
        let mut o = String::new();
        let mut counter = |name: &str, help: &str, kind: &str, rows: Vec<(String, f64)>| {
            o.push_str(&format!("# HELP ramjet_{name} {help}\n# TYPE ramjet_{name} {kind}\n"));
            for (labels, v) in rows {
                o.push_str(&format!("ramjet_{name}{labels} {v}\n"));
            }
        };
        self.expose_reads(&mut counter);
        self.expose_counters(&mut counter);
        self.expose_ring(&mut counter);
        o
    }

    /// Shards and bytes served and the read latency, by source.
    fn expose_reads(&self, counter: &mut impl FnMut(&str, &str, &str, Vec<(String, f64)>)) {
        let by_src = |m: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| (format!("{{source=\"{k}\"}}"), *v as f64))
                .collect()
        };
        counter(
            "reads_total",
            "Shards served, by source.",
            "counter",
            by_src(&self.reads),
        );
        counter(
            "read_bytes_total",
            "Bytes served, by source.",
            "counter",
            by_src(&self.bytes),
        );
        let mut q = Vec::new();
        for (src, l) in &self.latency {
            for (qq, v) in [("0.5", l.p50_us), ("0.9", l.p90_us), ("0.99", l.p99_us)] {
                q.push((format!("{{source=\"{src}\",quantile=\"{qq}\"}}"), v as f64 / 1e6));
            }
        }
        counter("read_latency_seconds", "Shard read latency, by source.", "summary", q);
    }

    /// The daemon's counters and gauges: flights, failures, refusals, peers served, origin
    /// traffic, the node cache.
    fn expose_counters(&self, counter: &mut impl FnMut(&str, &str, &str, Vec<(String, f64)>)) {
        let one = |v: u64| vec![(String::new(), v as f64)];
        // Unlabelled counters and gauges, in exposition order: (name, help, kind, value).
        let plain = [
            (
                "singleflight_coalesced_total",
                "Requests that joined a fetch in flight.",
                "counter",
                self.singleflight_coalesced,
            ),
            (
                "singleflight_timeouts_total",
                "Waiters that gave up on a flight.",
                "counter",
                self.singleflight_timeouts,
            ),
            ("failures_total", "Failed shard requests.", "counter", self.failures),
            (
                "auth_refused_total",
                "Peer connections refused by the handshake.",
                "counter",
                self.auth_refused,
            ),
            (
                "requests_refused_total",
                "Requests refused by validation.",
                "counter",
                self.requests_refused,
            ),
        ];
        for (name, help, kind, v) in plain {
            counter(name, help, kind, one(v));
        }
        counter(
            "connections_refused_total",
            "Connections closed on accept: their class (or their address's share) was full.",
            "counter",
            self.connections_refused
                .iter()
                .map(|(k, v)| (format!("{{class=\"{k}\"}}"), *v as f64))
                .collect(),
        );
        let plain = [
            (
                "peer_served_total",
                "Shards served to peers.",
                "counter",
                self.peer_served,
            ),
            (
                "peer_served_bytes_total",
                "Bytes served to peers.",
                "counter",
                self.peer_served_bytes,
            ),
            (
                "peer_corrupt_total",
                "Peer deliveries that failed verification.",
                "counter",
                self.peer_corrupt,
            ),
            (
                "origin_requests_total",
                "GET requests sent to the origin.",
                "counter",
                self.origin_requests,
            ),
            (
                "origin_bytes_total",
                "Bytes fetched from the origin.",
                "counter",
                self.origin_bytes,
            ),
            ("cache_bytes", "Bytes in the node cache.", "gauge", self.cache_bytes),
            ("cache_shards", "Shards in the node cache.", "gauge", self.cache_shards),
        ];
        for (name, help, kind, v) in plain {
            counter(name, help, kind, one(v));
        }
    }

    /// The ring and its peers' health.
    fn expose_ring(&self, counter: &mut impl FnMut(&str, &str, &str, Vec<(String, f64)>)) {
        let one = |v: u64| vec![(String::new(), v as f64)];
        counter("ring_version", "Ring version.", "gauge", one(self.ring_version));
        counter("ring_members", "Ring members.", "gauge", one(self.members.len() as u64));
        let health = self
            .peers
            .iter()
            .map(|(p, h)| (format!("{{peer=\"{p}\"}}"), if h.healthy { 1.0 } else { 0.0 }))
            .collect();
        counter("peer_up", "Peer reachable at the last attempt.", "gauge", health);
    }
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
        let p = d.prometheus();
        assert!(p.contains("ramjet_reads_total{source=\"origin\"} 1\n"), "{p}");
        let back: StatsDoc = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert_eq!(back.reads, d.reads);
    }
}
