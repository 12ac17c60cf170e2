//! A job's pace across its ranks: each rank's step time and samples per second, and the job's
//! step-time skew (the seed's "step time skew across ranks"). Host daemons gather these from
//! their consumers' heartbeats (`ramjet_transport::skew`) and hand a consumer its job's in
//! the answer to its heartbeat ([`BeatReply`]), so a rank's `metrics()` shows how it stands.

use serde::{Deserialize, Serialize};

use crate::provider::HostGrant;

/// One rank's pace: its consumers (DataLoader workers) together.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankPace {
    /// The rank.
    pub rank: u32,
    /// The daemon its consumers report to.
    pub node: String,
    /// Seconds per step: its workers hand batches out in turn, so the rank's rate of steps
    /// is the sum of theirs (0: no batch yet, or read sample by sample).
    pub step_s: f64,
    /// Samples per second, its workers summed.
    pub samples_per_s: f64,
}

/// One job's ranks side by side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobSkew {
    /// The job.
    pub job: String,
    /// Its ranks that reported, in rank order.
    pub ranks: Vec<RankPace>,
    /// The fastest, median and slowest step time among the ranks that step (seconds).
    pub step_s_min: f64,
    /// See `step_s_min`.
    pub step_s_median: f64,
    /// See `step_s_min`.
    pub step_s_max: f64,
    /// `(slowest - fastest) / median` step time: 0 when every rank steps alike (or fewer than
    /// two ranks step).
    pub skew: f64,
    /// The rank with the slowest step, if any rank steps.
    pub slowest_rank: Option<u32>,
    /// The lowest and highest samples per second among the ranks.
    pub samples_per_s_min: f64,
    /// See `samples_per_s_min`.
    pub samples_per_s_max: f64,
}

/// Ranks a daemon lists one by one in its answer to a heartbeat; a larger job gets the
/// summary alone.
pub const PACE_RANKS_SENT_MAX: usize = 64;

/// A job's pace as one host daemon knows it, for one of its consumers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobPace {
    /// `host`: the ranks that report to this daemon; `cluster`: every node's, as the daemon
    /// last gathered them from its ring (`docs/protocol.md`, `beat`).
    pub scope: String,
    /// Ranks the figures cover.
    pub ranks_seen: u32,
    /// Seconds since the other nodes' figures were gathered (0 for `host`).
    pub age_s: f64,
    /// The asking consumer's rank's step time (its workers together; 0 before it steps).
    pub rank_step_s: f64,
    /// The figures; `ranks` is empty above [`PACE_RANKS_SENT_MAX`] ranks.
    pub skew: JobSkew,
}

/// A host daemon's answer to a heartbeat.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BeatReply {
    /// The consumer's share of the host's budgets (a consumer whose loader decodes).
    pub grant: Option<HostGrant>,
    /// Its job's pace (a daemon that knows it, to a loader that asked).
    pub job: Option<JobPace>,
}

impl JobPace {
    /// The figures a consumer's metrics show, by name (`job_*`, and `step_vs_median`: its
    /// rank's step time over the job's median, when both are known).
    pub fn metrics(&self) -> std::collections::BTreeMap<String, serde_json::Value> {
        let s = &self.skew;
        let mut m = std::collections::BTreeMap::new();
        let mut put = |k: &str, v: serde_json::Value| {
            m.insert(format!("job_{k}"), v);
        };
        put("scope", self.scope.clone().into());
        put("ranks_seen", self.ranks_seen.into());
        put("age_s", self.age_s.into());
        put("rank_step_s", self.rank_step_s.into());
        put("step_s_min", s.step_s_min.into());
        put("step_s_median", s.step_s_median.into());
        put("step_s_max", s.step_s_max.into());
        put("skew", s.skew.into());
        put(
            "slowest_rank",
            s.slowest_rank.map_or(serde_json::Value::Null, Into::into),
        );
        put("samples_per_s_min", s.samples_per_s_min.into());
        put("samples_per_s_max", s.samples_per_s_max.into());
        if !s.ranks.is_empty() {
            put("ranks", serde_json::to_value(&s.ranks).unwrap_or_default());
        }
        if self.rank_step_s > 0.0 && s.step_s_median > 0.0 {
            m.insert("step_vs_median".into(), (self.rank_step_s / s.step_s_median).into());
        }
        m
    }
}
