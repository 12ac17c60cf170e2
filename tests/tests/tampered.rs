//! Tampered or inconsistent input on real packed files: a manifest whose counts disagree with
//! its shards, a manifest claiming a shard smaller than its footer, counts that overflow, and a
//! panic in the loader's reader thread. Each is an error naming what is wrong, never a panic
//! or a silently short epoch.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ramjet_engine::format::Manifest;
use ramjet_engine::loader::{Loader, LoaderConfig, Next};
use ramjet_engine::{Error, Stream, StreamConfig};
use ramjet_tests::{ramjet_ok, synth_dataset};

const N: usize = 24;

fn packed(tmp: &Path) -> PathBuf {
    let dst = tmp.join("packed");
    ramjet_ok(&[
        "pack",
        synth_dataset(N).to_str().unwrap(),
        dst.to_str().unwrap(),
        "--shard-size",
        "400KiB",
    ]);
    dst
}

/// Rewrites the manifest with `edit` applied and its version recomputed, as a tamperer who knows
/// the format would (the version is a content hash, not a signature).
fn tamper(dir: &Path, edit: impl FnOnce(&mut Manifest)) {
    let p = dir.join("manifest.json");
    let mut m = Manifest::parse(&fs::read(&p).unwrap(), "manifest.json").unwrap();
    edit(&mut m);
    m.version = m.compute_version();
    fs::write(&p, m.to_bytes()).unwrap();
}

/// A delivered sample: its (shard, index in the shard) and its record bytes.
type Delivered = ((u32, u32), Vec<u8>);

/// Reads the whole stream: the samples delivered, then the error that ended it (if any).
fn drain(dir: &Path) -> (Vec<Delivered>, Option<Error>) {
    let mut s = match Stream::open(StreamConfig::new(dir.to_str().unwrap())) {
        Ok(s) => s,
        Err(e) => return (Vec::new(), Some(e)),
    };
    let mut got = Vec::new();
    loop {
        match s.next_sample() {
            Ok(Some(x)) => got.push(((x.id.shard, x.id.index), x.record.to_vec())),
            Ok(None) => return (got, None),
            Err(e) => return (got, Some(e)),
        }
    }
}

/// Regression: the manifest's per-shard sample counts were trusted and never compared with the
/// shard headers, so moving a sample from one shard's count to another's went unnoticed.
#[test]
fn a_manifest_whose_sample_counts_disagree_with_the_shard_headers_is_corrupt() {
    let d = tempfile::tempdir().unwrap();
    let dir = packed(d.path());
    let (clean, e) = drain(&dir);
    assert_eq!(
        (clean.len(), e.is_none()),
        (N, true),
        "the untouched set must stream whole; it ended after {} samples with {e:?}",
        clean.len()
    );
    let clean: std::collections::HashMap<(u32, u32), Vec<u8>> = clean.into_iter().collect();
    let m = Manifest::parse(&fs::read(dir.join("manifest.json")).unwrap(), "m").unwrap();
    assert!(m.shard_count() >= 2, "the test needs two shards");
    let tampered = [m.shard(0).unwrap().key.clone(), m.shard(1).unwrap().key.clone()];
    tamper(&dir, |m| {
        m.shards_mut()[0].samples -= 1;
        m.shards_mut()[1].samples += 1;
    });
    let (got, e) = drain(&dir);
    let e = e.unwrap_or_else(|| panic!("a tampered manifest streamed {} samples and ended cleanly", got.len()));
    assert!(e.is_data_error(), "not a data error: {e}");
    let msg = e.to_string();
    assert!(
        tampered.iter().any(|k| msg.contains(k.as_str())),
        "the error names neither tampered shard ({tampered:?}): {msg}"
    );
    assert!(
        got.len() < N,
        "{} samples delivered from a tampered manifest",
        got.len()
    );
    // Every sample delivered before the error is the clean one at its place.
    for (at, rec) in &got {
        assert_eq!(clean.get(at), Some(rec), "sample {at:?} delivered with other bytes");
    }
}

/// Regression: a manifest claiming a shard smaller than its own footer made the ranged read of
/// the first samples compute `bytes - 16` and overflow.
#[test]
fn a_manifest_shard_smaller_than_its_footer_is_an_error_not_an_overflow() {
    let d = tempfile::tempdir().unwrap();
    let dir = packed(d.path());
    tamper(&dir, |m| {
        m.bytes = m.bytes - m.shard(0).unwrap().bytes + 5;
        m.shards_mut()[0].bytes = 5;
    });
    let (_, e) = drain(&dir);
    let e = e.expect("a shard of 5 bytes must fail");
    assert!(e.is_data_error(), "{e}");
}

/// Regression: a re-hashed manifest claiming a 16 GiB shard (the object is a few hundred KB),
/// read under an address-space limit, panicked the fetch task ("allocation of 17179869184 bytes
/// failed"): the buffer was sized from the claim before the object's real size was known. Now
/// a claim that large is checked against the object first, and the error names both sizes. The
/// stream runs in a child process (this test binary, [`claimed_size_child`]) under the limit.
#[test]
fn a_shard_size_claimed_past_memory_is_checked_against_the_object_not_allocated() {
    use std::os::unix::process::CommandExt;
    let d = tempfile::tempdir().unwrap();
    let dir = packed(d.path());
    let claim = 16u64 << 30;
    tamper(&dir, |m| {
        m.bytes = m.bytes - m.shard(0).unwrap().bytes + claim;
        m.shards_mut()[0].bytes = claim;
    });
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["claimed_size_child", "--exact", "--ignored", "--nocapture"])
        .env("RAMJET_CLAIM_DIR", &dir);
    // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 8_000_000 * 1024,
                rlim_max: 8_000_000 * 1024,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = c.output().unwrap();
    let text = ramjet_tests::text(&o);
    assert!(o.status.success(), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with("STREAM ERROR: "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(!line.contains("panicked") && !line.contains("allocation"), "{line}");
    assert!(line.contains(&format!("the manifest says {claim}")), "{line}");
}

/// The child of the test above: streams `RAMJET_CLAIM_DIR` whole shard by whole shard (no
/// sample read alone, which would meet the short object first) and prints the error that ends it.
#[test]
#[ignore = "run by a_shard_size_claimed_past_memory_is_checked_against_the_object_not_allocated, under a limit"]
fn claimed_size_child() {
    let dir = std::env::var("RAMJET_CLAIM_DIR").expect("set by the parent test");
    let mut cfg = StreamConfig::new(&dir);
    cfg.first_ranged_samples_max = 0;
    cfg.ranged_until_shard_bytes_max = 0;
    cfg.order.shuffle = ramjet_engine::order::Shuffle::None;
    let mut s = Stream::open(cfg).unwrap();
    loop {
        match s.next_sample() {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the stream ended without an error"),
            Err(e) => {
                println!("STREAM ERROR: {e}");
                return;
            }
        }
    }
}

/// Regression: sums of untrusted counts were unchecked: counts whose sum wraps to the stated
/// total passed, and per-shard counts beyond a shard's limit were truncated to 32 bits.
#[test]
fn a_manifest_whose_counts_overflow_or_exceed_the_shard_limit_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = packed(d.path());
    let p = dir.join("manifest.json");
    let good = Manifest::parse(&fs::read(&p).unwrap(), "m").unwrap();
    let mut m = good.clone();
    m.shards_mut()[0].samples = u64::MAX;
    m.samples = good.samples.wrapping_add(u64::MAX - good.shard(0).unwrap().samples);
    m.version = m.compute_version();
    let e = Manifest::parse(&m.to_bytes(), "m").unwrap_err().to_string();
    assert!(e.contains("overflow"), "{e}");
    let mut m = good.clone();
    m.shards_mut()[0].samples += 1 << 33;
    m.samples += 1 << 33;
    m.version = m.compute_version();
    let e = Manifest::parse(&m.to_bytes(), "m").unwrap_err().to_string();
    assert!(e.contains("over the shard limit"), "{e}");
}

/// Regression: a panic in the loader's reader thread ended the epoch silently short: the
/// consumer saw the end of the stream, not an error.
#[test]
fn a_panic_in_the_loader_reader_thread_is_an_error_not_a_short_epoch() {
    let d = tempfile::tempdir().unwrap();
    let dir = packed(d.path());
    let mut cfg = LoaderConfig::new(StreamConfig::new(dir.to_str().unwrap()));
    cfg.batch_size = 4;
    cfg.threads = 2;
    cfg.panic_reader_after_samples = Some(10);
    let mut l = Loader::start(cfg).unwrap();
    let mut batches = 0;
    let err = loop {
        match l.next_batch(Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e}")) {
            Next::Batch(_) => batches += 1,
            Next::Pending => panic!("no batch within 30 s"),
            Next::End | Next::EpochEnd(_) => panic!("the epoch ended after {batches} batches without an error"),
        }
        if batches == 2 {
            break l.next_batch(Duration::from_secs(30));
        }
    };
    let e = err.expect_err("the batch after the panic must be an error");
    assert!(matches!(e, Error::Internal { .. }), "{e}");
    assert!(e.to_string().contains("ramjet-reader"), "{e}");
    assert!(matches!(l.next_batch(Duration::from_secs(1)), Ok(Next::End)));
}
