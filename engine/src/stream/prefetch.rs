//! The prefetcher: one task per stream that plans each epoch and fetches whole shards in
//! first-use order, at most `prefetch_bytes_max` ahead of the consumer; at the start of a
//! stream it first reads the first samples one by one. Everything the consumer gets comes
//! from here, down one channel: the plan, then those samples, then whole shards.

use super::*;

pub(super) async fn prefetcher(
    shared: Arc<Shared>,
    start: EpochProgress,
    mut skip: usize,
    tx: mpsc::Sender<Msg>,
    per_sample: bool,
    mut ranged_budget: usize,
    mut gate: Option<tokio::sync::watch::Receiver<bool>>,
) {
    let mut base = start;
    loop {
        let epoch = base.epoch;
        if shared.cfg.epochs.is_some_and(|n| epoch >= n) {
            return;
        }
        let plan = Arc::new(plan_epoch(&shared, epoch, base, std::mem::take(&mut skip)));
        // Shards in order of first use, with their use counts.
        let mut first_use: Vec<(u32, u32)> = Vec::new();
        let mut uses: HashMap<(u32, u32), u64> = HashMap::new();
        for &p in &plan.positions[plan.skip..] {
            let r = at_position(&plan.order, p);
            let n = uses.entry((r.stream, r.shard)).or_insert(0);
            if *n == 0 {
                first_use.push((r.stream, r.shard));
            }
            *n += 1;
        }
        if tx.send(Msg::Epoch(plan.clone())).await.is_err() {
            return;
        }
        // Samples read one by one need whole shards only to warm the disk cache; without a
        // cache, fetching them would double the origin traffic for nothing.
        let first_use = if per_sample && shared.cache.is_none() {
            Vec::new()
        } else {
            first_use
        };
        let in_flight = shared.cfg.shards_in_flight_max.max(1);
        let sh = shared.clone();
        let mut start_fetches = Some(move || {
            stream::iter(first_use)
                .map(move |(s, shard)| {
                    let shared = sh.clone();
                    async move { ((s, shard), fetch_shard(shared, s as usize, shard as usize).await) }
                })
                .buffered(in_flight)
        });
        let mut fetched = None;
        // The first samples, one by one, while the first whole shards download.
        let ranged = std::mem::take(&mut ranged_budget);
        let (ranged_uses, head) = match ranged {
            0 => (HashMap::new(), None),
            n => {
                let first = FirstSamples {
                    plan: &plan,
                    budget: n,
                    gate: gate.take(),
                };
                match first.run(&shared, &tx, &mut start_fetches, &mut fetched).await {
                    Some(r) => r,
                    None => return,
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
            let Some(((s, sh), res)) = item else { break };
            let failed = res.is_err();
            let msg = if per_sample {
                // The consumer reads samples one by one; the fetch only warmed the disk cache.
                match res {
                    Ok(_) => continue,
                    Err(e) => Msg::Shard {
                        key: (epoch, s, sh),
                        uses: 0,
                        bytes: Err(e),
                    },
                }
            } else {
                Msg::Shard {
                    key: (epoch, s, sh),
                    uses: uses[&(s, sh)] - ranged_uses.get(&(s, sh)).copied().unwrap_or(0),
                    bytes: res,
                }
            };
            if tx.send(msg).await.is_err() || failed {
                return;
            }
        }
        base = EpochProgress {
            epoch: epoch + 1,
            consumed: 0,
            ahead: Vec::new(),
        };
    }
}

/// The first samples of a stream, read one by one (from the disk cache, or with two ranged
/// GETs each) in batches of [`RANGED_AHEAD_MAX`], so the first batch costs a few GET latencies
/// rather than a whole shard's download.
struct FirstSamples<'a> {
    plan: &'a EpochPlan,
    /// Samples that may be read this way.
    budget: usize,
    /// Held by a consumer with work of its own before its first output (the loader decodes
    /// its first batch): whole-shard fetches wait until it opens, at most [`FIRST_GATE_MAX`].
    gate: Option<tokio::sync::watch::Receiver<bool>>,
}

impl FirstSamples<'_> {
    /// Sends batches of samples read one by one, from the cursor on, until the budget is
    /// spent or the first whole shard arrives (it is then returned, to be sent next, and a
    /// batch still being read is dropped: its samples come with their shards). Whole
    /// shards start after the first batch (once the gate, if any, opens). Returns the uses of
    /// each shard delivered this way; `None` when the consumer went away.
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
        let positions = &plan.positions[plan.skip..];
        let deadline = tokio::time::Instant::now() + FIRST_GATE_MAX;
        let mut gate = self.gate;
        let mut budget = self.budget;
        let mut taken = 0;
        let mut ranged_uses: HashMap<(u32, u32), u64> = HashMap::new();
        let mut head = None;
        while budget > 0 && taken < positions.len() && head.is_none() {
            if fetched.is_none() && taken > 0 && gate_open(&gate, deadline) {
                *fetched = start_fetches.take().map(|f| f());
            }
            let n = RANGED_AHEAD_MAX.min(budget).min(positions.len() - taken);
            let batch = &positions[taken..taken + n];
            let ids: Vec<SampleRef> = batch.iter().map(|&p| at_position(&plan.order, p)).collect();
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
            for id in &ids {
                *ranged_uses.entry((id.stream, id.shard)).or_default() += 1;
            }
            let msg = Msg::Samples {
                epoch: plan.epoch,
                samples: batch.iter().copied().zip(records).collect(),
                from_origin,
            };
            if tx.send(msg).await.is_err() {
                return None;
            }
            budget -= n;
            taken += n;
        }
        if fetched.is_none() {
            if let Some(g) = gate.as_mut() {
                // A dropped sender (the consumer went away) opens the gate too.
                let _ = tokio::time::timeout_at(deadline, g.wait_for(|go| *go)).await;
            }
            *fetched = start_fetches.take().map(|f| f());
        }
        Some((ranged_uses, head))
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
