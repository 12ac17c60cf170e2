//! The consumers (trainer ranks and their workers) of this host, as their heartbeats tell:
//! the last report of each and a few minutes of its rate and data wait, in bounded memory.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ramjet_engine::Heartbeat;

use crate::stats::{JobPoint, JobView};

/// A consumer that has not reported for this long is dropped.
pub const JOB_SILENT_DROP: Duration = Duration::from_secs(30);
/// Consumers kept per daemon; past it, the one silent longest is dropped for a new one.
pub const JOBS_MAX: usize = 256;
/// Points of history kept per consumer (one per heartbeat: 5 minutes at 2 s).
pub const JOB_HISTORY_MAX: usize = 150;
/// The longest string field kept from a heartbeat (longer ones are cut).
const FIELD_MAX: usize = 256;

struct Track {
    beat: Heartbeat,
    seen: Instant,
    /// When each heartbeat came, and its figures (`age_s` filled in by [`Jobs::views`]).
    history: VecDeque<(Instant, JobPoint)>,
}

/// The host's consumers.
#[derive(Default)]
pub(super) struct Jobs {
    map: Mutex<HashMap<String, Track>>,
}

fn cut(s: &mut String) {
    if s.len() > FIELD_MAX {
        let mut at = FIELD_MAX;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
}

/// Whether a heartbeat's figures are sane (finite, shares in [0, 1]); one that is not is
/// refused whole, naming the field.
fn check(b: &Heartbeat) -> Result<(), String> {
    let share = |what: &str, v: f64| {
        if v.is_finite() && (0.0..=1.0 + 1e-9).contains(&v) {
            Ok(())
        } else {
            Err(format!(
                "heartbeat of {:?}: {what} {v} is not a share in [0, 1]",
                b.consumer
            ))
        }
    };
    share("data_wait_share", b.data_wait_share)?;
    for (k, v) in &b.split {
        share(k, *v)?;
    }
    if b.split.len() > 16 {
        return Err(format!(
            "heartbeat of {:?}: {} parts in its split",
            b.consumer,
            b.split.len()
        ));
    }
    for (what, v) in [("samples_per_s", b.samples_per_s), ("elapsed_s", b.elapsed_s)] {
        if !v.is_finite() || v < 0.0 {
            return Err(format!(
                "heartbeat of {:?}: {what} {v} is not a finite figure >= 0",
                b.consumer
            ));
        }
    }
    if b.consumer.is_empty() {
        return Err("heartbeat without a consumer name".into());
    }
    Ok(())
}

impl Jobs {
    /// Records one heartbeat (refused, with the reason, when its figures are not sane).
    pub fn beat(&self, mut b: Heartbeat) -> Result<(), String> {
        check(&b)?;
        for s in [&mut b.consumer, &mut b.job, &mut b.dataset] {
            cut(s);
        }
        let now = Instant::now();
        let mut map = self.map.lock().expect("jobs lock");
        map.retain(|_, t| now.duration_since(t.seen) < JOB_SILENT_DROP);
        if !map.contains_key(&b.consumer) && map.len() >= JOBS_MAX {
            if let Some(oldest) = map.iter().min_by_key(|(_, t)| t.seen).map(|(k, _)| k.clone()) {
                map.remove(&oldest);
            }
        }
        let point = JobPoint {
            age_s: 0.0,
            samples_per_s: b.samples_per_s,
            data_wait_share: b.data_wait_share,
        };
        let t = map.entry(b.consumer.clone()).or_insert_with(|| Track {
            beat: b.clone(),
            seen: now,
            history: VecDeque::with_capacity(8),
        });
        if t.history.len() == JOB_HISTORY_MAX {
            t.history.pop_front();
        }
        t.history.push_back((now, point));
        t.beat = b;
        t.seen = now;
        Ok(())
    }

    /// Every consumer heard from within [`JOB_SILENT_DROP`], by job and rank, with `node`
    /// (this daemon's ring name) and its history (points as seconds ago).
    pub fn views(&self, node: &str, with_history: bool) -> Vec<JobView> {
        let now = Instant::now();
        let mut map = self.map.lock().expect("jobs lock");
        map.retain(|_, t| now.duration_since(t.seen) < JOB_SILENT_DROP);
        let mut out: Vec<JobView> = map
            .values()
            .map(|t| JobView {
                node: node.to_string(),
                seen_s_ago: now.duration_since(t.seen).as_secs_f64(),
                beat: t.beat.clone(),
                history: if with_history {
                    t.history
                        .iter()
                        .map(|(at, p)| JobPoint {
                            age_s: now.duration_since(*at).as_secs_f64(),
                            ..p.clone()
                        })
                        .collect()
                } else {
                    Vec::new()
                },
            })
            .collect();
        out.sort_by(|a, b| {
            (&a.beat.job, a.beat.rank, a.beat.worker, &a.beat.consumer).cmp(&(
                &b.beat.job,
                b.beat.rank,
                b.beat.worker,
                &b.beat.consumer,
            ))
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(c: &str) -> Heartbeat {
        Heartbeat {
            consumer: c.into(),
            job: "j".into(),
            samples_per_s: 10.0,
            data_wait_share: 0.5,
            ..Default::default()
        }
    }

    #[test]
    fn heartbeats_are_kept_bounded_and_insane_ones_refused() {
        let j = Jobs::default();
        for i in 0..JOBS_MAX + 10 {
            j.beat(beat(&format!("c{i}"))).unwrap();
        }
        assert_eq!(j.views("n", false).len(), JOBS_MAX);
        for _ in 0..JOB_HISTORY_MAX + 5 {
            j.beat(beat("c1000")).unwrap();
        }
        let v = j.views("n", true);
        let c = v.iter().find(|v| v.beat.consumer == "c1000").unwrap();
        assert_eq!(c.history.len(), JOB_HISTORY_MAX);
        let mut bad = beat("x");
        bad.data_wait_share = f64::NAN;
        assert!(j.beat(bad).unwrap_err().contains("data_wait_share"));
        let mut bad = beat("x");
        bad.split.insert("origin".into(), 7.0);
        assert!(j.beat(bad).unwrap_err().contains("origin"));
        let mut long = beat(&"y".repeat(10_000));
        long.job = "é".repeat(500);
        j.beat(long).unwrap();
        assert!(j
            .views("n", false)
            .iter()
            .all(|v| v.beat.consumer.len() <= 256 && v.beat.job.len() <= 256));
    }
}
