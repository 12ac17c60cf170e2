//! The streaming engine against the real local S3 server: exactly-once delivery and one global
//! order for every topology, resume after SIGKILL and across world sizes, the cache budget,
//! corrupted cache files, and the origin going away mid-epoch.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ramjet_engine::cache::CacheConfig;
use ramjet_engine::order::{EpochProgress, OrderSpec, SampleRef, Shuffle, Tail, Topology, Weight};
use ramjet_engine::{Opened, SampleReader, SourceConfig, Stream, StreamConfig, StreamState};
use ramjet_tests::{once_per_run, ramjet, ramjet_bin, ramjet_ok, s3, s3_prefix, synth_dataset, text};

const N: usize = 40;

/// The synthetic set packed once per test run into small shards on S3.
fn dataset() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        s3();
        once_per_run("stream-dataset", || {
            let url = s3_prefix("stream");
            ramjet_ok(&[
                "pack",
                synth_dataset(N).to_str().unwrap(),
                &url,
                "--shard-size",
                "400KiB",
            ]);
            url
        })
    })
}

/// Rank `rank` of `world`, one worker each.
fn rank_of(rank: usize, world: usize) -> Topology {
    Topology {
        rank,
        world,
        ..Default::default()
    }
}

fn config(url: &str, topo: Topology, cache: Option<&Path>) -> StreamConfig {
    let mut c = StreamConfig::new(url);
    c.topology = topo;
    c.order = OrderSpec {
        seed: 7,
        shuffle: Shuffle::ShardBlock {
            window_shards: 2,
            block_samples: 2,
        },
        partitions: 2,
        tail: Tail::Uneven,
        ..Default::default()
    };
    c.cache = cache.map(|d| CacheConfig::new(d, 1 << 30));
    c
}

/// Runs every consumer of a topology to the end; returns (position, sample) per consumer.
fn run_job(url: &str, world: usize, workers: usize, cache: &Path, tail: Tail) -> Vec<Vec<(u64, SampleRef)>> {
    let mut out = Vec::new();
    for rank in 0..world {
        for worker in 0..workers {
            let mut c = config(
                url,
                Topology {
                    rank,
                    world,
                    worker,
                    workers,
                    ..Default::default()
                },
                Some(cache),
            );
            c.order.tail = tail;
            let s = Stream::open(c).unwrap();
            out.push(
                s.map(|x| x.map(|x| (x.position, x.id)))
                    .collect::<Result<Vec<_>, _>>()
                    .unwrap(),
            );
        }
    }
    out
}

#[test]
fn every_sample_once_and_one_global_order_for_every_topology() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    let reference: BTreeMap<u64, SampleRef> = run_job(url, 1, 1, cache.path(), Tail::Uneven)
        .into_iter()
        .flatten()
        .collect();
    assert_eq!(reference.len(), N);
    for world in [1, 2, 3, 8] {
        for workers in [1, 4] {
            let per = run_job(url, world, workers, cache.path(), Tail::Uneven);
            let all: Vec<(u64, SampleRef)> = per.iter().flatten().copied().collect();
            let mut ids: Vec<SampleRef> = all.iter().map(|x| x.1).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), N, "world {world} x {workers}: not every sample exactly once");
            assert_eq!(all.len(), N, "world {world} x {workers}: duplicates");
            let by_pos: BTreeMap<u64, SampleRef> = all.into_iter().collect();
            assert_eq!(by_pos, reference, "world {world} x {workers}: the global order changed");
        }
    }
}

#[test]
fn tails_drop_or_pad_evenly() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    // 40 samples over 3 x 4 = 12 consumers.
    let drop = run_job(url, 3, 4, cache.path(), Tail::DropLast);
    assert!(
        drop.iter().all(|c| c.len() == 3),
        "drop-last: {:?}",
        drop.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let pad = run_job(url, 3, 4, cache.path(), Tail::PadRepeat);
    assert!(pad.iter().all(|c| c.len() == 4));
    let mut ids: Vec<SampleRef> = pad.iter().flatten().map(|x| x.1).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), N, "padding must still cover every sample");
}

#[test]
fn resume_after_a_world_size_change_delivers_exactly_the_rest() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    // Two consumers read 7 and 5 samples, then the job stops.
    let mut states = Vec::new();
    let mut seen = Vec::new();
    for (rank, k) in [(0usize, 7usize), (1, 5)] {
        let mut s = Stream::open(config(url, rank_of(rank, 2), Some(cache.path()))).unwrap();
        for _ in 0..k {
            let x = s.next_sample().unwrap().unwrap();
            seen.push((x.position, x.id));
        }
        states.push(s.state().unwrap());
    }
    let point = StreamState::job_progress(&states).unwrap();
    // It resumes on three consumers.
    for rank in 0..3 {
        let mut c = config(url, rank_of(rank, 3), Some(cache.path()));
        c.resume = Some(point.clone());
        let mut last = None;
        for x in Stream::open(c).unwrap() {
            let x = x.unwrap();
            // Each consumer goes on in the order's direction.
            assert!(last < Some(x.position), "consumer {rank} of 3 went back in the order");
            last = Some(x.position);
            seen.push((x.position, x.id));
        }
    }
    let mut ids: Vec<SampleRef> = seen.iter().map(|x| x.1).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(
        (seen.len(), ids.len()),
        (N, N),
        "samples lost or repeated across the resume"
    );
    // Not only the same set: every position holds the sample the one global order puts there
    // (the order after the resume at a new world size is the order without it).
    let reference: BTreeMap<u64, SampleRef> = run_job(url, 1, 1, cache.path(), Tail::Uneven)
        .into_iter()
        .flatten()
        .collect();
    let by_pos: BTreeMap<u64, SampleRef> = seen.into_iter().collect();
    assert_eq!(by_pos, reference, "the order changed across the resume");
}

/// The exactly-once audit of a job's combined states (Issue 42).
fn audit_of(url: &str, states: &[StreamState]) -> ramjet_engine::stream::AuditReport {
    let (point, len) = StreamState::combine(states).unwrap();
    let mut cfg = config(url, Topology::default(), None);
    cfg.order = point.order;
    ramjet_engine::rt::block_on(ramjet_engine::stream::audit(&cfg, &point, Some(len)))
        .unwrap()
        .unwrap()
}

/// Issue 42, the exactly-once proof: ranks at different steps save, the job resumes on another
/// world size (4→2, 4→8, 3→5), checkpoints again mid-epoch and finishes; the audit of the
/// combined states says "exactly once" at every checkpoint and "the whole epoch" at the end,
/// and the samples really were each delivered once.
#[test]
fn the_audit_holds_across_world_size_changes_with_ranks_at_different_steps() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    for (from, to) in [(4usize, 2usize), (4, 8), (3, 5)] {
        let mut seen = Vec::new();
        let mut states = Vec::new();
        for rank in 0..from {
            let mut s = Stream::open(config(url, rank_of(rank, from), Some(cache.path()))).unwrap();
            for _ in 0..rank + 2 {
                seen.push(s.next_sample().unwrap().unwrap().id);
            }
            states.push(s.state().unwrap());
        }
        let r = audit_of(url, &states);
        assert!(r.exactly_once && !r.complete, "{from}->{to} first checkpoint: {r:?}");
        assert_eq!(r.delivered, seen.len() as u64);
        let point = StreamState::job_progress(&states).unwrap();
        assert_eq!(point.audit.count, seen.len() as u64);
        // The new world reads a little (ranks at different steps), checkpoints, then finishes.
        let mut streams: Vec<Stream> = (0..to)
            .map(|rank| {
                let mut c = config(url, rank_of(rank, to), Some(cache.path()));
                c.resume = Some(point.clone());
                Stream::open(c).unwrap()
            })
            .collect();
        let mut mid = Vec::new();
        for (rank, s) in streams.iter_mut().enumerate() {
            for _ in 0..rank % 3 + 1 {
                seen.push(s.next_sample().unwrap().unwrap().id);
            }
            mid.push(s.state().unwrap());
        }
        let r = audit_of(url, &mid);
        assert!(r.exactly_once && !r.complete, "{from}->{to} second checkpoint: {r:?}");
        let mut last = Vec::new();
        for mut s in streams {
            let mut st = None;
            while let Some(x) = s.next_sample().unwrap() {
                seen.push(x.id);
                st = s.state();
            }
            last.push(st.unwrap_or_else(|| s.state().unwrap()));
        }
        let r = audit_of(url, &last);
        assert!(r.exactly_once && r.complete, "{from}->{to} end: {r:?}");
        assert_eq!((r.delivered, r.len), (N as u64, N as u64));
        let mut ids = seen.clone();
        ids.sort();
        ids.dedup();
        assert_eq!(
            (seen.len(), ids.len()),
            (N, N),
            "{from}->{to}: the audit agreed with a wrong delivery"
        );
    }
}

/// The audit catches a replayed batch and a skipped one: a job state whose progress was set back
/// by 4 samples (or forward by 4) while the consumers' record was kept, as a resume that loses
/// or invents progress would. Each count is named.
#[test]
fn the_audit_catches_a_replayed_and_a_skipped_batch() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    let mut s = Stream::open(config(url, Topology::default(), Some(cache.path()))).unwrap();
    for _ in 0..10 {
        s.next_sample().unwrap().unwrap();
    }
    let point = StreamState::job_progress(&[s.state().unwrap()]).unwrap();
    drop(s);
    assert_eq!((point.progress.consumed, point.audit.count), (10, 10));
    for (consumed, needle) in [(6u64, "4 delivered more than once"), (14, "4 skipped")] {
        let mut p = point.clone();
        p.progress.consumed = consumed;
        let mut c = config(url, Topology::default(), Some(cache.path()));
        c.resume = Some(p);
        let mut s = Stream::open(c).unwrap();
        let mut st = None;
        while s.next_sample().unwrap().is_some() {
            st = s.state();
        }
        let r = audit_of(url, &[st.unwrap()]);
        assert!(!r.exactly_once, "{consumed}: {r:?}");
        assert!(r.message.contains(needle), "{consumed}: {}", r.message);
    }
}

#[test]
fn resume_on_changed_data_is_refused() {
    let url = dataset();
    let mut c = config(url, Topology::default(), None);
    c.resume = Some(ramjet_engine::stream::ResumePoint {
        order_version: ramjet_engine::order::ORDER_VERSION,
        versions: vec!["0123".into()],
        order: c.order,
        progress: EpochProgress::default(),
        audit: Default::default(),
    });
    let e = Stream::open(c).err().expect("must refuse").to_string();
    assert!(e.contains("manifest versions"), "{e}");
}

/// A state saved by a build from before the lazy order (no `order_version`: version 1) names
/// positions of another order: resuming from it is refused with the reason, for the job's state
/// and for one consumer's, whatever else matches.
#[test]
fn resume_from_the_old_order_is_refused() {
    let url = dataset();
    let c = config(url, Topology::default(), None);
    let version = Stream::open(c.clone()).unwrap().dataset(0).manifest().version.clone();
    let order = serde_json::to_value(c.order).unwrap();
    let job = serde_json::json!({
        "versions": [version], "order": order, "progress": {"epoch": 0, "consumed": 3, "ahead": []},
    });
    let mut c1 = c.clone();
    c1.resume = Some(serde_json::from_value(job).unwrap());
    let e = Stream::open(c1).err().expect("must refuse").to_string();
    assert!(e.contains("order version 1") && e.contains("order version 4"), "{e}");
    let consumer = serde_json::json!({
        "versions": [version], "order": order, "consumer": 0, "consumers": 1,
        "base": {"epoch": 0, "consumed": 0, "ahead": []}, "len": N, "delivered": 3,
    });
    let mut c2 = c;
    c2.resume_consumer = Some(serde_json::from_value(consumer).unwrap());
    let e = Stream::open(c2).err().expect("must refuse").to_string();
    assert!(e.contains("order version 1"), "{e}");
}

fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Starts `ramjet` with `args` and `env`: its output discarded, its stderr kept for
/// [`wait_for_lines`] to show should it exit early.
fn spawn_ramjet(args: &[&str], env: &[(&str, &str)]) -> std::process::Child {
    Command::new(ramjet_bin())
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits, at most 60 s, until `child` has written `n` lines to `out`. A child that exits
/// first fails the test with its stderr: one that died early would otherwise hold the loop.
fn wait_for_lines(child: &mut std::process::Child, out: &Path, n: usize) {
    let t0 = Instant::now();
    while lines(out).len() < n {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(e) = child.stderr.as_mut() {
                let _ = std::io::Read::read_to_string(e, &mut err);
            }
            panic!("the reader exited ({st}) after {} lines:\n{err}", lines(out).len());
        }
        ramjet_tests::assert_under(t0, Duration::from_secs(60), "the reader's progress");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sigkill_mid_epoch_then_resume_equals_an_uninterrupted_run() {
    let url = dataset();
    let t = tempfile::tempdir().unwrap();
    let (a, b, st) = (
        t.path().join("a.txt"),
        t.path().join("b.txt"),
        t.path().join("state.json"),
    );
    let cache = t.path().join("cache");
    let common = [
        "stream",
        url,
        "--epochs",
        "2",
        "--seed",
        "3",
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    let (a_out, b_out, state) = (a.to_str().unwrap(), b.to_str().unwrap(), st.to_str().unwrap());
    ramjet_ok(&[&common[..], &["--out", a_out]].concat());
    assert_eq!(lines(&a).len(), 2 * N);

    let mut child = spawn_ramjet(
        &[&common[..], &["--out", b_out, "--state", state, "--step-ms", "20"]].concat(),
        &[],
    );
    wait_for_lines(&mut child, &b, N / 2 + 3);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(lines(&b).len() < 2 * N, "killed too late to test anything");

    ramjet_ok(&[&common[..], &["--out", b_out, "--state", state, "--resume"]].concat());
    assert_eq!(
        lines(&b),
        lines(&a),
        "resumed output differs from the uninterrupted run"
    );
}

/// Issue 42: a stream SIGKILLed mid-epoch and resumed from its state file audits "exactly
/// once" with `ramjet audit` (the record crossed the kill inside the state); the same kill with
/// the saved state set back by 3 samples (their record kept) makes the resumed run deliver
/// them again, and the audit names the 3 and exits 1.
#[test]
fn ramjet_audit_after_sigkill_and_resume_and_after_a_replay() {
    let url = dataset();
    let t = tempfile::tempdir().unwrap();
    for rewind in [0u64, 3] {
        let (out, st) = (
            t.path().join(format!("out{rewind}.txt")),
            t.path().join(format!("state{rewind}.json")),
        );
        let common = [
            "stream",
            url,
            "--epochs",
            "1",
            "--seed",
            "5",
            "--state",
            st.to_str().unwrap(),
        ];
        let mut args = common.to_vec();
        args.extend(["--out", out.to_str().unwrap(), "--step-ms", "20"]);
        let mut child = spawn_ramjet(&args, &[]);
        wait_for_lines(&mut child, &out, N / 2);
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        if rewind > 0 {
            let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&st).unwrap()).unwrap();
            let d = v["state"]["delivered"].as_u64().unwrap();
            v["state"]["delivered"] = (d - rewind).into();
            std::fs::write(&st, serde_json::to_vec(&v).unwrap()).unwrap();
        }
        ramjet_ok(&[&common[..], &["--out", out.to_str().unwrap(), "--resume"]].concat());
        let o = ramjet(&["audit", url, "--state", st.to_str().unwrap()], &[]);
        let msg = text(&o);
        if rewind == 0 {
            assert!(o.status.success(), "{msg}");
            assert!(msg.contains("exactly once") && msg.contains("the whole epoch"), "{msg}");
        } else {
            assert_eq!(o.status.code(), Some(1), "{msg}");
            assert!(msg.contains("3 delivered more than once"), "{msg}");
        }
    }
}

fn dir_bytes(d: &Path) -> u64 {
    ["shards", "tmp"]
        .iter()
        .flat_map(|s| std::fs::read_dir(d.join(s)).into_iter().flatten().flatten())
        .map(|e| e.metadata().map(|m| m.len()).unwrap_or(0))
        .sum()
}

#[test]
fn the_cache_budget_holds_and_a_stable_subset_stays_resident() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    let total: u64 = {
        let s = Stream::open(config(url, Topology::default(), None)).unwrap();
        let _ = s.metrics();
        ramjet_engine::format::Manifest::parse(
            &ramjet_tests::block_on(ramjet_engine::Store::open(url).unwrap().get("manifest.json")).unwrap(),
            "m",
        )
        .unwrap()
        .bytes
    };
    let limit = total / 2;
    let stop = Arc::new(AtomicBool::new(false));
    let max_seen = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, max_seen, dir) = (stop.clone(), max_seen.clone(), cache.path().to_path_buf());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                max_seen.fetch_max(dir_bytes(&dir), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let mut c = config(url, Topology::default(), Some(cache.path()));
    c.cache = Some(CacheConfig::new(cache.path(), limit));
    c.epochs = Some(4);
    // Hits and misses are counted where shards are fetched, ahead of the consumer: keep the
    // prefetcher about one shard ahead so that counts land in the epoch they belong to (with the
    // default 512 MiB a slow consumer saw every epoch's fetches counted in the first).
    c.prefetch_bytes_max = 1 << 10;
    let mut hits_per_epoch = Vec::new();
    let mut s = Stream::open(c).unwrap();
    let mut last = (0, 0);
    let mut epoch = 0;
    while let Some(x) = s.next_sample().unwrap() {
        if x.epoch != epoch {
            let m = s.metrics();
            hits_per_epoch.push((m.cache_hits - last.0, m.cache_misses - last.1));
            last = (m.cache_hits, m.cache_misses);
            epoch = x.epoch;
        }
    }
    let end = s.metrics();
    hits_per_epoch.push((end.cache_hits - last.0, end.cache_misses - last.1));
    stop.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    assert!(
        max_seen.load(Ordering::SeqCst) <= limit,
        "cache reached {} > budget {limit}",
        max_seen.load(Ordering::SeqCst)
    );
    // After the first epoch the resident subset is stable: the later epochs hit about
    // budget/dataset of their shards instead of thrashing to zero. Taken over epochs 1-3
    // together: counts land where shards are fetched, a shard or so ahead of the consumer, so
    // on a loaded machine one epoch's count can shift into the next (regression: a CI run
    // beside a build saw epochs 1 and 2 counted as 6 and 10 fetches of 12 each, and epoch 2's
    // own rate alone fell to 0.20).
    let (h, m) = hits_per_epoch[1..]
        .iter()
        .fold((0, 0), |(h, m), (eh, em)| (h + eh, m + em));
    let rate = h as f64 / (h + m) as f64;
    assert!(
        rate >= 0.25,
        "warm hit rate {rate:.2} over epochs 1-3 with half the dataset cached ({hits_per_epoch:?})"
    );
}

/// Flips a byte in the middle of the first shard file in the cache at `cache`; returns its path
/// and its bytes before.
fn flip_a_cached_shard(cache: &Path) -> (std::path::PathBuf, Vec<u8>) {
    let shard = std::fs::read_dir(cache.join("shards"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let good = std::fs::read(&shard).unwrap();
    let mut b = good.clone();
    let mid = b.len() / 2;
    b[mid] ^= 0x08;
    std::fs::write(&shard, b).unwrap();
    (shard, good)
}

#[test]
fn a_flipped_byte_in_a_cached_shard_is_refetched_never_yielded() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    let records = |c: &Path| -> (HashMap<SampleRef, Vec<u8>>, u64) {
        let mut s = Stream::open(config(url, Topology::default(), Some(c))).unwrap();
        let mut out = HashMap::new();
        while let Some(x) = s.next_sample().unwrap() {
            out.insert(x.id, x.record.to_vec());
        }
        (out, s.metrics().cache_corrupt)
    };
    let (first, _) = records(cache.path());
    flip_a_cached_shard(cache.path());
    let (second, corrupt) = records(cache.path());
    assert_eq!(corrupt, 1, "the corruption was not detected");
    assert_eq!(first, second, "a corrupted record was yielded");
    // The re-fetched shard is sound again.
    assert_eq!(records(cache.path()).1, 0);
}

#[test]
fn random_access_by_global_index() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    let s = SampleReader::open(config(url, Topology::default(), Some(cache.path()))).unwrap();
    // A reader has no order and no prefetcher: nothing is fetched until a sample is asked for.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let m = s.metrics();
    assert_eq!((m.origin_requests, m.samples, m.cache_inserts), (0, 0, 0), "{m:?}");
    let src = synth_dataset(N);
    for i in [0u64, 13, N as u64 - 1] {
        let x = s.get(0, i).unwrap();
        let v = x.values().unwrap();
        let ramjet_engine::format::ValueRef::Bytes(img) = v[0] else {
            panic!("image column")
        };
        assert_eq!(img, std::fs::read(src.join(format!("images/{i:06}.jpg"))).unwrap());
    }
    assert!(s.get(0, N as u64).unwrap_err().to_string().contains("has 40 samples"));
}

#[test]
fn the_next_epoch_is_prefetched_before_this_one_ends() {
    let url = dataset();
    // No cache: every shard fetch is a miss, so the miss count says how many were fetched.
    let mut c = config(url, Topology::default(), None);
    c.epochs = Some(2);
    let shards = ramjet_tests::block_on(ramjet_engine::Dataset::open(url))
        .unwrap()
        .manifest()
        .shards()
        .count() as u64;
    let mut s = Stream::open(c).unwrap();
    let per_epoch = s.metrics_handle();
    let mut last_of_epoch0 = None;
    let mut n = 0;
    while let Some(x) = s.next_sample().unwrap() {
        n += 1;
        if x.epoch == 0 && s.epoch_len() == Some(n) {
            // The consumer is at the end of epoch 0: epoch 1's fetches start (waited for, up
            // to 30 s, on the miss count: they are epoch 1's only when more than an epoch's).
            let deadline = Instant::now() + Duration::from_secs(30);
            while per_epoch.snapshot().cache_misses <= shards && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            last_of_epoch0 = Some(per_epoch.snapshot());
        }
    }
    let at_boundary = last_of_epoch0.expect("epoch 0 ended");
    assert_eq!(s.metrics().cache_misses, 2 * shards, "each shard fetched once an epoch");
    assert!(
        at_boundary.cache_misses > shards,
        "at the end of epoch 0 only {} shard fetches had started ({shards} per epoch): epoch 1 was not prefetched",
        at_boundary.cache_misses
    );
}

#[test]
fn the_first_samples_are_read_ahead_together_and_shards_then_deliver_the_rest_once() {
    let url = dataset();
    // No cache, so every ranged read goes to the origin and is counted.
    let run = |ranged: usize| {
        let mut c = config(url, Topology::default(), None);
        c.first_ranged_samples_max = ranged;
        // The budget alone: no reading on while the first shard downloads (s3.rs tests that).
        c.ranged_until_shard_bytes_max = 0;
        let mut s = Stream::open(c).unwrap();
        let first = s.next_sample().unwrap().unwrap();
        let at_first = s.metrics().ranged_samples;
        let mut all = vec![(first.position, first.id, first.record)];
        while let Some(x) = s.next_sample().unwrap() {
            all.push((x.position, x.id, x.record));
        }
        (at_first, s.metrics().ranged_samples, all)
    };
    let (none_first, none_total, plain) = run(0);
    assert_eq!((none_first, none_total), (0, 0));
    assert_eq!(plain.len(), N);
    let (at_first, total, ranged) = run(64);
    assert_eq!(
        at_first, 8,
        "the first sample should bring the next 8 samples' ranged reads with it, together"
    );
    assert!((8..=64).contains(&total), "{total} ranged samples");
    assert_eq!(
        ranged, plain,
        "reading ahead changed the order, the samples or their bytes"
    );
}

/// A loader's stream (gated) reads its consumer's first batch, then nothing more (neither
/// samples nor whole shards) until the loader opens the gate, having decoded that batch; and a
/// first batch larger than the samples read one by one does not wait on the gate: its whole
/// shards start at once.
#[test]
fn a_gated_stream_holds_its_reads_after_the_first_batch_until_the_gate_opens() {
    let url = dataset();
    // No cache: every whole-shard fetch is a miss, so `cache_misses` counts them.
    let mut c = config(url, Topology::default(), None);
    c.first_ranged_samples_max = 64;
    // Long enough that a wait on the gate shows as one.
    c.first_gate_max_ms = 60_000;
    let (mut s, gate) = Stream::open_gated(c.clone(), 8).unwrap();
    let gate = gate.expect("a gate: the first samples are read one by one");
    for _ in 0..8 {
        s.next_sample().unwrap().expect("a sample");
    }
    // Wait for the prefetcher to reach the closed gate (an event, not a pause: a check after
    // a sleep would pass as well if the prefetcher had simply not run yet).
    let handle = s.metrics_handle();
    let deadline = Instant::now() + Duration::from_secs(30);
    while handle.snapshot().first_gate_waits == 0 {
        assert!(
            Instant::now() < deadline,
            "the prefetcher never reached the gate in 30 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let first = s.metrics();
    // Held there: still nothing more read a while later.
    std::thread::sleep(Duration::from_millis(300));
    let held = s.metrics();
    assert_eq!(
        held.origin_requests, first.origin_requests,
        "read on past the first batch with the gate closed"
    );
    assert_eq!(held.cache_misses, 0, "a whole shard started with the gate closed");
    gate.open();
    let mut n = 8;
    while s.next_sample().unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, N);
    assert!(s.metrics().cache_misses > 0, "whole shards after the gate opened");

    // A first batch of 24 with 8 samples read one by one (then more while no whole shard has
    // arrived): whole shards start without the gate (still closed here), as the first batch
    // may need them.
    c.first_ranged_samples_max = 8;
    let (mut s, gate) = Stream::open_gated(c, 24).unwrap();
    let _closed = gate.expect("a gate");
    let t = Instant::now();
    for _ in 0..24 {
        s.next_sample().unwrap().expect("a sample");
    }
    ramjet_tests::assert_under(t, Duration::from_secs(30), "the first batch waiting for its own gate");
}

/// The samples read one by one at the start share their requests: per shard, one GET for
/// their index entries and one for their records (they lie together in file order), where
/// each used to cost two GETs of its own; plus, once per shard and at the same time as the
/// entries, its header and footer, which tie what is read to the manifest (a shard swapped
/// at the origin for another valid one is refused: `swapped.rs`).
#[test]
fn samples_read_one_by_one_share_their_requests() {
    let url = dataset();
    let mut c = config(url, Topology::default(), None);
    c.order = OrderSpec {
        shuffle: Shuffle::None,
        ..Default::default()
    };
    c.first_ranged_samples_max = 8;
    // One batch exactly: no reading on while the first shard downloads (s3.rs tests that).
    c.ranged_until_shard_bytes_max = 0;
    let mut s = Stream::open(c).unwrap();
    let mut ids = Vec::new();
    while let Some(x) = s.next_sample().unwrap() {
        ids.push(x.id);
    }
    assert_eq!(ids.len(), N);
    let m = s.metrics();
    assert_eq!(m.ranged_samples, 8, "one batch of 8, before the whole shards start");
    let shards = |ids: &[SampleRef]| {
        ids.iter()
            .map(|i| i.shard)
            .collect::<std::collections::BTreeSet<_>>()
            .len() as u64
    };
    // Every shard is smaller than one ranged part: one GET each.
    let whole = shards(&ids);
    let first = shards(&ids[..8]);
    assert_eq!(
        m.origin_requests,
        whole + 4 * first,
        "{whole} shards, the first 8 samples in {first} of them: {} requests",
        m.origin_requests
    );
}

#[test]
fn global_shuffle_reads_every_sample_once_cold_and_warm() {
    let url = dataset();
    let cache = tempfile::tempdir().unwrap();
    let read = |shuffle: Shuffle, held: u64, indexes: u64| -> (Vec<(SampleRef, Vec<u8>)>, u64) {
        let mut c = config(url, Topology::default(), Some(cache.path()));
        c.order.shuffle = shuffle;
        c.resident_bytes_max = held;
        c.index_bytes_max = indexes;
        let mut s = Stream::open(c).unwrap();
        let mut out = Vec::new();
        while let Some(x) = s.next_sample().unwrap() {
            out.push((x.id, x.record.to_vec()));
        }
        (out, s.metrics().cache_corrupt)
    };
    let mut plain = read(Shuffle::None, 0, 1 << 30).0;
    // Every sample read one by one (no shard held): cold, then warm with the shards' indexes
    // held (one read a sample) and without (two); then warm shards held whole and sliced.
    for (pass, held, indexes) in [
        ("cold", 0, 1 << 30),
        ("warm", 0, 1 << 30),
        ("warm, every entry read", 0, 0),
        ("warm, shards held", 1 << 30, 1 << 30),
    ] {
        let shuffled = read(Shuffle::Global, held, indexes).0;
        assert_ne!(
            shuffled.iter().map(|x| x.0).collect::<Vec<_>>(),
            plain.iter().map(|x| x.0).collect::<Vec<_>>()
        );
        let mut sorted = shuffled;
        sorted.sort();
        plain.sort();
        assert_eq!(
            sorted, plain,
            "{pass}: the global shuffle lost, repeated or changed samples"
        );
    }
    // A flipped byte in a record of a cached shard, read one sample at a time through its held
    // index: the sample comes from the origin, and the damaged copy is removed (a warm shard is
    // not read whole to warm it, so only its samples' checks can find the damage). The cache
    // warming then fetches it again: in this same pass when the warming reaches the shard after
    // the removal (its check is lazy), else in the next one. Either way the damaged bytes never
    // stay.
    let (shard, good) = flip_a_cached_shard(cache.path());
    let (shuffled, corrupt) = read(Shuffle::Global, 0, 1 << 30);
    let mut sorted = shuffled;
    sorted.sort();
    assert_eq!(sorted, plain, "a damaged cached record was yielded");
    assert_eq!(corrupt, 1, "the damage was not found");
    if let Ok(now) = std::fs::read(&shard) {
        assert_eq!(now, good, "the damaged copy was not removed");
    }
    // The next epoch's warming fetches it again, sound.
    let (again, corrupt) = read(Shuffle::Global, 0, 1 << 30);
    assert_eq!((again.len(), corrupt), (plain.len(), 0));
    assert_eq!(std::fs::read(&shard).unwrap(), good, "the shard was not fetched again");
}

#[test]
fn mixed_streams_follow_their_weights() {
    let url = dataset();
    let mut c = config(url, Topology::default(), None);
    c.sources = vec![
        SourceConfig {
            url: url.into(),
            weight: Weight::Repeat(1.5),
        },
        SourceConfig {
            url: url.into(),
            weight: Weight::Count(5),
        },
    ];
    let ids = |c: StreamConfig| Stream::open(c).unwrap().map(|x| x.unwrap().id).collect::<Vec<_>>();
    let a = ids(c.clone());
    assert_eq!(a.iter().filter(|r| r.source == 0).count(), 60);
    assert_eq!(a.iter().filter(|r| r.source == 1).count(), 5);
    assert_eq!(a, ids(c), "mixing is not deterministic");
}

/// A second, private S3 server (other ports, own data) that the test may stop and restart.
struct PrivateS3 {
    env: Vec<(String, String)>,
}

impl PrivateS3 {
    fn start(port: u16) -> PrivateS3 {
        s3();
        let state = std::env::temp_dir().join(format!("ramjet-private-s3-{port}"));
        let env = vec![
            ("RAMJET_S3_PORT".to_owned(), port.to_string()),
            ("AWS_ENDPOINT_URL".to_owned(), format!("http://127.0.0.1:{port}")),
            ("RAMJET_STATE".to_owned(), state.display().to_string()),
        ];
        let p = PrivateS3 { env };
        p.script("start");
        p
    }
    fn script(&self, verb: &str) {
        let o = Command::new("bash")
            .arg(ramjet_tests::repo_root().join("tools/s3-server.sh"))
            .arg(verb)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        assert!(o.status.success(), "s3-server.sh {verb}: {}", text(&o));
    }
    fn env(&self) -> Vec<(&str, &str)> {
        self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }
}

impl Drop for PrivateS3 {
    fn drop(&mut self) {
        self.script("stop");
    }
}

/// Starts a slow reader of `url` writing to `out`, lets it deliver a few samples, then stops
/// the server under it (mid-epoch, which it checks). Returns the still-running reader.
fn read_into_outage(srv: &PrivateS3, url: &str, env: &[(&str, &str)], out: &Path) -> std::process::Child {
    let args = [
        "stream",
        url,
        "--shuffle",
        "none",
        "--prefetch",
        "1",
        "--step-ms",
        "100",
        "--out",
        out.to_str().unwrap(),
    ];
    let mut child = spawn_ramjet(&args, env);
    wait_for_lines(&mut child, out, 5);
    srv.script("stop");
    assert!(lines(out).len() < N, "the outage must begin mid-epoch");
    child
}

#[test]
fn the_origin_stopping_mid_epoch_fails_clearly_or_resumes_when_it_returns() {
    // This run's own second port (tools/test.sh: the run's S3 port + 100).
    let port = std::env::var("RAMJET_S3_PORT")
        .ok()
        .and_then(|p| p.parse::<u16>().ok())
        .unwrap_or(8333)
        + 100;
    let srv = PrivateS3::start(port);
    let url = format!("s3://{}/outage", s3().bucket);
    let mut env = srv.env();
    let o = ramjet(
        &[
            "pack",
            synth_dataset(N).to_str().unwrap(),
            &url,
            "--shard-size",
            "200KiB",
        ],
        &env,
    );
    assert!(o.status.success(), "{}", text(&o));
    let t = tempfile::tempdir().unwrap();
    let reference = t.path().join("ref.txt");
    let o = ramjet(
        &[
            "stream",
            &url,
            "--shuffle",
            "none",
            "--out",
            reference.to_str().unwrap(),
        ],
        &env,
    );
    assert!(o.status.success(), "{}", text(&o));

    // Outage shorter than the retry window: the run continues and its output is complete. The
    // window governs here, not the attempt count: restarting the server takes seconds more than
    // the 1.5 s pause on a loaded CI machine, longer than 8 attempts' backoff, and the restarted
    // server answers GETs with 500 until its volume server has re-registered: errors were seen
    // to last over 16 s from the outage's start on a loaded machine, hence the 45 s window.
    env.push(("RAMJET_RETRY_ATTEMPTS", "1000"));
    env.push(("RAMJET_RETRY_WINDOW_MS", "45000"));
    let out = t.path().join("a.txt");
    let child = read_into_outage(&srv, &url, &env, &out);
    std::thread::sleep(Duration::from_millis(1500));
    srv.script("start");
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "the run did not survive a 1.5 s outage: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(lines(&out), lines(&reference));

    // Outage longer than the retry window: a clear error naming the object.
    env.pop();
    env.pop();
    env.extend([("RAMJET_RETRY_WINDOW_MS", "1500"), ("RAMJET_RETRY_BACKOFF_MS", "100")]);
    let out = t.path().join("b.txt");
    let child = read_into_outage(&srv, &url, &env, &out);
    let t0 = Instant::now();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the run cannot finish without its origin");
    assert!(
        err.contains("origin error on s3://") && err.contains("attempt(s)"),
        "{err}"
    );
    ramjet_tests::assert_under(t0, Duration::from_secs(20), "giving up");
}

/// A consumer (one DataLoader worker of a `StatefulDataLoader`) resumes from its own saved
/// state alone, without the other consumers': it yields exactly the rest of its share.
#[test]
fn a_consumer_resumes_exactly_from_its_own_state() {
    let url = dataset();
    let tmp = tempfile::tempdir().unwrap();
    let topo = |worker| Topology {
        worker,
        workers: 2,
        ..Default::default()
    };
    for w in 0..2 {
        let full: Vec<(u64, SampleRef)> = Stream::open(config(url, topo(w), Some(tmp.path())))
            .unwrap()
            .map(|s| s.map(|s| (s.position, s.id)).unwrap())
            .collect();
        assert!(full.len() >= N / 2 - 1);
        for k in [1, 5, full.len() - 1, full.len()] {
            let mut s = Stream::open(config(url, topo(w), Some(tmp.path()))).unwrap();
            for _ in 0..k {
                s.next_sample().unwrap().unwrap();
            }
            let state: StreamState =
                serde_json::from_str(&serde_json::to_string(&s.state().unwrap()).unwrap()).unwrap();
            drop(s);
            let mut c = config(url, topo(w), Some(tmp.path()));
            c.resume_consumer = Some(state.clone());
            let rest: Vec<(u64, SampleRef)> = Stream::open(c)
                .unwrap()
                .map(|s| s.map(|s| (s.position, s.id)).unwrap())
                .collect();
            assert_eq!(rest, full[k..], "worker {w} after {k} samples");
            // Another topology is refused, naming both.
            let mut c = config(url, topo(1 - w), Some(tmp.path()));
            c.resume_consumer = Some(state);
            let e = Stream::open(c).err().expect("refused").to_string();
            assert!(e.contains(&format!("consumer {w} of 2")), "{e}");
        }
    }
}

/// A download lock that another process holds past `RAMJET_FETCH_LOCK_WAIT_MS` (a holder alive
/// but stuck) is gone around: the stream fetches the shards itself, in bounded time, with the
/// same samples as a run with no cache, and says which shard it stopped waiting for.
#[test]
fn a_download_lock_held_past_its_limit_is_gone_around_not_waited_on_forever() {
    let url = dataset();
    let t = tempfile::tempdir().unwrap();
    let cache = t.path().join("cache");
    std::fs::create_dir_all(cache.join("fetch")).unwrap();
    // Hold every shard's download lock, as a stuck holder would.
    let ds = ramjet_tests::block_on(ramjet_engine::Dataset::open(url)).unwrap();
    let mut held = Vec::new();
    for s in ds.manifest().shards() {
        let s = s.unwrap();
        let id = ramjet_engine::cache::ShardId {
            checksum: s.checksum_u64(),
            bytes: s.bytes,
        };
        let f = std::fs::File::create(cache.join("fetch").join(format!("{}.lock", id.file_name()))).unwrap();
        // SAFETY: flock on a descriptor we own; released when `f` is dropped at the test's end.
        let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
        held.push(f);
    }
    assert!(!held.is_empty());
    let (plain, cached) = (t.path().join("plain.txt"), t.path().join("cached.txt"));
    ramjet_ok(&["stream", url, "--seed", "5", "--out", plain.to_str().unwrap()]);
    let start = Instant::now();
    let o = ramjet(
        &[
            "stream",
            url,
            "--seed",
            "5",
            "--cache-dir",
            cache.to_str().unwrap(),
            "--out",
            cached.to_str().unwrap(),
        ],
        &[("RAMJET_FETCH_LOCK_WAIT_MS", "300")],
    );
    assert!(o.status.success(), "{}", text(&o));
    ramjet_tests::assert_under(start, Duration::from_secs(120), "the stream with the locks held");
    assert_eq!(lines(&cached), lines(&plain), "same samples, same order");
    assert_eq!(lines(&plain).len(), N);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("download lock") && err.contains(".rjs"),
        "the shard it stopped waiting for is named:\n{err}"
    );
    drop(held);
}

/// Issue 45, item 3: the whole shards held ahead of a slow consumer cover a fetch at its pace,
/// not the whole prefetch budget. 120 shards of one sample each on the local S3 server, read
/// through a disk cache (each fetch counts a miss when it is made, so `cache_misses` minus the
/// samples taken is how far the prefetcher got ahead), the consumer taking 40 ms a sample.
/// Tuned: a fetch takes milliseconds, so the shards in flight cover it; fixed (the budget
/// filled, as before): the prefetcher runs dozens of shards ahead.
#[test]
fn a_slow_consumer_holds_the_shards_that_cover_a_fetch_not_the_whole_budget() {
    s3();
    let url = once_per_run("stream-one-sample-shards", || {
        let url = s3_prefix("one-sample-shards");
        ramjet_ok(&[
            "pack",
            synth_dataset(120).to_str().unwrap(),
            &url,
            "--shard-size",
            "64KiB",
        ]);
        url
    });
    let ahead_after = |tuned: bool| {
        let dir = tempfile::tempdir().unwrap();
        let mut c = StreamConfig::new(&url);
        c.order.shuffle = Shuffle::None;
        c.cache = Some(CacheConfig::new(dir.path(), 1 << 30));
        c.prefetch_tuned = tuned;
        let mut s = Stream::open(c).unwrap();
        for _ in 0..20 {
            s.next_sample().unwrap().expect("a sample");
            std::thread::sleep(Duration::from_millis(40));
        }
        let m = s.metrics();
        (m.cache_misses.saturating_sub(20), m.tune)
    };
    let (tuned, t) = ahead_after(true);
    let (fixed, f) = ahead_after(false);
    let peak = t["tune_shards_ahead_peak"].as_u64().unwrap();
    let why = t["tune_shards_ahead_reason"].as_str().unwrap();
    eprintln!("shards fetched ahead after 20 samples: tuned {tuned} (peak held {peak}), fixed {fixed}");
    assert!(
        tuned <= 16 && peak <= 16,
        "tuned: {tuned} shards fetched ahead, peak {peak} ({why})"
    );
    assert!(fixed >= 48, "fixed: only {fixed} shards ahead: {f:?}");
    assert_eq!(f["tune_shards_ahead"], serde_json::json!(64), "{f:?}");
}

/// 503s on shard GETs in the middle of an epoch (the 2nd and the 5th shard read, on
/// connections kept alive since the epoch began) are retried: the epoch delivers exactly the
/// samples of a run without faults, in the same order, each record verified against its
/// checksum on the way.
#[test]
fn http_503s_on_shard_gets_mid_epoch_are_retried_and_the_epoch_is_the_same() {
    let url = dataset();
    let t = tempfile::tempdir().unwrap();
    let (clean, faulted) = (t.path().join("clean.txt"), t.path().join("faulted.txt"));
    let args = |out: &Path| {
        let out = out.to_str().unwrap().to_owned();
        vec![
            "stream".to_owned(),
            url.to_owned(),
            "--seed".into(),
            "3".into(),
            "--out".into(),
            out,
        ]
    };
    let run = |out: &Path, env: &[(&str, &str)]| {
        let a = args(out);
        let o = ramjet(&a.iter().map(String::as_str).collect::<Vec<_>>(), env);
        assert!(o.status.success(), "{}", text(&o));
    };
    run(&clean, &[]);
    let upstream = s3()
        .endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let proxy = ramjet_tests::RequestFaultProxy::start(&upstream, "/shards/", &[1, 4]);
    run(
        &faulted,
        &[("AWS_ENDPOINT_URL", &proxy.url), ("RAMJET_RETRY_BACKOFF_MS", "20")],
    );
    assert_eq!(proxy.injected(), 2, "the 2nd and 5th shard GETs were not both failed");
    assert!(
        proxy.matched() >= 6,
        "{} shard GETs: a retry each for the 2 failed",
        proxy.matched()
    );
    assert_eq!(lines(&faulted), lines(&clean), "the faulted epoch differs");
    assert_eq!(lines(&clean).len(), N);
}
