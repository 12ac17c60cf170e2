//! A consumer's job's pace across its ranks, in the answer to its heartbeat
//! ([`ramjet_engine::pace::JobPace`]): this host's ranks, and the other nodes' when the
//! daemon has gathered the ring's view lately. A daemon whose consumers belong to a job with
//! ranks on other hosts gathers that view every [`PACE_GATHER_EVERY`] (rings up to
//! [`PACE_GATHER_MEMBERS_MAX`] members; a larger one shows each host's ranks alone).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use ramjet_engine::pace::{JobPace, PACE_RANKS_SENT_MAX};

use super::Inner;

/// How often a daemon with a job spanning hosts gathers the ring's consumers.
pub const PACE_GATHER_EVERY: Duration = Duration::from_secs(5);
/// Other nodes' figures older than this are left out of a job's pace.
pub const PACE_GATHERED_FRESH: Duration = Duration::from_secs(15);
/// Rings above this many members are not gathered for the pace (each gathering asks every
/// member).
pub const PACE_GATHER_MEMBERS_MAX: usize = 64;

impl Inner {
    /// The pace of `job` for a consumer of rank `rank`: `None` when no consumer of the job
    /// reports here.
    pub(super) fn job_pace(&self, job: &str, rank: u32) -> Option<JobPace> {
        let mut views: Vec<_> = self
            .jobs
            .views(&self.me, false)
            .into_iter()
            .filter(|v| v.beat.job == job)
            .collect();
        let (mut scope, mut age_s) = ("host", 0.0);
        if let Some((age, others)) = self.gathered_jobs(job) {
            if age < PACE_GATHERED_FRESH && !others.is_empty() {
                views.extend(others);
                (scope, age_s) = ("cluster", age.as_secs_f64());
            }
        }
        let mut skew = crate::skew::skews(&views).into_iter().next()?;
        let rank_step_s = skew.ranks.iter().find(|r| r.rank == rank).map_or(0.0, |r| r.step_s);
        let ranks_seen = skew.ranks.len() as u32;
        if skew.ranks.len() > PACE_RANKS_SENT_MAX {
            skew.ranks.clear();
        }
        Some(JobPace {
            scope: scope.into(),
            ranks_seen,
            age_s,
            rank_step_s,
            skew,
        })
    }

    /// Whether a job of this host's consumers has ranks this daemon does not hear from.
    fn job_spans_hosts(&self) -> bool {
        let views = self.jobs.views(&self.me, false);
        let mut jobs: std::collections::BTreeMap<&str, (u32, BTreeSet<u32>)> = Default::default();
        for v in &views {
            let j = jobs.entry(&v.beat.job).or_default();
            j.0 = j.0.max(v.beat.world);
            j.1.insert(v.beat.rank);
        }
        jobs.values().any(|(world, ranks)| *world as usize > ranks.len())
    }
}

/// Gathers the ring's consumers every [`PACE_GATHER_EVERY`] while a job here spans hosts.
pub(super) async fn gather_paces(inner: Arc<Inner>) {
    loop {
        tokio::time::sleep(PACE_GATHER_EVERY).await;
        let members = inner.membership.read().expect("membership lock").ring().members().len();
        if members > 1 && members <= PACE_GATHER_MEMBERS_MAX && inner.job_spans_hosts() {
            inner.cluster().await;
        }
    }
}
