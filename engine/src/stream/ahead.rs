//! How many whole shards a stream holds ahead of its consumer, sized from rates: enough to
//! cover one shard's fetch at the consumer's pace (`crate::tune::shards_ahead`), within the
//! prefetch budget. A fetch takes a place before it starts; the place is given back when the
//! consumer takes the shard from the channel, so the places bound the shards in flight and
//! waiting in the channel together (the shards the consumer is reading from are outside:
//! the order's group needs them all).
//!
//! The two rates, both measured as the stream runs:
//! - the fetch time: from a fetch's start to its shard's arrival (a moving average);
//! - the consumer's pace: samples taken per second of its busy time (its waits for data left
//!   out: a consumer that waits would otherwise look slow, and get less ahead when it needs
//!   more), over the last [`PACE_SPAN`], in shards through the average samples a shard.
//!   Counted in samples, not in shards taken: a consumer takes the shards of an order group
//!   together (and shards whose samples came one by one at the start all at once), so the
//!   times between takes say little.
//!
//! `RAMJET_PREFETCH_TUNE=off` keeps the fixed depth (the prefetch budget in shards, as the
//! channel bounds it), for comparison.

use crate::metrics::Metrics;
use crate::tune::{Limit, Permit};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Whether the depth is tuned: not with `RAMJET_PREFETCH_TUNE=off` (or `0`, `false`).
pub(super) fn tuned_by_env() -> bool {
    !std::env::var("RAMJET_PREFETCH_TUNE").is_ok_and(|v| matches!(v.trim(), "off" | "0" | "false"))
}

/// The span the consumer's pace is measured over.
const PACE_SPAN: Duration = Duration::from_secs(4);
/// The fewest samples that make a pace.
const PACE_SAMPLES_MIN: u64 = 2;
/// Weight of a new fetch time in its moving average.
const FETCH_WEIGHT: f64 = 0.25;
/// Most messages the prefetch channel holds, whatever the budget (small shards).
pub(super) const CHANNEL_DEPTH_MAX: u64 = 64;

pub(super) struct Ahead {
    /// `None` with `RAMJET_PREFETCH_TUNE=off`: the channel's depth alone bounds the shards.
    limit: Option<Arc<Limit>>,
    /// The prefetch budget in shards (`prefetch_bytes_max` over the average shard, 1 to
    /// [`CHANNEL_DEPTH_MAX`]): the channel's depth and the most places.
    cap: usize,
    metrics: Arc<Metrics>,
    pace: Mutex<Pace>,
}

#[derive(Default)]
struct Pace {
    /// The fewest places: the fixed shards in flight (`shards_in_flight_max`).
    floor: usize,
    /// Fetch time of a shard, seconds (0 until one arrived).
    fetch_s: f64,
    /// The sources' samples a shard, on average.
    samples_per_shard: f64,
    /// (when, samples taken, nanoseconds waited) as the consumer's counters read then, over
    /// the last [`PACE_SPAN`].
    marks: VecDeque<(Instant, u64, u64)>,
    size: usize,
    peak: usize,
}

impl Ahead {
    /// `tuned` false: the fixed depth ([`tuned_by_env`]).
    pub(super) fn new(
        prefetch_bytes_max: u64,
        shard_bytes: u64,
        samples_per_shard: f64,
        floor: usize,
        tuned: bool,
        metrics: Arc<Metrics>,
    ) -> Ahead {
        let cap = (prefetch_bytes_max / shard_bytes.max(1)).clamp(1, CHANNEL_DEPTH_MAX) as usize;
        let ahead = Ahead {
            limit: tuned.then(|| Limit::new(cap)),
            cap,
            metrics,
            pace: Mutex::new(Pace {
                floor: floor.max(1),
                samples_per_shard: samples_per_shard.max(1.0),
                ..Default::default()
            }),
        };
        if tuned {
            ahead.resize(&mut ahead.pace.lock().expect("pace lock"));
        } else {
            ahead.metrics.set_tune("shards_ahead", cap as u64);
            ahead.metrics.set_tune(
                "shards_ahead_reason",
                "fixed (RAMJET_PREFETCH_TUNE=off or prefetch_tuned false): the prefetch budget",
            );
        }
        ahead
    }

    /// The prefetch channel's depth: the prefetch budget in shards.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// A place for one more shard ahead, waiting while all are taken; `None` when fixed.
    pub(super) async fn acquire(&self) -> Option<Permit> {
        let limit = self.limit.as_ref()?;
        let permit = limit.acquire().await;
        let held = limit.held();
        let mut p = self.pace.lock().expect("pace lock");
        if held > p.peak {
            p.peak = held;
            self.metrics.set_tune("shards_ahead_peak", held as u64);
        }
        Some(permit)
    }

    /// A shard arrived `took` after its fetch started.
    pub(super) fn fetched(&self, took: Duration) {
        if self.limit.is_none() {
            return;
        }
        let mut p = self.pace.lock().expect("pace lock");
        let s = took.as_secs_f64();
        p.fetch_s = if p.fetch_s == 0.0 {
            s
        } else {
            p.fetch_s + FETCH_WEIGHT * (s - p.fetch_s)
        };
        self.resize(&mut p);
    }

    /// The consumer took a shard from the channel.
    pub(super) fn taken(&self) {
        if self.limit.is_some() {
            self.resize(&mut self.pace.lock().expect("pace lock"));
        }
    }

    /// The consumer's busy seconds an average shard, from its counters (samples taken, time
    /// waited) over the last [`PACE_SPAN`]; 0 until measured.
    fn consume_s(&self, p: &mut Pace) -> f64 {
        let now = Instant::now();
        let m = &self.metrics;
        let mark = (
            now,
            m.samples.load(std::sync::atomic::Ordering::Relaxed),
            m.wait_ns.load(std::sync::atomic::Ordering::Relaxed),
        );
        while p.marks.len() > 1 && now.duration_since(p.marks[1].0) >= PACE_SPAN {
            p.marks.pop_front();
        }
        p.marks.push_back(mark);
        if p.marks.len() > 256 {
            // Called more often than the span needs: keep every other mark.
            let kept: VecDeque<_> = p.marks.iter().copied().step_by(2).collect();
            p.marks = kept;
        }
        let (t0, n0, w0) = p.marks[0];
        let samples = mark.1.saturating_sub(n0);
        let busy = now.duration_since(t0).as_secs_f64() - mark.2.saturating_sub(w0) as f64 * 1e-9;
        if samples < PACE_SAMPLES_MIN {
            return 0.0;
        }
        // A consumer that only waited is as fast as can be measured.
        busy.max(1e-6) / samples as f64 * p.samples_per_shard
    }

    fn resize(&self, p: &mut Pace) {
        let Some(limit) = &self.limit else { return };
        let consume_s = self.consume_s(p);
        let n = crate::tune::shards_ahead(p.fetch_s, consume_s, p.floor, self.cap);
        if n != p.size {
            p.size = n;
            limit.resize(n);
            let why = if p.fetch_s == 0.0 || consume_s == 0.0 {
                "not measured yet: one past the shards in flight"
            } else if n >= self.cap && n > p.floor {
                "the prefetch budget"
            } else if n <= p.floor {
                "the shards in flight cover a fetch at the consumer's pace"
            } else {
                "a fetch's time at the consumer's pace"
            };
            self.metrics.set_tune("shards_ahead", n as u64);
            self.metrics.set_tune("shards_ahead_reason", why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ahead() -> Ahead {
        // 64 MiB budget of 1 MiB shards of 10 samples: a cap of 64; 4 in flight.
        Ahead::new(64 << 20, 1 << 20, 10.0, 4, true, Arc::new(Metrics::default()))
    }

    fn size(a: &Ahead) -> usize {
        a.limit.as_ref().expect("tuned").size()
    }

    /// The consumer takes `n` samples, `busy` of work and `waited` of waiting for each.
    fn consume(a: &Ahead, n: usize, busy: Duration, waited: Duration) {
        for _ in 0..n {
            std::thread::sleep(busy + waited);
            Metrics::add(&a.metrics.samples, 1);
            Metrics::add(&a.metrics.wait_ns, waited.as_nanos() as u64);
            a.taken();
        }
    }

    /// A slow consumer of a fast store holds the fixed shards in flight and no more; a fast
    /// consumer of a slow origin gets as many as cover a fetch; waits are not the pace.
    #[test]
    fn places_follow_the_fetch_time_and_the_consumers_pace() {
        let a = ahead();
        assert_eq!((a.cap(), size(&a)), (64, 5), "not measured: one past the floor");
        // Each shard fetched in 10 ms; the consumer works 4 ms a sample (40 ms a shard).
        a.fetched(Duration::from_millis(10));
        consume(&a, 10, Duration::from_millis(4), Duration::ZERO);
        assert_eq!(size(&a), 4);
        // Fetches now take 1.5 s: about 1.5 / 0.04 x 1.5 + 1 = 58 places (the sleeps run
        // long on a loaded machine: a slower pace, fewer places).
        for _ in 0..30 {
            a.fetched(Duration::from_millis(1500));
        }
        let n = size(&a);
        assert!((20..=64).contains(&n), "{n}");
        // A consumer that waits for data most of the time: its waits are left out, so it is
        // still a fast consumer (more places, up to the budget), not a slow one.
        let b = ahead();
        b.fetched(Duration::from_millis(200));
        consume(&b, 10, Duration::from_millis(1), Duration::from_millis(20));
        let n = size(&b);
        assert!(n >= 20, "{n}: waits counted as work");
    }

    /// Places are held from a fetch's start to the consumer's taking it: a full set waits.
    #[tokio::test]
    async fn a_fetch_waits_for_a_place() {
        let a = Arc::new(ahead());
        let held: Vec<_> = futures::future::join_all((0..5).map(|_| a.acquire())).await;
        let a2 = a.clone();
        let sixth = tokio::spawn(async move { a2.acquire().await.is_some() });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!sixth.is_finished(), "a sixth shard ahead of 5 places");
        drop(held);
        assert!(tokio::time::timeout(Duration::from_secs(5), sixth)
            .await
            .unwrap()
            .unwrap());
        assert_eq!(
            a.metrics.snapshot().tune.get("tune_shards_ahead_peak"),
            Some(&serde_json::json!(5))
        );
        // Fixed: no places (the channel's depth bounds the shards), and it says so.
        let fixed = Ahead::new(64 << 20, 1 << 20, 10.0, 4, false, Arc::new(Metrics::default()));
        assert!(fixed.acquire().await.is_none());
        let t = fixed.metrics.snapshot().tune;
        assert_eq!(t.get("tune_shards_ahead"), Some(&serde_json::json!(64)));
    }
}
