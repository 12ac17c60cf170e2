//! Self-tuning: the controllers that size ramjet's concurrency from what it measures, so a host
//! needs no hand-set thread counts, request counts or prefetch depths.
//!
//! - [`Origin`]: how many requests are in flight to one origin, and how fast they may start.
//!   Additive increase while the throughput rises, multiplicative decrease at once on
//!   throttling (HTTP 503 SlowDown, 429) or rising latency, and a request-rate cap learnt from
//!   throttling. One per origin client in a process, so in a host daemon (which makes every
//!   whole-shard fetch of the host) it is host-wide.
//! - [`Limit`]: a concurrency bound whose size can change while permits are held (the
//!   origin's requests in flight; a loader's decode jobs and batches ahead).
//! - [`shares`]: a host budget (decode threads, prefetch memory) split among the ranks of a
//!   host by demand.
//! - [`prefetch_batches`], [`shards_ahead`]: the prefetch depths (a loader's batches, a
//!   stream's whole shards) that cover a fetch at the consumer's rate.
//!
//! Each is a plain state machine over the times and sizes it is given, so the unit tests below
//! drive them with simulated links and origins (convergence, backoff, the oscillation band).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The fewest requests in flight to an origin.
pub const ORIGIN_LIMIT_MIN: usize = 1;
/// The most requests in flight to an origin.
pub const ORIGIN_LIMIT_MAX: usize = 64;
/// Requests in flight to an origin at the start ("start modest": today's 4 ranged GETs of one
/// shard).
pub const ORIGIN_LIMIT_START: usize = 4;

/// A throughput gain smaller than this fraction is no gain (a plateau).
const GAIN: f64 = 0.05;
/// Latency this many times its floor, with no throughput gain, is congestion.
const LATENCY_RISE: f64 = 3.0;
/// After this many windows on a plateau the controller probes one request more.
const PROBE_EVERY: u32 = 8;
/// Multiplicative decrease of the requests in flight on throttling.
const THROTTLE_CUT: f64 = 0.7;
/// Multiplicative decrease of the request-rate cap on throttling.
const RATE_CUT: f64 = 0.9;
/// Requests completed in the last second below which a throttle sets no rate cap.
const RATE_CAP_MIN_OBSERVED: f64 = 8.0;
/// The rate cap grows by this fraction a second while nothing is throttled.
const RATE_GROWTH_PER_S: f64 = 0.02;
/// With nothing throttled for this long, the rate cap is lifted.
const RATE_CAP_FORGET: Duration = Duration::from_secs(60);

/// The smallest ranged GET [`OriginTune::range_bytes`] picks, on a slow link.
pub const RANGE_BYTES_MIN: u64 = 8 << 20;
/// The smallest it picks on a fast link ([`RANGE_FLOOR_S`]).
pub const RANGE_BYTES_FAST_MIN: u64 = 16 << 20;
/// The range floor is at least this long of one request's bandwidth, within
/// [[`RANGE_BYTES_MIN`], [`RANGE_BYTES_FAST_MIN`]]: where a request moves bytes fast, its fixed
/// cost (the server's work a request, not the round trip) is what small ranges multiply, so
/// the floor stays 16 MiB (the local S3 server's cold epoch was 15% slower at 8 MiB); where
/// each request gets a few MB/s (a WAN link), an 8 MiB range still lasts seconds and more
/// ranges in flight share the link better (8 MiB ranges were 3-9% faster on the WAN-like link).
pub const RANGE_FLOOR_S: f64 = 0.25;
/// The largest ranged GET [`OriginTune::range_bytes`] picks.
pub const RANGE_BYTES_MAX: u64 = 64 << 20;

/// How one request to the origin ended, for [`Origin::done`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    /// It succeeded, carrying `bytes`; `latency` is its time to the first byte (or its whole
    /// time where the first byte is not seen).
    Ok {
        /// Bytes received.
        bytes: u64,
        /// Time to the first byte.
        latency: Duration,
        /// Time from the first byte to the last.
        transfer: Duration,
    },
    /// The origin throttled it (503 SlowDown, 429).
    Throttled,
    /// It failed another way (not a signal about load).
    Failed,
}

/// Why the origin controller holds its current values (shown in `metrics()` and `/stats`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// No window measured yet.
    Start,
    /// The last step up raised the throughput: it goes on adding requests.
    Rising,
    /// More requests stopped raising the throughput: it stepped back and holds.
    Plateau,
    /// A probe of one request more, after a plateau.
    Probe,
    /// The origin throttled requests: fewer in flight, and a request-rate cap.
    Throttled,
    /// Latency rose past [`LATENCY_RISE`] times its floor with no gain: fewer in flight.
    Latency,
    /// A user's setting pins the value.
    Pinned,
}

impl Reason {
    /// The reason's name, as metrics show it.
    pub fn name(self) -> &'static str {
        match self {
            Reason::Start => "start",
            Reason::Rising => "throughput rising",
            Reason::Plateau => "throughput plateau",
            Reason::Probe => "probing",
            Reason::Throttled => "origin throttling",
            Reason::Latency => "latency rising",
            Reason::Pinned => "pinned by the user",
        }
    }
}

/// The origin controller's state (see the module docs). Times come from the caller, so tests
/// drive it on a simulated clock.
#[derive(Debug)]
pub struct OriginTune {
    limit: f64,
    pinned: bool,
    win_start: Option<Instant>,
    win_bytes: u64,
    win_done: u32,
    prev_rate: f64,
    stepped_up: bool,
    slow_start: bool,
    last_step: f64,
    settling: bool,
    plateau: u32,
    /// Latency floor (decays up slowly) and recent latency, seconds.
    lat_floor: f64,
    lat_recent: f64,
    /// One bulk request's own bandwidth (bytes/s, recent; 0: none measured).
    bw_req: f64,
    /// Successful completions in the last second (for the rate a throttle is measured at).
    recent: VecDeque<Instant>,
    cap_rps: Option<f64>,
    cap_grown_at: Option<Instant>,
    next_slot: Option<Instant>,
    last_throttle: Option<Instant>,
    last_cut: Option<Instant>,
    paused_until: Option<Instant>,
    throttle_streak: u32,
    /// Counters.
    pub throttled: u64,
    /// Requests that ended (any outcome).
    pub requests: u64,
    reason: Reason,
}

impl OriginTune {
    /// A controller starting at [`ORIGIN_LIMIT_START`] requests in flight, or pinned at
    /// `pinned` (a user's setting: it then never moves, but still counts throttling and
    /// spaces requests after one).
    pub fn new(pinned: Option<usize>) -> OriginTune {
        OriginTune {
            limit: pinned.unwrap_or(ORIGIN_LIMIT_START).clamp(ORIGIN_LIMIT_MIN, 4096) as f64,
            pinned: pinned.is_some(),
            win_start: None,
            win_bytes: 0,
            win_done: 0,
            prev_rate: 0.0,
            stepped_up: false,
            slow_start: true,
            last_step: 0.0,
            settling: false,
            plateau: 0,
            lat_floor: 0.0,
            lat_recent: 0.0,
            bw_req: 0.0,
            recent: VecDeque::new(),
            cap_rps: None,
            cap_grown_at: None,
            next_slot: None,
            last_throttle: None,
            last_cut: None,
            paused_until: None,
            throttle_streak: 0,
            throttled: 0,
            requests: 0,
            reason: if pinned.is_some() {
                Reason::Pinned
            } else {
                Reason::Start
            },
        }
    }

    /// Requests allowed in flight now.
    pub fn limit(&self) -> usize {
        self.limit.floor().max(ORIGIN_LIMIT_MIN as f64) as usize
    }

    /// The request-rate cap learnt from throttling (requests/s), if any.
    pub fn rate_cap(&self) -> Option<f64> {
        self.cap_rps
    }

    /// Why the values are what they are.
    pub fn reason(&self) -> Reason {
        self.reason
    }

    /// The recent time to first byte, seconds (0 before any request).
    pub fn latency_s(&self) -> f64 {
        self.lat_recent
    }

    /// The ranged GET size for whole shards: large enough that a request's round trip is at
    /// most a fifth of its time (`4 × latency × one request's bandwidth`), rounded up to a
    /// power of two, at most [`RANGE_BYTES_MAX`] and at least a floor of [`RANGE_FLOOR_S`] of
    /// one request's bandwidth, rounded up to a power of two, within 8-16 MiB
    /// ([`RANGE_BYTES_MIN`], [`RANGE_BYTES_FAST_MIN`]); `configured` until both are measured.
    /// A high-latency link with fast requests gets larger ranges (and, from the limit's
    /// additive increase, more of them in flight); a link whose requests each get a few MB/s
    /// gets 8 MiB ranges, more of them to share it.
    pub fn range_bytes(&self, configured: u64) -> u64 {
        if self.lat_recent <= 0.0 || self.bw_req <= 0.0 {
            return configured;
        }
        let floor = ((RANGE_FLOOR_S * self.bw_req).min(RANGE_BYTES_FAST_MIN as f64) as u64)
            .max(1)
            .next_power_of_two()
            .clamp(RANGE_BYTES_MIN, RANGE_BYTES_FAST_MIN);
        let want = (4.0 * self.lat_recent * self.bw_req).min(RANGE_BYTES_MAX as f64) as u64;
        want.max(1).next_power_of_two().clamp(floor, RANGE_BYTES_MAX)
    }

    /// When a request may start at `now`: `now`, or later while the origin is paused after a
    /// throttle or requests are paced by the rate cap. Takes the slot (the next caller gets
    /// the one after it).
    pub fn start_at(&mut self, now: Instant) -> Instant {
        let mut at = now;
        if let Some(p) = self.paused_until {
            at = at.max(p);
        }
        if let Some(cap) = self.cap_rps {
            // Throttle-free time grows the cap; a long enough one lifts it.
            let quiet = self
                .last_throttle
                .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
            if quiet >= RATE_CAP_FORGET {
                self.cap_rps = None;
                self.next_slot = None;
            } else if quiet >= Duration::from_secs(1) {
                let since = self
                    .cap_grown_at
                    .map_or(0.0, |t| now.saturating_duration_since(t).as_secs_f64());
                self.cap_rps = Some(cap * (1.0 + RATE_GROWTH_PER_S * since));
                self.cap_grown_at = Some(now);
            } else {
                self.cap_grown_at = Some(now);
            }
        }
        if let Some(cap) = self.cap_rps {
            let slot = self.next_slot.map_or(at, |s| s.max(at));
            self.next_slot = Some(slot + Duration::from_secs_f64(1.0 / cap.max(0.1)));
            at = slot;
        }
        at
    }

    /// Records how a request ended at `now`.
    pub fn done(&mut self, now: Instant, outcome: Outcome) {
        self.requests += 1;
        match outcome {
            Outcome::Ok {
                bytes,
                latency,
                transfer,
            } => {
                // One request's own bandwidth, from bulk requests only (small ones are all
                // latency).
                if bytes >= 1 << 20 && transfer > Duration::from_micros(100) {
                    let b = bytes as f64 / transfer.as_secs_f64();
                    self.bw_req = if self.bw_req == 0.0 {
                        b
                    } else {
                        0.8 * self.bw_req + 0.2 * b
                    };
                }
                self.throttle_streak = 0;
                self.recent.push_back(now);
                while self
                    .recent
                    .front()
                    .is_some_and(|t| now.saturating_duration_since(*t) > Duration::from_secs(1))
                {
                    self.recent.pop_front();
                }
                let l = latency.as_secs_f64();
                self.lat_recent = if self.lat_recent == 0.0 {
                    l
                } else {
                    0.8 * self.lat_recent + 0.2 * l
                };
                // The floor falls at once and rises by a hundredth of the gap (a path that
                // changed for good is learnt in a few hundred requests).
                self.lat_floor = if self.lat_floor == 0.0 || l < self.lat_floor {
                    l
                } else {
                    self.lat_floor + (l - self.lat_floor) / 100.0
                };
                let start = *self.win_start.get_or_insert(now);
                self.win_bytes += bytes;
                self.win_done += 1;
                let dt = now.saturating_duration_since(start).as_secs_f64();
                // A window spans several round trips and twice the requests in flight, so the
                // bursts in which requests complete average out.
                let long = dt >= (4.0 * self.lat_recent).max(0.5);
                if long && self.win_done as usize >= 2 * self.limit() {
                    let rate = self.win_bytes as f64 / dt;
                    let before = self.limit();
                    if self.settling {
                        // The window after a change holds the change's transition: not measured.
                        self.settling = false;
                    } else {
                        self.window(now, rate);
                    }
                    self.settling = self.limit() != before;
                    self.win_start = Some(now);
                    self.win_bytes = 0;
                    self.win_done = 0;
                }
            }
            Outcome::Throttled => self.throttle(now),
            Outcome::Failed => {}
        }
    }

    fn throttle(&mut self, now: Instant) {
        self.throttled += 1;
        self.last_throttle = Some(now);
        self.throttle_streak = (self.throttle_streak + 1).min(5);
        // Every request waits out a shared pause: 100 ms, doubling with each throttle in a row
        // (at most 3.2 s), so N ranks' retries never arrive together.
        let pause = Duration::from_millis(100 << (self.throttle_streak - 1));
        self.paused_until = Some(self.paused_until.map_or(now + pause, |p| p.max(now + pause)));
        // At most one cut per round trip: the throttles of one burst are one signal.
        let rtt = Duration::from_secs_f64(self.lat_recent.max(0.2));
        if self.last_cut.is_some_and(|t| now.saturating_duration_since(t) < rtt) {
            return;
        }
        self.last_cut = Some(now);
        let observed = self.recent.len() as f64;
        // A rate cap only from a rate: a 503 among a handful of requests a second is an outage
        // the retries wait out, not a request-rate limit (a cap learnt from it would space every
        // later request a second apart).
        if observed >= RATE_CAP_MIN_OBSERVED {
            self.cap_rps = Some(match self.cap_rps {
                Some(c) => c.min(observed) * RATE_CUT,
                None => observed * RATE_CUT,
            });
            self.cap_grown_at = Some(now);
        }
        if !self.pinned {
            self.limit = (self.limit * THROTTLE_CUT).max(ORIGIN_LIMIT_MIN as f64);
            self.reason = Reason::Throttled;
            self.slow_start = false;
        }
        self.stepped_up = false;
        self.prev_rate = 0.0;
        self.win_start = None;
        self.win_bytes = 0;
        self.win_done = 0;
    }

    /// One measured window's throughput (bytes/s): the additive increase, the step back at a
    /// plateau, the probe, the cut on rising latency.
    fn window(&mut self, now: Instant, rate: f64) {
        if self.pinned {
            return;
        }
        let recently_throttled = self
            .last_throttle
            .is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(2));
        let gained = self.prev_rate == 0.0 || rate > self.prev_rate * (1.0 + GAIN);
        if recently_throttled {
            // Hold: the rate cap is the binding limit now.
        } else if !gained && self.lat_floor > 0.0 && self.lat_recent > LATENCY_RISE * self.lat_floor {
            self.limit = (self.limit * 0.9).max(ORIGIN_LIMIT_MIN as f64);
            self.reason = Reason::Latency;
            self.slow_start = false;
            self.stepped_up = false;
        } else if gained && self.cap_rps.is_none() {
            // Slow start: half again per window until the first window without gain, then one
            // request at a time.
            let step = if self.slow_start {
                (self.limit * 0.5).max(1.0).floor()
            } else {
                1.0
            };
            let before = self.limit;
            self.limit = (self.limit + step).min(ORIGIN_LIMIT_MAX as f64);
            self.last_step = self.limit - before;
            self.reason =
                if self.reason == Reason::Probe || self.reason == Reason::Rising || self.reason == Reason::Start {
                    Reason::Rising
                } else {
                    Reason::Probe
                };
            self.stepped_up = true;
            self.plateau = 0;
        } else if self.stepped_up {
            // The last step bought nothing: give it back and hold.
            self.slow_start = false;
            self.limit = (self.limit - self.last_step.max(1.0)).max(ORIGIN_LIMIT_MIN as f64);
            self.reason = Reason::Plateau;
            self.stepped_up = false;
            self.plateau = 0;
        } else {
            self.plateau += 1;
            if self.plateau >= PROBE_EVERY && self.limit() < ORIGIN_LIMIT_MAX {
                self.limit += 1.0;
                self.last_step = 1.0;
                self.reason = Reason::Probe;
                self.stepped_up = true;
                self.plateau = 0;
            }
        }
        // The rate to beat is the better of this window's and a decayed memory of the last
        // (a window a little slower by noise does not reset the comparison).
        self.prev_rate = if gained { rate } else { rate.max(self.prev_rate * 0.98) };
    }
}

/// A concurrency bound whose size may change while permits are held: a smaller size takes
/// effect as permits are given back, a larger one at once.
#[derive(Debug)]
pub struct Limit {
    state: Mutex<(usize, usize)>,
    changed: tokio::sync::Notify,
    blocking: std::sync::Condvar,
}

/// One place in a [`Limit`], given back when dropped.
#[derive(Debug)]
pub struct Permit {
    limit: std::sync::Arc<Limit>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limit.state.lock().expect("limit lock").0 -= 1;
        self.limit.changed.notify_waiters();
        self.limit.blocking.notify_all();
    }
}

impl Limit {
    /// A bound of `size` (at least 1).
    pub fn new(size: usize) -> std::sync::Arc<Limit> {
        std::sync::Arc::new(Limit {
            state: Mutex::new((0, size.max(1))),
            changed: tokio::sync::Notify::new(),
            blocking: std::sync::Condvar::new(),
        })
    }

    /// The bound now.
    pub fn size(&self) -> usize {
        self.state.lock().expect("limit lock").1
    }

    /// Places held now.
    pub fn held(&self) -> usize {
        self.state.lock().expect("limit lock").0
    }

    /// Sets the bound (at least 1).
    pub fn resize(&self, size: usize) {
        let mut s = self.state.lock().expect("limit lock");
        if s.1 != size.max(1) {
            s.1 = size.max(1);
            drop(s);
            self.changed.notify_waiters();
            self.blocking.notify_all();
        }
    }

    fn try_take(self: &std::sync::Arc<Self>) -> Option<Permit> {
        let mut s = self.state.lock().expect("limit lock");
        (s.0 < s.1).then(|| {
            s.0 += 1;
            Permit { limit: self.clone() }
        })
    }

    /// Waits for a place.
    pub async fn acquire(self: &std::sync::Arc<Self>) -> Permit {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(p) = self.try_take() {
                return p;
            }
            changed.await;
        }
    }
}

/// Splits `budget` units (decode threads, bytes) among consumers by demand: each gets at least
/// `floor` and the rest in proportion to its weight. A consumer's weight is `0.25 + wait`,
/// `wait` being the share of its time its trainer waited for data: one that waits gets more,
/// one that is ahead (wait 0) keeps a quarter weight, so it never starves. The shares add up to
/// at most `max(budget, floor × consumers)`.
pub fn shares(budget: u64, floor: u64, waits: &[f64]) -> Vec<u64> {
    if waits.is_empty() {
        return Vec::new();
    }
    let n = waits.len() as u64;
    let spare = budget.saturating_sub(floor * n);
    let w: Vec<f64> = waits
        .iter()
        .map(|x| 0.25 + if x.is_finite() { x.clamp(0.0, 1.0) } else { 0.0 })
        .collect();
    let total: f64 = w.iter().sum();
    let mut out: Vec<u64> = w
        .iter()
        .map(|x| floor + (spare as f64 * x / total).floor() as u64)
        .collect();
    // Hand out what the rounding left, largest weights first.
    let mut left = spare.saturating_sub(out.iter().map(|x| x - floor).sum());
    let mut order: Vec<usize> = (0..w.len()).collect();
    order.sort_by(|a, b| w[*b].total_cmp(&w[*a]).then(a.cmp(b)));
    for i in order.iter().cycle().take(order.len() * 2) {
        if left == 0 {
            break;
        }
        out[*i] += 1;
        left -= 1;
    }
    out
}

/// Whole shards a stream keeps in flight so that its ranged GETs can fill the origin's
/// `limit` with one to spare (the controller only raises a limit its requests use):
/// `ceil((limit + 1) / ranges)`, where `ranges` is the ranged GETs one shard of `shard_bytes`
/// makes at once (`ceil(shard_bytes / range_bytes)`, at most `ranges_max`). Never below
/// `floor` (the fixed setting), never above `cap` (the shards' bytes the prefetch budget holds).
pub fn shards_in_flight(
    limit: usize,
    shard_bytes: u64,
    range_bytes: u64,
    ranges_max: usize,
    floor: usize,
    cap: usize,
) -> usize {
    let ranges = shard_bytes
        .div_ceil(range_bytes.max(1))
        .clamp(1, ranges_max.max(1) as u64) as usize;
    (limit + 1).div_ceil(ranges).clamp(floor.max(1), cap.max(floor).max(1))
}

/// Whole shards a stream holds ahead of its consumer (in flight and delivered, not yet taken):
/// enough to cover one shard's fetch at the consumer's pace (`fetch_s / consume_s` shards, with
/// a margin of half again), plus one; never below `floor` (the shards kept in flight), never
/// above `cap` (the prefetch budget in shards). `consume_s` is the consumer's busy time a
/// shard (its waits for data left out). `floor + 1` until both are measured.
pub fn shards_ahead(fetch_s: f64, consume_s: f64, floor: usize, cap: usize) -> usize {
    let floor = floor.max(1);
    let cap = cap.max(floor);
    let ok = |x: f64| x.is_finite() && x > 0.0;
    if !ok(fetch_s) || !ok(consume_s) {
        return (floor + 1).min(cap);
    }
    let need = (fetch_s / consume_s * 1.5).ceil().min(cap as f64) as usize + 1;
    need.clamp(floor, cap)
}

/// The batches a loader prepares ahead: enough to cover one fetch at the consumer's rate
/// (`rate` batches/s × `fetch_s`, with a margin of half again), plus one, no fewer than `min`
/// and no more than what `mem_bytes` holds at `batch_bytes` a batch.
pub fn prefetch_batches(rate: f64, fetch_s: f64, batch_bytes: u64, mem_bytes: u64, min: usize) -> usize {
    let need = if rate.is_finite() && fetch_s.is_finite() && rate > 0.0 && fetch_s > 0.0 {
        (rate * fetch_s * 1.5).ceil() as usize + 1
    } else {
        min
    };
    let cap = (mem_bytes / batch_bytes.max(1)).max(1) as usize;
    need.max(min)
        .min(cap.max(min.min(cap)))
        .min(crate::loader::PREFETCH_BATCHES_MAX)
}

/// The host's memory budget for prefetched and decoded batches: `RAMJET_HOST_MEMORY` (bytes,
/// or a size such as `8GiB`), else an eighth of the machine's memory, at most 16 GiB (2 GiB
/// where the machine's memory cannot be read).
pub fn host_memory_budget() -> u64 {
    if let Some(v) = std::env::var("RAMJET_HOST_MEMORY")
        .ok()
        .and_then(|v| crate::size::parse(v.trim()).ok())
    {
        return v.max(1 << 20);
    }
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    total.map_or(2 << 30, |t| (t / 8).min(16 << 30))
}

/// One origin's request control, shared by every store of a process on the same client (in a
/// host daemon: every whole-shard fetch of the host). Bulk requests (whole objects, ranged
/// GETs of shard parts) hold a place in its [`Limit`] while they run; every request, small
/// ones too, waits for its start slot (the shared pause after a throttle, the learnt rate cap)
/// and reports how it ended.
#[derive(Debug)]
pub struct Origin {
    tune: Mutex<OriginTune>,
    limit: std::sync::Arc<Limit>,
}

type Registry = Mutex<Vec<(String, std::sync::Weak<Origin>)>>;

/// The origin controls of this process, by origin ([`Origin::register`]).
static ORIGINS: Registry = Mutex::new(Vec::new());

/// Every live origin control of this process with its state (`/stats` `origins`).
pub fn origins() -> Vec<(String, OriginState)> {
    let r = ORIGINS.lock().unwrap_or_else(|p| p.into_inner());
    r.iter()
        .filter_map(|(n, w)| w.upgrade().map(|o| (n.clone(), o.state())))
        .collect()
}

/// A request's place with its [`Origin`], from its start slot to [`Ticket::finish`].
#[derive(Debug)]
pub struct Ticket {
    origin: std::sync::Arc<Origin>,
    _permit: Option<Permit>,
    started: Instant,
    first_byte: std::sync::OnceLock<Instant>,
}

/// The origin controller's state, as metrics and `/stats` show it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OriginState {
    /// Bulk requests allowed in flight.
    pub requests_limit: usize,
    /// Bulk requests in flight now.
    pub requests_in_flight: usize,
    /// The request-rate cap learnt from throttling (0: none).
    pub rate_cap_per_s: f64,
    /// Recent time to first byte, ms.
    pub latency_ms: f64,
    /// One bulk request's recent bandwidth, bytes/s.
    pub request_bytes_per_s: f64,
    /// The ranged GET size the rule picks now (0: not measured yet).
    pub range_bytes: u64,
    /// Requests the origin throttled (503 SlowDown, 429).
    pub throttled: u64,
    /// Requests that ended.
    pub requests: u64,
    /// Why the values are what they are ([`Reason::name`]).
    pub reason: String,
}

impl Origin {
    /// The origin control `RAMJET_ORIGIN_TUNE` and `RAMJET_ORIGIN_REQUESTS` ask for: `None`
    /// with `RAMJET_ORIGIN_TUNE=off` (requests go out as the stream issues them, today's fixed
    /// settings); pinned at `RAMJET_ORIGIN_REQUESTS` bulk requests in flight where set; else
    /// tuned.
    pub fn from_env() -> Option<std::sync::Arc<Origin>> {
        let off = std::env::var("RAMJET_ORIGIN_TUNE").is_ok_and(|v| matches!(v.trim(), "off" | "0" | "false"));
        if off {
            return None;
        }
        let pinned = std::env::var("RAMJET_ORIGIN_REQUESTS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| *n > 0);
        Some(Origin::new(pinned))
    }

    /// A controller, tuned or pinned at `pinned` bulk requests in flight.
    pub fn new(pinned: Option<usize>) -> std::sync::Arc<Origin> {
        let tune = OriginTune::new(pinned);
        let limit = Limit::new(tune.limit());
        std::sync::Arc::new(Origin {
            tune: Mutex::new(tune),
            limit,
        })
    }

    /// Lists `o` as the control of origin `name` (`s3://bucket`) in [`origins`].
    pub fn register(name: &str, o: &std::sync::Arc<Origin>) {
        let mut r = ORIGINS.lock().unwrap_or_else(|p| p.into_inner());
        r.retain(|(_, w)| w.strong_count() > 0);
        if r.len() < 256 {
            r.push((name.to_owned(), std::sync::Arc::downgrade(o)));
        }
    }

    /// Waits for this request's start slot and, for a bulk request, a place in flight.
    pub async fn start(self: &std::sync::Arc<Self>, bulk: bool) -> Ticket {
        let now = Instant::now();
        let at = self.tune.lock().expect("origin tune lock").start_at(now);
        if at > now {
            tokio::time::sleep_until(at.into()).await;
        }
        let permit = if bulk { Some(self.limit.acquire().await) } else { None };
        Ticket {
            origin: self.clone(),
            _permit: permit,
            started: Instant::now(),
            first_byte: std::sync::OnceLock::new(),
        }
    }

    /// Bulk requests allowed in flight now (the controller's limit, or the user's pin).
    pub fn requests_limit(&self) -> usize {
        self.tune.lock().expect("origin tune lock").limit()
    }

    /// The ranged GET size for whole shards now ([`OriginTune::range_bytes`]).
    pub fn range_bytes(&self, configured: u64) -> u64 {
        self.tune.lock().expect("origin tune lock").range_bytes(configured)
    }

    /// The controller's state now.
    pub fn state(&self) -> OriginState {
        let t = self.tune.lock().expect("origin tune lock");
        OriginState {
            requests_limit: t.limit(),
            requests_in_flight: self.limit.held(),
            rate_cap_per_s: t.rate_cap().unwrap_or(0.0),
            latency_ms: t.latency_s() * 1e3,
            request_bytes_per_s: t.bw_req,
            range_bytes: t.range_bytes(0),
            throttled: t.throttled,
            requests: t.requests,
            reason: t.reason().name().to_owned(),
        }
    }
}

impl Ticket {
    /// The response's first byte arrived at `at` (its latency is the time to there).
    pub fn first_byte_at(&self, at: Instant) {
        let _ = self.first_byte.set(at);
    }

    /// The request ended: `Ok(bytes)`, throttled, or failed another way.
    pub fn finish(self, outcome: std::result::Result<u64, bool>) {
        let now = Instant::now();
        let o = match outcome {
            Ok(bytes) => {
                let first = self.first_byte.get().copied().unwrap_or(now);
                Outcome::Ok {
                    bytes,
                    latency: first.saturating_duration_since(self.started),
                    transfer: now.saturating_duration_since(first),
                }
            }
            Err(true) => Outcome::Throttled,
            Err(false) => Outcome::Failed,
        };
        let mut t = self.origin.tune.lock().expect("origin tune lock");
        t.done(now, o);
        let l = t.limit();
        drop(t);
        self.origin.limit.resize(l);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated origin: requests of `size` bytes; each takes `rtt` plus its share of a link
    /// of `bw` bytes/s; with a `limit_rps`, requests past that many starts per second are
    /// answered 503 at once. Runs the controller for `secs` and returns per-second samples of
    /// (limit, successful requests/s, throttled requests/s, bytes/s).
    fn simulate(
        tune: &mut OriginTune,
        rtt: f64,
        bw: f64,
        size: u64,
        limit_rps: Option<f64>,
        secs: f64,
    ) -> Vec<(usize, f64, f64, f64)> {
        let t0 = Instant::now();
        let dt = 0.001;
        let mut in_flight: Vec<(f64, f64, bool)> = Vec::new(); // (start, remaining bytes, throttled)
        let mut starts: VecDeque<f64> = VecDeque::new();
        let mut out = Vec::new();
        let (mut ok, mut thr, mut bytes) = (0.0, 0.0, 0.0);
        let mut reserved: Option<f64> = None;
        let mut t = 0.0;
        let mut second = 1.0;
        while t < secs {
            let now = t0 + Duration::from_secs_f64(t);
            // Start requests while the limit allows and the controller's slot has come.
            while in_flight.len() < tune.limit() {
                // A slot taken earlier is used when its time comes; else take one.
                let at_s = match reserved {
                    Some(s) => s,
                    None => tune.start_at(now).duration_since(t0).as_secs_f64(),
                };
                if at_s > t {
                    reserved = Some(at_s);
                    break;
                }
                reserved = None;
                while starts.front().is_some_and(|s| t - s > 1.0) {
                    starts.pop_front();
                }
                let throttled = limit_rps.is_some_and(|r| starts.len() as f64 >= r);
                if !throttled {
                    starts.push_back(t);
                }
                in_flight.push((t, size as f64, throttled));
            }
            // Advance the link: the requests past their first byte share the bandwidth.
            let active = in_flight.iter().filter(|r| !r.2 && t - r.0 >= rtt).count().max(1) as f64;
            let mut i = 0;
            while i < in_flight.len() {
                let (s, rem, throttled) = in_flight[i];
                if throttled && t - s >= rtt / 2.0 {
                    tune.done(now, Outcome::Throttled);
                    thr += 1.0;
                    in_flight.swap_remove(i);
                    continue;
                }
                if !throttled && t - s >= rtt {
                    let r = rem - bw * dt / active;
                    if r <= 0.0 {
                        let transfer = Duration::from_secs_f64((t - s - rtt).max(0.0));
                        tune.done(
                            now,
                            Outcome::Ok {
                                bytes: size,
                                latency: Duration::from_secs_f64(rtt),
                                transfer,
                            },
                        );
                        ok += 1.0;
                        bytes += size as f64;
                        in_flight.swap_remove(i);
                        continue;
                    }
                    in_flight[i].1 = r;
                }
                i += 1;
            }
            t += dt;
            if t >= second {
                out.push((tune.limit(), ok, thr, bytes));
                ok = 0.0;
                thr = 0.0;
                bytes = 0.0;
                second += 1.0;
            }
        }
        out
    }

    #[test]
    fn rises_while_throughput_rises_then_holds_within_one_request() {
        // 20 ms round trip, 400 MB/s link, 8 MiB requests: one request moves 8 MiB per
        // 20 ms + 21 ms, so the link fills at about 2-3 in flight; past that, more buys nothing.
        let mut t = OriginTune::new(None);
        let s = simulate(&mut t, 0.020, 400e6, 8 << 20, None, 30.0);
        let tail: Vec<usize> = s[10..].iter().map(|x| x.0).collect();
        let (lo, hi) = (*tail.iter().min().unwrap(), *tail.iter().max().unwrap());
        // The oscillation band once converged: the knee and one probe above it.
        assert!(hi - lo <= 2, "limit moved {lo}..{hi} after convergence: {tail:?}");
        let rate: f64 = s[10..].iter().map(|x| x.3).sum::<f64>() / (s.len() - 10) as f64;
        assert!(rate > 0.9 * 400e6, "link not filled: {rate:.0} B/s: {s:?}");
        assert!(hi <= 12, "kept adding requests that bought nothing: {tail:?}");
    }

    #[test]
    fn a_high_latency_link_gets_more_in_flight() {
        // 200 ms round trip: the same link needs several times the requests in flight.
        let mut near = OriginTune::new(None);
        let near_s = simulate(&mut near, 0.005, 200e6, 4 << 20, None, 30.0);
        let mut far = OriginTune::new(None);
        let far_s = simulate(&mut far, 0.200, 200e6, 4 << 20, None, 30.0);
        let last = |s: &Vec<(usize, f64, f64, f64)>| s[20..].iter().map(|x| x.0).max().unwrap();
        assert!(
            last(&far_s) > last(&near_s) + 2,
            "far {} vs near {}: {far_s:?} {near_s:?}",
            last(&far_s),
            last(&near_s)
        );
        let rate: f64 = far_s[20..].iter().map(|x| x.3).sum::<f64>() / (far_s.len() - 20) as f64;
        assert!(rate > 0.8 * 200e6, "far link not filled: {rate:.0} B/s");
    }

    #[test]
    fn throttling_backs_off_at_once_and_converges_near_the_allowed_rate() {
        // Small requests on a fast link: the origin's limit of 50 requests/s binds.
        let mut t = OriginTune::new(None);
        let s = simulate(&mut t, 0.010, 1e9, 256 << 10, Some(50.0), 60.0);
        assert!(t.throttled > 0);
        let conv = &s[20..];
        let ok: f64 = conv.iter().map(|x| x.1).sum::<f64>() / conv.len() as f64;
        let thr: f64 = conv.iter().map(|x| x.2).sum::<f64>() / conv.len() as f64;
        assert!(ok >= 0.9 * 50.0, "converged rate {ok:.1}/s, allowed 50/s: {s:?}");
        assert!(thr <= 0.05 * (ok + thr), "{thr:.2} throttled/s of {:.1}", ok + thr);
        assert_eq!(t.reason(), Reason::Throttled);
    }

    #[test]
    fn today_fixed_settings_on_the_same_origin_are_throttled_far_more() {
        // A pinned limit (today's 16 GETs in flight) gets no learnt cap growth beyond the
        // origin and keeps its concurrency: the comparison the benchmark makes.
        let mut t = OriginTune::new(Some(16));
        let s = simulate(&mut t, 0.010, 1e9, 256 << 10, Some(50.0), 30.0);
        assert_eq!(t.limit(), 16);
        assert_eq!(t.reason(), Reason::Pinned);
        assert!(s.iter().all(|x| x.0 == 16));
    }

    #[test]
    fn a_throttle_pauses_every_request_and_cuts_once_per_round_trip() {
        let mut t = OriginTune::new(None);
        let now = Instant::now();
        for _ in 0..10 {
            t.done(
                now,
                Outcome::Ok {
                    bytes: 1 << 20,
                    latency: Duration::from_millis(50),
                    transfer: Duration::from_millis(10),
                },
            );
        }
        let before = t.limit;
        t.done(now, Outcome::Throttled);
        t.done(now, Outcome::Throttled);
        t.done(now, Outcome::Throttled);
        assert_eq!(t.throttled, 3);
        assert!((t.limit - before * THROTTLE_CUT).abs() < 1e-9, "one cut for one burst");
        assert!(
            t.start_at(now) >= now + Duration::from_millis(400),
            "a streak of 3 pauses 400 ms"
        );
        // The cap spaces the next requests.
        let a = t.start_at(now);
        let b = t.start_at(now);
        assert!(b > a);
    }

    /// A 503 among the first requests (an outage, not a rate limit) pauses and cuts, but sets
    /// no rate cap: one learnt from a rate of one request a second spaced every later request a
    /// second apart (a pack of a few hundred objects took minutes after two injected 503s).
    #[test]
    fn a_throttle_among_few_requests_sets_no_rate_cap() {
        let mut t = OriginTune::new(None);
        let now = Instant::now();
        t.done(
            now,
            Outcome::Ok {
                bytes: 1 << 10,
                latency: Duration::from_millis(1),
                transfer: Duration::from_millis(1),
            },
        );
        t.done(now, Outcome::Throttled);
        assert_eq!(t.rate_cap(), None);
        let later = now + Duration::from_secs(1);
        let a = t.start_at(later);
        let b = t.start_at(later);
        assert_eq!((a, b), (later, later), "no spacing once the pause is over");
    }

    #[test]
    fn range_size_covers_four_round_trips_of_one_request() {
        assert_eq!(
            OriginTune::new(None).range_bytes(32 << 20),
            32 << 20,
            "nothing measured: as configured"
        );
        // 20 requests of 32 MiB, each `ms` to its first byte and `bw` bytes/s after it.
        let measured = |ms: u64, bw: f64| {
            let mut t = OriginTune::new(None);
            let now = Instant::now();
            for _ in 0..20 {
                let transfer = Duration::from_secs_f64(32.0 * 1048576.0 / bw);
                let latency = Duration::from_millis(ms);
                t.done(
                    now,
                    Outcome::Ok {
                        bytes: 32 << 20,
                        latency,
                        transfer,
                    },
                );
            }
            t
        };
        // A near origin: 2 ms to first byte, 500 MB/s a request: 4 MB wanted, the floor of a
        // fast link (a request's fixed cost is the server's work: fewer, larger ranges).
        assert_eq!(measured(2, 500e6).range_bytes(32 << 20), RANGE_BYTES_FAST_MIN);
        // A WAN link: 30 ms, 4 MB/s a request: 0.5 MB wanted; a quarter second of the request
        // is 1 MB: the slow link's floor, 8 MiB (more ranges in flight to share the link).
        assert_eq!(measured(30, 4e6).range_bytes(32 << 20), RANGE_BYTES_MIN);
        // Between: 40 MB/s a request makes the floor 16 MiB (10 MB rounded up).
        assert_eq!(measured(30, 40e6).range_bytes(32 << 20), 16 << 20);
        // A far one: 80 ms, 100 MB/s a request: 32 MB wanted, rounded up to 32 MiB.
        assert_eq!(measured(80, 100e6).range_bytes(8 << 20), 32 << 20);
        // Very far: capped.
        assert_eq!(measured(300, 200e6).range_bytes(8 << 20), RANGE_BYTES_MAX);
    }

    #[test]
    fn shards_ahead_cover_one_fetch_at_the_consumers_pace() {
        // Nothing measured yet: one past the shards in flight.
        assert_eq!(shards_ahead(0.0, 0.0, 4, 32), 5);
        assert_eq!(shards_ahead(0.5, f64::NAN, 4, 32), 5);
        // A local store: a shard reads in 20 ms, the consumer takes 0.5 s over it: the floor.
        assert_eq!(shards_ahead(0.02, 0.5, 4, 32), 4);
        // A far origin: 2 s a shard against 0.1 s of use: 30 + 1, within the budget.
        assert_eq!(shards_ahead(2.0, 0.1, 4, 32), 31);
        assert_eq!(shards_ahead(2.0, 0.05, 4, 32), 32, "the prefetch budget caps it");
        // A budget under the floor leaves the floor (the shards in flight hold their bytes).
        assert_eq!(shards_ahead(2.0, 0.05, 4, 2), 4);
        assert_eq!(shards_ahead(1e300, 1e-300, 1, 8), 8, "no overflow");
    }

    #[test]
    fn limit_resizes_with_permits_held() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = Limit::new(2);
            let a = l.acquire().await;
            let b = l.acquire().await;
            assert_eq!(l.held(), 2);
            let l2 = l.clone();
            let waiter = tokio::spawn(async move { l2.acquire().await });
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished());
            l.resize(3);
            let c = tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(l.held(), 3);
            l.resize(1);
            drop((a, b));
            assert_eq!(l.held(), 1);
            let l3 = l.clone();
            let waiter = tokio::spawn(async move { l3.acquire().await });
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished(), "over the smaller bound");
            drop(c);
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .unwrap()
                .unwrap();
        });
    }

    #[test]
    fn shares_follow_demand_and_fit_the_budget() {
        // 8 cores, 4 ranks: equal demand, equal shares.
        assert_eq!(shares(8, 1, &[0.0; 4]), vec![2, 2, 2, 2]);
        // One rank waits for data: it gets the most; none drops under the floor.
        let s = shares(8, 1, &[0.6, 0.0, 0.0, 0.0]);
        assert_eq!(s.iter().sum::<u64>(), 8);
        assert!(s[0] > s[1] && s[1..].iter().all(|x| *x >= 1), "{s:?}");
        // More ranks than cores: each gets the floor.
        assert_eq!(shares(2, 1, &[0.5; 4]), vec![1, 1, 1, 1]);
        // A single process is the host.
        assert_eq!(shares(16, 1, &[0.3]), vec![16]);
        // Nonsense demand is no demand.
        assert_eq!(shares(4, 1, &[f64::NAN, -1.0]), vec![2, 2]);
        assert!(shares(4, 1, &[]).is_empty());
    }

    #[test]
    fn prefetch_covers_one_fetch_at_the_rate_within_memory() {
        // 20 batches/s, fetches of 0.5 s: 16 batches; memory for 100.
        assert_eq!(prefetch_batches(20.0, 0.5, 1 << 20, 100 << 20, 2), 16);
        // Memory for 5: 5.
        assert_eq!(prefetch_batches(20.0, 0.5, 1 << 20, 5 << 20, 2), 5);
        // No measurement yet: the minimum.
        assert_eq!(prefetch_batches(0.0, 0.0, 1 << 20, 100 << 20, 2), 2);
        assert_eq!(prefetch_batches(f64::NAN, 1.0, 1 << 20, 100 << 20, 2), 2);
        // A slow consumer on a fast link needs little.
        assert_eq!(prefetch_batches(1.0, 0.01, 1 << 20, 100 << 20, 2), 2);
    }

    #[test]
    fn shards_in_flight_fill_the_origin_limit_with_one_to_spare() {
        let mib = 1u64 << 20;
        // 16 MiB shards in one 32 MiB range each: a limit of 9 wants 10 shards.
        assert_eq!(shards_in_flight(9, 16 * mib, 32 * mib, 4, 4, 32), 10);
        // Ranges of 8 MiB: two a shard, so 5.
        assert_eq!(shards_in_flight(9, 16 * mib, 8 * mib, 4, 4, 32), 5);
        // A limit the fixed setting covers keeps the fixed setting.
        assert_eq!(shards_in_flight(4, 256 * mib, 32 * mib, 4, 4, 32), 4);
        // The prefetch budget caps it; a cap under the floor leaves the floor.
        assert_eq!(shards_in_flight(64, 16 * mib, 32 * mib, 4, 4, 12), 12);
        assert_eq!(shards_in_flight(64, 16 * mib, 32 * mib, 4, 4, 2), 4);
        // Nonsense sizes still give at least one.
        assert_eq!(shards_in_flight(0, 0, 0, 0, 0, 0), 1);
    }
}
