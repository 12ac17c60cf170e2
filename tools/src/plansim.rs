//! The manifest-only simulation of issue 20 (`ramjet plan-sim`): the cost of starting an
//! epoch over a dataset of any size, without the dataset.
//!
//! It writes a real manifest and binary shard table for `samples` tiny samples in shards of
//! `shard_samples`, and one real shard. Every record of the table describes that same shard
//! (same size and checksum, its own key), and a stub [`ShardProvider`] serves it for any
//! shard: planning, the manifest and the order are exercised at full size, the shard data is
//! not. It then opens a [`Stream`] and reads the first sample, timing it and reading the
//! process's peak RSS and how many blocks of the shard table were read.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use ramjet_engine::format::{shard_key, ColumnType, Manifest, Schema, ShardBuilder, ShardInfo, ShardTable, Value};
use ramjet_engine::order::{
    effective_len, DealRule, EpochOrder, EpochProgress, OrderSpec, SourceShape, Topology, Weight,
};
use ramjet_engine::provider::{Fetched, FetchedFrom, ShardProvider, ShardRequest};
use ramjet_engine::{Error, Opened, Result, Stream, StreamConfig};

/// Serves one shard's bytes for every request.
#[derive(Debug)]
struct OneShard(Bytes);

impl ShardProvider for OneShard {
    fn fetch(&self, _req: &ShardRequest<'_>) -> Result<Fetched> {
        Ok(Fetched {
            bytes: self.0.clone(),
            from: FetchedFrom::CacheLocal,
        })
    }
    fn report_corrupt(&self, req: &ShardRequest<'_>) {
        // The stream then fails with the verification error, which names the shard.
        eprintln!("plan-sim: the simulated shard {} failed verification", req.shard);
    }
}

/// What one simulation measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlanSim {
    /// Samples in the dataset.
    pub samples: u64,
    /// Shards in the dataset.
    pub shards: u64,
    /// Bytes of the shard table.
    pub table_bytes: u64,
    /// Shuffle used.
    pub shuffle: String,
    /// Seconds from opening the stream (manifest, table, plan) to its first sample.
    pub ttfs_s: f64,
    /// Seconds `Stream::open` took (part of `ttfs_s`).
    pub open_s: f64,
    /// Peak resident memory of the process (VmHWM), MB.
    pub rss_peak_mb: f64,
    /// Resident memory at the first sample (VmRSS), MB.
    pub rss_mb: f64,
    /// Blocks of the shard table read by the first sample (of `table_blocks`).
    pub table_blocks_read: u64,
    /// Blocks in the shard table.
    pub table_blocks: u64,
    /// Bytes the table's counts section takes in memory (packed; 0 when it was not read).
    pub counts_bytes: u64,
    /// The job: nodes, ranks a node, and the order's partitions; the stream is rank `rank`.
    pub nodes: u64,
    /// Ranks on each node.
    pub ranks_per_node: u64,
    /// The order's canonical partitions.
    pub partitions: u64,
    /// The rank measured.
    pub rank: u64,
    /// Whether the deal is node-affine (each node reads only its partitions' shards).
    pub node_affine: bool,
}

/// The shards one node of a job reads in an epoch, walked position by position through the
/// node's consumers' deals (the order alone: no shard is read).
#[derive(Debug, Clone, serde::Serialize)]
pub struct NodeShards {
    /// The node.
    pub node: u64,
    /// Positions the node's consumers are dealt.
    pub positions: u64,
    /// Distinct shards those positions lie in.
    pub shards: u64,
    /// The dataset's shards over the nodes: what a node reads at best.
    pub share: f64,
    /// `shards / share`.
    pub ratio: f64,
    /// Seconds the walk took.
    pub walk_s: f64,
}

/// Writes (once; kept under `dir`) the manifest, table and shard of a simulated dataset of
/// `samples` samples in shards of `shard_samples`; returns its URL and the shard's bytes.
pub fn prepare(dir: &Path, samples: u64, shard_samples: u64) -> Result<(String, Bytes)> {
    if shard_samples == 0 || samples == 0 || samples % shard_samples != 0 {
        return Err(Error::invalid(
            "plan-sim",
            "samples must be a positive multiple of shard_samples",
        ));
    }
    let schema = Schema::new([("id".to_string(), ColumnType::Int64)])?;
    let mut b = ShardBuilder::new(schema.clone());
    for i in 0..shard_samples {
        b.push(&[Value::Int64(i as i64)], "simulated")?;
    }
    let shard = b.finish();
    let root = dir.join(format!("sim-{samples}-{shard_samples}"));
    let url = format!("file://{}", root.display());
    let bytes = Bytes::from(shard.bytes);
    if root.join("manifest.json").exists() {
        return Ok((url, bytes));
    }
    let io = |e: std::io::Error| Error::io(root.display(), e);
    let shards = samples / shard_samples;
    let checksum = ramjet_engine::format::Checksum(shard.checksum);
    let infos: Vec<ShardInfo> = (0..shards as usize)
        .map(|i| ShardInfo {
            key: shard_key(i, shard.checksum),
            bytes: bytes.len() as u64,
            samples: shard_samples,
            checksum,
            columns: None,
            foreign: None,
        })
        .collect();
    let table = ShardTable::build(&infos).map_err(|why| Error::invalid("plan-sim table", why))?;
    drop(infos);
    let key = format!("tables/{:016x}.rjt", table.checksum());
    std::fs::create_dir_all(root.join("tables")).map_err(io)?;
    std::fs::create_dir_all(root.join("shards")).map_err(io)?;
    std::fs::write(root.join(&key), table.as_bytes().expect("built in memory")).map_err(io)?;
    std::fs::write(root.join(shard_key(0, shard.checksum)), &bytes).map_err(io)?;
    let m = Manifest::with_table("simulated", schema, Default::default(), table, key);
    std::fs::write(root.join("manifest.json"), m.to_bytes()).map_err(io)?;
    Ok((url, bytes))
}

/// The job a simulation measures: `nodes` of `ranks_per_node` ranks, the stream being rank
/// `rank`, under `order`.
#[derive(Debug, Clone, Copy)]
pub struct SimJob {
    /// Nodes.
    pub nodes: usize,
    /// Ranks a node.
    pub ranks_per_node: usize,
    /// The rank measured.
    pub rank: usize,
    /// The order.
    pub order: OrderSpec,
}

impl SimJob {
    fn topology(&self) -> Topology {
        let world = self.nodes * self.ranks_per_node;
        Topology {
            rank: self.rank,
            world,
            local_rank: self.rank % self.ranks_per_node,
            local_world: self.ranks_per_node,
            ..Topology::default()
        }
    }
}

/// Walks the deals of the consumers of node `node` of `job` over epoch 0 of the dataset at
/// `url` and counts the shards their positions lie in. Costs one cursor step a position.
pub fn node_shards(url: &str, job: &SimJob, node: usize) -> Result<NodeShards> {
    let t0 = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("runtime", e))?;
    let ds = rt.block_on(ramjet_engine::Dataset::open(url))?;
    let m = ds.manifest();
    let shapes = vec![SourceShape {
        version: m.version.clone(),
        counts: m.shard_counts(),
        weight: Weight::Natural,
    }];
    let order = Arc::new(EpochOrder::new(&shapes, &job.order, 0)?);
    let topo = job.topology();
    let rule = DealRule::for_job(&job.order, &topo);
    let len = effective_len(order.len(), &rule, job.order.tail);
    let mut seen = vec![0u64; m.shard_count().div_ceil(64)];
    let mut positions = 0u64;
    for r in node * job.ranks_per_node..(node + 1) * job.ranks_per_node {
        let deal = EpochProgress::default().deal(len, r, &rule);
        let mut cur = order.cursor();
        for k in 0..deal.len() {
            let s = cur.at(deal.position(k))?.0.shard as usize;
            seen[s / 64] |= 1 << (s % 64);
        }
        positions += deal.len();
    }
    let shards = seen.iter().map(|w| u64::from(w.count_ones())).sum::<u64>();
    let share = m.shard_count() as f64 / job.nodes as f64;
    Ok(NodeShards {
        node: node as u64,
        positions,
        shards,
        share,
        ratio: shards as f64 / share,
        walk_s: t0.elapsed().as_secs_f64(),
    })
}

/// Opens a stream over the simulated dataset at `url` (shards from the stub) as rank
/// `job.rank` and reads its first sample. Run it in a fresh process for a meaningful peak RSS.
pub fn first_sample(url: &str, shard: Bytes, job: &SimJob) -> Result<PlanSim> {
    let t0 = Instant::now();
    let mut cfg = StreamConfig::new(url);
    cfg.order = job.order;
    cfg.topology = job.topology();
    cfg.epochs = Some(1);
    cfg.provider = Some(Arc::new(OneShard(shard)));
    let mut s = Stream::open(cfg)?;
    let open_s = t0.elapsed().as_secs_f64();
    let first = s.next_sample()?;
    let ttfs_s = t0.elapsed().as_secs_f64();
    if first.is_none() {
        return Err(Error::invalid(url, "the stream gave no sample"));
    }
    let m = s.dataset(0).manifest();
    let (samples, shards) = (m.samples, m.shard_count() as u64);
    let table_bytes = m.table_ref().map_or(0, |t| t.bytes);
    let table_blocks_read = m.table().map_or(0, |t| (t.loaded_blocks() + t.counted_blocks()) as u64);
    let table_blocks = shards.div_ceil(ramjet_engine::format::SHARD_TABLE_BLOCK_RECORDS as u64);
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |field: &str| {
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok(PlanSim {
        samples,
        shards,
        table_bytes,
        shuffle: format!("{:?}", job.order.shuffle),
        ttfs_s,
        open_s,
        rss_peak_mb: kb("VmHWM:") / 1024.0,
        rss_mb: kb("VmRSS:") / 1024.0,
        table_blocks_read,
        table_blocks,
        counts_bytes: m.table().map_or(0, |t| t.counts_bytes() as u64),
        nodes: job.nodes as u64,
        ranks_per_node: job.ranks_per_node as u64,
        partitions: job.order.partitions as u64,
        rank: job.rank as u64,
        node_affine: DealRule::for_job(&job.order, &job.topology()).nodes > 1,
    })
}
