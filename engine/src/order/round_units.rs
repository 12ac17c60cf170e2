//! A shard-block round's units in shuffled order, and where each starts in the round's
//! concatenation: listed (one count lookup a unit), or, over a uniform shard table, computed
//! on demand (`docs/order.md`, "Step 2"), so a round of thousands of partitions costs a few
//! permutation inversions to build instead of a lookup per unit.

use super::{EpochOrder, Perm, Unit};
use crate::error::Result;

/// A round's units.
#[derive(Debug, Clone)]
pub(super) enum RoundUnits {
    /// Each unit, and where it starts (`units.len() + 1` entries, the last the round's length).
    Listed { units: Vec<Unit>, starts: Vec<u64> },
    /// The units of places `[0, n)` are the shuffled units `slot0 + t`, whole shards of `c`
    /// samples except those of the source's last shard (`last` samples), at places `short`
    /// (rising).
    Uniform(Uniform),
}

/// The arithmetic round (see [`RoundUnits::Uniform`]).
#[derive(Debug, Clone)]
pub(super) struct Uniform {
    perm: Perm,
    slot0: u64,
    n: u64,
    c: u64,
    last: u64,
    shards: u64,
    short: Vec<u64>,
}

impl RoundUnits {
    /// The units of `o`'s shuffled slots `slots`.
    pub(super) fn build(o: &EpochOrder, slots: std::ops::Range<u64>) -> Result<RoundUnits> {
        if let Some((c, last, shards, passes)) = o.uniform_units() {
            // Each pass's last shard is one unit: its place, when this round holds it.
            let mut short: Vec<u64> = (0..passes)
                .map(|q| o.perm.invert(q * shards + shards - 1))
                .filter(|s| slots.contains(s))
                .map(|s| s - slots.start)
                .collect();
            short.sort_unstable();
            return Ok(RoundUnits::Uniform(Uniform {
                perm: o.perm,
                slot0: slots.start,
                n: slots.end - slots.start,
                c,
                last,
                shards,
                short,
            }));
        }
        let units = o.shuffled_units(slots)?;
        let mut starts = Vec::with_capacity(units.len() + 1);
        starts.push(0u64);
        for u in &units {
            starts.push(starts.last().expect("non-empty") + u.len);
        }
        Ok(RoundUnits::Listed { units, starts })
    }

    /// Samples in the round.
    pub(super) fn len(&self) -> u64 {
        match self {
            RoundUnits::Listed { starts, .. } => *starts.last().expect("non-empty"),
            RoundUnits::Uniform(u) => u.start(u.n),
        }
    }

    /// Where unit `t` starts in the round's concatenation (`t` up to the units, the last
    /// giving the round's length).
    pub(super) fn start(&self, t: usize) -> u64 {
        match self {
            RoundUnits::Listed { starts, .. } => starts[t],
            RoundUnits::Uniform(u) => u.start(t as u64),
        }
    }

    /// The unit offset `c` of the concatenation lies in (`c` below the round's length).
    pub(super) fn find(&self, c: u64) -> usize {
        match self {
            RoundUnits::Listed { starts, .. } => starts.partition_point(|&s| s <= c) - 1,
            RoundUnits::Uniform(u) => {
                // Short units only pull later starts down, so the unit is at or after c / size.
                let mut t = c / u.c;
                while u.start(t + 1) <= c {
                    t += 1;
                }
                t as usize
            }
        }
    }

    /// Unit `t`.
    pub(super) fn unit(&self, t: usize) -> Unit {
        match self {
            RoundUnits::Listed { units, .. } => units[t],
            RoundUnits::Uniform(u) => {
                let shard = u.perm.apply(u.slot0 + t as u64) % u.shards;
                Unit {
                    source: 0,
                    shard: shard as usize,
                    first: 0,
                    len: if shard + 1 == u.shards { u.last } else { u.c },
                }
            }
        }
    }
}

impl Uniform {
    /// Where place `t` starts: `t` units of `c`, less what the short ones before it lack.
    fn start(&self, t: u64) -> u64 {
        let shorts = self.short.partition_point(|&s| s < t) as u64;
        t * self.c - shorts * (self.c - self.last)
    }
}
