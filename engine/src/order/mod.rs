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

mod deal;
mod round_units;
mod rows;
mod select;

pub use deal::{effective_len, Deal, DealRule, EpochProgress};
pub use select::{KeptBits, Selected};
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

/// Whether a node reads the same shards every epoch under a node-affine deal (`docs/order.md`,
/// "Later epochs"). Only the shard-block shuffle has rounds to fix; the others ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shares {
    /// Each epoch draws its rounds afresh: which shards a partition (so a node) reads changes
    /// from epoch to epoch, and a node's later epochs come from its peers' caches.
    #[default]
    Rotate,
    /// The rounds' shards are drawn once per seed: every partition reads the same shards every
    /// epoch, so a node whose share fits its cache reads only its own disk after the first
    /// epoch. The order of the rounds and the blocks inside each window are drawn per epoch.
    Sticky,
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
    /// The index in shard `shard` of its `k`-th counted sample: `k` itself unless the counts
    /// are a selection ([`Selected`]) that drops some of the shard's samples.
    fn real(&self, _shard: u64, k: u64) -> u64 {
        k
    }
    /// `(c, last)` when every shard but the last holds `c` samples and the last `last`, known
    /// without reading (a uniform shard table): a round's units are then arithmetic.
    fn uniform(&self) -> Option<(u64, u64)> {
        None
    }
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
    /// Whether the shard-block rounds are drawn per epoch or once per seed.
    #[serde(default)]
    pub shares: Shares,
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
            shares: Shares::Rotate,
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

    /// Nodes of the job: `world / local_world` when every host runs `local_world` ranks (ranks
    /// numbered host by host, as torchrun and Slurm's block distribution number them), else 1.
    pub fn nodes(&self) -> usize {
        if self.local_world > 0 && self.world % self.local_world == 0 {
            self.world / self.local_world
        } else {
            1
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
/// version 2 computes it position by position; version 3 deals the shard-block shuffle's rounds
/// into rows of equal partitions, so a node can read only its partitions (`docs/order.md`);
/// version 4 pads a partitioned order column by column, so padding stays on a node's shards.
pub const ORDER_VERSION: u32 = 4;

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
            x = self.pass(x);
            if x < self.n {
                return x;
            }
        }
    }

    /// [`apply`](Self::apply) of every value of `xs`, in place (each below `n`): the same
    /// images, walked a pass at a time over all the values still outside `[0, n)`, so the
    /// passes of different values overlap in the CPU where one value's walk is a chain of
    /// dependent multiplications and a branch each step.
    pub fn apply_all(&self, xs: &mut [u64]) {
        if self.n <= 1 {
            return;
        }
        let mut left: Vec<usize> = (0..xs.len()).collect();
        while !left.is_empty() {
            let mut kept = 0;
            for k in 0..left.len() {
                let i = left[k];
                xs[i] = self.pass(xs[i]);
                // Branch-free compaction: the index stays when its value is still outside.
                left[kept] = i;
                kept += usize::from(xs[i] >= self.n);
            }
            left.truncate(kept);
        }
    }

    /// The preimage of `y` (`y < n`): `apply(invert(y)) == y`.
    pub fn invert(&self, mut y: u64) -> u64 {
        debug_assert!(y < self.n);
        if self.n <= 1 {
            return y;
        }
        loop {
            let (mut l, mut r) = (y >> self.half, y & self.mask);
            for &k in self.keys.iter().rev() {
                let f = mix64(l ^ k) & self.mask;
                (l, r) = (r ^ f, l);
            }
            y = (l << self.half) | r;
            if y < self.n {
                return y;
            }
        }
    }

    /// One pass of the Feistel network over `[0, 4^half)`.
    fn pass(&self, x: u64) -> u64 {
        let (mut l, mut r) = (x >> self.half, x & self.mask);
        for k in self.keys {
            let f = mix64(r ^ k) & self.mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half) | r
    }
}

/// The key every random choice of an epoch derives from.
pub fn epoch_key(sources: &[SourceShape], spec: &OrderSpec, epoch: u64) -> u64 {
    xxh3_64(format!("{};epoch={epoch}", order_key_text(sources, spec)).as_bytes())
}

/// The key of the choices a sticky order makes once per seed (the rounds' shards): the epoch
/// key's text without the epoch.
fn seed_key(sources: &[SourceShape], spec: &OrderSpec) -> u64 {
    xxh3_64(format!("{};rounds", order_key_text(sources, spec)).as_bytes())
}

/// What the order's keys are a function of, as text. `shares` appears only when sticky, so a
/// rotating order keeps the keys it had before the field existed.
fn order_key_text(sources: &[SourceShape], spec: &OrderSpec) -> String {
    let mut s = format!("order=v{ORDER_VERSION};");
    for st in sources {
        s.push_str(&format!("{}:{:?};", st.version, st.weight));
    }
    s.push_str(&format!(
        "seed={};shuffle={:?};partitions={}",
        spec.seed, spec.shuffle, spec.partitions
    ));
    if spec.shares == Shares::Sticky {
        s.push_str(";shares=sticky");
    }
    s
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
    /// A sticky order keys it by the seed alone, so its rounds hold the same units every epoch.
    perm: Perm,
    /// A sticky order's epoch-keyed permutation of its rounds: epoch round `k` is drawn round
    /// `rounds.apply(k)`. `None` when rounds are drawn per epoch (their order is the identity).
    rounds: Option<Perm>,
    /// Rounds built lately by this order's cursors (a memo: `rows::SharedRounds`).
    shared_rounds: rows::SharedRounds,
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
        let sticky = matches!(spec.shuffle, Shuffle::ShardBlock { .. }) && spec.shares == Shares::Sticky;
        let perm = match spec.shuffle {
            Shuffle::Global => Perm::new(len, derive(key, 0x61, 0)),
            _ if sticky => Perm::new(units, derive(seed_key(sources, spec), 0x71, 0)),
            _ => Perm::new(units, derive(key, 0x71, 0)),
        };
        let mut order = EpochOrder {
            key,
            spec: *spec,
            parts,
            units,
            len,
            perm,
            rounds: None,
            shared_rounds: rows::SharedRounds::default(),
        };
        if sticky {
            let n = units.div_ceil(order.round_units());
            order.rounds = Some(Perm::new(n, derive(key, 0x73, 0)));
        }
        Ok(order)
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
            rounds: rows::Rounds::default(),
        }
    }

    /// The position of the epoch's order that position `g` of the tail-adjusted order reads, and
    /// how many times the order wrapped before it (`len > 0`). A position past the end repeats
    /// its own partition's column from its start (shard-block, `P > 1`, at least a row): the
    /// node that reads the column pads with its own shards. Otherwise it repeats the order.
    pub fn wrapped(&self, g: u64) -> (u64, u64) {
        let n = self.len;
        match self.block() {
            Some((_, _, p)) if p > 1 && n >= p && g >= n => {
                let (c, j) = (g % p, g / p);
                let rows = n / p + u64::from(c < n % p);
                (j / rows, (j % rows) * p + c)
            }
            _ => (g / n, g % n),
        }
    }

    /// Units in one round of the shard-block shuffle (`partitions x window`).
    fn round_units(&self) -> u64 {
        self.block().map_or(1, |(w, _, p)| w.saturating_mul(p))
    }

    /// The shuffled-unit indices of the epoch's round `k`: `[K R, (K + 1) R)` cut at the
    /// epoch's units, where `K` is the drawn round at place `k` (`k` itself unless sticky).
    fn round_slots(&self, k: u64) -> std::ops::Range<u64> {
        let r = self.round_units();
        let lo = self.rounds.as_ref().map_or(k, |p| p.apply(k)) * r;
        lo.min(self.units)..(lo + r).min(self.units)
    }

    /// `(c, last, shards, passes)` when the epoch is one source's whole passes over shards that
    /// all hold `c` samples but the last (`last`): its units are then whole shards and their
    /// places in a round arithmetic ([`rows`]).
    fn uniform_units(&self) -> Option<(u64, u64, u64, u64)> {
        let [p] = &self.parts[..] else { return None };
        let (c, last) = p.counts.uniform()?;
        (p.rest.is_empty() && p.first_unit == 0 && c > 0).then_some((c, last, p.shards(), p.passes))
    }

    /// Units `slots` of the shuffled order (`slots.end <= units`), in order: the permutation
    /// applied to all of them at once ([`Perm::apply_all`]).
    fn shuffled_units(&self, slots: std::ops::Range<u64>) -> Result<Vec<Unit>> {
        let mut xs: Vec<u64> = slots.collect();
        self.perm.apply_all(&mut xs);
        xs.into_iter().map(|u| self.unit(u)).collect()
    }
}

/// A reader's position in an [`EpochOrder`]: it maps positions to samples, fastest when the
/// positions it is asked for rise (a shard-block cursor keeps its current round).
#[derive(Debug, Clone)]
pub struct OrderCursor {
    order: Arc<EpochOrder>,
    rounds: rows::Rounds,
}

impl OrderCursor {
    /// The sample at position `g` of the tail-adjusted order (positions past the epoch's length
    /// repeat it from the start), and the group `g` lies in: the unit for `none`, the round for
    /// `shard-block`, 0 for `global`, counted on across repeats. A shard's samples inside one
    /// group are read together.
    pub fn at(&mut self, g: u64) -> Result<(SampleRef, u64)> {
        let (mut id, group) = self.at_counted(g)?;
        let counts = &self.order.parts[id.source as usize].counts;
        id.index = counts.real(id.shard as u64, id.index as u64) as u32;
        Ok((id, group))
    }

    /// [`OrderCursor::at`] with the sample's index among its shard's counted samples.
    fn at_counted(&mut self, g: u64) -> Result<(SampleRef, u64)> {
        let o = &self.order;
        assert!(o.len > 0, "position {g} of an empty order");
        let (wrap, g) = o.wrapped(g);
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
                let (u, k) = self.rounds.at(o, g)?;
                let id = SampleRef {
                    source: u.source as u32,
                    shard: u.shard as u32,
                    index: u.first as u32,
                };
                Ok((id, wrap * rounds + k))
            }
        }
    }

    /// A lower bound on the group [`OrderCursor::at`] gives position `g`, known without
    /// building a round (shard-block: from the rounds built so far; `None` when they say
    /// nothing, and for the other shuffles, whose groups cost nothing to compute).
    pub fn group_floor(&self, g: u64) -> Option<u64> {
        let o = &self.order;
        if o.len == 0 || !matches!(o.spec.shuffle, Shuffle::ShardBlock { .. }) {
            return None;
        }
        let rounds = o.units.div_ceil(o.round_units()).max(1);
        let (wrap, g) = o.wrapped(g);
        Some(wrap * rounds + self.rounds.group_floor(o, g)?)
    }

    /// For the shard-block shuffle, the first and last canonical partition whose windows of
    /// its round hold samples of the unit (the shard's samples in that round) that position `g`
    /// lies in; `None` for the other shuffles. A node-affine deal gives a unit to two nodes when
    /// the two partitions belong to different nodes.
    pub fn unit_partitions(&mut self, g: u64) -> Result<Option<(u64, u64)>> {
        let o = &self.order;
        assert!(o.len > 0, "position {g} of an empty order");
        if !matches!(o.spec.shuffle, Shuffle::ShardBlock { .. }) {
            return Ok(None);
        }
        let (_, g) = o.wrapped(g);
        self.rounds.unit_partitions(o, g).map(Some)
    }
}

/// The global order of one epoch as an array, before tail handling. It holds every position:
/// for tests and small datasets. Streams use [`EpochOrder`] and an [`OrderCursor`].
pub fn global_order(sources: &[SourceShape], spec: &OrderSpec, epoch: u64) -> Result<Vec<SampleRef>> {
    let order = Arc::new(EpochOrder::new(sources, spec, epoch)?);
    let mut c = order.cursor();
    (0..order.len()).map(|g| Ok(c.at(g)?.0)).collect()
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

    /// Padding repeats the position's own column while every column has a sample (`N >= P`),
    /// and the whole order when some column is empty (one sample, two partitions).
    #[test]
    fn padding_repeats_its_column_or_the_order_when_a_column_is_empty() {
        let spec = OrderSpec {
            shuffle: Shuffle::ShardBlock {
                window_shards: 1,
                block_samples: 1,
            },
            partitions: 2,
            ..Default::default()
        };
        let full = EpochOrder::new(&shape(&[3, 2]), &spec, 0).unwrap();
        assert_eq!(full.len(), 5);
        // Column 1 holds positions 1 and 3; positions 5, 7, 9 cycle it.
        assert_eq!([5, 7, 9].map(|g| full.wrapped(g).1), [1, 3, 1]);
        assert_eq!([6, 8, 10].map(|g| full.wrapped(g).1), [0, 2, 4]);
        let tiny = EpochOrder::new(&shape(&[1]), &spec, 0).unwrap();
        assert_eq!(tiny.len(), 1);
        assert_eq!([1, 2, 3].map(|g| tiny.wrapped(g)), [(1, 0), (2, 0), (3, 0)]);
    }

    /// `apply_all` gives each value's `apply` image, for domains whose Feistel range is far
    /// above `n` (many walks), exactly a power of four, and trivial.
    #[test]
    fn a_permutation_applied_to_many_values_at_once_gives_each_ones_image() {
        for (n, key) in [
            (0u64, 1u64),
            (1, 2),
            (2, 3),
            (5, 4),
            (17, 5),
            (1024, 6),
            (4096, 7),
            (2_300_000, 8),
        ] {
            let p = Perm::new(n, key);
            let mut xs: Vec<u64> = (0..n.min(20_000)).rev().collect();
            let want: Vec<u64> = xs.iter().map(|&x| p.apply(x)).collect();
            let before = xs.clone();
            p.apply_all(&mut xs);
            assert_eq!(xs, want, "n {n}");
            let back: Vec<u64> = xs.iter().map(|&y| p.invert(y)).collect();
            assert_eq!(back, before, "n {n}: invert undoes apply");
        }
    }

    /// Counts that say they are uniform (as a uniform shard table does).
    #[derive(Debug)]
    struct UniformCounts(CountList, u64, u64);

    impl ShardCounts for UniformCounts {
        fn shards(&self) -> u64 {
            self.0.shards()
        }
        fn total(&self) -> u64 {
            self.0.total()
        }
        fn samples(&self, shard: u64) -> Result<u64> {
            self.0.samples(shard)
        }
        fn locate(&self, o: u64) -> Result<(u64, u64)> {
            self.0.locate(o)
        }
        fn uniform(&self) -> Option<(u64, u64)> {
            Some((self.1, self.2))
        }
    }

    /// Over counts that say they are uniform, a round's units are computed, not listed: every
    /// position gives the same sample, group and unit partitions as over the same counts
    /// listed, for shards of 5 with a last of 5 or 2, one pass or two (`Repeat(2.0)`, two
    /// short units), across partitions, windows and blocks.
    #[test]
    fn a_uniform_round_is_the_listed_round() {
        for (last, weight, partitions, window) in [
            (5, Weight::Natural, 3, 2),
            (2, Weight::Natural, 4, 3),
            (2, Weight::Repeat(2.0), 2, 5),
            (1, Weight::Natural, 1, 64),
        ] {
            let counts: Vec<u64> = (0..37).map(|i| if i == 36 { last } else { 5 }).collect();
            let listed = vec![SourceShape::listed("v", counts.clone(), weight)];
            let uniform = vec![SourceShape {
                version: "v".into(),
                counts: Arc::new(UniformCounts(CountList::new(counts), 5, last)),
                weight,
            }];
            let spec = OrderSpec {
                shuffle: Shuffle::ShardBlock {
                    window_shards: window,
                    block_samples: 2,
                },
                partitions,
                ..Default::default()
            };
            for epoch in 0..2 {
                let a = Arc::new(EpochOrder::new(&listed, &spec, epoch).unwrap());
                let b = Arc::new(EpochOrder::new(&uniform, &spec, epoch).unwrap());
                assert!(a.uniform_units().is_none() && b.uniform_units().is_some());
                assert_eq!(a.len(), b.len());
                let (mut ca, mut cb) = (a.cursor(), b.cursor());
                for g in 0..a.len() {
                    assert_eq!(
                        ca.at(g).unwrap(),
                        cb.at(g).unwrap(),
                        "last {last}, {weight:?}, position {g}"
                    );
                    assert_eq!(
                        ca.unit_partitions(g).unwrap(),
                        cb.unit_partitions(g).unwrap(),
                        "position {g}"
                    );
                }
            }
        }
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
}

#[cfg(test)]
mod node_tests {
    use super::*;
    use std::collections::BTreeSet;

    fn shapes() -> Vec<SourceShape> {
        // 60 shards of 5 to 16 samples: the rounds' windows cut shards at uneven places.
        let counts: Vec<u64> = (0..60u64).map(|i| 5 + (i * 7) % 12).collect();
        vec![SourceShape::listed("v", counts, Weight::Natural)]
    }

    fn spec() -> OrderSpec {
        OrderSpec {
            seed: 7,
            shuffle: Shuffle::ShardBlock {
                window_shards: 6,
                block_samples: 2,
            },
            partitions: 8,
            tail: Tail::Uneven,
            shares: Shares::Rotate,
        }
    }

    fn sticky() -> OrderSpec {
        OrderSpec {
            shares: Shares::Sticky,
            ..spec()
        }
    }

    fn topo(world: usize, local_world: usize, rank: usize) -> Topology {
        Topology {
            rank,
            world,
            local_rank: rank % local_world,
            local_world,
            ..Topology::default()
        }
    }

    /// Each rank's `t`-th batch of `b` samples in `epoch`, for a job of `world` ranks, `local`
    /// a node.
    fn batches_of(spec: &OrderSpec, epoch: u64, world: usize, local: usize, b: usize) -> Vec<Vec<Vec<SampleRef>>> {
        let (st, spec) = (shapes(), *spec);
        let order = Arc::new(EpochOrder::new(&st, &spec, epoch).unwrap());
        let rule = DealRule::for_job(&spec, &topo(world, local, 0));
        assert_eq!(rule.nodes as usize, world / local);
        let len = effective_len(order.len(), &rule, spec.tail);
        (0..world)
            .map(|r| {
                let deal = EpochProgress::default().deal(len, r, &rule);
                let mut cur = order.cursor();
                let ids: Vec<SampleRef> = (0..deal.len()).map(|k| cur.at(deal.position(k)).unwrap().0).collect();
                ids.chunks(b).map(|c| c.to_vec()).collect()
            })
            .collect()
    }

    #[test]
    fn every_world_size_of_the_family_steps_through_the_same_global_batches() {
        for spec in [spec(), sticky()] {
            same_global_batches(&spec);
        }
    }

    fn same_global_batches(spec: &OrderSpec) {
        let global = 32; // a multiple of the 8 partitions
        let want: Vec<BTreeSet<SampleRef>> = batches_of(spec, 3, 1, 1, global)[0]
            .iter()
            .map(|b| b.iter().copied().collect())
            .collect();
        for (world, local) in [(2, 1), (2, 2), (4, 2), (8, 2), (8, 8), (4, 1)] {
            let ranks = batches_of(spec, 3, world, local, global / world);
            let steps = want.len() - 1; // the last, short step depends on the world
            for (t, want) in want.iter().enumerate().take(steps) {
                let got: BTreeSet<SampleRef> = ranks.iter().flat_map(|r| r[t].iter().copied()).collect();
                assert_eq!(&got, want, "world {world}, {local} a node: step {t}");
            }
        }
    }

    /// The shards each node of a `world`-rank job (`local` a node) reads in `epoch`.
    fn node_shards(spec: &OrderSpec, epoch: u64, world: usize, local: usize) -> Vec<BTreeSet<u32>> {
        let ranks = batches_of(spec, epoch, world, local, 1);
        (0..world / local)
            .map(|n| {
                ranks[n * local..(n + 1) * local]
                    .iter()
                    .flatten()
                    .flatten()
                    .map(|s| s.shard)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn sticky_shares_keep_a_nodes_shards_from_epoch_to_epoch_and_rotating_ones_do_not() {
        let (st, sticky) = (shapes(), sticky());
        assert_ne!(
            global_order(&st, &sticky, 0).unwrap(),
            global_order(&st, &sticky, 1).unwrap(),
            "a sticky order still changes from epoch to epoch"
        );
        for (spec, stays) in [(sticky, true), (spec(), false)] {
            let (a, b) = (node_shards(&spec, 0, 4, 2), node_shards(&spec, 1, 4, 2));
            for n in 0..2 {
                // Only the shards a cut between the nodes splits may change (one a round).
                let moved = a[n].symmetric_difference(&b[n]).count();
                assert_eq!(moved <= 4, stays, "{:?}: node {n} changed {moved} shards", spec.shares);
            }
        }
    }

    /// `unit_partitions` marks a shard as split between nodes exactly when two nodes read it,
    /// for every node count dividing the partitions.
    #[test]
    fn unit_partitions_mark_exactly_the_shards_two_nodes_read() {
        for spec in [spec(), sticky()] {
            let order = Arc::new(EpochOrder::new(&shapes(), &spec, 3).unwrap());
            for nodes in [2u64, 4, 8] {
                let rule = DealRule {
                    consumers: nodes,
                    nodes,
                    partitions: 8,
                };
                let mut cur = order.cursor();
                let mut readers: std::collections::BTreeMap<u32, BTreeSet<u64>> = Default::default();
                let mut marked = BTreeSet::new();
                for g in 0..order.len() {
                    let (id, _) = cur.at(g).unwrap();
                    readers.entry(id.shard).or_default().insert(rule.node_of(g).0);
                    let (lo, hi) = cur.unit_partitions(g).unwrap().expect("a shard-block order");
                    assert!(lo <= g % 8 && g % 8 <= hi, "position {g}: partitions {lo}..={hi}");
                    if rule.node_of_partition(lo) != rule.node_of_partition(hi) {
                        marked.insert(id.shard);
                    }
                }
                let split: BTreeSet<u32> = readers.iter().filter(|(_, n)| n.len() > 1).map(|(s, _)| *s).collect();
                assert!(!split.is_empty(), "{:?}, {nodes} nodes: no shard is split", spec.shares);
                assert_eq!(marked, split, "{:?}, {nodes} nodes", spec.shares);
            }
        }
    }

    #[test]
    fn a_node_reads_about_its_share_of_the_shards() {
        let (world, local) = (4, 2); // 2 nodes of 4 partitions each
        let node_shards = node_shards(&spec(), 3, world, local);
        let touched: usize = node_shards.iter().map(|s| s.len()).sum();
        // 60 shards over 2 nodes: 30 each, plus at most the one shard a round's cut between
        // the nodes splits (60 shards, rounds of 48: 2 rounds).
        assert!(touched <= 60 + 2, "nodes touch {touched} shards: {node_shards:?}");
        // Apart from those, no two nodes read the same shard.
        for a in 0..node_shards.len() {
            for b in a + 1..node_shards.len() {
                let both = node_shards[a].intersection(&node_shards[b]).count();
                assert!(both <= 2, "nodes {a} and {b} both read {both} shards");
            }
        }
    }

    #[test]
    fn partitions_stay_within_one_sample_of_each_other() {
        let order = Arc::new(EpochOrder::new(&shapes(), &spec(), 1).unwrap());
        let mut all: Vec<SampleRef> = global_order(&shapes(), &spec(), 1).unwrap();
        assert_eq!(all.len() as u64, order.len());
        all.sort();
        all.dedup();
        assert_eq!(all.len() as u64, order.len(), "every sample once");
    }

    #[test]
    fn a_groups_floor_is_never_past_its_group_and_sees_each_next_group_unbuilt() {
        // Walked as the prefetcher walks a deal: a cursor that read up to `k - 1` bounds `k`'s
        // group from below, and at each new group its floor already says so (no round built).
        for (spec, tail) in [(spec(), Tail::Uneven), (sticky(), Tail::PadRepeat)] {
            let spec = OrderSpec { tail, ..spec };
            let order = Arc::new(EpochOrder::new(&shapes(), &spec, 2).unwrap());
            for (world, local) in [(1, 1), (4, 2), (8, 2)] {
                let rule = DealRule::for_job(&spec, &topo(world, local, 0));
                let len = effective_len(order.len(), &rule, spec.tail);
                for r in 0..world {
                    let deal = EpochProgress::default().deal(len, r, &rule);
                    let mut cur = order.cursor();
                    let (mut last, mut seen) = (None, 0);
                    for k in 0..deal.len() {
                        let g = deal.position(k);
                        let floor = cur.group_floor(g);
                        let (_, group) = cur.at(g).unwrap();
                        assert!(
                            floor.is_none_or(|f| f <= group),
                            "{world} ranks, rank {r}, position {g}"
                        );
                        if last.is_some_and(|x| x != group) {
                            assert!(floor.is_some_and(|f| f > last.unwrap()), "{tail:?} {world} ranks, rank {r}, position {g} of {}: group {group} after {last:?}, floor {floor:?}", order.len());
                            seen += 1;
                        }
                        last = Some(group);
                    }
                    assert!(seen > 0, "{world} ranks, rank {r}: the walk crossed groups");
                }
            }
        }
    }
}
