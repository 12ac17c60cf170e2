//! Where a consumer's wait for data goes.
//!
//! Every second a training loop spends in `next()` is charged to one stage of the path of its
//! batch: the origin, a peer's cache, the host daemon's cache, this host's cache read (the
//! reader slicing and verifying samples included), or the decode and augmentation. Every
//! second it spends elsewhere (the trainer being the slower side) is "not waiting". The six
//! add up to the consumer's time since its first `next()`.
//!
//! How: the stream times each wait of its reader for the prefetcher and charges it to the
//! source of the shard (or samples) that ended it ([`Metrics::read_blocked_ns`]). The loader
//! gives each batch a [`Timeline`]: when its reader began and finished cutting it, how long
//! that reader waited on each source meanwhile, and when a decode thread took it. When the
//! consumer's wait for that batch ends, [`attribute`] lays the wait over the timeline: the
//! part while the batch was read goes to the sources in proportion to the reader's waits on
//! them (the rest of the read to the cache read), the part while it waited for or sat in a
//! decode thread to decode, and the part before its reader began (the reader held back by
//! earlier batches still decoding) to decode as well.
//!
//! Cost: four clock reads per batch on the reader, two per batch on the consumer, and one
//! per wait of the reader (only when the prefetcher is behind): nothing per sample.

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use crate::metrics::Metrics;
use crate::provider::FetchedFrom;

/// A stage a consumer waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOn {
    /// The object store (directly, or through the host daemon that went there).
    Origin = 0,
    /// Another host's cache, through the host daemon.
    Peer = 1,
    /// The host daemon's own cache.
    Daemon = 2,
    /// This process's read of the node cache, and the reader's own work on the samples.
    Cache = 3,
    /// Decode and augmentation (CPU threads, or the GPU side's share).
    Decode = 4,
}

/// The sources of a shard ([`WaitOn`]'s first four).
pub const SOURCES: usize = 4;
/// Stages a wait is charged to, plus "not waiting".
pub const PARTS: usize = 6;
/// The index of "not waiting" in [`PARTS`]-long arrays.
pub const NOT_WAITING: usize = 5;
/// The parts' names, in index order (metrics keys: `wait_<name>_s`, `wait_share_<name>`).
pub const NAMES: [&str; PARTS] = ["origin", "peer", "daemon", "cache", "decode", "not_waiting"];

impl WaitOn {
    /// Where a shard came from, as the stage that waited on it: `via_daemon` when the host
    /// daemon delivered it (its `from` is then the daemon's own source).
    pub fn of(from: FetchedFrom, via_daemon: bool) -> WaitOn {
        match (from, via_daemon) {
            (FetchedFrom::Origin, _) => WaitOn::Origin,
            (FetchedFrom::CachePeer, _) => WaitOn::Peer,
            (FetchedFrom::CacheLocal, true) => WaitOn::Daemon,
            (FetchedFrom::CacheLocal, false) => WaitOn::Cache,
        }
    }

    /// Its name in [`NAMES`].
    pub fn name(self) -> &'static str {
        NAMES[self as usize]
    }
}

/// One batch's way through the loader, as [`attribute`] needs it.
#[derive(Debug, Clone, Copy)]
pub struct Timeline {
    /// The reader began taking this batch's samples.
    pub read_start: Instant,
    /// The reader finished cutting it.
    pub cut: Instant,
    /// The reader's waits for the prefetcher while it read this batch, by source.
    pub blocked: [Duration; SOURCES],
    /// A decode thread took it (`None`: it was never decoded, an error).
    pub decode_start: Option<Instant>,
}

impl Timeline {
    /// A timeline of a batch read between `read_start` and `cut`, the reader's per-source
    /// waits counters (nanoseconds) being `before` at its start and `after` at its cut.
    pub fn read(read_start: Instant, cut: Instant, before: [u64; SOURCES], after: [u64; SOURCES]) -> Timeline {
        let mut blocked = [Duration::ZERO; SOURCES];
        for i in 0..SOURCES {
            blocked[i] = Duration::from_nanos(after[i].saturating_sub(before[i]));
        }
        Timeline {
            read_start,
            cut,
            blocked,
            decode_start: None,
        }
    }
}

/// The reader's waits so far, by source, in nanoseconds ([`Metrics::read_blocked_ns`]): a
/// batch's waits are the difference of two of these.
pub fn read_waits(m: &Metrics) -> [u64; SOURCES] {
    std::array::from_fn(|i| m.read_blocked_ns[i].load(std::sync::atomic::Ordering::Relaxed))
}

/// The length of `[a, b)` within `[lo, hi)`.
fn overlap(a: Instant, b: Instant, lo: Instant, hi: Instant) -> Duration {
    let (s, e) = (a.max(lo), b.min(hi));
    e.saturating_duration_since(s)
}

/// Splits a wait `[w0, w1)` for the batch of `tl` into its stages ([`WaitOn`] order). The
/// parts add up to the wait.
pub fn attribute(w0: Instant, w1: Instant, tl: &Timeline) -> [Duration; 5] {
    let mut out = [Duration::ZERO; 5];
    let decode_start = tl.decode_start.unwrap_or(tl.cut).max(tl.cut);
    // Before the reader began this batch, it was held by earlier ones decoding.
    out[WaitOn::Decode as usize] += overlap(w0, w1, w0.min(tl.read_start), tl.read_start);
    // While it was read: the sources by the reader's waits on them, the rest the read itself.
    let reading = overlap(w0, w1, tl.read_start, tl.cut);
    if !reading.is_zero() {
        let span = tl.cut.saturating_duration_since(tl.read_start).as_secs_f64().max(1e-12);
        let blocked_total: f64 = tl.blocked.iter().map(Duration::as_secs_f64).sum();
        // Waits never exceed the read they happened in (clock reads are a few ns apart).
        let scale = if blocked_total > span {
            span / blocked_total
        } else {
            1.0
        };
        let r = reading.as_secs_f64();
        let mut given = 0.0;
        for (i, b) in tl.blocked.iter().enumerate() {
            let part = r * b.as_secs_f64() * scale / span;
            out[i] += Duration::from_secs_f64(part);
            given += part;
        }
        out[WaitOn::Cache as usize] += Duration::from_secs_f64((r - given).max(0.0));
    }
    // Queued for a decode thread, then decoding, then on its way to the consumer.
    out[WaitOn::Decode as usize] += overlap(w0, w1, tl.cut, decode_start);
    out[WaitOn::Decode as usize] += overlap(w0, w1, decode_start.max(tl.cut), w1.max(decode_start));
    out
}

/// The consumer's side: when it began waiting for the batch it asks for, and when it last
/// took one (the time between is "not waiting").
#[derive(Debug, Default)]
pub struct ConsumerClock {
    wait_began: Option<Instant>,
    last_return: Option<Instant>,
}

impl ConsumerClock {
    /// The consumer asks for its next batch at `now` (again, after a timeout, changes nothing).
    pub fn asking(&mut self, now: Instant, m: &Metrics) {
        if self.wait_began.is_some() {
            return;
        }
        if let Some(t) = self.last_return.take() {
            add(&m.stall_ns[NOT_WAITING], now.saturating_duration_since(t));
        }
        self.wait_began = Some(now);
    }

    /// The batch of `tl` is handed to the consumer at `now`.
    pub fn delivered(&mut self, now: Instant, tl: Option<&Timeline>, m: &Metrics) {
        let w0 = self.wait_began.take().unwrap_or(now);
        match tl {
            Some(tl) => {
                for (i, d) in attribute(w0, now, tl).into_iter().enumerate() {
                    add(&m.stall_ns[i], d);
                }
            }
            None => add(&m.stall_ns[WaitOn::Decode as usize], now.saturating_duration_since(w0)),
        }
        self.last_return = Some(now);
    }

    /// The consumer's own call spent `d` more on `on` after the batch was handed out (the GPU
    /// side's share of the decode): charged to it, and not to "not waiting".
    pub fn charge(&mut self, on: WaitOn, d: Duration, m: &Metrics) {
        add(&m.stall_ns[on as usize], d);
        if let Some(t) = &mut self.last_return {
            *t = (*t + d).min(Instant::now());
        }
    }
}

/// The split for a consumer that reads a stream sample by sample, with no loader between
/// (`ramjet stream`): the time in each call goes to the sources the reader waited on, the rest
/// of the call to the cache read, and the time between calls to "not waiting".
#[derive(Debug, Default)]
pub struct SampleClock {
    last_return: Option<Instant>,
}

impl SampleClock {
    /// Runs one call for the next sample, charging its time.
    pub fn around<T>(&mut self, m: &Metrics, f: impl FnOnce() -> T) -> T {
        let (t0, before) = (Instant::now(), read_waits(m));
        if let Some(t) = self.last_return {
            add(&m.stall_ns[NOT_WAITING], t0.saturating_duration_since(t));
        }
        let r = f();
        let t1 = Instant::now();
        let after = read_waits(m);
        let mut charged = 0u64;
        for i in 0..SOURCES {
            let d = after[i].saturating_sub(before[i]);
            Metrics::add(&m.stall_ns[i], d);
            charged += d;
        }
        let call = t1.saturating_duration_since(t0).as_nanos() as u64;
        Metrics::add(&m.stall_ns[WaitOn::Cache as usize], call.saturating_sub(charged));
        self.last_return = Some(t1);
        r
    }
}

fn add(c: &AtomicU64, d: Duration) {
    Metrics::add(c, d.as_nanos() as u64);
}

/// The split in seconds and shares, for a snapshot: `wait_<name>_s` and `wait_share_<name>`
/// for each of [`NAMES`], and `data_wait_share` (every part but "not waiting").
pub fn split(ns: &[u64; PARTS]) -> std::collections::BTreeMap<String, f64> {
    let total: u64 = ns.iter().sum();
    let mut out = std::collections::BTreeMap::new();
    for (i, name) in NAMES.iter().enumerate() {
        out.insert(format!("wait_{name}_s"), ns[i] as f64 / 1e9);
        let share = if total == 0 { 0.0 } else { ns[i] as f64 / total as f64 };
        out.insert(format!("wait_share_{name}"), share);
    }
    let waited: u64 = ns[..NOT_WAITING].iter().sum();
    out.insert(
        "data_wait_share".into(),
        if total == 0 { 0.0 } else { waited as f64 / total as f64 },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_wait_splits_over_the_batchs_timeline_and_adds_up() {
        let t0 = Instant::now();
        // Read 0..100 ms (60 ms of it waiting on the origin, 20 on a peer), queued 100..150,
        // decoded from 150; the consumer waited 50..200.
        let mut tl = Timeline::read(t0, t0 + ms(100), [0; 4], [60_000_000, 20_000_000, 0, 0]);
        tl.decode_start = Some(t0 + ms(150));
        let p = attribute(t0 + ms(50), t0 + ms(200), &tl);
        let sum: Duration = p.iter().sum();
        assert!((sum.as_secs_f64() - 0.150).abs() < 1e-6, "{p:?}");
        // 50 ms of the read: 30 origin, 10 peer, 10 the read itself; 100 ms decode.
        assert!((p[0].as_secs_f64() - 0.030).abs() < 1e-6, "{p:?}");
        assert!((p[1].as_secs_f64() - 0.010).abs() < 1e-6, "{p:?}");
        assert!((p[3].as_secs_f64() - 0.010).abs() < 1e-6, "{p:?}");
        assert!((p[4].as_secs_f64() - 0.100).abs() < 1e-6, "{p:?}");
        // A wait that began before the reader took the batch: that part is decode.
        let p = attribute(t0 - ms(40), t0 + ms(10), &tl);
        assert!((p[4].as_secs_f64() - 0.040).abs() < 1e-6, "{p:?}");
        assert!((p.iter().sum::<Duration>().as_secs_f64() - 0.050).abs() < 1e-6);
    }

    #[test]
    fn the_consumer_clock_charges_the_time_between_batches_to_not_waiting() {
        let m = Metrics::default();
        let mut c = ConsumerClock::default();
        let t0 = Instant::now();
        let tl = Timeline::read(t0, t0 + ms(10), [0; 4], [0; 4]);
        c.asking(t0, &m);
        c.asking(t0 + ms(5), &m); // a timeout and a new ask: the same wait
        c.delivered(t0 + ms(10), Some(&tl), &m);
        c.asking(t0 + ms(110), &m);
        c.delivered(t0 + ms(110), Some(&tl), &m);
        let s = split(&std::array::from_fn(|i| {
            m.stall_ns[i].load(std::sync::atomic::Ordering::Relaxed)
        }));
        assert!((s["wait_not_waiting_s"] - 0.100).abs() < 1e-6, "{s:?}");
        assert!((s["wait_cache_s"] - 0.010).abs() < 1e-6, "{s:?}");
        assert!((s["data_wait_share"] - 0.010 / 0.110).abs() < 1e-6, "{s:?}");
    }
}
