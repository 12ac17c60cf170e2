//! The peer cluster against baselines measured in the same run.
//!
//! Targets (issue: host cache daemon and peer cluster):
//! - peer fetch throughput (shards read from a peer daemon's cache over TCP, `sendfile` on
//!   its side) at least 0.8x raw loopback TCP throughput measured by `iperf3`;
//! - origin bytes for a 3-node epoch (three readers, one per daemon, each reading the whole
//!   dataset at once) 1.0x the dataset with the ring, against 3.0x without it.
//!
//! `cargo bench -p ramjet-benches --bench cluster` (5,315 images); under `cargo test` it runs
//! once on 200 images. Needs the local S3 server (started here) and `iperf3` (Debian package;
//! without it the TCP baseline is skipped).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ramjet_benches::{bench_setup, save_results};
use ramjet_engine::cache::CacheConfig;
use ramjet_engine::{Dataset, Stream, StreamConfig};
use ramjet_tests::free_port;
use ramjet_transport::peer::LinkConfig;
use ramjet_transport::{Daemon, DaemonClient, DaemonConfig, PeerTransport, ShardGet, TcpTransport};

/// Three daemons (a ring, or three standalone ones) and three readers at once; returns the
/// origin bytes of the whole cluster.
fn three_node_epoch(url: &str, ring: bool, dir: &std::path::Path) -> u64 {
    let names: Vec<String> = (1..=3)
        .map(|i| {
            let ip = format!("127.0.0.{}", 20 + i);
            format!("{ip}:{}", free_port(&ip))
        })
        .collect();
    let daemons: Vec<Daemon> = names
        .iter()
        .enumerate()
        .map(|(i, me)| {
            let tag = format!("{}-{i}", if ring { "ring" } else { "solo" });
            let mut c = DaemonConfig::new(
                dir.join(format!("{tag}.sock")),
                CacheConfig::new(dir.join(&tag), 8 << 30),
            );
            c.threads = 2;
            if ring {
                c.listen = Some(me.parse().unwrap());
                c.peers = names.clone();
            }
            Daemon::start(c).expect("daemon")
        })
        .collect();
    let readers: Vec<_> = daemons
        .iter()
        .map(|d| {
            let (url, sock) = (url.to_owned(), d.socket().to_owned());
            std::thread::spawn(move || {
                let mut cfg = StreamConfig::new(url);
                cfg.provider = Some(Arc::new(DaemonClient::new(sock)));
                ramjet_benches::drain_through_daemon(cfg);
            })
        })
        .collect();
    for r in readers {
        r.join().expect("reader");
    }
    daemons.iter().map(|d| d.stats().origin_bytes).sum()
}

/// Reads every shard `passes` times from a warm peer over one connection; returns bytes/s.
fn peer_throughput(rt: &tokio::runtime::Runtime, peer: &str, ds: &Dataset, passes: usize) -> f64 {
    // The daemon's own peer client: pooled authenticated connection, pooled receive buffers.
    let t = TcpTransport::new(LinkConfig {
        api_key: None,
        peer_timeout: Duration::from_secs(10),
        reply_timeout: Duration::from_secs(30),
        transfer_min_bytes_per_s: ramjet_transport::peer::TRANSFER_MIN_BYTES_PER_S_DEFAULT,
    });
    rt.block_on(async {
        let gets: Vec<ShardGet> = ds
            .manifest()
            .shards()
            .map(Result::unwrap)
            .enumerate()
            .map(|(i, sh)| ShardGet {
                manifest_url: ds.manifest_url().to_owned(),
                shard: i as u32,
                checksum: sh.checksum_u64(),
                bytes: sh.bytes,
                what: format!("shard {i}"),
                keep: false,
            })
            .collect();
        // One untimed pass opens the connection and fills the buffer pool.
        for g in &gets {
            t.fetch(peer, g).await.unwrap();
        }
        let t0 = Instant::now();
        let mut total = 0u64;
        for _ in 0..passes {
            for g in &gets {
                total += t.fetch(peer, g).await.unwrap().len() as u64;
            }
        }
        total as f64 / t0.elapsed().as_secs_f64()
    })
}

/// Loopback TCP throughput by iperf3 (one stream, like one peer connection), bytes/s.
fn iperf3(secs: u64) -> Option<f64> {
    let port = free_port("127.0.0.1").to_string();
    let mut server = Command::new("iperf3")
        .args(["-s", "-1", "-B", "127.0.0.1", "-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("iperf3")
        .args(["-c", "127.0.0.1", "-p", &port, "-t", &secs.to_string(), "-J"])
        .output()
        .ok()?;
    let _ = server.wait();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    v["end"]["sum_received"]["bits_per_second"].as_f64().map(|b| b / 8.0)
}

fn main() {
    let (full, rt, url, ds, total, n) = bench_setup();
    let dir = tempfile::tempdir().unwrap();

    let with_ring = three_node_epoch(&url, true, dir.path());
    let without = three_node_epoch(&url, false, dir.path());
    let (r1, r3) = (with_ring as f64 / total as f64, without as f64 / total as f64);

    // A warm peer: a standalone daemon serving peers, its cache filled by one read.
    let ip = "127.0.0.30";
    let me = format!("{ip}:{}", free_port(ip));
    let mut c = DaemonConfig::new(
        dir.path().join("peer.sock"),
        CacheConfig::new(dir.path().join("peer"), 8 << 30),
    );
    c.listen = Some(me.parse().unwrap());
    c.peers = vec![me.clone()];
    let d = Daemon::start(c).unwrap();
    let mut cfg = StreamConfig::new(url.clone());
    cfg.provider = Some(Arc::new(DaemonClient::new(d.socket())));
    let mut s = Stream::open(cfg).unwrap();
    while s.next_sample().unwrap().is_some() {}
    drop(s);
    // Cache fills bypass the page cache (O_DIRECT): read the files once, so the peer serves
    // them page-cached, as a warm peer does (the disk path has its own bench, `io_uring`).
    ramjet_benches::warm_page_cache(&dir.path().join("peer"));
    // Deterministic, unlike the timings below, so asserted: with the ring each shard crosses
    // from the origin once for the whole cluster; without it, once per node.
    assert!(
        (r1 - 1.0).abs() < 0.01,
        "origin bytes with the ring: {r1:.3}x the dataset, not 1.00x"
    );
    assert!(
        (r3 - 3.0).abs() < 0.03,
        "origin bytes without the ring: {r3:.3}x the dataset, not 3.00x"
    );
    let passes = if full { 5 } else { 1 };
    let secs = if full { 5 } else { 1 };
    // Interleave the two, three rounds, and take medians (the machine is noisy).
    let (mut peer, mut tcp) = (Vec::new(), Vec::new());
    for _ in 0..if full { 3 } else { 1 } {
        peer.push(peer_throughput(&rt, &me, &ds, passes));
        if let Some(t) = iperf3(secs) {
            tcp.push(t);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let peer_bps = med(&mut peer).unwrap();
    let tcp_bps = med(&mut tcp);
    let gib = |b: f64| b / (1u64 << 30) as f64;
    println!(
        "cluster benchmark: {n} images, {} shards, {:.1} MiB",
        ds.manifest().shard_count(),
        total as f64 / (1 << 20) as f64
    );
    println!("| scenario | ramjet | baseline | ratio (target) |");
    println!("|---|---|---|---|");
    println!(
        "| origin bytes, 3-node epoch | ring: {r1:.2}x the dataset | no ring: {r3:.2}x | {:.2} (ring 1.0x vs 3.0x) |",
        r1 / r3
    );
    match tcp_bps {
        Some(t) => println!(
            "| peer fetch throughput, loopback | {:.2} GiB/s | iperf3 1 stream: {:.2} GiB/s | {:.2}x (>= 0.80) |",
            gib(peer_bps),
            gib(t),
            peer_bps / t
        ),
        None => println!(
            "| peer fetch throughput, loopback | {:.2} GiB/s | iperf3 not installed: skipped | - |",
            gib(peer_bps)
        ),
    }
    save_results(
        "cluster",
        &serde_json::json!({
            "images": n,
            "dataset_bytes": total,
            "origin_ratio_ring": r1,
            "origin_ratio_no_ring": r3,
            "peer_bytes_per_s": peer,
            "iperf3_bytes_per_s": tcp,
            "peer_over_iperf3": tcp_bps.map(|t| peer_bps / t),
        }),
    );
}
