//! The shard-block shuffle's rounds laid out as rows (order version 3, `docs/order.md`).
//!
//! Round `k` is the shuffled units `[k R, (k + 1) R)`, `R = P W`, their samples concatenated
//! and cut into `P` contiguous windows of equal length (the remainder's extra samples go to the
//! partitions in a sweep that carries on from round to round, so every partition's total stays
//! within one sample of every other's). Partition `i`'s sequence is its windows in round order,
//! each block-shuffled; position `p` is sample `p / P` of partition `p mod P`. Contiguous
//! windows keep a node's partitions of a round on few shards.

use std::sync::Arc;

use super::round_units::RoundUnits;
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
    units: RoundUnits,
    blocks: Vec<Perm>,
}

impl Round {
    fn build(o: &EpochOrder, at: RoundStart) -> Result<Round> {
        let (_, block, p) = o.block().expect("shard-block order");
        let units = RoundUnits::build(o, o.round_slots(at.k))?;
        let mut round = Round {
            at,
            len: units.len(),
            p,
            block,
            units,
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

    /// Where sample `x` of partition `i`'s window lies in the round's concatenation, after the
    /// window's block shuffle, and the unit it lies in.
    fn place(&self, i: u64, x: u64) -> (u64, usize) {
        let (start, _) = self.window(i);
        let perm = &self.blocks[i as usize];
        let full = perm.len() * self.block;
        let c = start
            + if x < full {
                perm.apply(x / self.block) * self.block + x % self.block
            } else {
                x
            };
        (c, self.units.find(c))
    }

    /// Sample `x` of partition `i`'s window, after its block shuffle.
    fn sample(&self, i: u64, x: u64) -> Unit {
        let (c, t) = self.place(i, x);
        let u = self.units.unit(t);
        Unit {
            first: u.first + (c - self.units.start(t)),
            len: 1,
            ..u
        }
    }

    /// The partition whose window holds offset `c` of the round's concatenation (`c < len`).
    fn partition_of(&self, c: u64) -> u64 {
        let (mut lo, mut hi) = (0, self.p);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if self.window(mid).0 <= c {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The partitions whose windows hold samples of the unit that sample `x` of partition `i`'s
    /// window lies in: first and last.
    fn unit_partitions(&self, i: u64, x: u64) -> (u64, u64) {
        let (_, t) = self.place(i, x);
        let (a, b) = (self.units.start(t), self.units.start(t + 1));
        (self.partition_of(a), self.partition_of(b - 1))
    }
}

/// Rounds built lately by any cursor of one [`EpochOrder`], shared: a stream's prefetcher and
/// its consumer walk the same rounds, and a round of thousands of partitions costs one count
/// lookup a unit (spread over the whole shard table) to build, so a round one cursor is
/// building is waited for by the others, not built twice. A memo only: a clone starts empty,
/// and a round missing from it is built again, the same.
#[derive(Default)]
pub(super) struct SharedRounds {
    memo: std::sync::Mutex<Memo>,
    built: std::sync::Condvar,
}

/// The shared rounds, and those being built.
#[derive(Default)]
struct Memo {
    rounds: std::collections::VecDeque<Arc<Round>>,
    building: Vec<u64>,
}

/// Rounds an order keeps shared (a prefetcher runs a round or two ahead of its consumer).
const ROUNDS_SHARED: usize = 4;

/// Marks round `k` built (or given up) when dropped, a panicking build included, and wakes
/// those waiting for it.
struct Building<'a> {
    shared: &'a SharedRounds,
    k: u64,
}

impl Drop for Building<'_> {
    fn drop(&mut self) {
        self.shared.lock().building.retain(|&x| x != self.k);
        self.shared.built.notify_all();
    }
}

impl SharedRounds {
    fn lock(&self) -> std::sync::MutexGuard<'_, Memo> {
        self.memo.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where each shared round starts, and where the round after it starts.
    fn starts(&self) -> Vec<RoundStart> {
        self.lock()
            .rounds
            .iter()
            .flat_map(|r| [r.at, r.at.next(r.len, r.p)])
            .collect()
    }

    /// Round `k`: shared, else awaited while another cursor builds it, else built by `build`
    /// (and shared). A build that fails is not kept: the next asker builds it again.
    fn get_or_build(&self, k: u64, build: impl FnOnce() -> Result<Round>) -> Result<Arc<Round>> {
        let mut m = self.lock();
        loop {
            if let Some(r) = m.rounds.iter().find(|r| r.at.k == k) {
                return Ok(r.clone());
            }
            if !m.building.contains(&k) {
                break;
            }
            m = self.built.wait(m).unwrap_or_else(|p| p.into_inner());
        }
        m.building.push(k);
        drop(m);
        let _building = Building { shared: self, k };
        let r = Arc::new(build()?);
        let mut m = self.lock();
        if m.rounds.len() >= ROUNDS_SHARED {
            m.rounds.pop_front();
        }
        m.rounds.push_back(r.clone());
        Ok(r)
    }
}

impl Clone for SharedRounds {
    fn clone(&self) -> Self {
        SharedRounds::default()
    }
}

impl std::fmt::Debug for SharedRounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRounds").finish_non_exhaustive()
    }
}

/// The rounds a cursor keeps built: the two it used last (a row can straddle two rounds).
#[derive(Debug, Clone, Default)]
pub(super) struct Rounds {
    built: Vec<Arc<Round>>,
}

/// Rounds a cursor keeps built.
const ROUNDS_KEPT: usize = 2;

impl Rounds {
    /// Round `at.k`: this cursor's, else the order's shared one (awaited while another cursor
    /// builds it), else built and shared (its length and its units come from the same count
    /// lookups, so the round a cursor stops at is not counted twice).
    fn round(&self, o: &EpochOrder, at: RoundStart) -> Result<Arc<Round>> {
        if let Some(r) = self.built.iter().find(|r| r.at.k == at.k) {
            return Ok(r.clone());
        }
        o.shared_rounds.get_or_build(at.k, || Round::build(o, at))
    }

    /// The unit (one sample) at position `g` (`g < len`) of the shard-block order `o`, and the
    /// group it lies in: the round of the row's last partition, which rises with `g`.
    pub(super) fn at(&mut self, o: &EpochOrder, g: u64) -> Result<(Unit, u64)> {
        let (round, i, x, group) = self.locate(o, g)?;
        Ok((round.sample(i, x), group))
    }

    /// The first and last partition whose windows of its round hold samples of the unit that
    /// position `g` (`g < len`) lies in: different when a cut between windows splits it.
    pub(super) fn unit_partitions(&mut self, o: &EpochOrder, g: u64) -> Result<(u64, u64)> {
        let (round, i, x, _) = self.locate(o, g)?;
        Ok(round.unit_partitions(i, x))
    }

    /// A lower bound on the group of position `g` (`g < len`), from the rounds built so far
    /// (by this cursor or another of the order) and where the rounds after them start: none is
    /// built. A walk that cuts the order at its groups sees the next group begin without
    /// building its round.
    ///
    /// The group of row `j` is the round that holds row `j` of partition `P - 1` (the last
    /// round `m <= last` with `start(m).first_row(P - 1) <= j`, or `last + 1` past it), and
    /// row `j` of partition `i` lies in the last round `m` with `start(m).first_row(i) <= j`,
    /// whose group is `m - 1` at least. So a known start `a` bounds the group by `a.k` when
    /// `a.first_row(P - 1) <= j` (`a.k <= last + 1`), else by `a.k - 1` when
    /// `a.first_row(i) <= j` (`a.k <= last`).
    pub(super) fn group_floor(&self, o: &EpochOrder, g: u64) -> Option<u64> {
        let (_, _, p) = o.block()?;
        let (i, j) = (g % p, g / p);
        let last = o.units.div_ceil(o.round_units()).max(1) - 1;
        self.built
            .iter()
            .flat_map(|r| [r.at, r.at.next(r.len, p)])
            .chain(o.shared_rounds.starts())
            .filter_map(|a| match (a.first_row(p - 1, p) <= j, a.first_row(i, p) <= j) {
                (true, _) if a.k <= last + 1 => Some(a.k),
                (false, true) if a.k <= last => a.k.checked_sub(1),
                _ => None,
            })
            .max()
    }

    /// Position `g`'s round, its partition `i` and its sample `x` of `i`'s window there, and its
    /// group.
    fn locate(&mut self, o: &EpochOrder, g: u64) -> Result<(Arc<Round>, u64, u64, u64)> {
        let (_, _, p) = o.block().expect("shard-block order");
        let (i, j) = (g % p, g / p);
        let last = o.units.div_ceil(o.round_units()).max(1) - 1;
        // A round this cursor holds that holds row `j` of partition `i` (positions that rise
        // stay in one), else the latest round known to start at or before it.
        let holds = |r: &Round| {
            let width = r.len / p + u64::from(takes_extra(i, r.at.extras % p, r.len % p, p));
            r.at.first_row(i, p) <= j && (j < r.at.first_row(i, p) + width || r.at.k >= last)
        };
        let mut at = match self.built.iter().rev().find(|r| holds(r)) {
            Some(r) => r.at,
            None => self
                .built
                .iter()
                .map(|r| r.at)
                .chain(o.shared_rounds.starts())
                .filter(|a| a.k <= last && a.first_row(i, p) <= j)
                .max_by_key(|a| a.k)
                .unwrap_or_default(),
        };
        let round = loop {
            let r = self.round(o, at)?;
            let width = r.len / p + u64::from(takes_extra(i, at.extras % p, r.len % p, p));
            if j < at.first_row(i, p) + width || at.k >= last {
                break r;
            }
            at = at.next(r.len, p);
        };
        let len = round.len;
        let group = if j < at.first_row(p - 1, p) {
            at.k.saturating_sub(1)
        } else if j >= at.next(len, p).first_row(p - 1, p) {
            at.k + 1
        } else {
            at.k
        };
        // The round stopped at is kept by this cursor (the order shares every round built).
        if !self.built.iter().any(|r| r.at.k == at.k) {
            if self.built.len() >= ROUNDS_KEPT {
                self.built.remove(0);
            }
            self.built.push(round.clone());
        }
        Ok((round, i, j - at.first_row(i, p), group))
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
