//! The order pinned to known values: a checkpoint written by one release must resume on the
//! next, so the samples at each position are a promise, not an implementation detail.
//! Every test here compares against values written down once (by this file's `render`) from
//! the build that made them; none compares a build with itself. Regenerate a table only
//! together with a new `ORDER_VERSION` (`engine/src/order/mod.rs`), which refuses the old
//! states by name.
//!
//! Also: two seeds give two orders, and a state saved under another seed, shuffle or
//! partitions is refused, naming the field.

use std::sync::Arc;

use ramjet_engine::order::{
    epoch_key, DealRule, EpochOrder, EpochProgress, OrderSpec, Shares, Shuffle, SourceShape, Tail, Topology, Weight,
};
use ramjet_engine::{Opened, Stream, StreamConfig, StreamState};

/// Samples per shard of the pinned source (36 samples in 8 shards of uneven sizes).
const COUNTS: [u64; 8] = [5, 3, 7, 4, 6, 2, 8, 1];

fn source() -> SourceShape {
    SourceShape::listed("golden-a", COUNTS.to_vec(), Weight::Natural)
}

fn mixed() -> Vec<SourceShape> {
    vec![
        source(),
        SourceShape::listed("golden-b", vec![4, 4, 4], Weight::Count(20)),
    ]
}

fn spec(seed: u64, shuffle: Shuffle, partitions: usize) -> OrderSpec {
    OrderSpec {
        seed,
        shuffle,
        partitions,
        tail: Tail::Uneven,
        shares: Shares::Rotate,
    }
}

const BLOCK_2_2: Shuffle = Shuffle::ShardBlock {
    window_shards: 2,
    block_samples: 2,
};
const BLOCK_4_1: Shuffle = Shuffle::ShardBlock {
    window_shards: 4,
    block_samples: 1,
};

/// The whole epoch as `source.shard.index` words (`shard.index` with one source).
fn render(sources: &[SourceShape], spec: &OrderSpec, epoch: u64) -> String {
    let order = Arc::new(EpochOrder::new(sources, spec, epoch).unwrap());
    let mut cursor = order.cursor();
    let words: Vec<String> = (0..order.len())
        .map(|g| {
            let (id, _) = cursor.at(g).unwrap();
            if sources.len() == 1 {
                format!("{}.{}", id.shard, id.index)
            } else {
                format!("{}.{}.{}", id.source, id.shard, id.index)
            }
        })
        .collect();
    words.join(" ")
}

/// Pinned epoch `name` of `tests/fixtures/order-v4.txt`.
fn golden(name: &str) -> String {
    let table = include_str!("../fixtures/order-v4.txt");
    let prefix = format!("{name}: ");
    table
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("tests/fixtures/order-v4.txt has no {name:?}"))
        .to_owned()
}

/// Compares every case with its pinned epoch, printing every mismatch (so that a deliberate
/// change of the order, with a new ORDER_VERSION, can rewrite the table from the output).
fn check(cases: &[(&str, Vec<SourceShape>, OrderSpec, u64, &str)]) {
    let mut bad = Vec::new();
    for (name, sources, spec, epoch, want) in cases {
        let got = render(sources, spec, *epoch);
        if got != *want {
            bad.push(format!("{name}:\n  want {want}\n  got  {got}"));
        }
    }
    assert!(bad.is_empty(), "the order changed:\n{}", bad.join("\n"));
}

#[test]
fn golden_order_of_every_shuffle_for_fixed_shapes_seeds_and_partitions() {
    let one = || vec![source()];
    check(&[
        ("none", one(), spec(0, Shuffle::None, 1), 0, &golden("none")),
        (
            "none, 3 partitions, seed 7",
            one(),
            spec(7, Shuffle::None, 3),
            0,
            &golden("none"),
        ),
        (
            "global seed 0",
            one(),
            spec(0, Shuffle::Global, 1),
            0,
            &golden("global_s0"),
        ),
        (
            "global seed 7",
            one(),
            spec(7, Shuffle::Global, 1),
            0,
            &golden("global_s7"),
        ),
        (
            "global seed 7 epoch 1",
            one(),
            spec(7, Shuffle::Global, 1),
            1,
            &golden("global_s7_e1"),
        ),
        (
            "block 2x2 seed 0",
            one(),
            spec(0, BLOCK_2_2, 1),
            0,
            &golden("block22_s0"),
        ),
        (
            "block 2x2 seed 7",
            one(),
            spec(7, BLOCK_2_2, 1),
            0,
            &golden("block22_s7"),
        ),
        (
            "block 2x2 seed 7, 3 partitions",
            one(),
            spec(7, BLOCK_2_2, 3),
            0,
            &golden("block22_s7_p3"),
        ),
        (
            "block 2x2 seed 7, 3 partitions, epoch 1",
            one(),
            spec(7, BLOCK_2_2, 3),
            1,
            &golden("block22_s7_p3_e1"),
        ),
        (
            "block 4x1 seed 7, 2 partitions",
            one(),
            spec(7, BLOCK_4_1, 2),
            0,
            &golden("block41_s7_p2"),
        ),
    ]);
}

#[test]
fn golden_order_of_a_mix_a_sticky_order_and_the_tails() {
    let one = || vec![source()];
    let sticky = OrderSpec {
        shares: Shares::Sticky,
        ..spec(7, BLOCK_2_2, 3)
    };
    let tail = |tail| OrderSpec {
        tail,
        ..spec(7, BLOCK_2_2, 1)
    };
    check(&[
        (
            "mix, block 2x2 seed 7",
            mixed(),
            spec(7, BLOCK_2_2, 1),
            0,
            &golden("mix_block22_s7"),
        ),
        (
            "mix, global seed 7",
            mixed(),
            spec(7, Shuffle::Global, 1),
            0,
            &golden("mix_global_s7"),
        ),
        ("sticky epoch 0", one(), sticky, 0, &golden("sticky_e0")),
        ("sticky epoch 1", one(), sticky, 1, &golden("sticky_e1")),
        // The tail changes how the order is dealt, never the order itself.
        ("drop last", one(), tail(Tail::DropLast), 0, &golden("block22_s7")),
        ("pad repeat", one(), tail(Tail::PadRepeat), 0, &golden("block22_s7")),
    ]);
}

/// The key every choice derives from, for fixed inputs (the key text of docs/order.md).
#[test]
fn golden_epoch_keys() {
    let keys: Vec<String> = [
        (spec(0, BLOCK_2_2, 1), 0),
        (spec(7, BLOCK_2_2, 1), 0),
        (spec(7, BLOCK_2_2, 1), 1),
        (spec(7, Shuffle::Global, 3), 0),
        (
            OrderSpec {
                shares: Shares::Sticky,
                ..spec(7, BLOCK_2_2, 3)
            },
            0,
        ),
    ]
    .iter()
    .map(|(s, e)| format!("{:016x}", epoch_key(&[source()], s, *e)))
    .collect();
    assert_eq!(keys, GOLDEN_KEYS, "the order's key text changed");
}

/// Who reads which positions: the deal of 4 ranks on 2 nodes over 4 partitions, and the rest
/// of each consumer's positions after a saved progress.
#[test]
fn golden_deal_of_ranks_on_nodes_and_after_a_saved_progress() {
    let spec = spec(7, BLOCK_2_2, 4);
    let len = EpochOrder::new(&[source()], &spec, 0).unwrap().len();
    let topo = Topology {
        world: 4,
        local_world: 2,
        ..Default::default()
    };
    let rule = DealRule::for_job(&spec, &topo);
    assert_eq!(rule.nodes, 2);
    let fresh = EpochProgress::default();
    let saved: EpochProgress = serde_json::from_str(GOLDEN_PROGRESS).unwrap();
    let got: Vec<(Vec<u64>, Vec<u64>)> = (0..4)
        .map(|c| (fresh.positions_for(len, c, &rule), saved.positions_for(len, c, &rule)))
        .collect();
    assert_eq!(got, golden_deal(), "the deal changed");
}

#[test]
fn two_seeds_give_two_orders_for_every_shuffle_but_none() {
    for shuffle in [BLOCK_2_2, BLOCK_4_1, Shuffle::Global] {
        for partitions in [1, 3] {
            let a = render(&[source()], &spec(1, shuffle, partitions), 0);
            let b = render(&[source()], &spec(2, shuffle, partitions), 0);
            assert_ne!(
                a, b,
                "{shuffle:?}, {partitions} partitions: seeds 1 and 2 gave one order"
            );
        }
    }
    let a = render(&[source()], &spec(1, Shuffle::None, 1), 0);
    assert_eq!(a, render(&[source()], &spec(2, Shuffle::None, 1), 0));
}

const GOLDEN_KEYS: [&str; 5] = [
    "487698d2d7636f12",
    "44aba340a9ffff06",
    "674587deaf710d89",
    "e487b149973f4a38",
    "567bf46f1d096ccf",
];
/// A progress as a state saves it: 9 positions consumed in order, 3 past them yielded ahead.
const GOLDEN_PROGRESS: &str = r#"{"epoch": 0, "consumed": 9, "ahead": [10, 12, 13]}"#;

fn golden_deal() -> Vec<(Vec<u64>, Vec<u64>)> {
    vec![
        (vec![0, 4, 8, 12, 16, 20, 24, 28, 32], vec![9, 17, 21, 25, 29, 33]),
        (vec![1, 5, 9, 13, 17, 21, 25, 29, 33], vec![16, 20, 24, 28, 32]),
        (vec![2, 6, 10, 14, 18, 22, 26, 30, 34], vec![11, 15, 19, 23, 27, 31, 35]),
        (vec![3, 7, 11, 15, 19, 23, 27, 31, 35], vec![14, 18, 22, 26, 30, 34]),
    ]
}

/// The synthetic set of 40 samples packed into 400 KiB shards on local disk: the same bytes
/// from every build (its manifest version is pinned below).
fn packed() -> String {
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(|| {
        ramjet_tests::once_per_run("golden-packed", || {
            let out = ramjet_tests::run_dir().join("golden-packed.d");
            let _ = std::fs::remove_dir_all(&out);
            let raw = ramjet_tests::synth_dataset(40);
            ramjet_tests::ramjet_ok(&[
                "pack",
                raw.to_str().unwrap(),
                out.to_str().unwrap(),
                "--shard-size",
                "400KiB",
            ]);
            out.to_string_lossy().into_owned()
        })
    })
    .clone()
}

fn stream_config(url: &str, order: OrderSpec) -> StreamConfig {
    let mut c = StreamConfig::new(url);
    c.topology = Topology {
        world: 2,
        ..Default::default()
    };
    c.order = order;
    c
}

/// A state this release wrote (consumer 0 of 2 after 7 samples, kept in
/// `tests/fixtures/state-order-v4.json`) resumes exactly: the rest of its deal is pinned, so a
/// later release that cannot resume it fails here rather than in someone's training run.
#[test]
fn golden_state_written_by_this_release_resumes_exactly() {
    let url = packed();
    let order = spec(7, BLOCK_2_2, 2);
    let state: StreamState = serde_json::from_str(GOLDEN_STATE).unwrap();
    let version = Stream::open(stream_config(&url, order))
        .unwrap()
        .dataset(0)
        .manifest()
        .version
        .clone();
    assert_eq!(
        state.versions,
        [version],
        "the synthetic set packs to other bytes now (ramjet synth or pack changed): the fixture's dataset is gone"
    );
    let mut c = stream_config(&url, order);
    c.resume_consumer = Some(state);
    let rest: Vec<String> = Stream::open(c)
        .unwrap()
        .map(|s| {
            let s = s.unwrap();
            format!("{}:{}.{}", s.position, s.id.shard, s.id.index)
        })
        .collect();
    assert_eq!(
        rest.join(" "),
        GOLDEN_STATE_REST,
        "the rest of a saved state's deal changed; this build would write:\n{}",
        the_golden_state_of_this_build(&url)
    );
}

/// A saved state under another seed, shuffle, partitions, tail or shares is refused, naming the
/// field and both values; the same state under its own order resumes.
#[test]
fn a_state_under_another_seed_shuffle_or_partitions_is_refused_naming_the_field() {
    let url = packed();
    let order = spec(7, BLOCK_2_2, 2);
    let state: StreamState = serde_json::from_str(GOLDEN_STATE).unwrap();
    let others = [
        (OrderSpec { seed: 8, ..order }, "seed 7 when saved, 8 now"),
        (
            OrderSpec {
                shuffle: BLOCK_4_1,
                ..order
            },
            "shuffle ShardBlock { window_shards: 2, block_samples: 2 } when saved",
        ),
        (
            OrderSpec {
                shuffle: Shuffle::Global,
                ..order
            },
            "shuffle ShardBlock",
        ),
        (OrderSpec { partitions: 1, ..order }, "partitions 2 when saved, 1 now"),
        (
            OrderSpec {
                tail: Tail::DropLast,
                ..order
            },
            "tail Uneven when saved, DropLast now",
        ),
        (
            OrderSpec {
                shares: Shares::Sticky,
                ..order
            },
            "shares Rotate when saved, Sticky now",
        ),
    ];
    for (other, names) in others {
        let mut c = stream_config(&url, other);
        c.resume_consumer = Some(state.clone());
        let e = Stream::open(c)
            .err()
            .expect("a state under another order must be refused")
            .to_string();
        assert!(e.contains("different order") && e.contains(names), "{other:?}: {e}");
    }
    let mut c = stream_config(&url, order);
    c.resume_consumer = Some(state);
    assert!(Stream::open(c).is_ok());
}

/// Written by ramjet 0.1.0 (ORDER_VERSION 4), as `the_golden_state_of_this_build` shows it.
const GOLDEN_STATE: &str = include_str!("../fixtures/state-order-v4.json");
const GOLDEN_STATE_REST: &str =
    "14:3.4 16:2.0 18:2.1 20:4.2 22:4.3 24:4.4 26:4.5 28:4.0 30:4.1 32:5.0 34:5.1 36:5.2 38:5.3";

/// What this build writes for the two constants above (shown when the pinned ones fail, to
/// write a new fixture together with a new ORDER_VERSION).
fn the_golden_state_of_this_build(url: &str) -> String {
    let mut s = Stream::open(stream_config(url, spec(7, BLOCK_2_2, 2))).unwrap();
    for _ in 0..7 {
        s.next_sample().unwrap().unwrap();
    }
    let state = serde_json::to_string(&s.state().unwrap()).unwrap();
    let rest: Vec<String> = s
        .map(|x| {
            let x = x.unwrap();
            format!("{}:{}.{}", x.position, x.id.shard, x.id.index)
        })
        .collect();
    format!(
        "tests/fixtures/state-order-v4.json: {state}\nGOLDEN_STATE_REST: {}",
        rest.join(" ")
    )
}
