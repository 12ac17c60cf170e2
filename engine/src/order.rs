//! Sample order: one global order per epoch, its split across ranks and workers, source
//! mixing, and the resume state. Everything here is a pure function; `docs/order.md` states
//! the algorithms.
//!
//! Nothing here holds one entry per sample: position `p` of an epoch maps to its sample
//! through keyed bijections computed on demand ([`Perm`], a Feistel network with cycle
//! walking), so the cost of starting an epoch does not grow with the dataset.
//!
//! The global order of an epoch depends only on the manifest versions, the mixing weights, the
//! seed, the epoch, the number of canonical partitions, the shuffle algorithm and its block and
//! window sizes. World size, workers per rank and batch size only change how that one sequence
//! is dealt out: position `p` of the (tail-adjusted) order goes to consumer `p mod C`, where
//! consumer `c = rank * workers + worker` and `C = world * workers`.

use crate::error::Invalid;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use crate::error::Result;

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

/// How many samples of one source an epoch takes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Weight {
    /// Every sample once.
    Natural,
    /// This source's share of the proportional sources' total (their natural sizes summed).
    Proportion(f64),
    /// `round(factor x size)` samples: 2.0 takes each sample twice, 0.5 half of them.
    Repeat(f64),
    /// Exactly this many samples.
    Count(u64),
}

/// One input source as the order sees it: its version and its shards' sample counts.
#[derive(Debug, Clone)]
pub struct SourceShape {
    /// Manifest version.
    pub version: String,
    /// Samples per shard, in manifest order, read on demand.
    pub counts: Arc<dyn ShardCounts>,
    /// Mixing weight.
    pub weight: Weight,
}

impl SourceShape {
    /// A source whose shards' sample counts are listed.
    pub fn listed(version: impl Into<String>, shard_samples: Vec<u64>, weight: Weight) -> SourceShape {
        SourceShape {
            version: version.into(),
            counts: Arc::new(CountList::new(shard_samples)),
            weight,
        }
    }
}

/// A source's shards' sample counts as the order reads them: on demand, so that an epoch over a
/// million shards reads only the counts it reaches (a manifest's shard table reads a block of
/// counts on first use, which can fail).
pub trait ShardCounts: Send + Sync + std::fmt::Debug {
    /// Number of shards.
    fn shards(&self) -> u64;
    /// Samples in all shards.
    fn total(&self) -> u64;
    /// Samples of shard `shard` (`shard < shards`).
    fn samples(&self, shard: u64) -> Result<u64>;
    /// The shard holding sample `o` of the source (`o < total`), and `o`'s index in it.
    fn locate(&self, o: u64) -> Result<(u64, u64)>;
}

/// Sample counts held in memory, with their prefix sums.
#[derive(Debug, Clone)]
pub struct CountList {
    /// Each shard's first sample, then the total (`shards + 1` entries).
    starts: Vec<u64>,
}

impl CountList {
    /// The counts `shard_samples`, in shard order (sums saturate).
    pub fn new(shard_samples: Vec<u64>) -> CountList {
        let mut starts = Vec::with_capacity(shard_samples.len() + 1);
        let mut acc = 0u64;
        starts.push(0);
        for n in shard_samples {
            acc = acc.saturating_add(n);
            starts.push(acc);
        }
        CountList { starts }
    }
}

impl ShardCounts for CountList {
    fn shards(&self) -> u64 {
        self.starts.len() as u64 - 1
    }
    fn total(&self) -> u64 {
        *self.starts.last().expect("at least the total")
    }
    fn samples(&self, shard: u64) -> Result<u64> {
        let i = shard as usize;
        Ok(self.starts[i + 1] - self.starts[i])
    }
    fn locate(&self, o: u64) -> Result<(u64, u64)> {
        let i = self.starts.partition_point(|&x| x <= o) - 1;
        Ok((i as u64, o - self.starts[i]))
    }
}

/// The parameters the global order is a function of (with the sources and the epoch).
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
    /// Refuses a topology no job can have, naming the field: no ranks or workers, a rank or
    /// worker past its count (which would read another consumer's samples twice), or counts
    /// whose product overflows.
    pub fn check(&self) -> crate::Result<()> {
        let bad = |what: &str, why: String| Err(crate::Error::invalid(format!("topology {what}"), why));
        if self.world == 0 {
            return bad("world_size", "must be at least 1, not 0".into());
        }
        if self.rank >= self.world {
            return bad(
                "rank",
                format!(
                    "{} is not below world_size {}: ranks are 0..world_size",
                    self.rank, self.world
                ),
            );
        }
        if self.workers == 0 || self.worker >= self.workers {
            return bad(
                "worker",
                format!(
                    "worker {} of {} workers: workers are 0..workers, at least one",
                    self.worker, self.workers
                ),
            );
        }
        if self.local_world == 0 || self.local_rank >= self.local_world {
            return bad(
                "local_rank",
                format!("{} of local_world {}", self.local_rank, self.local_world),
            );
        }
        if self
            .world
            .checked_mul(self.workers)
            .is_none_or(|c| c > u32::MAX as usize)
        {
            return bad(
                "world_size",
                format!("{} ranks x {} workers is too many consumers", self.world, self.workers),
            );
        }
        Ok(())
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

/// A contiguous run of samples of one shard of one source: the unit the order shuffles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    /// Stream index.
    pub source: usize,
    /// Shard index in the source's manifest.
    pub shard: usize,
    /// First sample (index inside the shard).
    pub first: u64,
    /// Number of samples.
    pub len: u64,
}

/// A sample's identity: its source (the input dataset of the mix), shard and index inside the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SampleRef {
    /// Source index (the input dataset of the mix).
    pub source: u32,
    /// Shard index.
    pub shard: u32,
    /// Sample index inside the shard.
    pub index: u32,
}

/// The version of the order's algorithms. A saved position names positions of one version's
/// order; under another version they would name other samples, so resuming across versions is
/// refused. Version 1 built each epoch's order as an array (ramjet before the lazy order);
/// version 2 computes it position by position (`docs/order.md`).
pub const ORDER_VERSION: u32 = 2;

/// The version a saved state without the field was written under.
pub(crate) fn order_version_1() -> u32 {
    1
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finalizer: a bijective 64-bit mix.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A key for one purpose (`tag`) and one instance (`x`) of it, from the epoch key.
pub fn derive(key: u64, tag: u64, x: u64) -> u64 {
    mix64(key.wrapping_add(mix64(tag.wrapping_mul(GOLDEN).wrapping_add(x))))
}

/// `v` scaled into `[0, n)` (the high word of `v * n`).
fn scale(v: u64, n: u64) -> u64 {
    ((v as u128 * n as u128) >> 64) as u64
}

/// Feistel rounds of [`Perm`].
const FEISTEL_ROUNDS: usize = 6;

/// A keyed bijection of `[0, n)`, computed on demand with no table: a balanced Feistel network
/// over the smallest even number of bits `2h >= 2` whose range holds `n`, walked in cycles
/// until the value falls inside `[0, n)` (fewer than 4 steps on average, as `4^h < 4n`).
#[derive(Debug, Clone, Copy)]
pub struct Perm {
    n: u64,
    half: u32,
    mask: u64,
    /// Round keys: `derive(key, 0xFE, i)` for round `i`.
    keys: [u64; FEISTEL_ROUNDS],
}

impl Perm {
    /// The permutation of `[0, n)` under `key`.
    pub fn new(n: u64, key: u64) -> Perm {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half = bits.div_ceil(2).max(1);
        Perm {
            n,
            half,
            mask: if half >= 64 { u64::MAX } else { (1u64 << half) - 1 },
            keys: std::array::from_fn(|i| derive(key, 0xFE, i as u64)),
        }
    }

    /// The domain's size.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether the domain is empty.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The image of `x` (`x < n`).
    pub fn apply(&self, mut x: u64) -> u64 {
        debug_assert!(x < self.n);
        if self.n <= 1 {
            return x;
        }
        loop {
            let (mut l, mut r) = (x >> self.half, x & self.mask);
            for k in self.keys {
                let f = mix64(r ^ k) & self.mask;
                (l, r) = (r, l ^ f);
            }
            x = (l << self.half) | r;
            if x < self.n {
                return x;
            }
        }
    }
}

/// The key every random choice of an epoch derives from.
pub fn epoch_key(sources: &[SourceShape], spec: &OrderSpec, epoch: u64) -> u64 {
    let mut s = format!("order=v{ORDER_VERSION};");
    for st in sources {
        s.push_str(&format!("{}:{:?};", st.version, st.weight));
    }
    s.push_str(&format!(
        "seed={};shuffle={:?};partitions={};epoch={epoch}",
        spec.seed, spec.shuffle, spec.partitions
    ));
    xxh3_64(s.as_bytes())
}

/// Positions of one epoch over `sources` before tail handling, or `None` when the sum overflows.
pub fn epoch_positions(sources: &[SourceShape]) -> Option<u64> {
    (0..sources.len()).try_fold(0u64, |acc, s| acc.checked_add(source_take(sources, s)))
}

/// Samples source `s` contributes to an epoch under its weight.
pub fn source_take(sources: &[SourceShape], s: usize) -> u64 {
    let size = |st: &SourceShape| st.counts.total();
    if size(&sources[s]) == 0 {
        // Nothing to take from, whatever the weight asks (a count of an empty source).
        return 0;
    }
    match sources[s].weight {
        Weight::Natural => size(&sources[s]),
        Weight::Count(n) => n,
        Weight::Repeat(f) => (f.max(0.0) * size(&sources[s]) as f64).round() as u64,
        Weight::Proportion(p) => {
            let (mut psum, mut total) = (0.0, 0u64);
            for st in sources {
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

/// One source's part of an epoch: `passes` full passes over its shards (one unit per shard,
/// empty shards included as empty units), then the remainder's units.
#[derive(Debug, Clone)]
struct StreamPart {
    /// The source's shards' sample counts.
    counts: Arc<dyn ShardCounts>,
    passes: u64,
    /// The remainder: whole shards in keyed order, the last cut short.
    rest: Vec<Unit>,
    /// Where each remainder unit starts inside the remainder (`rest.len() + 1` entries).
    rest_starts: Vec<u64>,
    /// First unit and first position of this source in the epoch.
    first_unit: u64,
    first_position: u64,
}

impl StreamPart {
    fn shards(&self) -> u64 {
        self.counts.shards()
    }
    fn size(&self) -> u64 {
        self.counts.total()
    }
    fn units(&self) -> u64 {
        self.passes * self.shards() + self.rest.len() as u64
    }
    fn samples(&self) -> u64 {
        self.passes * self.size() + self.rest_starts.last().copied().unwrap_or(0)
    }
}

/// One epoch's order, computed position by position: memory for the remainders, none per
/// shard or per sample (the shards' counts are read through [`ShardCounts`]). Every method is a pure function of the sources, the
/// order settings and the epoch (`docs/order.md`).
#[derive(Debug, Clone)]
pub struct EpochOrder {
    key: u64,
    spec: OrderSpec,
    parts: Vec<StreamPart>,
    units: u64,
    len: u64,
    /// The shard-block shuffle's unit permutation (and, for global, the sample permutation).
    perm: Perm,
}

impl EpochOrder {
    /// The order of `epoch` over `sources` under `spec`.
    pub fn new(sources: &[SourceShape], spec: &OrderSpec, epoch: u64) -> Result<EpochOrder> {
        let key = epoch_key(sources, spec, epoch);
        let (mut units, mut len) = (0u64, 0u64);
        let mut parts = Vec::with_capacity(sources.len());
        for (s, st) in sources.iter().enumerate() {
            let (size, want) = (st.counts.total(), source_take(sources, s));
            let (passes, mut rest_n) = want.checked_div(size).map_or((0, 0), |q| (q, want % size));
            let mut rest = Vec::new();
            let mut rest_starts = vec![0u64];
            if rest_n > 0 {
                let shards = st.counts.shards();
                let perm = Perm::new(shards, derive(key, 0x51, s as u64));
                let mut j = 0;
                while rest_n > 0 && j < shards {
                    let shard = perm.apply(j) as usize;
                    j += 1;
                    let n = st.counts.samples(shard as u64)?;
                    if n == 0 {
                        continue;
                    }
                    let take = n.min(rest_n);
                    let first = scale(derive(key, 0x52, s as u64), n - take + 1);
                    rest.push(Unit {
                        source: s,
                        shard,
                        first,
                        len: take,
                    });
                    rest_starts.push(rest_starts.last().expect("non-empty") + take);
                    rest_n -= take;
                }
            }
            let part = StreamPart {
                counts: st.counts.clone(),
                passes,
                rest,
                rest_starts,
                first_unit: units,
                first_position: len,
            };
            units += part.units();
            len += part.samples();
            parts.push(part);
        }
        let perm = match spec.shuffle {
            Shuffle::Global => Perm::new(len, derive(key, 0x61, 0)),
            _ => Perm::new(units, derive(key, 0x71, 0)),
        };
        Ok(EpochOrder {
            key,
            spec: *spec,
            parts,
            units,
            len,
            perm,
        })
    }

    /// Positions before tail handling (samples the epoch takes).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the epoch takes no sample.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Units of the epoch (before shuffling).
    pub fn units(&self) -> u64 {
        self.units
    }

    /// Unit `u` of the epoch, in unshuffled order.
    pub fn unit(&self, u: u64) -> Result<Unit> {
        let s = self.parts.partition_point(|p| p.first_unit <= u) - 1;
        let p = &self.parts[s];
        let i = u - p.first_unit;
        let full = p.passes * p.shards();
        Ok(if i < full {
            let shard = i % p.shards();
            Unit {
                source: s,
                shard: shard as usize,
                first: 0,
                len: p.counts.samples(shard)?,
            }
        } else {
            p.rest[(i - full) as usize]
        })
    }

    /// The sample at position `g` of the unshuffled order (`g < len`): sources in turn, each its
    /// full passes then its remainder.
    fn natural_at(&self, g: u64) -> Result<SampleRef> {
        let s = self.parts.partition_point(|p| p.first_position <= g) - 1;
        let p = &self.parts[s];
        let i = g - p.first_position;
        let (shard, index) = if i < p.passes * p.size() {
            let (shard, index) = p.counts.locate(i % p.size())?;
            (shard as usize, index)
        } else {
            let o = i - p.passes * p.size();
            let r = p.rest_starts.partition_point(|&x| x <= o) - 1;
            let u = &p.rest[r];
            (u.shard, u.first + (o - p.rest_starts[r]))
        };
        Ok(SampleRef {
            source: s as u32,
            shard: shard as u32,
            index: index as u32,
        })
    }

    /// The shard-block shuffle's parameters: units per window, samples per block, partitions.
    fn block(&self) -> Option<(u64, u64, u64)> {
        match self.spec.shuffle {
            Shuffle::ShardBlock {
                window_shards,
                block_samples,
            } => Some((
                window_shards.max(1) as u64,
                block_samples.max(1),
                self.spec.partitions.max(1) as u64,
            )),
            _ => None,
        }
    }

    /// A cursor over this order (cheap to make; each reader of the order keeps its own).
    pub fn cursor(self: &Arc<Self>) -> OrderCursor {
        OrderCursor {
            order: self.clone(),
            round: None,
        }
    }

    /// Units in one round of the shard-block shuffle (`partitions x window`).
    fn round_units(&self) -> u64 {
        self.block().map_or(1, |(w, _, p)| w.saturating_mul(p))
    }

    /// Samples in round `k` (the sum of its units' lengths).
    fn round_len(&self, k: u64) -> Result<u64> {
        let r = self.round_units();
        let lo = k * r;
        (lo..(lo + r).min(self.units)).try_fold(0u64, |a, j| Ok(a + self.unit(self.perm.apply(j))?.len))
    }

    /// Round `k` of the shard-block shuffle, starting at position `start`.
    fn round(&self, k: u64, start: u64) -> Result<Round> {
        let (w, b, p) = self.block().expect("shard-block order");
        let lo = k * w * p;
        let mut windows = Vec::with_capacity(p as usize);
        for part in 0..p {
            let mut units = Vec::new();
            let mut starts = vec![0u64];
            for t in 0..w {
                let j = lo + part + p * t;
                if j >= self.units {
                    break;
                }
                let u = self.unit(self.perm.apply(j))?;
                starts.push(starts.last().expect("non-empty") + u.len);
                units.push(u);
            }
            let len = *starts.last().expect("non-empty");
            let full = len / b;
            windows.push(Window {
                units,
                starts,
                len,
                blocks: Perm::new(full, derive(self.key, 0x72, k.wrapping_mul(p).wrapping_add(part))),
                block: b,
            });
        }
        let mut lens: Vec<u64> = windows.iter().map(|w| w.len).collect();
        lens.sort_unstable();
        let len = lens.iter().sum();
        Ok(Round {
            k,
            start,
            len,
            windows,
            sorted_lens: lens,
        })
    }
}

/// One window of one partition in a round: its units in order, their start inside the window,
/// and the keyed permutation of its full blocks.
#[derive(Debug, Clone)]
struct Window {
    units: Vec<Unit>,
    starts: Vec<u64>,
    len: u64,
    blocks: Perm,
    block: u64,
}

impl Window {
    /// The window's sample at index `i` of its shuffled sequence.
    fn at(&self, i: u64) -> Unit {
        let full = self.blocks.len() * self.block;
        let c = if i < full {
            self.blocks.apply(i / self.block) * self.block + i % self.block
        } else {
            i
        };
        let t = self.starts.partition_point(|&x| x <= c) - 1;
        let u = self.units[t];
        Unit {
            first: u.first + (c - self.starts[t]),
            len: 1,
            ..u
        }
    }
}

/// One round of the shard-block shuffle: window `k` of every partition, interleaved sample by
/// sample (an exhausted window drops out).
#[derive(Debug, Clone)]
struct Round {
    k: u64,
    start: u64,
    len: u64,
    windows: Vec<Window>,
    sorted_lens: Vec<u64>,
}

impl Round {
    /// The sample at index `i` of the round.
    fn at(&self, i: u64) -> Unit {
        let mut live = self.windows.len() as u64;
        let (mut prev, mut acc) = (0u64, 0u64);
        for (n, &l) in self.sorted_lens.iter().enumerate() {
            if l > prev {
                let seg = (l - prev) * live;
                if i < acc + seg {
                    let depth = prev + (i - acc) / live;
                    let nth = (i - acc) % live;
                    let w = self
                        .windows
                        .iter()
                        .filter(|w| w.len > depth)
                        .nth(nth as usize)
                        .expect("a live window");
                    return w.at(depth);
                }
                acc += seg;
                prev = l;
            }
            live = self.sorted_lens.len() as u64 - n as u64 - 1;
        }
        unreachable!("index {i} past the round's {} samples", self.len)
    }
}

/// A reader's position in an [`EpochOrder`]: it maps positions to samples, fastest when the
/// positions it is asked for rise (a shard-block cursor keeps its current round).
#[derive(Debug, Clone)]
pub struct OrderCursor {
    order: Arc<EpochOrder>,
    round: Option<Round>,
}

impl OrderCursor {
    /// The sample at position `g` of the tail-adjusted order (positions past the epoch's length
    /// repeat it from the start), and the group `g` lies in: the unit for `none`, the round for
    /// `shard-block`, 0 for `global`, counted on across repeats. A shard's samples inside one
    /// group are read together.
    pub fn at(&mut self, g: u64) -> Result<(SampleRef, u64)> {
        let o = &self.order;
        let n = o.len;
        assert!(n > 0, "position {g} of an empty order");
        let (wrap, g) = (g / n, g % n);
        match o.spec.shuffle {
            Shuffle::None => {
                let r = o.natural_at(g)?;
                let s = r.source as usize;
                let p = &o.parts[s];
                let i = g - p.first_position;
                let local = if i < p.passes * p.size() {
                    (i / p.size()) * p.shards() + r.shard as u64
                } else {
                    let o = i - p.passes * p.size();
                    p.passes * p.shards() + (p.rest_starts.partition_point(|&x| x <= o) - 1) as u64
                };
                Ok((r, wrap * o.units + p.first_unit + local))
            }
            Shuffle::Global => Ok((o.natural_at(o.perm.apply(g))?, wrap)),
            Shuffle::ShardBlock { .. } => {
                let rounds = o.units.div_ceil(o.round_units()).max(1);
                if self.round.as_ref().is_none_or(|r| g < r.start) {
                    self.round = Some(o.round(0, 0)?);
                }
                loop {
                    let r = self.round.as_ref().expect("set above");
                    if g < r.start + r.len {
                        break;
                    }
                    // Rounds passed over whole need only their length.
                    let (mut k, mut start) = (r.k + 1, r.start + r.len);
                    while k + 1 < rounds {
                        let l = o.round_len(k)?;
                        if g < start + l {
                            break;
                        }
                        start += l;
                        k += 1;
                    }
                    self.round = Some(o.round(k, start)?);
                }
                let r = self.round.as_ref().expect("set above");
                let u = r.at(g - r.start);
                let id = SampleRef {
                    source: u.source as u32,
                    shard: u.shard as u32,
                    index: u.first as u32,
                };
                Ok((id, wrap * rounds + r.k))
            }
        }
    }
}

/// The global order of one epoch as an array, before tail handling. It holds every position:
/// for tests and small datasets. Streams use [`EpochOrder`] and an [`OrderCursor`].
pub fn global_order(sources: &[SourceShape], spec: &OrderSpec, epoch: u64) -> Result<Vec<SampleRef>> {
    let order = Arc::new(EpochOrder::new(sources, spec, epoch)?);
    let mut c = order.cursor();
    (0..order.len()).map(|g| Ok(c.at(g)?.0)).collect()
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
    pub fn validate(&self, len: u64) -> std::result::Result<(), Invalid> {
        if self.consumed > len {
            return Err(Invalid::from(format!(
                "consumed {} exceeds the epoch's {len} positions",
                self.consumed
            )));
        }
        let mut prev: Option<u64> = None;
        for &a in &self.ahead {
            if a < self.consumed || a >= len || prev.is_some_and(|p| a <= p) {
                return Err(Invalid::from(format!(
                    "position {a} in `ahead` is out of order or outside [{}, {len})",
                    self.consumed
                )));
            }
            prev = Some(a);
        }
        Ok(())
    }

    /// Positions not yet delivered for an order of `len` positions.
    pub fn remaining_len(&self, len: u64) -> u64 {
        len.saturating_sub(self.consumed)
            .saturating_sub(self.ahead.len() as u64)
    }

    /// The `i`-th position not yet delivered (`i < remaining_len`): `[consumed, len)` with the
    /// `ahead` positions skipped.
    pub fn remaining_at(&self, i: u64) -> u64 {
        let mut x = self.consumed + i;
        for &a in &self.ahead {
            if a <= x {
                x += 1;
            } else {
                break;
            }
        }
        x
    }

    /// Positions not yet delivered, in order, for an order of `len` positions.
    pub fn remaining(&self, len: u64) -> impl Iterator<Item = u64> + '_ {
        (0..self.remaining_len(len)).map(|i| self.remaining_at(i))
    }

    /// The deal of consumer `c` of `consumers` from here on: every `consumers`-th remaining
    /// position, starting at the `c`-th.
    pub fn deal(&self, len: u64, consumer: usize, consumers: usize) -> Deal {
        let consumers = consumers.max(1) as u64;
        let rem = self.remaining_len(len);
        let c = consumer as u64;
        Deal {
            progress: Arc::new(self.clone()),
            consumer: c,
            consumers,
            count: if rem > c { (rem - c).div_ceil(consumers) } else { 0 },
        }
    }

    /// The positions consumer `c` of `consumers` reads from here on, as an array (for tests
    /// and small orders; streams use [`EpochProgress::deal`]).
    pub fn positions_for(&self, len: u64, consumer: usize, consumers: usize) -> Vec<u64> {
        let d = self.deal(len, consumer, consumers);
        (0..d.len()).map(|k| d.position(k)).collect()
    }

    /// The progress after consumer `c` (of `consumers`, dealt from `self`) delivered
    /// `delivered[c]` of its positions, for every `c`. Work and memory grow with `ahead` and
    /// the spread between consumers, not with the epoch.
    pub fn advance(&self, len: u64, delivered: &[u64]) -> EpochProgress {
        let cs = delivered.len().max(1) as u64;
        let rem = self.remaining_len(len);
        // The first remaining index not delivered: consumer c's next index is delivered[c]*C+c.
        let first_open = (0..delivered.len() as u64)
            .map(|c| delivered[c as usize].saturating_mul(cs).saturating_add(c))
            .filter(|&i| i < rem)
            .min();
        let consumed = first_open.map_or(len, |i| self.remaining_at(i));
        let mut ahead: Vec<u64> = self.ahead.iter().copied().filter(|&a| a >= consumed).collect();
        if let Some(f) = first_open {
            for c in 0..cs {
                let k_min = if c > f { 0 } else { (f - c) / cs + 1 };
                for k in k_min..delivered[c as usize] {
                    let i = c + k * cs;
                    if i < rem {
                        ahead.push(self.remaining_at(i));
                    }
                }
            }
        }
        ahead.sort_unstable();
        EpochProgress {
            epoch: self.epoch,
            consumed,
            ahead,
        }
    }
}

/// One consumer's positions in an epoch, computed on demand: its `k`-th position is remaining
/// position `c + k * C` of the progress it was dealt from.
#[derive(Debug, Clone)]
pub struct Deal {
    progress: Arc<EpochProgress>,
    consumer: u64,
    consumers: u64,
    count: u64,
}

impl Deal {
    /// Positions dealt.
    pub fn len(&self) -> u64 {
        self.count
    }

    /// Whether none was dealt.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The `k`-th position of the deal (`k < len`).
    pub fn position(&self, k: u64) -> u64 {
        self.progress.remaining_at(self.consumer + k * self.consumers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(shards: &[u64]) -> Vec<SourceShape> {
        vec![SourceShape::listed("v", shards.to_vec(), Weight::Natural)]
    }

    fn global_order(sources: &[SourceShape], spec: &OrderSpec, epoch: u64) -> Vec<SampleRef> {
        super::global_order(sources, spec, epoch).unwrap()
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
        st.push(SourceShape::listed("w", vec![5, 5, 5], Weight::Repeat(2.0)));
        st.push(SourceShape::listed("x", vec![100], Weight::Count(7)));
        let o = global_order(&st, &OrderSpec::default(), 3);
        let count = |s| o.iter().filter(|r| r.source == s).count();
        assert_eq!((count(0), count(1), count(2)), (20, 30, 7));
        let st2 = vec![
            SourceShape::listed("a", vec![100], Weight::Proportion(3.0)),
            SourceShape::listed("b", vec![100], Weight::Proportion(1.0)),
        ];
        assert_eq!((source_take(&st2, 0), source_take(&st2, 1)), (150, 50));
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
