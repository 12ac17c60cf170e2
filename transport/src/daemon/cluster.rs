//! The dashboard's view of the cluster: this daemon's summary (its counters, a few minutes of
//! read rates, its host's consumers), and the whole ring's, gathered from every member over
//! the authenticated peer channel (`Msg::SummaryRequest`). The browser only ever talks to
//! the daemon that serves it, which holds the cluster key; the browser never does.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::stats::{ClusterDoc, NodeSummary, NodeView, RatePoint, RATES_MAX, SUMMARY_JOBS_MAX};
use crate::wire::{self, Msg};

use super::Inner;

/// How often the read rates are sampled.
pub const RATES_EVERY: Duration = Duration::from_secs(5);
/// The longest a member may take to answer for its summary before it is shown down.
pub const SUMMARY_TIMEOUT: Duration = Duration::from_secs(2);
/// A gathered cluster view is served again for this long (many browsers, one gathering).
const CLUSTER_FRESH: Duration = Duration::from_secs(1);

/// The counters rates are computed from, at one instant.
#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    bytes: [u64; 3],
    origin: u64,
    to_peers: u64,
}

/// Read rates of the last minutes, and the last gathered cluster view.
#[derive(Default)]
pub(super) struct History {
    last: Mutex<Option<Sample>>,
    /// (when the interval ended, its rates).
    rates: Mutex<VecDeque<(Instant, RatePoint)>>,
    cluster: Mutex<Option<(Instant, ClusterDoc)>>,
}

impl Inner {
    fn sample(&self) -> Sample {
        let s = &self.stats;
        Sample {
            at: Instant::now(),
            bytes: std::array::from_fn(|i| s.bytes[i].load(Ordering::Relaxed)),
            origin: self.metrics.origin_bytes.load(Ordering::Relaxed),
            to_peers: s.peer_served_bytes.load(Ordering::Relaxed),
        }
    }

    /// Records the rates since the last sample (every [`RATES_EVERY`]).
    pub(super) fn sample_rates(&self) {
        let now = self.sample();
        let prev = self.history.last.lock().expect("history lock").replace(now);
        let Some(prev) = prev else { return };
        let dt = now.at.duration_since(prev.at).as_secs_f64().max(1e-3);
        let r = |a: u64, b: u64| a.saturating_sub(b) as f64 / dt;
        let point = RatePoint {
            age_s: 0.0,
            cache_local: r(now.bytes[0], prev.bytes[0]),
            cache_peer: r(now.bytes[1], prev.bytes[1]),
            origin: r(now.bytes[2], prev.bytes[2]),
            origin_fetched: r(now.origin, prev.origin),
            to_peers: r(now.to_peers, prev.to_peers),
        };
        let mut rates = self.history.rates.lock().expect("history lock");
        if rates.len() == RATES_MAX {
            rates.pop_front();
        }
        rates.push_back((now.at, point));
    }

    /// This daemon's summary.
    pub(super) fn summary(&self) -> NodeSummary {
        let d = self.stats_doc();
        let now = Instant::now();
        let rates = self
            .history
            .rates
            .lock()
            .expect("history lock")
            .iter()
            .map(|(at, p)| RatePoint {
                age_s: now.duration_since(*at).as_secs_f64(),
                ..p.clone()
            })
            .collect();
        let mut jobs = self.jobs.views(&self.me, false);
        if jobs.len() > SUMMARY_JOBS_MAX {
            jobs.sort_by(|a, b| a.seen_s_ago.total_cmp(&b.seen_s_ago));
            jobs.truncate(SUMMARY_JOBS_MAX);
        }
        NodeSummary {
            ready: d.members.contains(&d.node) && d.peers.values().all(|p| p.healthy),
            node: d.node,
            uptime_s: d.uptime_s,
            ring_version: d.ring_version,
            members: d.members,
            frozen: d.frozen,
            pending_members: d.pending_members.is_some(),
            cache_bytes: d.cache_bytes,
            cache_limit_bytes: d.cache_limit_bytes,
            cache_shards: d.cache_shards,
            reads: d.reads,
            bytes: d.bytes,
            origin_bytes: d.origin_bytes,
            origin_requests: d.origin_requests,
            singleflight_coalesced: d.singleflight_coalesced,
            corrupt_caught: d.peer_corrupt + d.local_corrupt + self.metrics.cache_corrupt.load(Ordering::Relaxed),
            failures: d.failures,
            rates,
            jobs,
        }
    }

    /// This daemon's summary as a peer frame: cut (consumers, then rates) until it fits.
    pub(super) fn summary_msg(&self) -> Msg {
        let mut s = self.summary();
        loop {
            let m = Msg::Summary(Box::new(s.clone()));
            if wire::encode(&m).len() + wire::FRAME_TAG_BYTES + 64 <= wire::FRAME_MAX {
                return m;
            }
            if s.jobs.pop().is_none() && s.rates.pop().is_none() {
                s.members.truncate(1);
                return Msg::Summary(Box::new(s));
            }
        }
    }

    /// A member's summary over the peer channel, within [`SUMMARY_TIMEOUT`].
    async fn peer_summary(&self, peer: &str) -> crate::error::Result<NodeSummary> {
        let fail = |why: String| crate::error::Error::peer(peer, why);
        let ask = async {
            let mut ch = crate::peer::connect(&self.link, peer)
                .await
                .map_err(|e| fail(e.to_string()))?;
            ch.send(&Msg::SummaryRequest).await.map_err(|e| fail(e.to_string()))?;
            match ch.recv().await.map_err(|e| fail(e.to_string()))? {
                Msg::Summary(s) => Ok(*s),
                Msg::Fail { message } => Err(fail(message)),
                m => Err(fail(format!("unexpected reply {m:?}"))),
            }
        };
        match tokio::time::timeout(SUMMARY_TIMEOUT, ask).await {
            Ok(r) => r,
            Err(_) => Err(fail(format!("no answer within {SUMMARY_TIMEOUT:?}"))),
        }
    }

    /// The other nodes' consumers of `job` in the last gathered cluster view, with its age
    /// (`None` before the first gathering).
    pub(super) fn gathered_jobs(&self, job: &str) -> Option<(Duration, Vec<crate::stats::JobView>)> {
        let cached = self.history.cluster.lock().expect("history lock");
        let (at, doc) = cached.as_ref()?;
        let views = doc
            .jobs
            .iter()
            .filter(|v| v.node != self.me && v.beat.job == job)
            .cloned()
            .collect();
        Some((at.elapsed(), views))
    }

    /// The whole cluster: every member of this daemon's ring, asked at once.
    pub(super) async fn cluster(self: &Arc<Self>) -> ClusterDoc {
        if let Some((at, doc)) = &*self.history.cluster.lock().expect("history lock") {
            if at.elapsed() < CLUSTER_FRESH {
                return doc.clone();
            }
        }
        let members = self
            .membership
            .read()
            .expect("membership lock")
            .ring()
            .members()
            .to_vec();
        let asks = members.iter().map(|m| async move {
            let r = if *m == self.me {
                Ok(self.summary())
            } else {
                self.peer_summary(m).await
            };
            (m.clone(), r)
        });
        let mut doc = ClusterDoc {
            served_by: self.me.clone(),
            at_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            ..Default::default()
        };
        for (name, r) in futures::future::join_all(asks).await {
            let view = match r {
                Ok(s) => {
                    let latest = s.rates.last().cloned().unwrap_or_default();
                    doc.origin_bytes_per_s += latest.origin_fetched;
                    for (k, v) in [
                        ("cache_local", latest.cache_local),
                        ("cache_peer", latest.cache_peer),
                        ("origin", latest.origin),
                    ] {
                        *doc.read_bytes_per_s.entry(k.into()).or_default() += v;
                    }
                    doc.jobs.extend(s.jobs.iter().cloned());
                    let state = if s.frozen {
                        "frozen"
                    } else if s.ready {
                        "ready"
                    } else {
                        "up"
                    };
                    NodeView {
                        name,
                        state: state.into(),
                        error: None,
                        summary: Some(s),
                    }
                }
                Err(e) => {
                    doc.down += 1;
                    NodeView {
                        name,
                        state: "down".into(),
                        // The node is named beside it: the reason alone.
                        error: Some(match e {
                            crate::error::Error::Peer { reason, .. } => reason,
                            other => other.to_string(),
                        }),
                        summary: None,
                    }
                }
            };
            doc.nodes.push(view);
        }
        doc.skew = crate::skew::skews(&doc.jobs);
        *self.history.cluster.lock().expect("history lock") = Some((Instant::now(), doc.clone()));
        doc
    }
}

/// Samples the read rates every [`RATES_EVERY`] while the daemon runs.
pub(super) async fn sample_rates(inner: Arc<Inner>) {
    loop {
        inner.sample_rates();
        tokio::time::sleep(RATES_EVERY).await;
    }
}
