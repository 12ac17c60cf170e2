//! The prefetcher: one task per stream that plans each epoch and sends the consumer
//! everything it gets, down one channel: the plan; at the start of a stream the first samples
//! read one by one; then whole shards in first-use order, at most `prefetch_bytes_max` ahead
//! of the consumer. Under the global shuffle it sends batches of samples read one by one
//! instead (ranged reads merged per shard, from the disk cache or the origin, several batches
//! in flight), while whole shards warm the disk cache.
//!
//! Nothing is computed for the whole epoch up front: the shards and their uses are found by
//! walking this consumer's positions one group of the order at a time (a unit, or a round of
//! the shard-block shuffle), as the fetches are pulled.

use super::fetch::read_samples;
use super::fetch::{fetch_shard, fetch_shard_from};
use super::plan::plan_epoch;
use super::plan::EpochPlan;
use super::shared::{slice_record, Live, Shared};
use super::split::SplitVia;
use super::{Gate, Msg, RANGED_AHEAD_MAX, SAMPLE_BATCHES_IN_FLIGHT};
use crate::error::Result;
use crate::metrics::Metrics;
use crate::order::OrderCursor;
use crate::order::SampleRef;
use crate::order::{DealRule, EpochProgress};
use crate::stall::WaitOn;
use bytes::Bytes;
use futures::stream::{self, StreamExt};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;

pub(super) async fn prefetcher(
    shared: Arc<Shared>,
    start: EpochProgress,
    mut skip: usize,
    tx: mpsc::Sender<Msg>,
    per_sample: Option<usize>,
    mut ranged_budget: usize,
    mut gate: Option<Gate>,
) {
    let mut base = start;
    loop {
        let epoch = base.epoch;
        if shared.cfg.epochs.is_some_and(|n| epoch >= n) {
            return;
        }
        let plan = match plan_epoch(&shared, epoch, base, std::mem::take(&mut skip)) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                let _ = tx.send(Msg::Failed(e)).await;
                return;
            }
        };
        if tx.send(Msg::Epoch(plan.clone())).await.is_err() {
            return;
        }
        let went_on = match per_sample {
            Some(batch) => sample_epoch(&shared, &plan, &tx, batch).await,
            None => shard_epoch(&shared, &plan, &tx, std::mem::take(&mut ranged_budget), gate.take()).await,
        };
        if !went_on {
            return;
        }
        base = EpochProgress {
            epoch: epoch + 1,
            consumed: 0,
            ahead: Vec::new(),
        };
    }
}

/// This consumer's shards in the order of their first use, one group of the order at a time,
/// each with its uses inside the group (a shard used again in a later group comes again).
/// Memory: one group's shards.
struct ShardUses {
    plan: Arc<EpochPlan>,
    cursor: OrderCursor,
    /// The next index of the deal to walk.
    k: u64,
    pending: std::collections::VecDeque<((u32, u32), u64)>,
    /// When the node keeps its share ([`Shared::keeps_share`]) and sends the shards a cut splits
    /// through another daemon (`split_shards` not `Origin`): the stream, the deal's rule and
    /// this consumer's node, to mark the shards another node reads too
    /// ([`Shared::split_shards`]) before they are fetched.
    splits: Option<(Arc<Shared>, DealRule, u64)>,
}

impl ShardUses {
    fn new(plan: Arc<EpochPlan>, shared: &Arc<Shared>) -> ShardUses {
        let routed = shared.cfg.split_shards != super::SplitShards::Origin;
        let splits = (shared.keeps_share() && routed).then(|| {
            let rule = DealRule::for_job(&shared.cfg.order, &shared.cfg.topology);
            let me = rule.node_of_consumer(shared.cfg.topology.consumer() as u64);
            (shared.clone(), rule, me)
        });
        ShardUses {
            cursor: plan.order.cursor(),
            k: plan.skip as u64,
            plan,
            pending: Default::default(),
            splits,
        }
    }

    /// Marks the shard at position `g` as split when its unit's samples in its round lie in
    /// partitions of two nodes: through its ring owner, or through its reader (the node of its
    /// first partition) unless this node is the reader (which reads it from the origin).
    fn mark_if_split(&mut self, g: u64, key: (u32, u32)) -> Result<()> {
        let Some((shared, rule, me)) = &self.splits else {
            return Ok(());
        };
        if let Some((lo, hi)) = self.cursor.unit_partitions(g)? {
            let reader = rule.node_of_partition(lo);
            if reader == rule.node_of_partition(hi) {
                return Ok(());
            }
            let via = match shared.cfg.split_shards {
                super::SplitShards::Owner => SplitVia::Owner,
                _ if reader == *me => return Ok(()),
                _ => SplitVia::Reader(reader as u32),
            };
            let mut m = shared.split_shards.lock().unwrap_or_else(|p| p.into_inner());
            m.insert(key, via);
        }
        Ok(())
    }
}

impl Iterator for ShardUses {
    /// A shard and its uses; an error (the order could not be computed) ends the walk.
    type Item = Result<((u32, u32), u64)>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(x) = self.pending.pop_front() {
                return Some(Ok(x));
            }
            let n = self.plan.deal.len();
            if self.k >= n {
                return None;
            }
            let mut group = None;
            let mut first_use: Vec<(u32, u32)> = Vec::new();
            let mut uses: HashMap<(u32, u32), u64> = HashMap::new();
            while self.k < n {
                let position = self.plan.deal.position(self.k);
                // The next group's first position ends this one, known (at the seed's scale)
                // without building that group's round of thousands of count lookups.
                if group.is_some_and(|x| self.cursor.group_floor(position).is_some_and(|f| f > x)) {
                    break;
                }
                let (id, g) = match self.cursor.at(position) {
                    Ok(x) => x,
                    Err(e) => {
                        self.k = n;
                        return Some(Err(e));
                    }
                };
                if group.is_some_and(|x| x != g) {
                    break;
                }
                group = Some(g);
                let key = (id.source, id.shard);
                let u = uses.entry(key).or_insert(0);
                if *u == 0 {
                    first_use.push(key);
                    if let Err(e) = self.mark_if_split(position, key) {
                        self.k = n;
                        return Some(Err(e));
                    }
                }
                *u += 1;
                self.k += 1;
            }
            self.pending.extend(first_use.into_iter().map(|key| (key, uses[&key])));
        }
    }
}

/// Shards in the order this consumer first touches them, each once (to warm the disk cache
/// under the global shuffle). Memory: a bit per shard.
struct FirstTouch {
    plan: Arc<EpochPlan>,
    cursor: OrderCursor,
    k: u64,
    seen: Vec<Vec<u64>>,
}

impl FirstTouch {
    fn new(plan: Arc<EpochPlan>, shared: &Shared) -> FirstTouch {
        FirstTouch {
            cursor: plan.order.cursor(),
            k: plan.skip as u64,
            seen: shared
                .sources
                .iter()
                .map(|s| vec![0u64; s.ds.manifest().shard_count().div_ceil(64)])
                .collect(),
            plan,
        }
    }
}

impl Iterator for FirstTouch {
    /// A shard; an error (the order could not be computed) ends the walk.
    type Item = Result<(u32, u32)>;
    fn next(&mut self) -> Option<Self::Item> {
        while self.k < self.plan.deal.len() {
            let at = self.cursor.at(self.plan.deal.position(self.k));
            self.k += 1;
            let id = match at {
                Ok((id, _)) => id,
                Err(e) => {
                    self.k = self.plan.deal.len();
                    return Some(Err(e));
                }
            };
            let (word, bit) = (
                &mut self.seen[id.source as usize][id.shard as usize / 64],
                id.shard % 64,
            );
            if *word & (1 << bit) == 0 {
                *word |= 1 << bit;
                return Some(Ok((id.source, id.shard)));
            }
        }
        None
    }
}

/// One epoch of whole shards: the first samples one by one (if any budget), then the shards
/// in first-use order. Returns whether the consumer is still there.
async fn shard_epoch(
    shared: &Arc<Shared>,
    plan: &Arc<EpochPlan>,
    tx: &mpsc::Sender<Msg>,
    ranged: usize,
    gate: Option<Gate>,
) -> bool {
    let epoch = plan.epoch;
    let mut in_flight = InFlight::new(shared);
    let (sh, uses) = (shared.clone(), ShardUses::new(plan.clone(), shared));
    let mut start_fetches = Some(move || {
        // Each fetch takes a place among the shards ahead before it starts (in order: `then`
        // runs one at a time), and hands it on with its shard to the consumer.
        let sh2 = sh.clone();
        let fetches = stream::iter(uses)
            .then(move |u| {
                let shared = sh.clone();
                async move { (u, shared.ahead.acquire().await) }
            })
            .map(move |(u, place)| {
                let shared = sh2.clone();
                async move {
                    let ((s, shard), n) = u?;
                    let t = std::time::Instant::now();
                    let res = fetch_shard_from(shared.clone(), s as usize, shard as usize).await;
                    if res.is_ok() {
                        shared.ahead.fetched(t.elapsed());
                    }
                    Ok(((s, shard), n, res, place))
                }
            });
        buffered_by(Box::pin(fetches), move || in_flight.width())
    });
    let mut fetched = None;
    // The first samples, one by one, while the first whole shards download.
    let (mut ranged_left, head) = match ranged {
        0 => (HashMap::new(), None),
        n => {
            let first = FirstSamples {
                plan,
                budget: n,
                bytes_max: shared.cfg.ranged_until_shard_bytes_max,
                gate,
            };
            match first.run(shared, tx, &mut start_fetches, &mut fetched).await {
                Some(r) => r,
                None => return false,
            }
        }
    };
    let mut fetched = match fetched {
        Some(f) => f,
        None => (start_fetches.take().expect("started once"))(),
    };
    let mut head = head;
    loop {
        let item = match head.take() {
            Some(item) => item,
            None => fetched.next().await,
        };
        let Some(item) = item else { break };
        let ((s, sh), mut uses, res, place) = match item {
            Ok(x) => x,
            Err(e) => {
                let _ = tx.send(Msg::Failed(e)).await;
                return false;
            }
        };
        // Samples already delivered one by one come first in the deal: they take off the
        // shard's earliest groups.
        if let Some(left) = ranged_left.get_mut(&(s, sh)) {
            let taken = (*left).min(uses);
            *left -= taken;
            uses -= taken;
        }
        let failed = res.is_err();
        let (bytes, from) = match res {
            Ok((b, from)) => (Ok(b), from),
            Err(e) => (Err(e), WaitOn::Origin),
        };
        let msg = Msg::Shard {
            key: (epoch, s, sh),
            uses,
            bytes,
            from,
            place,
        };
        if tx.send(msg).await.is_err() || failed {
            return false;
        }
    }
    true
}

/// How many whole shards the prefetcher keeps in flight: `shards_in_flight_max` (the fixed
/// setting), raised while the origin's control allows more requests than those shards make
/// ([`crate::tune::shards_in_flight`]), within the prefetch budget (each shard in flight holds
/// its bytes: at most half of `prefetch_bytes_max` in flight). Fixed without an origin control
/// (local stores, `RAMJET_ORIGIN_TUNE=off`) and behind a host daemon (its own control paces
/// the host's fetches).
struct InFlight {
    shared: Arc<Shared>,
    origins: Vec<Arc<crate::tune::Origin>>,
    shard_bytes: u64,
    cap: usize,
    last: usize,
}

impl InFlight {
    fn new(shared: &Arc<Shared>) -> InFlight {
        let cfg = &shared.cfg;
        let mut origins: Vec<Arc<crate::tune::Origin>> = Vec::new();
        if cfg.provider.is_none() {
            for s in &shared.sources {
                if let Some(o) = s.ds.store().origin() {
                    if !origins.iter().any(|x| Arc::ptr_eq(x, &o)) {
                        origins.push(o);
                    }
                }
            }
        }
        let shard_bytes = shared.avg_shard_bytes();
        let cap = (cfg.prefetch_bytes_max / 2 / shard_bytes).clamp(1, SHARDS_IN_FLIGHT_CAP as u64) as usize;
        InFlight {
            shared: shared.clone(),
            origins,
            shard_bytes,
            cap,
            last: 0,
        }
    }

    /// The shards to keep in flight now; a change shows in metrics (`tune_shards_in_flight`).
    fn width(&mut self) -> usize {
        let cfg = &self.shared.cfg;
        let floor = cfg.shards_in_flight_max.max(1);
        let (n, why) = match self
            .origins
            .iter()
            .map(|o| {
                let range = if cfg.range_pinned {
                    cfg.range_bytes
                } else {
                    o.range_bytes(cfg.range_bytes)
                };
                crate::tune::shards_in_flight(
                    o.requests_limit(),
                    self.shard_bytes,
                    range,
                    cfg.ranges_in_flight_max,
                    floor,
                    self.cap,
                )
            })
            .max()
        {
            Some(n) if n >= self.cap && n > floor => (n, "the prefetch budget's share for shards in flight"),
            Some(n) if n > floor => (n, "the origin control allows more requests in flight"),
            Some(n) => (n, "the fixed setting covers the origin's limit"),
            None if cfg.provider.is_some() => (floor, "fixed: the host daemon paces the host's fetches"),
            None => (floor, "fixed: no origin control"),
        };
        if n != self.last {
            self.last = n;
            let m = &self.shared.metrics;
            m.set_tune("shards_in_flight", n as u64);
            m.set_tune("shards_in_flight_reason", why);
        }
        n
    }
}

/// Most whole shards one stream keeps in flight, whatever the origin allows.
const SHARDS_IN_FLIGHT_CAP: usize = 64;

/// `futures`' `buffered` (the futures of `items` run at once, their outputs in order), with
/// the number run at once asked of `width` before each pull, so it can change while the
/// stream runs. A wider `width` shows at the next poll: after a future ends, or when `items`
/// yields one that was not ready (a fetch waiting for its place ahead).
fn buffered_by<I, F>(
    mut items: I,
    mut width: impl FnMut() -> usize + Unpin,
) -> impl futures::Stream<Item = F::Output> + Unpin
where
    I: futures::Stream<Item = F> + Unpin,
    F: std::future::Future,
{
    let mut running = futures::stream::FuturesOrdered::new();
    let mut drained = false;
    stream::poll_fn(move |cx| {
        while !drained && running.len() < width().max(1) {
            match items.poll_next_unpin(cx) {
                std::task::Poll::Ready(Some(f)) => running.push_back(f),
                std::task::Poll::Ready(None) => drained = true,
                std::task::Poll::Pending => break,
            }
        }
        if running.is_empty() {
            // The end once `items` is drained; else `items` wakes this task.
            return match drained {
                true => std::task::Poll::Ready(None),
                false => std::task::Poll::Pending,
            };
        }
        running.poll_next_unpin(cx)
    })
}

/// One epoch of the global shuffle: batches of samples read one by one, several in flight,
/// while (with a disk cache) whole shards warm the cache in first-touch order; those shards
/// are held, verified, up to `resident_bytes_max` for the epoch, and the samples of a held
/// shard are sliced from memory. Returns whether the consumer is still there.
async fn sample_epoch(shared: &Arc<Shared>, plan: &Arc<EpochPlan>, tx: &mpsc::Sender<Msg>, batch: usize) -> bool {
    let epoch = plan.epoch;
    let mut cursor = plan.order.cursor();
    let p = plan.clone();
    let sh = shared.clone();
    // Whole shards the cache warming fetched, held (verified) while they fit in
    // `resident_bytes_max`: their samples are sliced from memory, not read one by one.
    let held: Held = Default::default();
    let h = held.clone();
    let mut reads = stream::iter(growing_batches(plan.skip as u64, plan.deal.len(), batch)).map(move |range| {
        let positions: Vec<u64> = range.map(|k| p.deal.position(k)).collect();
        let ids: Result<Vec<SampleRef>> = positions.iter().map(|&g| Ok(cursor.at(g)?.0)).collect();
        read_batch(sh.clone(), h.clone(), epoch, positions, ids)
    });
    // The first batch alone, so the larger ones behind it do not compete for its reads.
    if let Some(first) = reads.next().await {
        let msg = first.await;
        let failed = matches!(msg, Msg::Failed(_));
        if tx.send(msg).await.is_err() || failed {
            return false;
        }
    }
    let mut batches = reads.buffered(SAMPLE_BATCHES_IN_FLIGHT);
    let warm_list = warm_list(shared, plan);
    let sh = shared.clone();
    let mut warm = stream::iter(warm_list)
        .map(move |t| {
            let shared = sh.clone();
            async move {
                let (s, shard) = t?;
                Ok(((s, shard), fetch_shard(shared, s as usize, shard as usize).await))
            }
        })
        .buffered(shared.cfg.shards_in_flight_max.max(1));
    let mut warming = true;
    let mut held_bytes = 0u64;
    let mut hold = |(s, sh): (u32, u32), bytes: Bytes| {
        let len = bytes.len() as u64;
        if held_bytes + len > shared.cfg.resident_bytes_max || bytes.len() < 64 {
            return;
        }
        let url = shared.sources[s as usize].shard_url(sh as usize);
        if let Ok(header) = crate::format::Header::parse(&bytes[..64], &url) {
            held_bytes += len;
            let live = Live {
                bytes,
                header,
                uses_left: 0,
            };
            held.lock().expect("not poisoned").insert((s, sh), live);
        }
    };
    // Warming goes on after the last batch: the cache is warmed for every shard of the epoch,
    // as the next epoch reads them again.
    let mut reading = true;
    loop {
        tokio::select! {
            b = batches.next(), if reading => match b {
                None => reading = false,
                Some(msg) => {
                    let failed = matches!(msg, Msg::Failed(_));
                    if tx.send(msg).await.is_err() || failed {
                        return false;
                    }
                }
            },
            w = warm.next(), if warming => match w {
                None => warming = false,
                Some(Ok((key, Ok(bytes)))) => {
                    if reading {
                        hold(key, bytes);
                    }
                }
                Some(Err(e)) => {
                    let _ = tx.send(Msg::Failed(e)).await;
                    return false;
                }
                Some(Ok(((s, sh), Err(e)))) => {
                    let _ = tx.send(Msg::Shard { key: (epoch, s, sh), uses: 0, bytes: Err(e), from: WaitOn::Origin, place: None }).await;
                    return false;
                }
            },
            else => return true,
        }
    }
}

/// Whole shards held in memory for an epoch of the global shuffle, by (source, shard).
type Held = Arc<std::sync::Mutex<HashMap<(u32, u32), Live>>>;

/// The global shuffle's batches of deal positions `start..n`: they start at
/// [`RANGED_AHEAD_MAX`] samples and double up to `batch`, so the first sample waits for a few
/// reads, not for a full batch's.
fn growing_batches(start: u64, n: u64, batch: usize) -> impl Iterator<Item = std::ops::Range<u64>> {
    let (mut k, mut size) = (start, RANGED_AHEAD_MAX.min(batch).max(1) as u64);
    std::iter::from_fn(move || {
        (k < n).then(|| {
            let r = k..(k + size).min(n);
            k = r.end;
            size = (size * 2).min(batch.max(1) as u64);
            r
        })
    })
}

/// One batch of the global shuffle (`ids` at `positions`): the samples of a held shard sliced
/// from memory, the others read one by one.
async fn read_batch(
    shared: Arc<Shared>,
    held: Held,
    epoch: u64,
    positions: Vec<u64>,
    ids: Result<Vec<SampleRef>>,
) -> Msg {
    let ids = match ids {
        Ok(ids) => ids,
        Err(e) => return Msg::Failed(e),
    };
    let mut sliced: Vec<Option<Result<Bytes>>> = Vec::with_capacity(ids.len());
    {
        let held = held.lock().expect("not poisoned");
        sliced.extend(ids.iter().map(|id| {
            held.get(&(id.source, id.shard))
                .map(|live| slice_record(live, *id, &shared))
        }));
    }
    let rest: Vec<SampleRef> = ids
        .iter()
        .zip(&sliced)
        .filter(|(_, r)| r.is_none())
        .map(|(id, _)| *id)
        .collect();
    let (read, from_origin) = if rest.is_empty() {
        (Vec::new(), 0)
    } else {
        read_samples(&shared, &rest).await
    };
    let mut read = read.into_iter();
    let records = sliced
        .into_iter()
        .map(|r| r.unwrap_or_else(|| read.next().expect("one record per sample not held")));
    Msg::Samples {
        epoch,
        samples: positions.into_iter().zip(records).collect(),
        from_origin,
    }
}

/// The shards the global shuffle's epoch warms the disk cache with, in first-touch order.
/// Samples read one by one need whole shards only for that: without a cache, fetching them
/// would double the origin traffic for nothing. A shard that will not be held and is in the
/// cache already needs no warming: reading it whole would only check it (its samples are
/// checked as they are read, and a damaged one is removed then, to be fetched again by the
/// next epoch's warming).
fn warm_list(shared: &Arc<Shared>, plan: &Arc<EpochPlan>) -> impl Iterator<Item = Result<(u32, u32)>> {
    let first_touch = shared
        .cache
        .is_some()
        .then(|| FirstTouch::new(plan.clone(), shared))
        .into_iter()
        .flatten();
    let mut planned = 0u64;
    let sh = shared.clone();
    first_touch.filter(move |t| {
        let Ok((s, shard)) = t else { return true };
        let Ok(id) = sh.sources[*s as usize].id(*shard as usize) else {
            return true;
        };
        if planned.saturating_add(id.bytes) <= sh.cfg.resident_bytes_max {
            planned += id.bytes;
            return true;
        }
        !sh.cache.as_ref().is_some_and(|c| c.contains(id))
    })
}

/// The first samples of a stream, read one by one (from the disk cache, or with two ranged
/// GETs each) in batches of [`RANGED_AHEAD_MAX`], so the first batch costs a few GET latencies
/// rather than a whole shard's download.
struct FirstSamples<'a> {
    plan: &'a EpochPlan,
    /// Samples that may be read this way.
    budget: usize,
    /// Then, bytes of records that may be read this way while no whole shard has arrived.
    bytes_max: u64,
    /// Held by a consumer with work of its own before its first output (the loader decodes
    /// its first batch): once that batch's samples are read, nothing more is read (samples or
    /// whole shards) until it opens, at most `first_gate_max_ms` ([`FIRST_GATE_MAX`]).
    gate: Option<Gate>,
}

impl FirstSamples<'_> {
    /// Sends batches of samples read one by one, from the cursor on, until the sample budget
    /// and then the byte budget are spent, or the first whole shard arrives (it is then
    /// returned, to be sent next, and a batch still being read is dropped: its samples come
    /// with their shards). Whole shards start after the first batch (once the gate, if any,
    /// opens; at the latest when the sample budget is spent, or at once when the consumer's
    /// first batch needs more samples than the budget). Returns the uses of each shard
    /// delivered this way; `None` when the consumer went away.
    async fn run<F, S>(
        self,
        shared: &Arc<Shared>,
        tx: &mpsc::Sender<Msg>,
        start_fetches: &mut Option<F>,
        fetched: &mut Option<S>,
    ) -> Option<(HashMap<(u32, u32), u64>, Option<Option<S::Item>>)>
    where
        F: FnOnce() -> S,
        S: futures::Stream + Unpin,
    {
        let plan = self.plan;
        let dealt = plan.count().saturating_sub(plan.skip);
        let mut cursor = plan.order.cursor();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(shared.cfg.first_gate_max_ms);
        // A short epoch's first batch is all of it.
        let first_batch = self.gate.as_ref().map_or(0, |g| g.first_batch.min(dealt).max(1));
        let mut gate = self.gate.map(|g| g.rx);
        let mut budget = self.budget;
        let mut bytes_left = self.bytes_max;
        let mut taken = 0;
        let mut ranged_uses: HashMap<(u32, u32), u64> = HashMap::new();
        let mut head = None;
        while (budget > 0 || bytes_left > 0) && taken < dealt && head.is_none() {
            if taken >= first_batch {
                // The consumer's first batch is read: nothing more until it is decoded. Over
                // the WAN-like link on two cores, the next reads (theirs and a same-host
                // origin's work) made its decode take 28-47 ms instead of 7, in 5 cold starts
                // of 11 (docs/benchmarks-history.md).
                wait_gate(&mut gate, deadline, &shared.metrics).await;
            }
            if fetched.is_none() && budget == 0 {
                // Past the first samples only while the first shard downloads: it must start
                // (after the gate above, or now when the first batch itself needs it).
                *fetched = start_fetches.take().map(|f| f());
            }
            if fetched.is_none() && taken > 0 && gate_open(&gate, deadline) {
                *fetched = start_fetches.take().map(|f| f());
            }
            let n = RANGED_AHEAD_MAX
                .min(if budget > 0 { budget } else { usize::MAX })
                .min(dealt - taken);
            let batch: Vec<u64> = (plan.skip + taken..plan.skip + taken + n)
                .map(|k| plan.deal.position(k as u64))
                .collect();
            let ids: Result<Vec<SampleRef>> = batch.iter().map(|&p| Ok(cursor.at(p)?.0)).collect();
            let ids = match ids {
                Ok(ids) => ids,
                Err(e) => {
                    let _ = tx.send(Msg::Failed(e)).await;
                    return None;
                }
            };
            let read = read_samples(shared, &ids);
            tokio::pin!(read);
            let got = match fetched.as_mut() {
                Some(f) => tokio::select! {
                    got = &mut read => Some(got),
                    first = f.next() => {
                        // A whole shard arrived: it goes to the consumer now, not after these
                        // reads (under a loaded link a ranged GET can take longer than a
                        // shard), and the next shard's fetch starts. The samples being read
                        // come with their shards instead.
                        let abandon = first.is_some();
                        head = Some(first);
                        if abandon { None } else { Some(read.await) }
                    }
                },
                None => Some(read.await),
            };
            let Some((records, from_origin)) = got else { break };
            let got_bytes: u64 = records.iter().map(|r| r.as_ref().map_or(0, |b| b.len() as u64)).sum();
            for id in &ids {
                *ranged_uses.entry((id.source, id.shard)).or_default() += 1;
            }
            let msg = Msg::Samples {
                epoch: plan.epoch,
                samples: batch.iter().copied().zip(records).collect(),
                from_origin,
            };
            if tx.send(msg).await.is_err() {
                return None;
            }
            if budget > 0 {
                budget -= n;
            } else {
                // At least a page a sample, so failing reads cannot go on for ever.
                bytes_left = bytes_left.saturating_sub(got_bytes.max(n as u64 * 4096));
            }
            taken += n;
        }
        if fetched.is_none() {
            if taken >= first_batch {
                wait_gate(&mut gate, deadline, &shared.metrics).await;
            }
            *fetched = start_fetches.take().map(|f| f());
        }
        Some((ranged_uses, head))
    }
}

/// Waits until the first-batch gate opens (counted when it was still closed), its holder goes
/// away (the consumer is gone: a dropped sender opens it too), or `deadline`.
async fn wait_gate(
    gate: &mut Option<tokio::sync::watch::Receiver<bool>>,
    deadline: tokio::time::Instant,
    metrics: &Metrics,
) {
    if let Some(g) = gate.as_mut() {
        if !*g.borrow() {
            Metrics::add(&metrics.first_gate_waits, 1);
        }
        let _ = tokio::time::timeout_at(deadline, g.wait_for(|go| *go)).await;
    }
}

/// Whether whole-shard fetches may start: no gate, or it was opened, its holder went away, or
/// the deadline passed.
fn gate_open(gate: &Option<tokio::sync::watch::Receiver<bool>>, deadline: tokio::time::Instant) -> bool {
    match gate {
        None => true,
        Some(g) => *g.borrow() || g.has_changed().is_err() || tokio::time::Instant::now() >= deadline,
    }
}

#[cfg(test)]
mod tests {
    use super::buffered_by;
    use futures::StreamExt;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;

    /// The futures run at most `width` at once, `width` read anew as they end, and their
    /// outputs come in order.
    #[tokio::test]
    async fn buffered_by_follows_its_width_and_keeps_the_order() {
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let width = Arc::new(AtomicUsize::new(2));
        let (r, m) = (running.clone(), most.clone());
        let items = futures::stream::iter(0..40u64).map(move |i| {
            let (r, m) = (r.clone(), m.clone());
            async move {
                let now = r.fetch_add(1, SeqCst) + 1;
                m.fetch_max(now, SeqCst);
                // Later items end sooner: the order must still hold.
                tokio::time::sleep(std::time::Duration::from_millis(20 - i % 20)).await;
                r.fetch_sub(1, SeqCst);
                i
            }
        });
        let w = width.clone();
        let mut s = buffered_by(items, move || w.load(SeqCst));
        let mut out = Vec::new();
        while let Some(i) = s.next().await {
            if i == 9 {
                assert_eq!(most.swap(0, SeqCst), 2);
                width.store(6, SeqCst);
            }
            out.push(i);
        }
        assert_eq!(out, (0..40).collect::<Vec<_>>());
        assert_eq!(most.load(SeqCst), 6);
        // Nothing to run: the end at once, however wide.
        let mut empty = buffered_by(futures::stream::empty::<std::future::Ready<u8>>(), || 0);
        assert_eq!(empty.next().await, None);
    }
}
