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
fn check(b: &Heartbeat) -> Result<(), crate::error::Error> {
    let share = |what: &str, v: f64| {
        if v.is_finite() && (0.0..=1.0 + 1e-9).contains(&v) {
            Ok(())
        } else {
            Err(crate::error::Error::Invalid(format!(
                "heartbeat of {:?}: {what} {v} is not a share in [0, 1]",
                b.consumer
            )))
        }
    };
    share("data_wait_share", b.data_wait_share)?;
    if let Some(n) = b.node.filter(|&n| n >= b.world.max(1)) {
        // A job's nodes are at most its ranks: another daemon would look for a node that
        // cannot exist (a split shard's reader).
        return Err(crate::error::Error::Invalid(format!(
            "heartbeat of {:?}: node {n} of a job of {} ranks",
            b.consumer, b.world
        )));
    }
    for (k, v) in &b.split {
        share(k, *v)?;
    }
    if b.split.len() > 16 {
        return Err(crate::error::Error::Invalid(format!(
            "heartbeat of {:?}: {} parts in its split",
            b.consumer,
            b.split.len()
        )));
    }
    for (what, v) in [
        ("samples_per_s", b.samples_per_s),
        ("elapsed_s", b.elapsed_s),
        ("step_s", b.step_s),
    ] {
        if !v.is_finite() || v < 0.0 {
            return Err(crate::error::Error::Invalid(format!(
                "heartbeat of {:?}: {what} {v} is not a finite figure >= 0",
                b.consumer
            )));
        }
    }
    if b.consumer.is_empty() {
        return Err(crate::error::Error::Invalid("heartbeat without a consumer name".into()));
    }
    Ok(())
}

/// A decoding consumer heard from within this long shares the host's decode budget.
const GRANT_LIVE: Duration = Duration::from_secs(6);

impl Jobs {
    /// `consumer`'s share of the host's budgets: `decode_threads` decode jobs at once and
    /// `memory_bytes` of batches, split among the consumers that decode and reported within
    /// [`GRANT_LIVE`], by their data wait ([`ramjet_engine::tune::shares`]). `None` for a
    /// consumer that does not decode (a plain stream).
    pub fn grant(&self, consumer: &str, decode_threads: u64, memory_bytes: u64) -> Option<ramjet_engine::HostGrant> {
        self.grants(decode_threads, memory_bytes).remove(consumer)
    }

    /// Consumers heard from within [`GRANT_LIVE`] (they share the host's shards).
    pub fn live(&self) -> usize {
        let now = Instant::now();
        let map = self.map.lock().expect("jobs lock");
        map.values().filter(|t| now.duration_since(t.seen) < GRANT_LIVE).count()
    }

    /// Every decoding consumer's grant now, by consumer (see [`Jobs::grant`]).
    pub fn grants(
        &self,
        decode_threads: u64,
        memory_bytes: u64,
    ) -> std::collections::BTreeMap<String, ramjet_engine::HostGrant> {
        let now = Instant::now();
        let map = self.map.lock().expect("jobs lock");
        let mut live: Vec<(&String, f64)> = map
            .iter()
            .filter(|(_, t)| t.beat.decode_threads > 0 && now.duration_since(t.seen) < GRANT_LIVE)
            .map(|(k, t)| (k, t.beat.data_wait_share))
            .collect();
        live.sort_by(|a, b| a.0.cmp(b.0));
        let waits: Vec<f64> = live.iter().map(|x| x.1).collect();
        let n = live.len() as u64;
        let threads = ramjet_engine::tune::shares(decode_threads, 1, &waits);
        let memory = ramjet_engine::tune::shares(memory_bytes, memory_bytes / (4 * n).max(1), &waits);
        live.iter()
            .zip(threads.into_iter().zip(memory))
            .map(|((k, _), (t, m))| {
                let g = ramjet_engine::HostGrant {
                    decode_threads: t.min(u32::MAX as u64) as u32,
                    memory_bytes: m,
                    consumers: n as u32,
                };
                ((*k).clone(), g)
            })
            .collect()
    }

    /// Records one heartbeat (refused, with the reason, when its figures are not sane).
    pub fn beat(&self, mut b: Heartbeat) -> Result<(), crate::error::Error> {
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
    fn decoding_consumers_split_the_hosts_budgets_by_demand() {
        let j = Jobs::default();
        let mut a = beat("a");
        a.decode_threads = 4;
        a.data_wait_share = 0.8;
        let mut b = beat("b");
        b.decode_threads = 4;
        b.data_wait_share = 0.0;
        // A plain stream (no loader) takes no share.
        let mut c = beat("c");
        c.decode_threads = 0;
        for x in [a, b, c] {
            j.beat(x).unwrap();
        }
        let (ga, gb) = (j.grant("a", 8, 1 << 30).unwrap(), j.grant("b", 8, 1 << 30).unwrap());
        assert!(j.grant("c", 8, 1 << 30).is_none());
        assert_eq!((ga.consumers, gb.consumers), (2, 2));
        assert_eq!(ga.decode_threads + gb.decode_threads, 8);
        assert!(ga.decode_threads > gb.decode_threads, "{ga:?} {gb:?}");
        assert!(ga.memory_bytes > gb.memory_bytes && ga.memory_bytes + gb.memory_bytes <= 1 << 30);
        assert_eq!(j.grants(8, 1 << 30).len(), 2);
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
        assert!(j.beat(bad).unwrap_err().to_string().contains("data_wait_share"));
        let mut bad = beat("x");
        bad.split.insert("origin".into(), 7.0);
        assert!(j.beat(bad).unwrap_err().to_string().contains("origin"));
        let mut bad = beat("x");
        (bad.world, bad.node) = (4, Some(4));
        assert!(j
            .beat(bad)
            .unwrap_err()
            .to_string()
            .contains("node 4 of a job of 4 ranks"));
        let mut fine = beat("x");
        (fine.world, fine.node) = (4, Some(3));
        j.beat(fine).unwrap();
        let mut long = beat(&"y".repeat(10_000));
        long.job = "é".repeat(500);
        j.beat(long).unwrap();
        assert!(j
            .views("n", false)
            .iter()
            .all(|v| v.beat.consumer.len() <= 256 && v.beat.job.len() <= 256));
    }
}
