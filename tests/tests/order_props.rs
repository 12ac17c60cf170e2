//! Property tests of the lazy order (`engine/src/order.rs`, `docs/order.md`): the keyed
//! permutation is a bijection; every epoch's order takes each of its samples as often as the
//! mixing says; the deal gives every position to exactly one consumer for any consumer count;
//! and a job resumed under another world size delivers the rest of the epoch exactly once.

use std::collections::HashMap;
use std::sync::Arc;

use proptest::prelude::*;
use ramjet_engine::order::{
    effective_len, global_order, DealRule, EpochOrder, EpochProgress, OrderSpec, Perm, SampleRef, Shares, Shuffle,
    SourceShape, Tail, Weight,
};

fn shuffles() -> impl Strategy<Value = Shuffle> {
    prop_oneof![
        Just(Shuffle::None),
        Just(Shuffle::Global),
        (1usize..6, 1u64..5).prop_map(|(w, b)| Shuffle::ShardBlock {
            window_shards: w,
            block_samples: b,
        }),
    ]
}

/// Whether the shard-block rounds are drawn per epoch or once per seed.
fn shares() -> impl Strategy<Value = Shares> {
    prop_oneof![Just(Shares::Rotate), Just(Shares::Sticky)]
}

/// A job's deal: position by position round 1 to 8 consumers, or node-affine over 2 to 4
/// nodes of 1 to 3 consumers each, with 1 to 3 partitions a node.
fn rules() -> impl Strategy<Value = DealRule> {
    prop_oneof![
        (1usize..9).prop_map(DealRule::strided),
        (2u64..5, 1u64..4, 1u64..4).prop_map(|(nodes, per, w)| DealRule {
            consumers: nodes * per,
            nodes,
            partitions: nodes * w,
        }),
    ]
}

fn weights() -> impl Strategy<Value = Weight> {
    prop_oneof![
        Just(Weight::Natural),
        (0u32..30).prop_map(|f| Weight::Repeat(f as f64 / 10.0)),
        (0u64..200).prop_map(Weight::Count),
        (1u32..5).prop_map(|p| Weight::Proportion(p as f64)),
    ]
}

fn streams() -> impl Strategy<Value = Vec<SourceShape>> {
    prop::collection::vec((prop::collection::vec(0u64..40, 1..12), weights()), 1..4).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (shard_samples, weight))| SourceShape::listed(format!("v{i}"), shard_samples, weight))
            .collect()
    })
}

/// The epoch's samples with their multiplicity, from the units (unshuffled).
fn units_multiset(order: &EpochOrder) -> HashMap<SampleRef, u64> {
    let mut m = HashMap::new();
    for u in 0..order.units() {
        let unit = order.unit(u).unwrap();
        for i in unit.first..unit.first + unit.len {
            let r = SampleRef {
                source: unit.source as u32,
                shard: unit.shard as u32,
                index: i as u32,
            };
            *m.entry(r).or_insert(0) += 1;
        }
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The Feistel permutation with cycle walking is a bijection of [0, n) for every n and key.
    #[test]
    fn perm_is_a_bijection(n in 0u64..3000, key in any::<u64>()) {
        let p = Perm::new(n, key);
        let mut seen = vec![false; n as usize];
        for x in 0..n {
            let y = p.apply(x);
            prop_assert!(y < n);
            prop_assert!(!seen[y as usize], "{y} hit twice");
            seen[y as usize] = true;
        }
    }

    /// The order is a permutation of the epoch's samples (as many of each as the mixing takes),
    /// the same on every call, and with the shard-block shuffle it keeps `partitions x window`
    /// units per round.
    #[test]
    fn the_order_takes_each_sample_as_the_mixing_says(
        st in streams(), shuffle in shuffles(), partitions in 1usize..4, seed in any::<u64>(), epoch in 0u64..3,
        shares in shares(),
    ) {
        let spec = OrderSpec { seed, shuffle, partitions, tail: Tail::Uneven, shares };
        let order = EpochOrder::new(&st, &spec, epoch).unwrap();
        let g = global_order(&st, &spec, epoch).unwrap();
        prop_assert_eq!(g.len() as u64, order.len());
        let mut got: HashMap<SampleRef, u64> = HashMap::new();
        for r in &g {
            *got.entry(*r).or_insert(0) += 1;
        }
        prop_assert_eq!(got, units_multiset(&order));
        prop_assert_eq!(&g, &global_order(&st, &spec, epoch).unwrap());
        for s in 0..st.len() {
            let n = g.iter().filter(|r| r.source as usize == s).count() as u64;
            prop_assert_eq!(n, ramjet_engine::order::source_take(&st, s), "stream {}", s);
        }
    }

    /// Every position of the tail-adjusted order goes to exactly one consumer, for any consumer
    /// count, and reassembling the consumers' samples by position gives the one global order.
    #[test]
    fn every_position_dealt_exactly_once(
        st in streams(), shuffle in shuffles(), rule in rules(), tail_i in 0usize..3, seed in any::<u64>(),
        shares in shares(),
    ) {
        let tail = [Tail::Uneven, Tail::DropLast, Tail::PadRepeat][tail_i];
        let spec = OrderSpec { seed, shuffle, partitions: rule.partitions as usize, tail, shares };
        let order = Arc::new(EpochOrder::new(&st, &spec, 1).unwrap());
        prop_assume!(!order.is_empty());
        let consumers = rule.consumers as usize;
        let len = effective_len(order.len(), &rule, tail);
        let g = global_order(&st, &spec, 1).unwrap();
        let mut hit = vec![0u32; len as usize];
        for c in 0..consumers {
            let deal = EpochProgress::default().deal(len, c, &rule);
            let mut cur = order.cursor();
            for k in 0..deal.len() {
                let p = deal.position(k);
                hit[p as usize] += 1;
                prop_assert_eq!(cur.at(p).unwrap().0, g[order.wrapped(p).1 as usize]);
                let columns_full = order.len() >= rule.partitions;
                if p >= order.len() && columns_full && rule.nodes > 1 && matches!(shuffle, Shuffle::ShardBlock { .. }) {
                    // Padding stays in the position's column, so on the node that reads it
                    // (when every column has a sample: `docs/order.md`, the tail table).
                    prop_assert_eq!(order.wrapped(p).1 % rule.partitions, p % rule.partitions);
                }
            }
        }
        prop_assert!(hit.iter().all(|&h| h == 1), "a position dealt {:?} times", hit.iter().find(|&&h| h != 1));
    }

    /// A job of `c1` consumers stops after each delivered some of its deal; resumed with `c2`
    /// consumers from the combined progress (twice, through another stop), every position is
    /// delivered exactly once overall.
    #[test]
    fn resume_across_world_sizes_delivers_the_rest_once(
        len in 0u64..400, r1 in rules(), r2 in rules(), r3 in rules(),
        f1 in prop::collection::vec(0u64..100, 8), f2 in prop::collection::vec(0u64..100, 8),
    ) {
        let mut delivered = vec![0u32; len as usize];
        let mut progress = EpochProgress::default();
        for (rule, frac) in [(r1, &f1), (r2, &f2)] {
            let mut counts = Vec::new();
            let frac: Vec<u64> = (0..rule.consumers as usize).map(|c| frac[c % frac.len()]).collect();
            for (c, f) in frac.iter().enumerate() {
                let deal = progress.deal(len, c, &rule);
                let n = deal.len() * f / 100;
                for k in 0..n {
                    delivered[deal.position(k) as usize] += 1;
                }
                counts.push(n);
            }
            progress = progress.advance(len, &counts, &rule);
            prop_assert!(progress.validate(len).is_ok());
        }
        for c in 0..r3.consumers as usize {
            let deal = progress.deal(len, c, &r3);
            for k in 0..deal.len() {
                delivered[deal.position(k) as usize] += 1;
            }
        }
        prop_assert!(delivered.iter().all(|&d| d == 1));
    }
}

/// A cursor asked for positions out of order (a consumer resumed, or padding that wraps to the
/// start) gives the same samples as one walked in order.
#[test]
fn a_cursor_answers_any_position() {
    let st = vec![SourceShape::listed(
        "v",
        vec![13, 0, 7, 29, 1, 16, 16, 5],
        Weight::Repeat(1.5),
    )];
    for shuffle in [
        Shuffle::None,
        Shuffle::Global,
        Shuffle::ShardBlock {
            window_shards: 3,
            block_samples: 2,
        },
    ] {
        let spec = OrderSpec {
            seed: 9,
            shuffle,
            partitions: 3,
            tail: Tail::PadRepeat,
            ..Default::default()
        };
        let order = Arc::new(EpochOrder::new(&st, &spec, 4).unwrap());
        let g = global_order(&st, &spec, 4).unwrap();
        let mut cur = order.cursor();
        for p in [50u64, 3, 3, 120, 0, 200, 131, 7] {
            assert_eq!(
                cur.at(p).unwrap().0,
                g[order.wrapped(p).1 as usize],
                "{shuffle:?} position {p}"
            );
        }
    }
}

/// Regression (found by the property above): a count asked of a stream with no samples took
/// one position in the epoch's length but none in its order, so the length told to a loader
/// disagreed with what it was given. An empty stream now takes nothing, whatever its weight.
#[test]
fn an_empty_source_takes_nothing_whatever_its_weight() {
    for weight in [Weight::Count(1), Weight::Repeat(2.0), Weight::Proportion(1.0)] {
        let st = vec![SourceShape::listed("e", vec![0, 0], weight)];
        assert_eq!(ramjet_engine::order::epoch_positions(&st), Some(0), "{weight:?}");
        assert!(EpochOrder::new(&st, &OrderSpec::default(), 0).unwrap().is_empty());
    }
}
