//! Evenness across a job's ranks: each rank's step time and samples per second, from its
//! consumers' last heartbeats, and the job's step-time skew (the seed's "step time skew
//! across ranks"). A DDP job steps at its slowest rank's pace, so the skew says how much of
//! every other rank's time goes to waiting for it.

use std::collections::BTreeMap;

use crate::stats::{JobSkew, JobView, RankPace};

/// Each job's ranks, from the consumers in `jobs` (every node's, for the cluster view; one
/// daemon's, for its `/metrics`), jobs in name order.
pub fn skews(jobs: &[JobView]) -> Vec<JobSkew> {
    let mut by_job: BTreeMap<&str, BTreeMap<u32, RankPace>> = BTreeMap::new();
    for j in jobs {
        let b = &j.beat;
        let r = by_job
            .entry(&b.job)
            .or_default()
            .entry(b.rank)
            .or_insert_with(|| RankPace {
                rank: b.rank,
                node: j.node.clone(),
                ..Default::default()
            });
        r.samples_per_s += b.samples_per_s;
        // Steps per second add up; `step_s` holds the sum of rates until the end.
        if b.step_s > 0.0 {
            r.step_s += 1.0 / b.step_s;
        }
    }
    by_job
        .into_iter()
        .map(|(job, ranks)| {
            let ranks: Vec<RankPace> = ranks
                .into_values()
                .map(|mut r| {
                    r.step_s = if r.step_s > 0.0 { 1.0 / r.step_s } else { 0.0 };
                    r
                })
                .collect();
            of_ranks(job, ranks)
        })
        .collect()
}

fn of_ranks(job: &str, ranks: Vec<RankPace>) -> JobSkew {
    let mut steps: Vec<f64> = ranks.iter().map(|r| r.step_s).filter(|s| *s > 0.0).collect();
    steps.sort_by(f64::total_cmp);
    let rate = |f: fn(f64, f64) -> f64| ranks.iter().map(|r| r.samples_per_s).reduce(f).unwrap_or(0.0);
    let median = steps.get(steps.len() / 2).copied().unwrap_or(0.0);
    let (lo, hi) = (
        steps.first().copied().unwrap_or(0.0),
        steps.last().copied().unwrap_or(0.0),
    );
    JobSkew {
        job: job.to_owned(),
        step_s_min: lo,
        step_s_median: median,
        step_s_max: hi,
        skew: if steps.len() >= 2 && median > 0.0 {
            (hi - lo) / median
        } else {
            0.0
        },
        slowest_rank: ranks
            .iter()
            .filter(|r| r.step_s > 0.0)
            .max_by(|a, b| a.step_s.total_cmp(&b.step_s))
            .map(|r| r.rank),
        samples_per_s_min: rate(f64::min),
        samples_per_s_max: rate(f64::max),
        ranks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(node: &str, rank: u32, worker: u32, step_s: f64, rate: f64) -> JobView {
        JobView {
            node: node.into(),
            beat: ramjet_engine::Heartbeat {
                consumer: format!("1/{rank}.{worker}"),
                job: "train".into(),
                rank,
                worker,
                step_s,
                samples_per_s: rate,
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_slow_rank_shows_as_skew_and_is_named() {
        // Rank 0: two workers of 0.2 s a batch each, so 0.1 s a step; rank 1: 0.1 s; rank 2
        // waits on its data: 0.3 s.
        let jobs = vec![
            view("a", 0, 0, 0.2, 100.0),
            view("a", 0, 1, 0.2, 100.0),
            view("a", 1, 0, 0.1, 200.0),
            view("b", 2, 0, 0.3, 70.0),
        ];
        let s = skews(&jobs);
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!(s.ranks.len(), 3);
        assert!((s.ranks[0].step_s - 0.1).abs() < 1e-9, "{:?}", s.ranks[0]);
        assert!((s.ranks[0].samples_per_s - 200.0).abs() < 1e-9);
        assert!((s.step_s_median - 0.1).abs() < 1e-9);
        assert!((s.skew - 2.0).abs() < 1e-9, "skew {}", s.skew);
        assert_eq!(s.slowest_rank, Some(2));
        assert_eq!(s.ranks[2].node, "b");
        assert_eq!((s.samples_per_s_min, s.samples_per_s_max), (70.0, 200.0));
    }

    #[test]
    fn ranks_that_do_not_step_yet_are_listed_but_not_in_the_skew() {
        let s = &skews(&[view("a", 0, 0, 0.0, 0.0), view("a", 1, 0, 0.5, 10.0)])[0];
        assert_eq!(s.ranks.len(), 2);
        assert_eq!(s.skew, 0.0);
        assert_eq!(s.slowest_rank, Some(1));
        assert!(skews(&[]).is_empty());
    }
}
