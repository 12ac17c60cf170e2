//! The shard-block shuffle's rounds laid out as rows (order version 3, `docs/order.md`).
//!
//! Round `k` is the shuffled units `[k R, (k + 1) R)`, `R = P W`, their samples concatenated
//! and cut into `P` contiguous windows of equal length (the remainder's extra samples go to the
//! partitions in a sweep that carries on from round to round, so every partition's total stays
//! within one sample of every other's). Partition `i`'s sequence is its windows in round order,
//! each block-shuffled; position `p` is sample `p / P` of partition `p mod P`. Contiguous
//! windows keep a node's partitions of a round on few shards.

use super::{derive, EpochOrder, Perm, Unit};
use crate::error::Result;

/// Where round `k` starts: the rows the partitions filled before it and the extra samples
/// handed out before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct RoundStart {
    k: u64,
    rows: u64,
    extras: u64,
}

impl RoundStart {
    /// Partition `i`'s first row in this round.
    fn first_row(&self, i: u64, p: u64) -> u64 {
        self.rows + self.extras / p + u64::from(i < self.extras % p)
    }

    /// The start of the round after this one, of `len` samples.
    fn next(&self, len: u64, p: u64) -> RoundStart {
        RoundStart {
            k: self.k + 1,
            rows: self.rows + len / p,
            extras: self.extras + len % p,
        }
    }
}

/// Whether partition `i` takes one of the `r` extra samples of a round whose sweep starts at
/// partition `o`.
fn takes_extra(i: u64, o: u64, r: u64, p: u64) -> bool {
    (i + p - o) % p < r
}

/// Partitions below `i` that take an extra sample (the sweep `[o, o + r)` modulo `p`).
fn extras_below(i: u64, o: u64, r: u64, p: u64) -> u64 {
    if o + r <= p {
        i.saturating_sub(o).min(r)
    } else {
        i.saturating_sub(o).min(p - o) + i.min(o + r - p)
    }
}

/// One round, built: its units in shuffled order and where each starts in the round's
/// concatenation, and each partition's block permutation.
#[derive(Debug, Clone)]
pub(super) struct Round {
    at: RoundStart,
    len: u64,
    p: u64,
    block: u64,
    units: Vec<Unit>,
    starts: Vec<u64>,
    blocks: Vec<Perm>,
}

impl Round {
    fn build(o: &EpochOrder, at: RoundStart) -> Result<Round> {
        let (_, block, p) = o.block().expect("shard-block order");
        let slots = o.round_slots(at.k);
        let mut units = Vec::with_capacity((slots.end - slots.start) as usize);
        let mut starts = vec![0u64];
        for j in slots {
            let u = o.shuffled_unit(j)?;
            starts.push(starts.last().expect("non-empty") + u.len);
            units.push(u);
        }
        let len = *starts.last().expect("non-empty");
        let mut round = Round {
            at,
            len,
            p,
            block,
            units,
            starts,
            blocks: Vec::with_capacity(p as usize),
        };
        for i in 0..p {
            let full = round.window(i).1 / block;
            let key = derive(o.key, 0x72, at.k.wrapping_mul(p).wrapping_add(i));
            round.blocks.push(Perm::new(full, key));
        }
        Ok(round)
    }

    /// Partition `i`'s window: its start in the round's concatenation and its length.
    fn window(&self, i: u64) -> (u64, u64) {
        let (p, m, r, o) = (self.p, self.len / self.p, self.len % self.p, self.at.extras % self.p);
        (i * m + extras_below(i, o, r, p), m + u64::from(takes_extra(i, o, r, p)))
    }

    /// Sample `x` of partition `i`'s window, after its block shuffle.
    fn sample(&self, i: u64, x: u64) -> Unit {
        let (start, _) = self.window(i);
        let perm = &self.blocks[i as usize];
        let full = perm.len() * self.block;
        let c = start
            + if x < full {
                perm.apply(x / self.block) * self.block + x % self.block
            } else {
                x
            };
        let t = self.starts.partition_point(|&s| s <= c) - 1;
        let u = self.units[t];
        Unit {
            first: u.first + (c - self.starts[t]),
            len: 1,
            ..u
        }
    }
}

/// The rounds a cursor keeps built: the two it used last (a row can straddle two rounds).
#[derive(Debug, Clone, Default)]
pub(super) struct Rounds {
    built: Vec<Round>,
}

/// Rounds a cursor keeps built.
const ROUNDS_KEPT: usize = 2;

impl Rounds {
    /// The unit (one sample) at position `g` (`g < len`) of the shard-block order `o`, and the
    /// group it lies in: the round of the row's last partition, which rises with `g`.
    pub(super) fn at(&mut self, o: &EpochOrder, g: u64) -> Result<(Unit, u64)> {
        let (_, _, p) = o.block().expect("shard-block order");
        let (i, j) = (g % p, g / p);
        let last = o.units.div_ceil(o.round_units()).max(1) - 1;
        // The latest round known to start at or before row `j` for partition `i`.
        let mut at = self
            .built
            .iter()
            .map(|r| r.at)
            .filter(|a| a.first_row(i, p) <= j)
            .max_by_key(|a| a.k)
            .unwrap_or_default();
        let len = loop {
            let len = match self.built.iter().find(|r| r.at.k == at.k) {
                Some(r) => r.len,
                None => o.round_len(at.k)?,
            };
            let width = len / p + u64::from(takes_extra(i, at.extras % p, len % p, p));
            if j < at.first_row(i, p) + width || at.k >= last {
                break len;
            }
            at = at.next(len, p);
        };
        let group = if j < at.first_row(p - 1, p) {
            at.k.saturating_sub(1)
        } else if j >= at.next(len, p).first_row(p - 1, p) {
            at.k + 1
        } else {
            at.k
        };
        let idx = match self.built.iter().position(|r| r.at.k == at.k) {
            Some(idx) => idx,
            None => {
                if self.built.len() >= ROUNDS_KEPT {
                    self.built.remove(0);
                }
                self.built.push(Round::build(o, at)?);
                self.built.len() - 1
            }
        };
        let r = &self.built[idx];
        Ok((r.sample(i, j - at.first_row(i, p)), group))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_extra_sweep_counts_agree_with_the_rule() {
        for p in 1..7u64 {
            for o in 0..p {
                for r in 0..p {
                    for i in 0..=p {
                        let want = (0..i).filter(|&x| takes_extra(x, o, r, p)).count() as u64;
                        assert_eq!(extras_below(i, o, r, p), want, "p={p} o={o} r={r} i={i}");
                    }
                }
            }
        }
    }
}
