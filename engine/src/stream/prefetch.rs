//! The prefetcher: one task per stream that plans each epoch and fetches whole shards in
//! first-use order, at most `prefetch_bytes_max` ahead of the consumer.

use super::*;

pub(super) async fn prefetcher(
    shared: Arc<Shared>,
    start: EpochProgress,
    mut skip: usize,
    tx: mpsc::Sender<Msg>,
    per_sample: bool,
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
        let fetches = stream::iter(first_use).map(|(s, sh)| {
            let shared = shared.clone();
            async move { ((s, sh), fetch_shard(shared, s as usize, sh as usize).await) }
        });
        if let Some(mut g) = gate.take() {
            // The consumer reads the first batch's samples with small ranged GETs first; a
            // dropped sender (the stream went away) opens the gate too.
            let _ = tokio::time::timeout(FIRST_GATE_MAX, g.wait_for(|go| *go)).await;
        }
        let mut fetched = fetches.buffered(shared.cfg.shards_in_flight_max.max(1));
        while let Some(((s, sh), res)) = fetched.next().await {
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
                    uses: uses[&(s, sh)],
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
