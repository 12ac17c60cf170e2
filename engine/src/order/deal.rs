//! Dealing the global order to consumers, the tail, and a job's progress through an epoch
//! (`docs/order.md`, "Dealing the order to consumers" and "Progress and resume").
//!
//! Two rules deal the same positions (a [`DealRule`]): position by position round the job's
//! consumers (`nodes == 1`), or node-affine: each node takes the columns of its canonical
//! partitions, and deals them round its own consumers. Both are pure functions of the
//! progress, so a job resumed on another topology deals the rest of the epoch exactly once.

use super::{OrderSpec, Shuffle, Tail, Topology};
use crate::error::Invalid;
use std::sync::Arc;

/// How the positions of an epoch are dealt to a job's consumers. Every rank of a job computes
/// the same rule from job-wide facts (the order, the world, the ranks per host, the workers),
/// never from its own rank, so the consumers never disagree about who reads what.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DealRule {
    /// Consumers in the job (`world * workers`).
    pub consumers: u64,
    /// Nodes the positions are split across (1: round the job's consumers, position by
    /// position). Divides `partitions` and `consumers`.
    pub nodes: u64,
    /// Canonical partitions of the order (the columns of its rows).
    pub partitions: u64,
}

impl DealRule {
    /// Position by position round `consumers` consumers.
    pub fn strided(consumers: usize) -> DealRule {
        DealRule {
            consumers: consumers.max(1) as u64,
            nodes: 1,
            partitions: 1,
        }
    }

    /// The rule a job deals by: node-affine when the order is the shard-block shuffle, the job
    /// spans several nodes (`world / local_world`, every node with the same ranks) and the
    /// nodes divide the partitions; otherwise position by position (see [`Self::why_strided`]).
    pub fn for_job(spec: &OrderSpec, topo: &Topology) -> DealRule {
        let strided = DealRule::strided(topo.consumers());
        let nodes = topo.nodes() as u64;
        let p = spec.partitions.max(1) as u64;
        let shard_block = matches!(spec.shuffle, Shuffle::ShardBlock { .. });
        if nodes > 1 && shard_block && p % nodes == 0 {
            DealRule {
                nodes,
                partitions: p,
                ..strided
            }
        } else {
            strided
        }
    }

    /// Why a job of several nodes deals position by position (every node reads the whole
    /// dataset), or `None` when it deals by node or runs on one node.
    pub fn why_strided(spec: &OrderSpec, topo: &Topology) -> Option<String> {
        if topo.world <= 1 || topo.local_world >= topo.world || Self::for_job(spec, topo).nodes > 1 {
            return None;
        }
        if topo.world % topo.local_world != 0 {
            return Some(format!(
                "world_size {} is not a multiple of the {} ranks a host (LOCAL_WORLD_SIZE)",
                topo.world, topo.local_world
            ));
        }
        if !matches!(spec.shuffle, Shuffle::ShardBlock { .. }) {
            return Some(format!(
                "the {:?} shuffle has no partitions to give each node",
                spec.shuffle
            ));
        }
        Some(format!(
            "the {} nodes do not divide partitions={}",
            topo.nodes(),
            spec.partitions
        ))
    }

    fn per_node(&self) -> u64 {
        (self.consumers / self.nodes).max(1)
    }

    /// Partitions (columns of a row) each node takes.
    fn width(&self) -> u64 {
        if self.nodes <= 1 {
            1
        } else {
            self.partitions / self.nodes
        }
    }

    /// Columns in a row (1 for the strided rule: every position is its own row).
    fn row(&self) -> u64 {
        if self.nodes <= 1 {
            1
        } else {
            self.partitions
        }
    }

    /// The node of consumer `c` (of `consumers`): the consumers of a node are consecutive.
    pub fn node_of_consumer(&self, c: u64) -> u64 {
        (c / self.per_node()).min(self.nodes.saturating_sub(1))
    }

    /// The node whose columns hold canonical partition `c` (`c < partitions`).
    pub fn node_of_partition(&self, c: u64) -> u64 {
        c / self.width()
    }

    /// The node that reads position `p`, and `p`'s index among that node's positions.
    pub fn node_of(&self, p: u64) -> (u64, u64) {
        let (row, col) = (p / self.row(), p % self.row());
        let w = self.width();
        (col / w, row * w + col % w)
    }

    /// Node `n`'s `q`-th position.
    pub fn position(&self, n: u64, q: u64) -> u64 {
        let w = self.width();
        (q / w) * self.row() + n * w + q % w
    }

    /// Node `n`'s positions below `x`.
    pub fn below(&self, n: u64, x: u64) -> u64 {
        let w = self.width();
        (x / self.row()) * w + (x % self.row()).saturating_sub(n * w).min(w)
    }

    /// Positions a tail-adjusted order keeps or pads to a multiple of: the consumers for the
    /// strided rule; for the node-affine one also the row, so every node and every consumer
    /// gets the same count.
    fn tail_unit(&self) -> u64 {
        if self.nodes <= 1 {
            self.consumers
        } else {
            lcm(self.row(), self.consumers)
        }
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    (a / gcd(a, b).max(1)).saturating_mul(b)
}

/// Length of the order of `n` samples after tail handling, for a job dealt by `rule`.
pub fn effective_len(n: u64, rule: &DealRule, tail: Tail) -> u64 {
    let u = rule.tail_unit().max(1);
    match tail {
        Tail::Uneven => n,
        Tail::DropLast => n - n % u,
        Tail::PadRepeat => {
            if n == 0 {
                0
            } else {
                n.div_ceil(u).saturating_mul(u)
            }
        }
    }
}

/// `x` moved past every entry of the sorted `ahead` at or below its running value: the
/// `x - start`-th value from `start` on that is not in `ahead` (every entry at least `start`).
fn skip_ahead(mut x: u64, ahead: &[u64]) -> u64 {
    for &a in ahead {
        if a <= x {
            x += 1;
        } else {
            break;
        }
    }
    x
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
        skip_ahead(self.consumed + i, &self.ahead)
    }

    /// Positions not yet delivered, in order, for an order of `len` positions.
    pub fn remaining(&self, len: u64) -> impl Iterator<Item = u64> + '_ {
        (0..self.remaining_len(len)).map(|i| self.remaining_at(i))
    }

    /// Node `n`'s positions not yet delivered under `rule`, in order.
    fn node_rest(&self, len: u64, rule: &DealRule, n: u64) -> NodeRest {
        let (lo, hi) = (rule.below(n, self.consumed), rule.below(n, len));
        let ahead: Vec<u64> = self
            .ahead
            .iter()
            .filter_map(|&a| {
                let (m, q) = rule.node_of(a);
                (m == n).then_some(q)
            })
            .collect();
        NodeRest {
            rule: *rule,
            node: n,
            lo,
            len: (hi - lo).saturating_sub(ahead.len() as u64),
            ahead,
        }
    }

    /// The deal of `consumer` (of `rule.consumers`) from here on.
    pub fn deal(&self, len: u64, consumer: usize, rule: &DealRule) -> Deal {
        let c = consumer as u64;
        let per = rule.per_node();
        let rest = self.node_rest(len, rule, c / per);
        let l = c % per;
        Deal {
            count: if rest.len > l { (rest.len - l).div_ceil(per) } else { 0 },
            rest: Arc::new(rest),
            local: l,
            per_node: per,
        }
    }

    /// The positions `consumer` reads from here on, as an array (for tests and small orders;
    /// streams use [`EpochProgress::deal`]).
    pub fn positions_for(&self, len: u64, consumer: usize, rule: &DealRule) -> Vec<u64> {
        let d = self.deal(len, consumer, rule);
        (0..d.len()).map(|k| d.position(k)).collect()
    }

    /// The progress after consumer `c` (dealt from `self` by `rule`) delivered `delivered[c]`
    /// of its positions, for every `c`. Work and memory grow with `ahead` and the spread
    /// between consumers, not with the epoch.
    pub fn advance(&self, len: u64, delivered: &[u64], rule: &DealRule) -> EpochProgress {
        let per = rule.per_node();
        let nodes: Vec<NodeRest> = (0..rule.nodes).map(|n| self.node_rest(len, rule, n)).collect();
        // Each node's first undelivered index: its consumer l's next is delivered[l] * per + l.
        let open = |n: u64| {
            (0..per)
                .map(|l| {
                    let d = delivered.get((n * per + l) as usize).copied().unwrap_or(0);
                    d.saturating_mul(per).saturating_add(l)
                })
                .filter(|&i| i < nodes[n as usize].len)
                .min()
        };
        let consumed = (0..rule.nodes)
            .filter_map(|n| open(n).map(|i| nodes[n as usize].at(i)))
            .min()
            .unwrap_or(len);
        let mut ahead: Vec<u64> = self.ahead.iter().copied().filter(|&a| a >= consumed).collect();
        for rest in &nodes {
            // Indices below `first` name positions below `consumed`: delivered and counted.
            let first = rest.index_of_first_at_or_above(consumed);
            for l in 0..per {
                let d = delivered.get((rest.node * per + l) as usize).copied().unwrap_or(0);
                let k_min = first.saturating_sub(l).div_ceil(per);
                for k in k_min..d {
                    let i = l + k * per;
                    if i < rest.len {
                        let p = rest.at(i);
                        if p != consumed {
                            ahead.push(p);
                        }
                    }
                }
            }
        }
        ahead.sort_unstable();
        ahead.dedup();
        EpochProgress {
            epoch: self.epoch,
            consumed,
            ahead,
        }
    }
}

/// One node's positions not yet delivered: its positions from `lo` on (by index among the
/// node's), the `ahead` ones (as such indices, sorted) skipped.
#[derive(Debug, Clone)]
struct NodeRest {
    rule: DealRule,
    node: u64,
    lo: u64,
    len: u64,
    ahead: Vec<u64>,
}

impl NodeRest {
    /// The `i`-th remaining position of the node (`i < len`).
    fn at(&self, i: u64) -> u64 {
        self.rule.position(self.node, skip_ahead(self.lo + i, &self.ahead))
    }

    /// The number of remaining positions below `p`.
    fn index_of_first_at_or_above(&self, p: u64) -> u64 {
        let q = self.rule.below(self.node, p);
        let skipped = self.ahead.iter().filter(|&&a| a < q).count() as u64;
        q.saturating_sub(self.lo).saturating_sub(skipped).min(self.len)
    }
}

/// One consumer's positions in an epoch, computed on demand: its `k`-th position is its node's
/// remaining position `local + k * per_node`.
#[derive(Debug, Clone)]
pub struct Deal {
    rest: Arc<NodeRest>,
    local: u64,
    per_node: u64,
    count: u64,
}

impl Deal {
    /// The deal of an epoch with no positions.
    pub fn empty() -> Deal {
        EpochProgress::default().deal(0, 0, &DealRule::strided(1))
    }

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
        self.rest.at(self.local + k * self.per_node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(consumers: u64, nodes: u64, partitions: u64) -> DealRule {
        DealRule {
            consumers,
            nodes,
            partitions,
        }
    }

    #[test]
    fn a_node_reads_only_its_columns_and_every_position_is_dealt_once() {
        let r = rule(4, 2, 4);
        let len = 37;
        let mut all = Vec::new();
        for c in 0..4usize {
            let ps = EpochProgress::default().positions_for(len, c, &r);
            let node = c as u64 / 2;
            assert!(ps.iter().all(|&p| (p % 4) / 2 == node), "consumer {c}: {ps:?}");
            all.extend(ps);
        }
        all.sort_unstable();
        assert_eq!(all, (0..len).collect::<Vec<_>>());
    }

    #[test]
    fn one_node_deals_as_the_strided_rule() {
        let (one, strided) = (rule(3, 1, 1), DealRule::strided(3));
        for c in 0..3 {
            let a = EpochProgress::default().positions_for(20, c, &one);
            let b: Vec<u64> = (0..20).filter(|p| p % 3 == c as u64).collect();
            assert_eq!(a, b);
            assert_eq!(a, EpochProgress::default().positions_for(20, c, &strided));
        }
    }

    #[test]
    fn the_tail_evens_every_consumer_of_a_node_affine_deal() {
        let r = rule(6, 3, 6);
        for tail in [Tail::DropLast, Tail::PadRepeat] {
            let len = effective_len(50, &r, tail);
            let counts: Vec<u64> = (0..6)
                .map(|c| EpochProgress::default().deal(len, c, &r).len())
                .collect();
            assert!(counts.iter().all(|&n| n == counts[0]), "{tail:?}: {counts:?}");
        }
        assert_eq!(effective_len(50, &r, Tail::DropLast), 48);
        assert_eq!(effective_len(50, &r, Tail::PadRepeat), 54);
    }

    #[test]
    fn progress_advance_and_resume_on_another_deal() {
        let len = 23;
        let start = EpochProgress::default();
        // Three consumers delivered 4, 3 and 4 of their positions.
        let p = start.advance(len, &[4, 3, 4], &DealRule::strided(3));
        assert_eq!(p.consumed, 10); // position 10 = consumer 1's 4th, not delivered
        assert_eq!(p.ahead, vec![11]);
        // Resume with two consumers: they cover exactly the rest, once.
        let two = DealRule::strided(2);
        let mut rest: Vec<u64> = (0..2).flat_map(|c| p.positions_for(len, c, &two)).collect();
        rest.sort();
        let want: Vec<u64> = (10..23).filter(|&x| x != 11).collect();
        assert_eq!(rest, want);
    }

    #[test]
    fn node_affine_progress_resumes_exactly_on_any_rule() {
        let len = 61;
        let rules = [
            rule(4, 2, 4),
            rule(2, 1, 1),
            rule(8, 4, 8),
            rule(3, 1, 1),
            rule(6, 2, 4),
        ];
        for (a, b) in [(0, 1), (1, 0), (2, 0), (0, 2), (3, 4), (4, 2)] {
            let (ra, rb) = (rules[a], rules[b]);
            let start = EpochProgress::default();
            let delivered: Vec<u64> = (0..ra.consumers).map(|c| 3 + c % 3).collect();
            let mut seen: Vec<u64> = (0..ra.consumers as usize)
                .flat_map(|c| start.positions_for(len, c, &ra).into_iter().take(delivered[c] as usize))
                .collect();
            let p = start.advance(len, &delivered, &ra);
            p.validate(len).unwrap();
            let covered: Vec<u64> = (0..p.consumed).chain(p.ahead.iter().copied()).collect();
            let mut s = seen.clone();
            s.sort_unstable();
            assert_eq!(s, covered, "{ra:?} -> progress {p:?}");
            seen.extend((0..rb.consumers as usize).flat_map(|c| p.positions_for(len, c, &rb)));
            seen.sort_unstable();
            assert_eq!(seen, (0..len).collect::<Vec<_>>(), "{ra:?} then {rb:?}");
        }
    }
}
