//! Token streams (`ramjet_engine::tokens`) over a real packed dataset of documents with known
//! tokens: the windows of an epoch, reassembled by index, are the documents of the epoch's
//! order concatenated with their end-of-document tokens, for any topology; a job resumed from
//! its consumers' states at different steps, on another world size, delivers exactly the
//! windows not yet delivered.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use ramjet_engine::format::ValueRef;
use ramjet_engine::order::{OrderSpec, Shuffle, Tail, Topology};
use ramjet_engine::tokens::{TokenConfig, TokenDtype, TokenOptions, TokenResume, TokenState, TokenStream};
use ramjet_engine::{Stream, StreamConfig};
use ramjet_tests::{once_per_run, ramjet_ok};

const DOCS: usize = 300;
const EOS: i64 = 0;

/// Document `d`'s tokens: lengths from 0 to 640, values that name the document and the place.
fn doc_tokens(d: usize) -> Vec<i64> {
    let n = (d * 7919 + 13) % 641;
    (0..n).map(|j| (d * 1000 + j + 1) as i64).collect()
}

/// The documents packed once per run as `tokens: int32[]` into shards of about 8 KiB.
fn dataset() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        once_per_run("token-dataset", || {
            let dir = std::env::temp_dir().join(format!("ramjet-token-test-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let mut jsonl = String::new();
            for d in 0..DOCS {
                jsonl.push_str(&format!("{{\"id\": {d}, \"tokens\": {:?}}}\n", doc_tokens(d)));
            }
            let src = dir.join("docs.jsonl");
            std::fs::write(&src, jsonl).unwrap();
            let dst: PathBuf = dir.join("packed");
            ramjet_ok(&[
                "pack",
                src.to_str().unwrap(),
                dst.to_str().unwrap(),
                "--column",
                "tokens:int32[]",
                "--shard-size",
                "8KiB",
            ]);
            dst.to_string_lossy().into_owned()
        })
    })
}

fn order() -> OrderSpec {
    OrderSpec {
        seed: 11,
        shuffle: Shuffle::ShardBlock {
            window_shards: 3,
            block_samples: 2,
        },
        partitions: 2,
        tail: Tail::Uneven,
        ..Default::default()
    }
}

fn stream_config(topo: Topology) -> StreamConfig {
    let mut c = StreamConfig::new(dataset());
    c.order = order();
    c.topology = topo;
    c
}

fn options(seq_len: usize, batch: usize) -> TokenOptions {
    TokenOptions {
        seq_len,
        eos: Some(EOS),
        batch_size: batch,
        dtype: TokenDtype::Int32,
        boundaries: true,
        ..Default::default()
    }
}

/// The epoch's documents in order (read by an ordinary one-consumer stream), concatenated,
/// each followed by EOS.
fn expected_concatenation() -> Vec<i64> {
    let s = Stream::open(stream_config(Topology::default())).unwrap();
    let mut out = Vec::new();
    let mut seen = 0;
    for x in s {
        let x = x.unwrap();
        let vals = x.values().unwrap();
        let ValueRef::Int64(id) = vals[0] else {
            panic!("id column")
        };
        let ValueRef::Array(a) = vals[1] else {
            panic!("tokens column")
        };
        let want = doc_tokens(id as usize);
        let got: Vec<i64> = a
            .data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
            .collect();
        assert_eq!(got, want, "document {id} as packed");
        out.extend(want);
        out.push(EOS);
        seen += 1;
    }
    assert_eq!(seen, DOCS);
    out
}

type Windows = BTreeMap<u64, (Vec<i64>, i32, Vec<i32>, Vec<i32>)>;

/// Drains a stream (at most `batches` batches), adding its windows to `out` (refusing a
/// window seen twice); returns the state after the last batch taken.
fn drain(s: &mut TokenStream, seq_len: usize, batches: usize, out: &mut Windows) -> TokenState {
    let w = seq_len + 1;
    for _ in 0..batches {
        let Some(b) = s.next_batch().unwrap() else { break };
        let pos = b.positions.as_ref().unwrap();
        let seg = b.segments.as_ref().unwrap();
        for (r, &win) in b.windows.iter().enumerate() {
            let toks = (0..w).map(|i| b.tokens.get(r * w + i)).collect();
            let prev = out.insert(
                win,
                (
                    toks,
                    b.lengths[r],
                    pos[r * w..(r + 1) * w].to_vec(),
                    seg[r * w..(r + 1) * w].to_vec(),
                ),
            );
            assert!(prev.is_none(), "window {win} delivered twice");
        }
    }
    s.state()
}

fn open(topo: Topology, opts: &TokenOptions, resume: Option<TokenResume>) -> TokenStream {
    TokenStream::open(TokenConfig {
        stream: stream_config(topo),
        tokens: opts.clone(),
        epoch: 0,
        resume,
    })
    .unwrap()
}

fn topo(rank: usize, world: usize, worker: usize, workers: usize) -> Topology {
    Topology {
        rank,
        world,
        worker,
        workers,
        ..Default::default()
    }
}

/// Every window of the epoch once, each equal to its span of the concatenation; the position
/// and segment of each token agree with the documents' boundaries.
fn check_epoch(all: &Windows, seq_len: usize, concat: &[i64], padded: bool) {
    let w = seq_len + 1;
    let full = concat.len() / w;
    let count = if padded && concat.len() % w != 0 {
        full + 1
    } else {
        full
    };
    assert_eq!(
        all.keys().copied().collect::<Vec<_>>(),
        (0..count as u64).collect::<Vec<_>>(),
        "windows delivered"
    );
    for (&k, (toks, len, pos, seg)) in all {
        let from = k as usize * w;
        let real = (concat.len() - from).min(w);
        assert_eq!(*len as usize, real, "window {k}'s length");
        assert_eq!(&toks[..real], &concat[from..from + real], "window {k}'s tokens");
        for i in 0..real {
            // A document starts after an EOS (or at the epoch's start).
            let g = from + i;
            let doc_start = g == 0 || concat[g - 1] == EOS;
            if doc_start {
                assert_eq!(pos[i], 0, "window {k} token {i} starts a document");
            } else if i > 0 {
                assert_eq!(pos[i], pos[i - 1] + 1, "window {k} token {i}'s position");
            }
            let want_seg = if i == 0 { 0 } else { seg[i - 1] + doc_start as i32 };
            assert_eq!(seg[i], want_seg, "window {k} token {i}'s segment");
        }
        assert!(seg[real..w].iter().all(|&s| s == -1), "window {k}'s padding");
    }
}

#[test]
fn the_windows_of_an_epoch_are_the_documents_concatenated_for_every_topology() {
    let concat = expected_concatenation();
    for seq_len in [7, 128] {
        let opts = options(seq_len, 5);
        for (world, workers) in [(1, 1), (2, 1), (3, 1), (8, 1), (2, 4)] {
            let mut all = Windows::new();
            for rank in 0..world {
                for worker in 0..workers {
                    let mut s = open(topo(rank, world, worker, workers), &opts, None);
                    let st = drain(&mut s, seq_len, usize::MAX, &mut all);
                    assert_eq!(st.next, None, "a drained consumer has no window left");
                }
            }
            check_epoch(&all, seq_len, &concat, false);
        }
    }
    // Padded: the last, partial window too.
    let mut opts = options(100, 3);
    opts.pad = Some(99_999_999);
    let mut all = Windows::new();
    for rank in 0..3 {
        let mut s = open(topo(rank, 3, 0, 1), &opts, None);
        drain(&mut s, 100, usize::MAX, &mut all);
    }
    assert!(concat.len() % 101 != 0, "the test needs a partial window");
    check_epoch(&all, 100, &concat, true);
    let last = all.values().last().unwrap();
    assert!(last.0[last.1 as usize..].iter().all(|&t| t == 99_999_999));
}

#[test]
fn a_job_resumed_from_states_at_different_steps_on_another_world_size_delivers_exactly_the_rest() {
    let concat = expected_concatenation();
    let seq_len = 31;
    let opts = options(seq_len, 4);
    for (from, to, steps) in [
        (4usize, 2usize, [3usize, 1, 5, 2]),
        (3, 8, [0, 4, 2, 0]),
        (2, 5, [6, 1, 0, 0]),
    ] {
        let mut all = Windows::new();
        let states: Vec<TokenState> = (0..from)
            .map(|r| {
                let mut s = open(topo(r, from, 0, 1), &opts, None);
                drain(&mut s, seq_len, steps[r], &mut all)
            })
            .collect();
        let point = TokenState::combine(&states).unwrap();
        // Through JSON, as a checkpoint keeps it.
        let point: TokenResume = serde_json::from_str(&serde_json::to_string(&point).unwrap()).unwrap();
        assert_eq!(point.epoch, 0);
        // A second interruption, on the new world size, before finishing.
        let states: Vec<TokenState> = (0..to)
            .map(|r| {
                let mut s = open(topo(r, to, 0, 1), &opts, Some(point.clone()));
                drain(&mut s, seq_len, r % 3, &mut all)
            })
            .collect();
        let point = TokenState::combine(&states).unwrap();
        for r in 0..3 {
            let mut s = open(topo(r, 3, 0, 1), &opts, Some(point.clone()));
            drain(&mut s, seq_len, usize::MAX, &mut all);
        }
        check_epoch(&all, seq_len, &concat, false);
        // The finished job's states say the epoch is over.
    }
}

#[test]
fn a_finished_job_moves_to_the_next_epoch_and_bad_states_are_refused() {
    let opts = options(64, 8);
    let states: Vec<TokenState> = (0..2)
        .map(|r| {
            let mut s = open(topo(r, 2, 0, 1), &opts, None);
            let mut all = Windows::new();
            drain(&mut s, 64, usize::MAX, &mut all)
        })
        .collect();
    let point = TokenState::combine(&states).unwrap();
    assert_eq!((point.epoch, point.start.window, point.ahead.len()), (1, 0, 0));

    let mut s = open(topo(0, 1, 0, 1), &opts, None);
    s.next_batch().unwrap().unwrap();
    let state = s.state();
    let point = TokenState::combine(std::slice::from_ref(&state)).unwrap();
    let refused = |p: TokenResume, o: &TokenOptions, needle: &str| {
        let e = TokenStream::open(TokenConfig {
            stream: stream_config(Topology::default()),
            tokens: o.clone(),
            epoch: 0,
            resume: Some(p),
        })
        .err()
        .unwrap_or_else(|| panic!("a state with {needle} should be refused"));
        assert!(e.to_string().contains(needle), "{e}");
    };
    let mut other = opts.clone();
    other.seq_len = 65;
    refused(point.clone(), &other, "seq_len 64, not 65");
    let mut p = point.clone();
    p.start.offset = 1 << 40;
    refused(p, &opts, "past document");
    let mut p = point.clone();
    p.start.doc = 1 << 40;
    refused(p, &opts, "resume state");
    let mut p = point.clone();
    p.ahead = vec![p.start.window];
    refused(p, &opts, "ahead");
    let mut p = point.clone();
    p.versions = vec!["0000".into()];
    refused(p, &opts, "resume state");
    // Two states of one consumer, or of another job, do not combine.
    assert!(TokenState::combine(&[state.clone(), state.clone()]).is_err());
    let mut st2 = state.clone();
    st2.consumers = 2;
    st2.consumer = 1;
    assert!(TokenState::combine(&[state, st2]).is_err());
}

/// A token the output type cannot hold is an error naming its sample and column, raised by
/// the batch that holds it (the batches before it are whole), and the stream's state stays
/// after the last batch delivered.
#[test]
fn a_token_out_of_the_output_range_fails_its_batch_naming_the_sample() {
    let dir = std::env::temp_dir().join(format!("ramjet-token-range-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut jsonl = String::new();
    for d in 0..40u64 {
        // Document 30 holds a token past int32 (packed as int64, read as int32).
        let bad = if d == 30 { ", 4294967296" } else { "" };
        jsonl.push_str(&format!("{{\"tokens\": [{}, {}{bad}]}}\n", d + 1, d + 2));
    }
    let src = dir.join("docs.jsonl");
    std::fs::write(&src, jsonl).unwrap();
    let dst = dir.join("packed");
    ramjet_ok(&[
        "pack",
        src.to_str().unwrap(),
        dst.to_str().unwrap(),
        "--column",
        "tokens:int64[]",
    ]);
    let mut s = TokenStream::open(TokenConfig {
        stream: StreamConfig::new(dst.to_str().unwrap()),
        tokens: TokenOptions {
            seq_len: 3,
            eos: Some(0),
            batch_size: 2,
            dtype: TokenDtype::Int32,
            ..Default::default()
        },
        epoch: 0,
        resume: None,
    })
    .unwrap();
    let (mut good, mut last) = (0, None);
    let err = loop {
        match s.next_batch() {
            Ok(Some(b)) => {
                assert_eq!(b.tokens.len(), b.windows.len() * 4, "whole rows");
                good += 1;
                last = Some(b.state.clone());
            }
            Ok(None) => panic!("the epoch ended without the bad token's error"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(good > 0, "the batches before the bad token were delivered");
    assert!(
        err.contains("4294967296") && err.contains("\"tokens\"") && err.contains("sample"),
        "{err}"
    );
    let st = serde_json::to_string(&s.state()).unwrap();
    assert_eq!(
        st,
        serde_json::to_string(&last.unwrap()).unwrap(),
        "the state stays after the last batch"
    );
    assert!(s.next_batch().unwrap().is_none(), "a failed stream ends");
    let _ = std::fs::remove_dir_all(&dir);
}
