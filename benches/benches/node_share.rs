//! Bytes into each node per epoch: the one global order dealt node by node against today's
//! deal, position by position, that makes every node read the whole dataset.
//!
//! Targets (issue: each node reads only its share):
//! - each node's bytes in per epoch (origin plus peers) at most 1.1x the dataset divided by
//!   the nodes, with 3 and 8 daemons on loopback addresses and 2 ranks a node;
//! - the cluster's origin bytes 1.0x the dataset;
//! - with sticky shares, the second epoch's peer and origin bytes under 2% of the first's.
//!
//! Sticky shares run three times by where a shard two nodes read (a cut splits it) comes from
//! (`StreamConfig::split_shards`): through the daemon of its reader node (the default), through
//! its ring owner, and from the origin into each of the two nodes.
//!
//! `cargo bench -p ramjet-benches --bench node_share` (5,315 images in shards of 1 MiB, about
//! 15 images each; 3 and 8 nodes); under `cargo test` it runs once on 400 images and 3 nodes. The counts are
//! deterministic (the order and the ring are), so each configuration runs once; the wall
//! time of each epoch is printed beside them, not compared. Needs the local S3 server.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use ramjet_benches::{drain_through_daemon, full_run, packed_dataset, save_results};
use ramjet_engine::cache::CacheConfig;
use ramjet_engine::order::{OrderSpec, Shares, Shuffle, Tail, Topology};
use ramjet_engine::{SplitShards, StreamConfig};
use ramjet_tests::free_port;
use ramjet_transport::{Daemon, DaemonClient, DaemonConfig};

/// How the job's positions reach its nodes.
#[derive(Debug, Clone, Copy)]
enum Deal {
    /// Today's default: one partition, so positions go round every rank of every node.
    Strided,
    /// Partitions dealt node by node; each epoch draws the rounds afresh.
    Rotate,
    /// Partitions dealt node by node; the rounds hold the same shards every epoch; a shard two
    /// nodes read goes through its reader node's daemon (the default).
    Sticky,
    /// Sticky, and a shard two nodes read goes through its ring owner.
    StickyOwner,
    /// Sticky, and a shard two nodes read comes from the origin into each.
    StickyOrigin,
}

/// Bytes into one node in one epoch.
#[derive(Debug, Clone, Copy, Default)]
struct NodeIn {
    origin: u64,
    peer: u64,
}

impl NodeIn {
    fn total(&self) -> u64 {
        self.origin + self.peer
    }
}

/// A daemon's bytes in so far: what it fetched from the origin and from its peers (each
/// fetch once, however many of its loaders it served).
fn bytes_in(d: &Daemon) -> NodeIn {
    let s = d.stats();
    NodeIn {
        origin: s.origin_bytes,
        peer: s.peer_fetched_bytes,
    }
}

fn order(deal: Deal, nodes: usize) -> OrderSpec {
    OrderSpec {
        seed: 3,
        shuffle: Shuffle::ShardBlock {
            window_shards: 4,
            block_samples: 1,
        },
        // Four partitions a node: a node's columns of a round hold 16 shards, of which the cuts
        // at its two ends split about one (read whole by both neighbours).
        partitions: match deal {
            Deal::Strided => 1,
            _ => 4 * nodes,
        },
        tail: Tail::PadRepeat,
        shares: match deal {
            Deal::Sticky | Deal::StickyOwner | Deal::StickyOrigin => Shares::Sticky,
            _ => Shares::Rotate,
        },
    }
}

/// One epoch of a job of `nodes` nodes, 2 ranks each, reading through each node's daemon.
fn epoch(url: &str, daemons: &[Daemon], spec: OrderSpec, split: SplitShards, epoch: u64) {
    let world = 2 * daemons.len();
    let readers: Vec<_> = (0..world)
        .map(|rank| {
            let (url, sock) = (url.to_owned(), daemons[rank / 2].socket().to_owned());
            std::thread::spawn(move || {
                let mut cfg = StreamConfig::new(url);
                cfg.order = spec;
                cfg.split_shards = split;
                cfg.topology = Topology {
                    rank,
                    world,
                    local_rank: rank % 2,
                    local_world: 2,
                    ..Topology::default()
                };
                cfg.first_epoch = epoch;
                cfg.epochs = Some(epoch + 1);
                // Every byte through the daemon: no samples read by ranged GETs of its own.
                cfg.first_ranged_samples_max = 0;
                cfg.ranged_until_shard_bytes_max = 0;
                cfg.provider = Some(Arc::new(DaemonClient::new(sock)));
                drain_through_daemon(cfg);
            })
        })
        .collect();
    for r in readers {
        r.join().expect("reader");
    }
}

/// Two epochs of `deal` over `nodes` fresh daemons (a ring on loopback addresses): each node's
/// bytes in, epoch by epoch, and each epoch's wall seconds.
fn run(url: &str, nodes: usize, deal: Deal, dir: &Path) -> (Vec<[NodeIn; 2]>, [f64; 2]) {
    let names: Vec<String> = (0..nodes)
        .map(|i| {
            let ip = format!("127.0.0.{}", 70 + i);
            format!("{ip}:{}", free_port(&ip))
        })
        .collect();
    let daemons: Vec<Daemon> = names
        .iter()
        .enumerate()
        .map(|(i, me)| {
            let tag = format!("{deal:?}-{nodes}-{i}");
            let mut c = DaemonConfig::new(
                dir.join(format!("{tag}.sock")),
                CacheConfig::new(dir.join(&tag), 8 << 30),
            );
            c.threads = 1;
            c.listen = Some(me.parse().unwrap());
            c.peers = names.clone();
            Daemon::start(c).expect("daemon")
        })
        .collect();
    let spec = order(deal, nodes);
    let mut per_node = vec![[NodeIn::default(); 2]; nodes];
    let mut wall = [0.0; 2];
    for e in 0..2 {
        let before: Vec<NodeIn> = daemons.iter().map(bytes_in).collect();
        let t = Instant::now();
        let split = match deal {
            Deal::StickyOwner => SplitShards::Owner,
            Deal::StickyOrigin => SplitShards::Origin,
            _ => SplitShards::Reader,
        };
        epoch(url, &daemons, spec, split, e as u64);
        wall[e] = t.elapsed().as_secs_f64();
        for (n, d) in daemons.iter().enumerate() {
            let now = bytes_in(d);
            per_node[n][e] = NodeIn {
                origin: now.origin - before[n].origin,
                peer: now.peer - before[n].peer,
            };
        }
        eprintln!("node_share: {nodes} nodes, {deal:?}, epoch {e}: {:.1} s", wall[e]);
    }
    (per_node, wall)
}

fn main() {
    let full = full_run();
    let n = if full { 5315 } else { 400 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    // Shards of about 15 images, as a real pack's shards hold many samples: the deal position by
    // position then touches every shard from every node.
    let shard_bytes = 1u64 << 20;
    let opts = ramjet_tools::pack::PackOptions {
        shard_bytes_target: shard_bytes,
        ..Default::default()
    };
    let (url, ds) = packed_dataset(&rt, n, &format!("node-share-{n}-{}k", shard_bytes >> 10), &opts);
    let total = ds.manifest().bytes;
    let shards = ds.manifest().shard_count();
    println!(
        "node_share benchmark: {n} images, {shards} shards, {:.1} MiB",
        total as f64 / (1 << 20) as f64
    );
    println!("| nodes | deal | epoch 1: max node in / (dataset / nodes) | origin / dataset | epoch 2: max node in / (dataset / nodes) | epoch 2 peer+origin / epoch 1 | wall s (1, 2) |");
    println!("|---|---|---|---|---|---|---|");
    let dir = tempfile::tempdir().unwrap();
    let mut results = Vec::new();
    for nodes in if full { vec![3, 8] } else { vec![3] } {
        for deal in [
            Deal::Strided,
            Deal::Rotate,
            Deal::Sticky,
            Deal::StickyOwner,
            Deal::StickyOrigin,
        ] {
            let (per_node, wall) = run(&url, nodes, deal, dir.path());
            let share = total as f64 / nodes as f64;
            let max_in = |e: usize| per_node.iter().map(|p| p[e].total()).max().unwrap_or(0) as f64 / share;
            let origin = per_node.iter().map(|p| p[0].origin).sum::<u64>() as f64 / total as f64;
            let second = per_node.iter().map(|p| p[1].total()).sum::<u64>() as f64
                / per_node.iter().map(|p| p[0].total()).sum::<u64>().max(1) as f64;
            println!(
                "| {nodes} | {deal:?} | {:.2}x | {origin:.2}x | {:.2}x | {:.1}% | {:.1}, {:.1} |",
                max_in(0),
                max_in(1),
                100.0 * second,
                wall[0],
                wall[1]
            );
            let bytes: Vec<serde_json::Value> = per_node
                .iter()
                .map(|p| serde_json::json!(p.map(|e| serde_json::json!({"origin": e.origin, "peer": e.peer}))))
                .collect();
            results.push(serde_json::json!({
                "nodes": nodes,
                "deal": format!("{deal:?}"),
                "per_node_bytes_in": bytes,
                "max_node_in_over_share": [max_in(0), max_in(1)],
                "origin_over_dataset_epoch1": origin,
                "epoch2_over_epoch1": second,
                "wall_s": wall,
            }));
        }
    }
    save_results(
        "node_share",
        &serde_json::json!({ "images": n, "shards": shards, "dataset_bytes": total, "runs": results }),
    );
}
