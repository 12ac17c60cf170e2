//! `/metrics`: the daemon's counters and its host's consumers in the OpenMetrics text format,
//! through `prometheus-client` (the Prometheus project's Rust client) instead of hand-written
//! exposition text.
//!
//! A registry is built for each scrape from the same document `/stats` serves, so the two
//! never disagree. Labels are bounded: `source` (3 values), `class` (4), `quantile` (3),
//! `peer` (the ring's members), and per consumer `job`, `rank`, `worker` (and `stage`, 6
//! values): at most [`crate::daemon::JOBS_MAX`] consumers per daemon, so at most 256 × 10
//! job series.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::stats::{JobView, StatsDoc};

type Labels = Vec<(String, String)>;
type FGauge = Gauge<f64, AtomicU64>;

fn counter(r: &mut Registry, name: &str, help: &str, v: u64) {
    let c: Counter = Counter::default();
    c.inc_by(v);
    r.register(name, help, c);
}

fn gauge(r: &mut Registry, name: &str, help: &str, v: f64) {
    let g = FGauge::default();
    g.set(v);
    r.register(name, help, g);
}

fn counters_by(r: &mut Registry, name: &str, help: &str, label: &str, rows: impl IntoIterator<Item = (String, u64)>) {
    let f = Family::<Labels, Counter>::default();
    for (k, v) in rows {
        f.get_or_create(&vec![(label.to_string(), k)]).inc_by(v);
    }
    r.register(name, help, f);
}

fn gauges(r: &mut Registry, name: &str, help: &str, rows: impl IntoIterator<Item = (Labels, f64)>) {
    let f = Family::<Labels, FGauge>::default();
    for (l, v) in rows {
        f.get_or_create(&l).set(v);
    }
    r.register(name, help, f);
}

/// The exposition of `d` and `jobs` (names under `ramjet_`; counters end in `_total`).
pub fn exposition(d: &StatsDoc, jobs: &[JobView]) -> String {
    let mut root = Registry::with_prefix("ramjet");
    let r = &mut root;
    let cp = |m: &std::collections::BTreeMap<String, u64>| m.iter().map(|(k, v)| (k.clone(), *v)).collect::<Vec<_>>();
    counters_by(
        r,
        "reads",
        "Shards served to this host's loaders, by source.",
        "source",
        cp(&d.reads),
    );
    counters_by(
        r,
        "read_bytes",
        "Bytes served to this host's loaders, by source.",
        "source",
        cp(&d.bytes),
    );
    let mut q = Vec::new();
    for (src, l) in &d.latency {
        for (qq, v) in [("0.5", l.p50_us), ("0.9", l.p90_us), ("0.99", l.p99_us)] {
            q.push((
                vec![
                    ("source".to_string(), src.clone()),
                    ("quantile".to_string(), qq.to_string()),
                ],
                v as f64 / 1e6,
            ));
        }
    }
    gauges(r, "read_latency_seconds", "Shard read latency quantiles, by source.", q);
    for (name, help, v) in [
        (
            "singleflight_coalesced",
            "Requests that joined a fetch in flight.",
            d.singleflight_coalesced,
        ),
        (
            "singleflight_timeouts",
            "Waiters that gave up on a flight.",
            d.singleflight_timeouts,
        ),
        ("failures", "Failed shard requests.", d.failures),
        (
            "auth_refused",
            "Peer connections refused by the handshake.",
            d.auth_refused,
        ),
        (
            "handshakes",
            "Peer connections that completed the handshake.",
            d.handshakes,
        ),
        (
            "requests_refused",
            "Requests refused by validation.",
            d.requests_refused,
        ),
        ("peer_served", "Shards served to peers.", d.peer_served),
        ("peer_served_bytes", "Bytes served to peers.", d.peer_served_bytes),
        (
            "peer_fetched_bytes",
            "Bytes fetched from peers (with origin_bytes, the bytes into the node).",
            d.peer_fetched_bytes,
        ),
        (
            "peer_corrupt",
            "Peer deliveries that failed verification.",
            d.peer_corrupt,
        ),
        ("local_corrupt", "Loaders' reports of corrupt copies.", d.local_corrupt),
        ("origin_requests", "GET requests sent to the origin.", d.origin_requests),
        ("origin_bytes", "Bytes fetched from the origin.", d.origin_bytes),
    ] {
        counter(r, name, help, v);
    }
    counters_by(
        r,
        "connections_refused",
        "Connections closed on accept: their class (or their address's share) was full.",
        "class",
        cp(&d.connections_refused),
    );
    gauge(r, "cache_bytes", "Bytes in the node cache.", d.cache_bytes as f64);
    gauge(
        r,
        "cache_limit_bytes",
        "The node cache's budget.",
        d.cache_limit_bytes as f64,
    );
    gauge(r, "cache_shards", "Shards in the node cache.", d.cache_shards as f64);
    gauge(r, "ring_version", "Ring version.", d.ring_version as f64);
    gauge(r, "ring_members", "Ring members.", d.members.len() as f64);
    gauge(
        r,
        "ring_frozen",
        "1 while the ring version is frozen.",
        f64::from(u8::from(d.frozen)),
    );
    gauges(
        r,
        "peer_up",
        "Peer reachable at the last attempt.",
        d.peers
            .iter()
            .map(|(p, h)| (vec![("peer".to_string(), p.clone())], f64::from(u8::from(h.healthy)))),
    );
    expose_jobs(r, jobs);
    let mut out = String::new();
    encode(&mut out, &root).expect("writing to a String");
    out
}

/// The host's consumers, labelled by job, rank and worker.
fn expose_jobs(r: &mut Registry, jobs: &[JobView]) {
    let who = |j: &JobView| -> Labels {
        vec![
            ("job".into(), j.beat.job.clone()),
            ("rank".into(), j.beat.rank.to_string()),
            ("worker".into(), j.beat.worker.to_string()),
        ]
    };
    gauge(r, "jobs", "Consumers reporting to this daemon.", jobs.len() as f64);
    gauges(
        r,
        "job_samples_per_second",
        "A consumer's samples per second over its last heartbeat interval.",
        jobs.iter().map(|j| (who(j), j.beat.samples_per_s)),
    );
    gauges(
        r,
        "job_step_seconds",
        "A consumer's seconds per batch over its last heartbeat interval (since its last batch when none came).",
        jobs.iter().map(|j| (who(j), j.beat.step_s)),
    );
    // Each job's ranks as this daemon knows them (its host's; the cluster view, /cluster,
    // holds every node's).
    let skews = crate::skew::skews(jobs);
    gauges(
        r,
        "rank_step_seconds",
        "A rank's seconds per step, its workers together (this host's ranks).",
        skews.iter().flat_map(|s| {
            s.ranks.iter().map(move |p| {
                let l = vec![("job".into(), s.job.clone()), ("rank".into(), p.rank.to_string())];
                (l, p.step_s)
            })
        }),
    );
    gauges(
        r,
        "job_step_skew",
        "(slowest - fastest) / median step time of a job's ranks on this host.",
        skews.iter().map(|s| (vec![("job".to_string(), s.job.clone())], s.skew)),
    );
    gauges(
        r,
        "job_data_wait_share",
        "A consumer's share of its time spent waiting for data.",
        jobs.iter().map(|j| (who(j), j.beat.data_wait_share)),
    );
    gauges(
        r,
        "job_wait_share",
        "A consumer's share of its time by stage (origin, peer, daemon, cache, decode, not_waiting).",
        jobs.iter().flat_map(|j| {
            j.beat.split.iter().map(move |(stage, v)| {
                let mut l = who(j);
                l.push(("stage".into(), stage.clone()));
                (l, *v)
            })
        }),
    );
    let f = Family::<Labels, Counter>::default();
    for j in jobs {
        f.get_or_create(&who(j)).inc_by(j.beat.samples_skipped);
    }
    r.register(
        "job_samples_skipped",
        "Samples a consumer's loader found corrupt (undecodable) and left out of their batches, since it started.",
        f,
    );
    gauges(
        r,
        "job_epoch",
        "The epoch a consumer reads.",
        jobs.iter().map(|j| (who(j), j.beat.epoch as f64)),
    );
    gauges(
        r,
        "job_epoch_progress",
        "The share of its epoch a consumer has read (0 when its length is unknown).",
        jobs.iter().map(|j| {
            let p = if j.beat.epoch_len == 0 {
                0.0
            } else {
                j.beat.position as f64 / j.beat.epoch_len as f64
            };
            (who(j), p)
        }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Stats;
    use ramjet_engine::FetchedFrom;
    use std::time::Duration;

    #[test]
    fn the_exposition_carries_counters_gauges_and_jobs() {
        let s = Stats::default();
        s.record(FetchedFrom::Origin, 100, Duration::from_millis(20));
        let mut d = StatsDoc::default();
        d.fill(&s);
        let mut beat = ramjet_engine::Heartbeat {
            consumer: "1/0.0".into(),
            job: "train".into(),
            samples_per_s: 12.5,
            data_wait_share: 0.25,
            step_s: 0.5,
            samples_skipped: 3,
            ..Default::default()
        };
        beat.split.insert("origin".into(), 0.25);
        let jobs = vec![JobView {
            node: "n".into(),
            beat,
            ..Default::default()
        }];
        let p = exposition(&d, &jobs);
        assert!(p.contains("ramjet_reads_total{source=\"origin\"} 1\n"), "{p}");
        assert!(p.contains("# TYPE ramjet_cache_bytes gauge"), "{p}");
        assert!(
            p.contains("ramjet_job_data_wait_share{job=\"train\",rank=\"0\",worker=\"0\"} 0.25"),
            "{p}"
        );
        assert!(p.contains("stage=\"origin\""), "{p}");
        assert!(
            p.contains("ramjet_job_step_seconds{job=\"train\",rank=\"0\",worker=\"0\"} 0.5"),
            "{p}"
        );
        assert!(
            p.contains("ramjet_rank_step_seconds{job=\"train\",rank=\"0\"} 0.5"),
            "{p}"
        );
        assert!(p.contains("ramjet_job_step_skew{job=\"train\"} 0"), "{p}");
        assert!(
            p.contains("ramjet_job_samples_skipped_total{job=\"train\",rank=\"0\",worker=\"0\"} 3\n"),
            "{p}"
        );
        assert!(p.ends_with("# EOF\n"), "{p}");
    }
}
