//! Where a consumer's wait goes (`ramjet_engine::stall`), on real readers: one behind a
//! throttled origin (the real local S3 server behind a slow proxy) waits on the origin; a
//! warm reader whose consumer is the slower side is "not waiting"; a loader with one decode
//! thread and large images waits on decode. In each, the parts add up to the consumer's time.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ramjet_engine::image::ImageSpec;
use ramjet_engine::loader::{Loader, LoaderConfig, Next};
use ramjet_engine::StreamConfig;
use ramjet_tests::{json_of, ramjet, ramjet_ok, s3, s3_prefix, synth_dataset, text, Fault, FaultProxy};

const STAGES: [&str; 6] = ["origin", "peer", "daemon", "cache", "decode", "not_waiting"];

fn packed(tmp: &Path, n: usize) -> PathBuf {
    let dst = tmp.join("packed");
    ramjet_ok(&[
        "pack",
        synth_dataset(n).to_str().unwrap(),
        dst.to_str().unwrap(),
        "--shard-size",
        "400KiB",
    ]);
    dst
}

/// The shares by stage, checked to add up to 1.
fn shares(m: &serde_json::Value) -> Vec<(String, f64)> {
    let v: Vec<(String, f64)> = STAGES
        .iter()
        .map(|s| {
            let k = format!("wait_share_{s}");
            (s.to_string(), m[&k].as_f64().unwrap_or_else(|| panic!("no {k} in {m}")))
        })
        .collect();
    let total: f64 = v.iter().map(|(_, x)| x).sum();
    assert!((total - 1.0).abs() < 1e-6, "the shares add up to {total}: {v:?}");
    v
}

/// The stage that took most of the wait (not counting "not waiting").
fn top_wait(v: &[(String, f64)]) -> (String, f64) {
    let waited: f64 = v[..5].iter().map(|(_, x)| x).sum();
    let (k, x) = v[..5].iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().clone();
    (k, x / waited.max(1e-12))
}

/// Runs a loader over `cfg`, the consumer spending `step` per batch, and returns its metrics.
fn run_loader(cfg: LoaderConfig, step: Duration) -> serde_json::Value {
    let mut l = Loader::start(cfg).unwrap();
    let mut batches = 0;
    loop {
        match l.next_batch(Duration::from_secs(60)).unwrap() {
            Next::Batch(_) => batches += 1,
            Next::Pending => panic!("no batch within 60 s"),
            Next::End => break,
            Next::EpochEnd(e) => panic!("epoch {} ended with no batch", e.epoch),
        }
        std::thread::sleep(step);
    }
    assert!(batches > 3, "{batches} batches");
    serde_json::to_value(l.metrics().snapshot()).unwrap()
}

#[test]
fn a_reader_behind_a_throttled_origin_waits_on_the_origin() {
    s3();
    let url = s3_prefix("stall-slow");
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("rows.jsonl");
    let rows: String = (0..12_000)
        .map(|i| format!("{{\"id\": {i}, \"text\": \"row {i}\"}}\n"))
        .collect();
    std::fs::write(&src, rows).unwrap();
    ramjet_ok(&["pack", src.to_str().unwrap(), &url, "--shard-size", "256KiB"]);
    let upstream = s3().endpoint.trim_start_matches("http://").to_owned();
    // About 0.9 MB of shards at 256 KiB/s: some 3.5 s of waiting, nearly all of it the origin.
    let proxy = FaultProxy::start(&upstream, Fault::Throttle(256 << 10), usize::MAX);
    let o = ramjet(
        &["stream", &url, "--shuffle", "none", "--json", "--prefetch", "256KiB"],
        &[("AWS_ENDPOINT_URL", &proxy.url)],
    );
    assert!(o.status.success(), "{}", text(&o));
    let m = json_of(&String::from_utf8_lossy(&o.stdout));
    let v = shares(&m);
    let (top, part) = top_wait(&v);
    assert_eq!(top, "origin", "{v:?}");
    assert!(part > 0.6, "origin is only {part:.2} of the wait: {v:?}");
    assert!(m["data_wait_share"].as_f64().unwrap() > 0.5, "{m}");
    // The same in the summary line for people.
    let o = ramjet(
        &["stream", &url, "--shuffle", "none", "--limit", "10"],
        &[("AWS_ENDPOINT_URL", &proxy.url)],
    );
    assert!(text(&o).contains("where the time went: origin "), "{}", text(&o));
}

#[test]
fn a_warm_reader_with_a_slow_consumer_is_not_waiting() {
    let d = tempfile::tempdir().unwrap();
    let dir = packed(d.path(), 48);
    let mut cfg = LoaderConfig::new(StreamConfig::new(dir.to_str().unwrap()));
    cfg.batch_size = 4;
    cfg.threads = 2;
    cfg.image = Some(ImageSpec::train(32));
    let m = run_loader(cfg, Duration::from_millis(60));
    let v = shares(&m);
    let not_waiting = v[5].1;
    assert!(not_waiting > 0.8, "the consumer was the slower side, yet: {v:?}");
}

#[test]
fn a_loader_with_one_decode_thread_waits_on_decode() {
    let d = tempfile::tempdir().unwrap();
    let dir = packed(d.path(), 48);
    let mut cfg = LoaderConfig::new(StreamConfig::new(dir.to_str().unwrap()));
    cfg.batch_size = 8;
    cfg.threads = 1;
    cfg.prefetch_batches = 1;
    cfg.image = Some(ImageSpec::train(448));
    let m = run_loader(cfg, Duration::ZERO);
    let v = shares(&m);
    let (top, part) = top_wait(&v);
    assert_eq!(top, "decode", "{v:?}");
    assert!(part > 0.6, "decode is only {part:.2} of the wait: {v:?}");
    assert!(m["data_wait_share"].as_f64().unwrap() > 0.5, "{m}");
}
