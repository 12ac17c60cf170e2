//! `ramjet`: pack, inspect and verify datasets; generate the synthetic demo set.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use ramjet_engine::cache::CacheConfig;
use ramjet_engine::order::{OrderSpec, Shuffle, Tail, Topology, Weight};
use ramjet_engine::{Dataset, SourceConfig, Stream, StreamConfig, StreamState};
use ramjet_tools::pack::{pack, PackOptions, SourceKind};
use ramjet_tools::synth::{synth, SynthOptions};
use ramjet_tools::ui::{bytes_bar, count_bar, human_bytes, parse_size};
use ramjet_transport::{Daemon, DaemonConfig};

// mimalloc keeps freed memory mapped for reuse: with the system allocator every decoded image's
// buffers were fresh pages, faulted in again image after image (docs/dependencies.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "ramjet",
    version,
    about = "Stream training data from object storage at GPU speed"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a deterministic synthetic YOLO dataset (photo-like 640x480 JPEGs plus labels).
    Synth {
        /// Output folder.
        dir: PathBuf,
        /// Number of images.
        #[arg(long, default_value_t = 5315)]
        samples: usize,
        /// Dataset seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Pack an image folder, a YOLO layout or a JSONL file into shards plus a manifest.
    Pack {
        /// Input: a folder (YOLO or one subfolder per class) or a .jsonl file.
        src: PathBuf,
        /// Output: a local folder, file://, or s3://bucket/prefix (also gs://, az://).
        dst: String,
        /// Target shard size, e.g. 64MiB.
        #[arg(long, default_value = "64MiB", value_parser = parse_size)]
        shard_size: u64,
        /// Input layout (detected when omitted).
        #[arg(long, value_enum)]
        format: Option<SourceKind>,
        /// Skip unreadable or unsupported inputs, then list them, instead of aborting.
        #[arg(long)]
        skip_bad: bool,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// List the shards in a binary shard table beside the manifest (48 bytes a shard)
        /// rather than in its JSON: `auto` does so above 4,096 shards.
        #[arg(long, value_enum, default_value = "auto")]
        shard_table: ramjet_tools::pack::ShardTableMode,
        /// Store JPEGs transcoded losslessly (the same pixels, not the same bytes) with a
        /// restart marker every 32 pixels of each MCU row and optimal Huffman tables: a random
        /// crop then decodes only the part of the image it needs, about 1.3x faster.
        #[arg(long)]
        jpeg_restarts: bool,
    },
    /// Index a MosaicML (MDS) or WebDataset dataset in place: writes a ramjet manifest beside
    /// its shards (no copy), with every shard's size and checksum and every sample's checksum,
    /// so that ramjet reads and verifies it as its own.
    Index {
        /// An MDS folder or prefix (holding index.json); a WebDataset brace pattern such as
        /// s3://b/ds/train-{000000..000099}.tar, or one .tar; or a shard-list .txt file (one
        /// tar per line, relative to its folder). The manifest goes into that folder.
        src: String,
        /// Have the ramjet shards that the foreign ones transcode to (what the caches hold)
        /// store each JPEG (an MDS `jpeg` or `bytes` value, or a WebDataset member, that is a
        /// JPEG file by its first bytes) transcoded
        /// losslessly with a restart marker every 32 pixels of each MCU row: the same pixels,
        /// crops about 1.3x faster. The foreign objects are not changed. It costs a few CPU ms
        /// a JPEG each time a shard is read from the origin.
        #[arg(long)]
        jpeg_restarts: bool,
    },
    /// Measure the cost of starting an epoch over a simulated dataset of any size: a real
    /// manifest and shard table, every shard served by a stub from one real tiny shard. Prints
    /// JSON: time to first sample and peak RSS (measured in a fresh child process).
    PlanSim {
        /// Folder for the simulated manifests (kept and reused per size).
        #[arg(long)]
        dir: PathBuf,
        /// Samples in the dataset.
        #[arg(long)]
        samples: u64,
        /// Samples per shard.
        #[arg(long, default_value_t = 1000)]
        shard_samples: u64,
        /// Shuffle: none or block (the stub serves whole shards, so not global).
        #[arg(long, default_value = "block")]
        shuffle: String,
        /// Measure in this process (the parent prepares, then runs this in a child).
        #[arg(long, hide = true)]
        measure: bool,
    },
    /// Print a dataset's schema, shard count, sample count and bytes.
    Inspect {
        /// Dataset URL (a prefix, or a manifest .json).
        url: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stream samples through the engine (order, cache, prefetch) and report throughput.
    Stream(Box<StreamArgs>),
    /// The exactly-once audit: checks saved job or consumer states against the epoch's order
    /// ("each sample exactly once so far", or which count is off). Exit status 0 when each
    /// sample was delivered exactly once, 1 when not.
    Audit {
        /// The job's sources (dataset URLs), in the order the job lists them.
        #[arg(required = true)]
        urls: Vec<String>,
        /// Saved states: a job's (Python `state_dict()`, or its `resume` JSON) or every
        /// consumer's (`ramjet stream --state` files, a DataLoader worker's `state_dict()`,
        /// or raw consumer states), taken at the same step.
        #[arg(long = "state", required = true)]
        states: Vec<PathBuf>,
        /// Sampling weight per source (natural, p:X, r:X, n:N), as the job used.
        #[arg(long = "weight")]
        weights: Vec<String>,
        /// Consumers (ranks x workers) of the job, for a job state whose tail was dropped or
        /// padded (a consumer's state records its epoch's length itself).
        #[arg(long, default_value_t = 1)]
        consumers: usize,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run the host cache daemon: owns the node cache, serves local loaders over a Unix
    /// socket and peers over TCP (consistent-hash ring, singleflight, RAMJET_API_KEY).
    Serve(Box<ServeArgs>),
    /// Print a cluster view from daemons' /stats (HOST is host:port of their --http).
    Stats {
        /// Daemons' HTTP addresses.
        #[arg(required = true)]
        hosts: Vec<String>,
        /// Print the raw JSON documents.
        #[arg(long)]
        json: bool,
        /// First wait until the ring is complete: every daemon answers /ready (it is a member
        /// and has completed an authenticated handshake with every other member), all report
        /// the same members and ring version, and the members are as many as HOSTS. Exits 1
        /// after --timeout, naming each daemon that is not ready and why.
        #[arg(long)]
        wait: bool,
        /// Seconds --wait waits.
        #[arg(long, default_value_t = 120.0)]
        timeout: f64,
    },
    /// Re-read every shard and check every checksum. Exits 1 and names each bad shard and sample.
    Verify {
        /// Dataset URL (a prefix, or a manifest .json).
        url: String,
        /// Shards checked at once.
        #[arg(long, default_value_t = 4)]
        parallel: usize,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ShuffleArg {
    None,
    Block,
    Global,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TailArg {
    Uneven,
    DropLast,
    PadRepeat,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Unix socket for local loaders (default: $RAMJET_SOCKET, $XDG_RUNTIME_DIR/ramjet.sock
    /// or /tmp/ramjet-UID.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Node-local cache directory.
    #[arg(long, env = "RAMJET_CACHE_DIR")]
    cache_dir: PathBuf,
    /// Cache byte budget.
    #[arg(long, default_value = "100GiB", value_parser = parse_size)]
    cache_limit: u64,
    /// Peer TCP address to listen on (none: no peers).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// This daemon's name in the member list (default: the listen address, or
    /// HOSTNAME:PORT when the members are host names).
    #[arg(long)]
    advertise: Option<String>,
    /// Members, host:port, comma-separated; hostlists allowed (`node[01-04]:7341`).
    #[arg(long, env = "RAMJET_PEERS")]
    peers: Option<String>,
    /// A member file, one host:port or hostlist per line; re-read every second.
    #[arg(long)]
    peers_file: Option<PathBuf>,
    /// Port of every member when members come from SLURM_JOB_NODELIST.
    #[arg(long, default_value_t = 7341)]
    peer_port: u16,
    /// HTTP address for /stats and /metrics.
    #[arg(long)]
    http: Option<std::net::SocketAddr>,
    /// Serve only datasets under these URL prefixes (comma-separated), matched on URL
    /// components: `s3://bucket/data` admits `s3://bucket/data/...`, not `s3://bucket/database`.
    #[arg(long, value_delimiter = ',')]
    allow: Vec<String>,
    /// Listen for peers on a non-loopback address without RAMJET_API_KEY (trusted networks only).
    #[arg(long)]
    insecure: bool,
    /// Datasets (manifests) held open at once.
    #[arg(long, default_value_t = ramjet_transport::daemon::DATASETS_OPEN_MAX_DEFAULT)]
    datasets_open_max: usize,
    /// Connections served at once in each class (local loaders, authenticated peers, HTTP):
    /// each class has a budget of its own, so a flood on one port never refuses another.
    #[arg(long, default_value_t = ramjet_transport::daemon::CONNECTIONS_MAX_DEFAULT)]
    connections_max: usize,
    /// Peer-port connections still in the handshake, at once (each is closed after
    /// RAMJET_HANDSHAKE_TIMEOUT_MS, default 2000).
    #[arg(long, default_value_t = ramjet_transport::daemon::HANDSHAKES_MAX_DEFAULT)]
    handshakes_max: usize,
    /// Connections from one address held at once among those in the handshake and among HTTP
    /// connections.
    #[arg(long, default_value_t = ramjet_transport::daemon::PER_ADDRESS_MAX_DEFAULT)]
    per_address_max: usize,
    /// Network runtime worker threads (default: one per core; an embedded daemon shares its
    /// process's runtime instead, see `RAMJET_NET_THREADS`).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// How shard bytes move between peers: `tcp`, or `rdma` (RDMA WRITE; needs a build with
    /// the cargo feature `rdma` and an RDMA device; peers without RDMA are read over TCP).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
    transport: String,
    /// RDMA device (default: the first one).
    #[arg(long)]
    rdma_device: Option<String>,
    /// GID index on the RDMA port (RoCE v2: usually 1 or 3; InfiniBand: 0).
    #[arg(long, default_value_t = 0)]
    rdma_gid_index: u8,
}

#[derive(clap::Args)]
struct StreamArgs {
    /// Dataset URLs; several are mixed (see --weights).
    #[arg(required = true)]
    urls: Vec<String>,
    /// One weight per URL: `natural`, `p:0.7` (proportion), `r:2` (repeat factor), `n:1000` (count).
    #[arg(long, value_delimiter = ',')]
    weights: Vec<String>,
    /// Epochs to stream.
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    /// Shuffle: none, block (locality-preserving shard-block), global.
    #[arg(long, value_enum, default_value = "block")]
    shuffle: ShuffleArg,
    /// Shards per window of the block shuffle.
    #[arg(long, default_value_t = 4)]
    window: usize,
    /// Samples per block of the block shuffle.
    #[arg(long, default_value_t = 1)]
    block: u64,
    /// Canonical partitions.
    #[arg(long, default_value_t = 1)]
    partitions: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tail handling when the epoch does not divide across consumers.
    #[arg(long, value_enum, default_value = "uneven")]
    tail: TailArg,
    /// Rank (default: $RANK or 0).
    #[arg(long)]
    rank: Option<usize>,
    /// World size (default: $WORLD_SIZE or 1).
    #[arg(long)]
    world: Option<usize>,
    /// Worker index in the rank.
    #[arg(long, default_value_t = 0)]
    worker: usize,
    /// Workers per rank.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// Node-local cache directory (none: stream from the origin only).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Cache byte budget.
    #[arg(long, default_value = "10GiB", value_parser = parse_size)]
    cache_limit: u64,
    /// Bytes of shards prefetched ahead.
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    prefetch: u64,
    /// Bytes of whole shards the global shuffle holds in memory (beyond them, samples are
    /// read one by one from the cache).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    resident: u64,
    /// Record bytes read one sample at a time, past the first 64, while no whole shard has
    /// arrived yet (a slow link: the consumer is fed while the first shard downloads).
    #[arg(long, default_value = "32MiB", value_parser = parse_size)]
    ranged_bytes: u64,
    /// Bytes of shard indexes held for samples read one by one from the cache (one read a
    /// sample instead of two, when every source's index fits).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    index_bytes: u64,
    /// Whole shards are fetched as parallel ranged GETs of this size.
    #[arg(long, default_value = "32MiB", value_parser = parse_size)]
    range_size: u64,
    /// Write one line per sample: epoch position stream shard index global_index record_bytes.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Save the stream state here (atomically) every --state-every samples.
    #[arg(long)]
    state: Option<PathBuf>,
    /// Samples between state saves.
    #[arg(long, default_value_t = 1)]
    state_every: u64,
    /// Resume from --state (and truncate --out to what that state covers).
    #[arg(long)]
    resume: bool,
    /// Stop after this many samples.
    #[arg(long)]
    limit: Option<u64>,
    /// Simulated training step: sleep this many milliseconds after each sample.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// Read whole shards through the host daemon at this socket (`ramjet serve`).
    #[arg(long)]
    daemon: Option<PathBuf>,
    /// Print the final metrics as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_weight(w: &str) -> anyhow::Result<Weight> {
    Ok(match w.split_once(':') {
        None if w == "natural" => Weight::Natural,
        Some(("p", v)) => Weight::Proportion(v.parse()?),
        Some(("r", v)) => Weight::Repeat(v.parse()?),
        Some(("n", v)) => Weight::Count(v.parse()?),
        _ => anyhow::bail!("weight {w:?}: use natural, p:X, r:X or n:N"),
    })
}

/// What `--state` holds: the stream state and how many bytes of `--out` it covers.
#[derive(serde::Serialize, serde::Deserialize)]
struct SavedState {
    state: StreamState,
    out_len: u64,
}

fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}

/// One saved state for `ramjet audit`: a job's position, or one consumer's.
enum Saved {
    Job(ramjet_engine::stream::ResumePoint),
    Consumer(StreamState),
}

/// Reads any state ramjet saves: `ramjet stream --state` (`{"state": ..., "out_len"}`), a
/// Python `state_dict()` (`{"resume": "<json>"}` or a worker's `{"consumer": "<json>"}`), a
/// job's resume JSON, or a consumer's state.
fn read_saved(p: &std::path::Path) -> anyhow::Result<Saved> {
    let text = std::fs::read(p).with_context(|| format!("read {}", p.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&text).with_context(|| format!("{}: not JSON", p.display()))?;
    let inner = |field: &str| -> anyhow::Result<Option<serde_json::Value>> {
        match v.get(field) {
            Some(serde_json::Value::String(s)) => Ok(Some(serde_json::from_str(s)?)),
            Some(serde_json::Value::Null) | None => Ok(None),
            Some(other) => Ok(Some(other.clone())),
        }
    };
    let what = |e: serde_json::Error| anyhow::anyhow!("{}: not a ramjet state ({e})", p.display());
    if let Some(c) = inner("consumer")? {
        return Ok(Saved::Consumer(serde_json::from_value(c).map_err(what)?));
    }
    if let Some(r) = inner("resume")? {
        return Ok(Saved::Job(serde_json::from_value(r).map_err(what)?));
    }
    if let Some(s) = v.get("state") {
        return Ok(Saved::Consumer(serde_json::from_value(s.clone()).map_err(what)?));
    }
    if v.get("progress").is_some() {
        return Ok(Saved::Job(serde_json::from_value(v).map_err(what)?));
    }
    Ok(Saved::Consumer(serde_json::from_value(v).map_err(what)?))
}

fn audit_cmd(
    urls: &[String],
    paths: &[PathBuf],
    weights: &[String],
    consumers: usize,
    json: bool,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(consumers >= 1, "--consumers must be at least 1");
    let mut jobs = Vec::new();
    let mut each = Vec::new();
    for p in paths {
        match read_saved(p)? {
            Saved::Job(j) => jobs.push(j),
            Saved::Consumer(c) => each.push(c),
        }
    }
    let (point, len) = match (jobs.len(), each.is_empty()) {
        (0, false) => {
            let (p, len) = StreamState::combine(&each)?;
            (p, Some(len))
        }
        (1, true) => (jobs.pop().expect("one"), None),
        _ => anyhow::bail!(
            "give one job state, or the states of every consumer of the job (got {} job and {} consumer states)",
            jobs.len(),
            each.len()
        ),
    };
    let mut cfg = StreamConfig::new(urls[0].clone());
    cfg.sources = urls
        .iter()
        .enumerate()
        .map(|(i, u)| {
            Ok(SourceConfig {
                url: u.clone(),
                weight: match weights.get(i) {
                    Some(w) => parse_weight(w)?,
                    None => Weight::Natural,
                },
            })
        })
        .collect::<anyhow::Result<_>>()?;
    cfg.order = point.order;
    cfg.topology = Topology {
        rank: 0,
        world: consumers,
        ..Topology::default()
    };
    let report = runtime()?.block_on(ramjet_engine::stream::audit(&cfg, &point, len))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "audit: {} ({} of {} positions delivered)",
            report.message, report.expected, report.len
        );
    }
    Ok(if report.exactly_once {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn stream_cmd(a: StreamArgs) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    let env_topo = Topology::from_env();
    let world = a.world.unwrap_or(env_topo.world);
    let topology = Topology {
        rank: a.rank.unwrap_or(env_topo.rank),
        world,
        worker: a.worker,
        workers: a.workers,
        ..env_topo
    };
    anyhow::ensure!(
        topology.rank < world && a.worker < a.workers,
        "rank/worker out of range"
    );
    let mut cfg = StreamConfig::new(a.urls[0].clone());
    cfg.sources = a
        .urls
        .iter()
        .enumerate()
        .map(|(i, u)| {
            Ok(SourceConfig {
                url: u.clone(),
                weight: match a.weights.get(i) {
                    Some(w) => parse_weight(w)?,
                    None => Weight::Natural,
                },
            })
        })
        .collect::<anyhow::Result<_>>()?;
    cfg.order = OrderSpec {
        seed: a.seed,
        shuffle: match a.shuffle {
            ShuffleArg::None => Shuffle::None,
            ShuffleArg::Global => Shuffle::Global,
            ShuffleArg::Block => Shuffle::ShardBlock {
                window_shards: a.window,
                block_samples: a.block,
            },
        },
        partitions: a.partitions,
        tail: match a.tail {
            TailArg::Uneven => Tail::Uneven,
            TailArg::DropLast => Tail::DropLast,
            TailArg::PadRepeat => Tail::PadRepeat,
        },
    };
    cfg.topology = topology;
    cfg.epochs = Some(a.epochs);
    cfg.prefetch_bytes_max = a.prefetch;
    cfg.resident_bytes_max = a.resident;
    cfg.index_bytes_max = a.index_bytes;
    cfg.ranged_until_shard_bytes_max = a.ranged_bytes;
    cfg.range_bytes = a.range_size;
    cfg.cache = a.cache_dir.as_ref().map(|d| CacheConfig::new(d, a.cache_limit));
    cfg.provider = a.daemon.as_ref().map(|p| {
        std::sync::Arc::new(ramjet_transport::DaemonClient::new(p)) as std::sync::Arc<dyn ramjet_engine::ShardProvider>
    });
    let mut out_len = 0u64;
    if a.resume {
        let p = a.state.as_ref().context("--resume needs --state")?;
        let saved: SavedState =
            serde_json::from_slice(&std::fs::read(p).with_context(|| format!("read {}", p.display()))?)?;
        cfg.resume = Some(StreamState::job_progress(std::slice::from_ref(&saved.state))?);
        out_len = saved.out_len;
    }
    let mut out = match &a.out {
        Some(p) => {
            let f = std::fs::OpenOptions::new().create(true).append(true).open(p)?;
            f.set_len(out_len)?;
            Some(std::io::BufWriter::new(f))
        }
        None => None,
    };
    let t0 = std::time::Instant::now();
    let mut stream = Stream::open(cfg)?;
    let mut n = 0u64;
    let mut first: Option<f64> = None;
    while let Some(s) = stream.next_sample()? {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        n += 1;
        if let Some(w) = out.as_mut() {
            let line = format!(
                "{} {} {} {} {} {} {}\n",
                s.epoch,
                s.position,
                s.id.stream,
                s.id.shard,
                s.id.index,
                s.global_index,
                s.record.len()
            );
            w.write_all(line.as_bytes())?;
            // Line by line, so a reader (or a test) sees progress as it happens.
            w.flush()?;
            out_len += line.len() as u64;
        }
        if let (Some(p), true) = (&a.state, n % a.state_every.max(1) == 0) {
            if let Some(w) = out.as_mut() {
                w.flush()?;
            }
            let st = stream.state().context("stream state")?;
            write_atomic(p, &serde_json::to_vec(&SavedState { state: st, out_len })?)?;
        }
        if a.limit.is_some_and(|l| n >= l) {
            break;
        }
        if a.step_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(a.step_ms));
        }
    }
    if let Some(w) = out.as_mut() {
        w.flush()?;
    }
    if let (Some(p), Some(st)) = (&a.state, stream.state()) {
        write_atomic(p, &serde_json::to_vec(&SavedState { state: st, out_len })?)?;
    }
    let m = stream.metrics();
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&m)?);
    } else {
        println!(
            "stream: {n} samples in {secs:.2} s: {:.0} samples/s, {}/s; time to first sample {:.3} s",
            n as f64 / secs.max(1e-9),
            human_bytes((m.sample_bytes as f64 / secs.max(1e-9)) as u64),
            first.unwrap_or(0.0)
        );
        println!(
            "stream: cache hit rate {:.1}% ({} hits, {} misses), origin {} in {} requests, {} samples by ranged GET, waited {:.2} s",
            m.hit_rate * 100.0,
            m.cache_hits,
            m.cache_misses,
            human_bytes(m.origin_bytes),
            m.origin_requests,
            m.ranged_samples,
            m.wait_s
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Raises this process's soft limit on open files to its hard limit: every connection and
/// every cache file handed out holds a descriptor, and the common soft default (1024) is
/// below `connections_max` for each class. Says so when the hard limit stays below the
/// classes' budgets together.
fn raise_open_files_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    if ok && r.rlim_cur < r.rlim_max {
        let want = libc::rlimit {
            rlim_cur: r.rlim_max,
            rlim_max: r.rlim_max,
        };
        // SAFETY: as above; raising the soft limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            r.rlim_cur = r.rlim_max;
        }
    }
    if ok {
        tracing::info!(open_files_limit = r.rlim_cur, "descriptor limit");
    }
}

fn serve_cmd(a: ServeArgs) -> anyhow::Result<ExitCode> {
    // A peer or loader that goes away mid-transfer must cost that transfer an EPIPE, not the
    // daemon its life (`main` restores SIGPIPE's default for the other subcommands, and
    // `sendfile` has no MSG_NOSIGNAL).
    // SAFETY: setting a signal's disposition to ignore, before the daemon starts its threads.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let socket = a.socket.unwrap_or_else(ramjet_transport::default_socket);
    let mut cfg = DaemonConfig::new(socket, CacheConfig::new(&a.cache_dir, a.cache_limit));
    cfg.listen = a.listen;
    cfg.http = a.http;
    cfg.peers_file = a.peers_file;
    cfg.allow_prefixes = a.allow;
    cfg.insecure = a.insecure;
    cfg.datasets_open_max = a.datasets_open_max;
    cfg.connections_max = a.connections_max;
    cfg.handshakes_max = a.handshakes_max;
    cfg.per_address_max = a.per_address_max;
    raise_open_files_limit();
    cfg.threads = if a.threads > 0 {
        a.threads
    } else {
        ramjet_engine::rt::cores()
    };
    if a.transport == "rdma" {
        cfg.transport = ramjet_transport::TransportKind::Rdma {
            device: a.rdma_device,
            gid_index: a.rdma_gid_index,
        };
    }
    let mut from_slurm = false;
    if let Some(p) = &a.peers {
        cfg.peers = ramjet_transport::read_members(p).map_err(anyhow::Error::msg)?;
    } else if cfg.peers_file.is_none() {
        if let Ok(list) = std::env::var("SLURM_JOB_NODELIST") {
            cfg.peers = ramjet_transport::hostlist::expand(&list)
                .map_err(anyhow::Error::msg)?
                .into_iter()
                .map(|h| format!("{h}:{}", a.peer_port))
                .collect();
            from_slurm = true;
        }
    }
    cfg.advertise = a.advertise.or_else(|| {
        let host = hostname()?;
        let port = cfg.listen.map(|l| l.port()).unwrap_or(a.peer_port);
        let name = format!("{host}:{port}");
        (from_slurm || cfg.peers.contains(&name)).then_some(name)
    });
    anyhow::ensure!(
        cfg.peers.is_empty() && cfg.peers_file.is_none() || cfg.listen.is_some(),
        "members were given but no --listen address for peers"
    );
    let d = Daemon::start(cfg).context("start the daemon")?;
    eprintln!(
        "ramjet serve: socket {}, peers {}, http {}",
        d.socket().display(),
        d.peer_addr().map(|a| a.to_string()).unwrap_or("-".into()),
        d.http_addr().map(|a| a.to_string()).unwrap_or("-".into())
    );
    d.run_until_signal();
    Ok(ExitCode::SUCCESS)
}

fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// Waits until every daemon at `hosts` (HTTP addresses) is ready and they agree on one ring of
/// `hosts.len()` members. Prints progress on stderr whenever the picture changes. False on
/// timeout, after naming what is missing.
fn wait_ready(hosts: &[String], timeout: std::time::Duration) -> anyhow::Result<bool> {
    let t0 = std::time::Instant::now();
    let mut last = String::new();
    loop {
        let mut problems = Vec::new();
        let mut rings = std::collections::BTreeSet::new();
        let mut not_ready = 0;
        for h in hosts {
            let seen = problems.len();
            match http_get_any(h, "/ready")
                .and_then(|(_, b)| Ok(serde_json::from_str::<ramjet_transport::ReadyDoc>(&b)?))
            {
                Ok(d) => {
                    if !d.ready {
                        problems.push(format!("{h} ({}): {}", d.node, d.problems.join("; ")));
                    } else if d.members.len() != hosts.len() {
                        problems.push(format!(
                            "{h} ({}): {} members {:?}, but {} daemons were named",
                            d.node,
                            d.members.len(),
                            d.members,
                            hosts.len()
                        ));
                    }
                    rings.insert((d.ring_version, d.members));
                }
                Err(e) => problems.push(format!("{h}: not answering ({e:#})")),
            }
            not_ready += usize::from(problems.len() > seen);
        }
        if rings.len() > 1 {
            problems.push(format!("the daemons disagree on the ring: {rings:?}"));
        }
        if problems.is_empty() {
            let (version, members) = rings.into_iter().next().expect("one ring");
            eprintln!(
                "ramjet stats --wait: ring ready after {:.1} s: {} members, version {version}: {}",
                t0.elapsed().as_secs_f64(),
                members.len(),
                members.join(" ")
            );
            return Ok(true);
        }
        let now = format!(
            "{} of {} daemons ready: {}",
            hosts.len() - not_ready,
            hosts.len(),
            problems.join(" | ")
        );
        if t0.elapsed() >= timeout {
            eprintln!(
                "ramjet stats --wait: gave up after {:.0} s: {now}",
                timeout.as_secs_f64()
            );
            return Ok(false);
        }
        if now != last {
            eprintln!("ramjet stats --wait: {:.1} s: {now}", t0.elapsed().as_secs_f64());
            last = now;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// GET over plain HTTP/1.1 (the daemons' stats port): the status code and body.
fn http_get_any(host: &str, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::{Read, Write};
    let addr = host.trim_start_matches("http://").trim_end_matches('/');
    let sock = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .with_context(|| format!("resolve {addr}"))?
        .next()
        .with_context(|| format!("resolve {addr}: no address"))?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, std::time::Duration::from_secs(5))
        .with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    write!(s, "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").context("malformed HTTP response")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("malformed HTTP status line")?;
    Ok((code, body.to_owned()))
}

/// GET over plain HTTP/1.1 (the daemons' stats port); an error unless it answers 200.
fn http_get(host: &str, path: &str) -> anyhow::Result<String> {
    let (code, body) = http_get_any(host, path)?;
    anyhow::ensure!(code == 200, "{host}{path}: HTTP {code}: {}", body.trim());
    Ok(body)
}

fn stats_cmd(hosts: &[String], json: bool) -> anyhow::Result<ExitCode> {
    let mut docs = Vec::new();
    let mut failed = false;
    for h in hosts {
        match http_get(h, "/stats").and_then(|b| Ok(serde_json::from_str::<ramjet_transport::StatsDoc>(&b)?)) {
            Ok(d) => docs.push((h.clone(), d)),
            Err(e) => {
                eprintln!("{h}: {e:#}");
                failed = true;
            }
        }
    }
    if json {
        let all: Vec<_> = docs
            .iter()
            .map(|(h, d)| serde_json::json!({"host": h, "stats": d}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        println!(
            "{:<22} {:>5} {:>8} {:>8} {:>8} {:>10} {:>10} {:>7} {:>7} {:>6}  peers",
            "node", "ring", "local", "peer", "origin", "origin", "cached", "coalesc", "refused", "p50ms"
        );
        for (_, d) in &docs {
            let p50 = d
                .latency
                .values()
                .filter(|l| l.count > 0)
                .map(|l| l.p50_us)
                .max()
                .unwrap_or(0);
            let down: Vec<&str> = d
                .peers
                .iter()
                .filter(|(_, h)| !h.healthy)
                .map(|(p, _)| p.as_str())
                .collect();
            println!(
                "{:<22} {:>5} {:>8} {:>8} {:>8} {:>10} {:>10} {:>7} {:>7} {:>6.1}  {} members{}{}",
                d.node,
                d.ring_version,
                d.reads["cache_local"],
                d.reads["cache_peer"],
                d.reads["origin"],
                human_bytes(d.origin_bytes),
                human_bytes(d.cache_bytes),
                d.singleflight_coalesced,
                d.auth_refused,
                p50 as f64 / 1e3,
                d.members.len(),
                if d.frozen { ", frozen" } else { "" },
                if down.is_empty() {
                    String::new()
                } else {
                    format!(", down: {}", down.join(" "))
                }
            );
        }
        let total = |f: &dyn Fn(&ramjet_transport::StatsDoc) -> u64| docs.iter().map(|(_, d)| f(d)).sum::<u64>();
        println!(
            "cluster: {} nodes, origin {} in {} requests, {} shards from peers, {} from local caches",
            docs.len(),
            human_bytes(total(&|d| d.origin_bytes)),
            total(&|d| d.origin_requests),
            total(&|d| d.reads["cache_peer"]),
            total(&|d| d.reads["cache_local"])
        );
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

fn main() -> ExitCode {
    // Like other Unix tools, end quietly when stdout is closed (`ramjet ... | head`), instead
    // of failing on the write.
    // SAFETY: restoring a signal's default disposition at start-up, before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // Warnings by default (a corrupt cached shard re-fetched, a failed cache write); more
    // with RAMJET_LOG, in tracing's filter syntax.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::builder()
                .with_default_directive(tracing_subscriber::filter::LevelFilter::WARN.into())
                .with_env_var("RAMJET_LOG")
                .from_env_lossy(),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::PlanSim {
            dir,
            samples,
            shard_samples,
            shuffle,
            measure,
        } => {
            let shuffle = match shuffle.as_str() {
                "none" => Shuffle::None,
                "block" => OrderSpec::default().shuffle,
                other => anyhow::bail!("plan-sim --shuffle: {other:?} is not none or block"),
            };
            let (url, shard) = ramjet_tools::plansim::prepare(&dir, samples, shard_samples)?;
            if measure {
                let r = ramjet_tools::plansim::first_sample(&url, shard, shuffle)?;
                println!("{}", serde_json::to_string(&r)?);
            } else {
                let out = std::process::Command::new(std::env::current_exe()?)
                    .args(std::env::args_os().skip(1))
                    .arg("--measure")
                    .output()?;
                if !out.status.success() {
                    anyhow::bail!("plan-sim: {}", String::from_utf8_lossy(&out.stderr));
                }
                print!("{}", String::from_utf8_lossy(&out.stdout));
            }
        }
        Cmd::Synth { dir, samples, seed } => {
            let t0 = std::time::Instant::now();
            let r = synth(&dir, &SynthOptions { samples, seed }, &count_bar("synth"))?;
            println!(
                "synth: {} images ({}, {}..{} each), {} boxes in {:.1} s -> {}",
                r.images,
                human_bytes(r.jpeg_bytes),
                human_bytes(r.jpeg_bytes_min_max.0),
                human_bytes(r.jpeg_bytes_min_max.1),
                r.boxes,
                t0.elapsed().as_secs_f64(),
                dir.display()
            );
        }
        Cmd::Pack {
            src,
            dst,
            shard_size,
            format,
            skip_bad,
            threads,
            shard_table,
            jpeg_restarts,
        } => {
            let opts = PackOptions {
                shard_bytes_target: shard_size,
                skip_bad,
                kind: format,
                shard_table,
                jpeg_restarts,
            };
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads.unwrap_or(0))
                .build()
                .context("thread pool")?;
            let r = pool.install(|| pack(&src, &dst, &opts, &bytes_bar("pack")))?;
            let secs = r.elapsed.as_secs_f64();
            println!(
                "pack: {} samples in {} shards ({}) from {} of input in {:.2} s ({}/s) -> {}",
                r.manifest.samples,
                r.manifest.shard_count(),
                human_bytes(r.manifest.bytes),
                human_bytes(r.input_bytes),
                secs,
                human_bytes((r.input_bytes as f64 / secs.max(1e-9)) as u64),
                r.manifest_url
            );
            println!("pack: manifest version {}", r.manifest.version);
            // The peak memory of the whole run (a JSONL file is packed as a stream: it stays
            // about (threads + 2) x --shard-size, whatever the input's size).
            if let Some(kb) = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            }) {
                println!("pack: peak RSS {} MiB", kb / 1024);
            }
            if !r.skipped.is_empty() {
                println!("pack: skipped {} bad input(s):", r.skipped.len());
                for (what, why) in &r.skipped {
                    println!("  {what}: {why}");
                }
            }
        }
        Cmd::Index { src, jpeg_restarts } => {
            let bar = bytes_bar("index");
            let r = ramjet_tools::index::index(&src, jpeg_restarts, &|n| bar.inc(n))?;
            bar.finish_and_clear();
            let secs = r.elapsed.as_secs_f64();
            println!(
                "index: {} samples in {} {} shards ({} read) in {:.2} s ({}/s) -> {}",
                r.manifest.samples,
                r.manifest.shard_count(),
                r.manifest.source,
                human_bytes(r.bytes_read),
                secs,
                human_bytes((r.bytes_read as f64 / secs.max(1e-9)) as u64),
                r.manifest_url
            );
            println!("index: schema {}", r.manifest.schema.describe());
            if let Some(px) = r.manifest.foreign.as_ref().and_then(|f| f.jpeg_restart_px) {
                println!("index: the shards it reads as hold their JPEGs with a restart marker every {px} px");
            }
            if r.foreign_hashes_checked > 0 {
                println!(
                    "index: {} of the dataset's own hashes checked",
                    r.foreign_hashes_checked
                );
            }
            println!("index: manifest version {}", r.manifest.version);
        }
        Cmd::Inspect { url, json } => {
            let ds = runtime()?.block_on(Dataset::open(&url))?;
            let m = ds.manifest();
            let restart_px = m.jpeg_restart_px();
            if json {
                let v = serde_json::json!({
                    "url": ds.manifest_url(),
                    "version": m.version,
                    "source": m.source,
                    "schema": m.schema,
                    "shards": m.shard_count(),
                    "samples": m.samples,
                    "bytes": m.bytes,
                    "meta": m.meta,
                    "learned_index": ds.learned_index_url(),
                    "jpeg_restart_px": restart_px,
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("dataset  {}", ds.manifest_url());
                if let Some(l) = ds.learned_index_url() {
                    println!("index    learned on this host, kept in {l} (no `ramjet index` beside the data)");
                }
                println!("version  {}", m.version);
                println!("source   {}", m.source);
                println!("schema   {}", m.schema.describe());
                println!("shards   {}", m.shard_count());
                println!("samples  {}", m.samples);
                println!(
                    "bytes    {} ({} per sample on average)",
                    human_bytes(m.bytes),
                    human_bytes(m.bytes / m.samples.max(1))
                );
                if let Some(px) = restart_px {
                    println!(
                        "jpegs    stored with a restart marker every {px} px (transcoded losslessly: the same pixels)"
                    );
                }
                if let Some(c) = m.meta.get("classes").and_then(|c| c.as_array()) {
                    let names: Vec<&str> = c.iter().filter_map(|x| x.as_str()).collect();
                    println!("classes  {} ({})", names.len(), names.join(", "));
                }
            }
        }
        Cmd::Stream(a) => return stream_cmd(*a),
        Cmd::Audit {
            urls,
            states,
            weights,
            consumers,
            json,
        } => return audit_cmd(&urls, &states, &weights, consumers, json),
        Cmd::Serve(a) => return serve_cmd(*a),
        Cmd::Stats {
            hosts,
            json,
            wait,
            timeout,
        } => {
            let timeout = std::time::Duration::try_from_secs_f64(timeout)
                .map_err(|e| anyhow::anyhow!("--timeout {timeout}: {e}"))?;
            if wait && !wait_ready(&hosts, timeout)? {
                return Ok(ExitCode::FAILURE);
            }
            return stats_cmd(&hosts, json);
        }
        Cmd::Verify { url, parallel } => {
            let rt = runtime()?;
            let t0 = std::time::Instant::now();
            let ds = rt.block_on(Dataset::open(&url))?;
            let bar = bytes_bar("verify");
            bar.set_length(ds.manifest().bytes);
            let report = rt.block_on(ds.verify(parallel, |n| bar.inc(n)));
            bar.finish_and_clear();
            for p in &report.problems {
                println!("BAD {p}");
            }
            let secs = t0.elapsed().as_secs_f64();
            if report.is_ok() {
                println!(
                    "verify: OK, {} shards, {} samples, {} checked in {:.2} s ({}/s)",
                    report.shards,
                    report.samples,
                    human_bytes(report.bytes_read),
                    secs,
                    human_bytes((report.bytes_read as f64 / secs.max(1e-9)) as u64)
                );
            } else {
                println!(
                    "verify: FAILED, {} of {} shards bad, {} problem(s)",
                    report.shards_bad,
                    report.shards,
                    report.problems.len()
                );
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
