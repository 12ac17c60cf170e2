//! Sample order: one global order per epoch, its split across ranks and workers, stream
//! mixing, and the resume state. Everything here is a pure function; `docs/order.md` states
//! the algorithms.
//!
//! The global order of an epoch depends only on the manifest versions, the mixing weights, the
//! seed, the epoch, the number of canonical partitions, the shuffle algorithm and its block and
//! window sizes. World size, workers per rank and batch size only change how that one sequence
//! is dealt out: position `p` of the (tail-adjusted) order goes to consumer `p mod C`, where
//! consumer `c = rank * workers + worker` and `C = world * workers`.

use xxhash_rust::xxh3::xxh3_64;

/// How samples are shuffled within an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Shuffle {
    /// Shards and samples in manifest order.
    None,
    /// Locality-preserving: shard order is shuffled; shards are dealt to canonical partitions
    /// and grouped into windows of `window_shards`; inside a window, blocks of `block_samples`
    /// consecutive samples are shuffled. A reader has at most `partitions x window_shards`
    /// shards live at once.
    ShardBlock {
        /// Shards per window.
        window_shards: usize,
        /// Consecutive samples that stay together.
        block_samples: u64,
    },
    /// A full permutation of every sample of the epoch.
    Global,
}

/// What happens when the epoch does not divide evenly across consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tail {
    /// Every sample exactly once; consumers may differ by one sample.
    Uneven,
    /// Drop the last `len mod C` samples of the order, so every consumer gets the same count.
    DropLast,
    /// Repeat the first samples of the order until every consumer gets the same count.
    PadRepeat,
}

/// How many samples of one stream an epoch takes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Weight {
    /// Every sample once.
    Natural,
    /// This stream's share of the proportional streams' total (their natural sizes summed).
    Proportion(f64),
    /// `round(factor x size)` samples: 2.0 takes each sample twice, 0.5 half of them.
    Repeat(f64),
    /// Exactly this many samples.
    Count(u64),
}

/// One input stream as the order sees it: its version and its shards' sample counts.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamShape {
    /// Manifest version.
    pub version: String,
    /// Samples per shard, in manifest order.
    pub shard_samples: Vec<u64>,
    /// Mixing weight.
    pub weight: Weight,
}

/// The parameters the global order is a function of (with the streams and the epoch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OrderSpec {
    /// Seed.
    pub seed: u64,
    /// Shuffle algorithm.
    pub shuffle: Shuffle,
    /// Canonical partitions: shuffled orders interleave this many independent sub-orders.
    pub partitions: usize,
    /// Tail handling.
    pub tail: Tail,
}

impl Default for OrderSpec {
    fn default() -> Self {
        Self {
            seed: 0,
            shuffle: Shuffle::ShardBlock {
                window_shards: 4,
                block_samples: 1,
            },
            partitions: 1,
            tail: Tail::Uneven,
        }
    }
}

/// Which consumer of the job this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Topology {
    /// Rank of this process.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Worker index inside the rank.
    pub worker: usize,
    /// Workers per rank.
    pub workers: usize,
    /// Rank of this process among those on its host (`LOCAL_RANK`). It does not change the
    /// deal; it tells the host's processes apart (which one hosts the embedded cache daemon).
    #[serde(default)]
    pub local_rank: usize,
    /// Processes on this host (`LOCAL_WORLD_SIZE`).
    #[serde(default = "one")]
    pub local_world: usize,
}

fn one() -> usize {
    1
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            rank: 0,
            world: 1,
            worker: 0,
            workers: 1,
            local_rank: 0,
            local_world: 1,
        }
    }
}

impl Topology {
    /// Rank and world from `RANK` / `WORLD_SIZE`, host-local rank and size from `LOCAL_RANK` /
    /// `LOCAL_WORLD_SIZE` (as torchrun sets them), one worker.
    pub fn from_env() -> Topology {
        let get = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
        let world = get("WORLD_SIZE").unwrap_or(1).max(1);
        let local_world = get("LOCAL_WORLD_SIZE").unwrap_or(1).max(1);
        Topology {
            rank: get("RANK").unwrap_or(0).min(world - 1),
            world,
            worker: 0,
            workers: 1,
            local_rank: get("LOCAL_RANK").unwrap_or(0).min(local_world - 1),
            local_world,
        }
    }

    /// This consumer's index, `rank * workers + worker`.
    pub fn consumer(&self) -> usize {
        self.rank * self.workers + self.worker
    }

    /// Consumers in the job, `world * workers`.
    pub fn consumers(&self) -> usize {
        self.world * self.workers
    }
}

/// A contiguous run of samples of one shard of one stream: the unit the order shuffles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// Stream index.
    pub stream: usize,
    /// Shard index in the stream's manifest.
    pub shard: usize,
    /// First sample (index inside the shard).
    pub first: u64,
    /// Number of samples.
    pub len: u64,
}

/// A sample's identity: stream, shard and index inside the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SampleRef {
    /// Stream index.
    pub stream: u32,
    /// Shard index.
    pub shard: u32,
    /// Sample index inside the shard.
    pub index: u32,
}

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn new(key: u64, purpose: u64) -> Rng {
        Rng(key ^ purpose.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, n) (Lemire's multiply-shift; the tiny bias is irrelevant here).
    fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// The key every random choice of an epoch derives from.
pub fn epoch_key(streams: &[StreamShape], spec: &OrderSpec, epoch: u64) -> u64 {
    let mut s = String::new();
    for st in streams {
        s.push_str(&format!("{}:{:?};", st.version, st.weight));
    }
    s.push_str(&format!(
        "seed={};shuffle={:?};partitions={};epoch={epoch}",
        spec.seed, spec.shuffle, spec.partitions
    ));
    xxh3_64(s.as_bytes())
}

/// The most positions one epoch's order may hold: the order is built in memory, 16 bytes a
/// position (`Stream::open` refuses a larger epoch with an error, never an allocation failure).
pub const ORDER_POSITIONS_MAX: u64 = 1 << 32;

/// Positions of one epoch over `streams` before tail handling, or `None` when the sum overflows.
pub fn epoch_positions(streams: &[StreamShape]) -> Option<u64> {
    (0..streams.len()).try_fold(0u64, |acc, s| acc.checked_add(stream_take(streams, s)))
}

/// Samples stream `s` contributes to an epoch under its weight.
pub fn stream_take(streams: &[StreamShape], s: usize) -> u64 {
    let size = |st: &StreamShape| st.shard_samples.iter().fold(0u64, |a, &n| a.saturating_add(n));
    match streams[s].weight {
        Weight::Natural => size(&streams[s]),
        Weight::Count(n) => n,
        Weight::Repeat(f) => (f.max(0.0) * size(&streams[s]) as f64).round() as u64,
        Weight::Proportion(p) => {
            let (mut psum, mut total) = (0.0, 0u64);
            for st in streams {
                if let Weight::Proportion(q) = st.weight {
                    psum += q.max(0.0);
                    total = total.saturating_add(size(st));
                }
            }
            if psum <= 0.0 {
                0
            } else {
                (p.max(0.0) / psum * total as f64).round() as u64
            }
        }
    }
}

/// The units of one epoch after mixing: full passes over each stream, then a seeded choice of
/// whole shards (the last one cut short) for the remainder.
pub fn epoch_units(streams: &[StreamShape], key: u64) -> Vec<Unit> {
    let mut units = Vec::new();
    for (s, st) in streams.iter().enumerate() {
        let size: u64 = st.shard_samples.iter().fold(0u64, |a, &n| a.saturating_add(n));
        let want = stream_take(streams, s);
        if size == 0 || want == 0 {
            continue;
        }
        let all = |units: &mut Vec<Unit>| {
            for (shard, &n) in st.shard_samples.iter().enumerate() {
                if n > 0 {
                    units.push(Unit {
                        stream: s,
                        shard,
                        first: 0,
                        len: n,
                    });
                }
            }
        };
        for _ in 0..want / size {
            all(&mut units);
        }
        let mut rest = want % size;
        if rest > 0 {
            let mut rng = Rng::new(key, 0x51 + s as u64);
            let mut shards: Vec<usize> = (0..st.shard_samples.len()).collect();
            rng.shuffle(&mut shards);
            for shard in shards {
                let n = st.shard_samples[shard];
                if n == 0 {
                    continue;
                }
                let take = n.min(rest);
                let first = rng.below(n - take + 1);
                units.push(Unit {
                    stream: s,
                    shard,
                    first,
                    len: take,
                });
                rest -= take;
                if rest == 0 {
                    break;
                }
            }
        }
    }
    units
}

/// The global order of one epoch, before tail handling.
pub fn global_order(streams: &[StreamShape], spec: &OrderSpec, epoch: u64) -> Vec<SampleRef> {
    let key = epoch_key(streams, spec, epoch);
    let mut units = epoch_units(streams, key);
    let expand = |u: &Unit, out: &mut Vec<SampleRef>| {
        for i in u.first..u.first + u.len {
            out.push(SampleRef {
                stream: u.stream as u32,
                shard: u.shard as u32,
                index: i as u32,
            });
        }
    };
    let total: u64 = units.iter().map(|u| u.len).sum();
    let mut out = Vec::with_capacity(total as usize);
    match spec.shuffle {
        Shuffle::None => {
            for u in &units {
                expand(u, &mut out);
            }
        }
        Shuffle::Global => {
            for u in &units {
                expand(u, &mut out);
            }
            Rng::new(key, 0x61).shuffle(&mut out);
        }
        Shuffle::ShardBlock {
            window_shards,
            block_samples,
        } => {
            let (w, b, p) = (window_shards.max(1), block_samples.max(1), spec.partitions.max(1));
            let mut rng = Rng::new(key, 0x71);
            rng.shuffle(&mut units);
            // Deal units to partitions round robin, then order each partition by windows.
            let mut parts: Vec<Vec<SampleRef>> = vec![Vec::new(); p];
            for (pi, part) in parts.iter_mut().enumerate() {
                let mine: Vec<&Unit> = units.iter().skip(pi).step_by(p).collect();
                for window in mine.chunks(w) {
                    let mut blocks: Vec<Unit> = Vec::new();
                    for u in window {
                        let mut f = u.first;
                        while f < u.first + u.len {
                            let len = b.min(u.first + u.len - f);
                            blocks.push(Unit { first: f, len, ..**u });
                            f += len;
                        }
                    }
                    rng.shuffle(&mut blocks);
                    for blk in &blocks {
                        expand(blk, part);
                    }
                }
            }
            // Interleave the partitions sample by sample; exhausted ones drop out.
            let mut cursors = vec![0usize; p];
            let mut live = p;
            while live > 0 {
                live = 0;
                for (pi, part) in parts.iter().enumerate() {
                    if cursors[pi] < part.len() {
                        out.push(part[cursors[pi]]);
                        cursors[pi] += 1;
                        live += 1;
                    }
                }
            }
        }
    }
    out
}

/// Length of the order after tail handling for `consumers` consumers.
pub fn effective_len(n: u64, consumers: u64, tail: Tail) -> u64 {
    let c = consumers.max(1);
    match tail {
        Tail::Uneven => n,
        Tail::DropLast => n - n % c,
        Tail::PadRepeat => {
            if n == 0 {
                0
            } else {
                n.div_ceil(c) * c
            }
        }
    }
}

/// The sample at position `p` of the tail-adjusted order (padding repeats from the start).
pub fn at_position(order: &[SampleRef], p: u64) -> SampleRef {
    order[(p % order.len() as u64) as usize]
}

/// Where a job stands in one epoch: every position below `consumed` was delivered, and so was
/// each position in `ahead`. Positions index the tail-adjusted global order, so the state means
/// the same thing for any topology.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct EpochProgress {
    /// Epoch.
    pub epoch: u64,
    /// All positions below this were delivered.
    pub consumed: u64,
    /// Delivered positions at or above `consumed`, sorted.
    pub ahead: Vec<u64>,
}

impl EpochProgress {
    /// Checks the progress against an order of `len` positions: `consumed <= len`, and `ahead`
    /// strictly increasing inside `[consumed, len)`. Saved state can be edited or damaged: a
    /// bad one must be refused, not silently end an epoch short.
    pub fn validate(&self, len: u64) -> std::result::Result<(), String> {
        if self.consumed > len {
            return Err(format!(
                "consumed {} exceeds the epoch's {len} positions",
                self.consumed
            ));
        }
        let mut prev: Option<u64> = None;
        for &a in &self.ahead {
            if a < self.consumed || a >= len || prev.is_some_and(|p| a <= p) {
                return Err(format!(
                    "position {a} in `ahead` is out of order or outside [{}, {len})",
                    self.consumed
                ));
            }
            prev = Some(a);
        }
        Ok(())
    }

    /// Positions not yet delivered, in order, for an order of `len` positions.
    pub fn remaining(&self, len: u64) -> impl Iterator<Item = u64> + '_ {
        let mut ahead = self.ahead.iter().peekable();
        (self.consumed..len).filter(move |p| {
            while ahead.peek().is_some_and(|&&a| a < *p) {
                ahead.next();
            }
            if ahead.peek() == Some(&p) {
                ahead.next();
                return false;
            }
            true
        })
    }

    /// The positions consumer `c` of `consumers` reads from here on: every `consumers`-th
    /// remaining position, starting at the `c`-th.
    pub fn positions_for(&self, len: u64, consumer: usize, consumers: usize) -> Vec<u64> {
        self.remaining(len).skip(consumer).step_by(consumers.max(1)).collect()
    }

    /// The progress after consumer `c` (of `consumers`, dealt from `self`) delivered
    /// `delivered[c]` of its positions, for every `c`.
    pub fn advance(&self, len: u64, delivered: &[u64]) -> EpochProgress {
        let consumers = delivered.len().max(1);
        let rem: Vec<u64> = self.remaining(len).collect();
        let done = |i: usize| ((i / consumers) as u64) < delivered[i % consumers];
        let first_open = (0..rem.len()).find(|&i| !done(i));
        let consumed = first_open.map(|i| rem[i]).unwrap_or(len);
        let mut ahead: Vec<u64> = self.ahead.iter().copied().filter(|&a| a >= consumed).collect();
        if let Some(f) = first_open {
            ahead.extend((f + 1..rem.len()).filter(|&i| done(i)).map(|i| rem[i]));
        }
        ahead.sort_unstable();
        EpochProgress {
            epoch: self.epoch,
            consumed,
            ahead,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(shards: &[u64]) -> Vec<StreamShape> {
        vec![StreamShape {
            version: "v".into(),
            shard_samples: shards.to_vec(),
            weight: Weight::Natural,
        }]
    }

    #[test]
    fn every_shuffle_is_a_permutation_and_depends_on_epoch() {
        let st = shape(&[7, 9, 3, 10, 5]);
        for shuffle in [
            Shuffle::None,
            Shuffle::Global,
            Shuffle::ShardBlock {
                window_shards: 2,
                block_samples: 3,
            },
        ] {
            let spec = OrderSpec {
                shuffle,
                partitions: 2,
                ..Default::default()
            };
            let a = global_order(&st, &spec, 0);
            let mut s = a.clone();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), 34, "{shuffle:?}");
            if shuffle != Shuffle::None {
                assert_ne!(a, global_order(&st, &spec, 1), "{shuffle:?}");
            }
            assert_eq!(a, global_order(&st, &spec, 0));
        }
    }

    #[test]
    fn shard_block_keeps_few_shards_live() {
        let st = shape(&[50; 20]);
        let spec = OrderSpec {
            shuffle: Shuffle::ShardBlock {
                window_shards: 3,
                block_samples: 1,
            },
            partitions: 1,
            ..Default::default()
        };
        let o = global_order(&st, &spec, 0);
        for w in o.chunks(150) {
            let mut shards: Vec<u32> = w.iter().map(|r| r.shard).collect();
            shards.sort();
            shards.dedup();
            assert!(shards.len() <= 3, "window touches {} shards", shards.len());
        }
    }

    #[test]
    fn mixing_weights() {
        let mut st = shape(&[10, 10]);
        st.push(StreamShape {
            version: "w".into(),
            shard_samples: vec![5, 5, 5],
            weight: Weight::Repeat(2.0),
        });
        st.push(StreamShape {
            version: "x".into(),
            shard_samples: vec![100],
            weight: Weight::Count(7),
        });
        let o = global_order(&st, &OrderSpec::default(), 3);
        let count = |s| o.iter().filter(|r| r.stream == s).count();
        assert_eq!((count(0), count(1), count(2)), (20, 30, 7));
        let st2 = vec![
            StreamShape {
                version: "a".into(),
                shard_samples: vec![100],
                weight: Weight::Proportion(3.0),
            },
            StreamShape {
                version: "b".into(),
                shard_samples: vec![100],
                weight: Weight::Proportion(1.0),
            },
        ];
        assert_eq!((stream_take(&st2, 0), stream_take(&st2, 1)), (150, 50));
    }

    #[test]
    fn progress_advance_and_resume_with_another_topology() {
        let len = 23;
        let start = EpochProgress::default();
        // Three consumers delivered 4, 3 and 4 of their positions.
        let p = start.advance(len, &[4, 3, 4]);
        assert_eq!(p.consumed, 10); // position 10 = consumer 1's 4th, not delivered
        assert_eq!(p.ahead, vec![11]);
        // Resume with two consumers: they cover exactly the rest, once.
        let mut rest: Vec<u64> = (0..2).flat_map(|c| p.positions_for(len, c, 2)).collect();
        rest.sort();
        let want: Vec<u64> = (10..23).filter(|&x| x != 11).collect();
        assert_eq!(rest, want);
    }
}
