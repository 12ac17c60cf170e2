//! `ramjet stream`: samples through the engine (order, cache, prefetch), with throughput.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use std::sync::atomic::Ordering;

use crate::ui::{human_bytes, parse_size};
use ramjet_engine::cache::CacheConfig;
use ramjet_engine::order::{OrderSpec, Shares, Shuffle, Tail, Topology, Weight};
use ramjet_engine::{Opened, SourceConfig, Stream, StreamConfig, StreamState};

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
pub struct StreamArgs {
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
    /// Sticky shares: the block shuffle's rounds hold the same shards every epoch, so under a
    /// node-affine deal each node reads the same shards and keeps them in its cache.
    #[arg(long)]
    sticky: bool,
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
    /// Whole shards are fetched as parallel ranged GETs of this size (default: 32 MiB to
    /// start, then the origin control's rule: four round trips of one request's bandwidth,
    /// 8 or 16 MiB to 64 MiB). Given, it pins the size.
    #[arg(long, value_parser = parse_size)]
    range_size: Option<u64>,
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

pub(super) fn parse_weight(w: &str) -> anyhow::Result<Weight> {
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
pub(super) struct SavedState {
    state: StreamState,
    out_len: u64,
}

/// Replaces `path` with `bytes` whole or not at all (a temporary file beside it, then a
/// rename); a failure names `path`, whose last content stays as it was.
fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let saved = std::fs::write(&tmp, bytes)
        .with_context(|| format!("write {}", tmp.display()))
        .and_then(|()| std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display())));
    if saved.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    saved.with_context(|| {
        format!(
            "save the stream state {} (its last saved content is kept)",
            path.display()
        )
    })
}

/// The stream's configuration from the command's arguments (the topology from the
/// environment where the arguments leave it out).
fn stream_config(a: &StreamArgs) -> anyhow::Result<StreamConfig> {
    // Arguments and the environment are checked alike, a contradiction named (launch.rs).
    let given = ramjet_engine::launch::Given {
        rank: a.rank,
        world: a.world,
        dist: None,
    };
    let l = ramjet_engine::launch::resolve_env(&given)?;
    let topology = Topology {
        rank: l.rank,
        world: l.world,
        worker: a.worker,
        workers: a.workers,
        local_rank: l.local_rank,
        local_world: l.local_world,
    };
    topology.check()?;
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
        shares: if a.sticky { Shares::Sticky } else { Shares::Rotate },
    };
    cfg.topology = topology;
    cfg.epochs = Some(a.epochs);
    cfg.prefetch_bytes_max = a.prefetch;
    cfg.resident_bytes_max = a.resident;
    cfg.index_bytes_max = a.index_bytes;
    cfg.ranged_until_shard_bytes_max = a.ranged_bytes;
    if let Some(r) = a.range_size {
        cfg.range_bytes = r;
        cfg.range_pinned = true;
    }
    cfg.cache = a.cache_dir.as_ref().map(|d| CacheConfig::new(d, a.cache_limit));
    cfg.provider = a.daemon.as_ref().map(|p| {
        std::sync::Arc::new(ramjet_transport::DaemonClient::new(p)) as std::sync::Arc<dyn ramjet_engine::ShardProvider>
    });
    Ok(cfg)
}

pub fn stream_cmd(a: StreamArgs) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    let mut cfg = stream_config(&a)?;
    let mut out_len = 0u64;
    if a.resume {
        let p = a.state.as_ref().context("--resume needs --state")?;
        let saved: SavedState = serde_json::from_slice(&ramjet_engine::io::read_file_bounded(p, 256 << 20)?)?;
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
    let (metrics, mut clock) = (stream.metrics_handle(), ramjet_engine::stall::SampleClock::default());
    while let Some(s) = clock.around(&metrics, || stream.next_sample())? {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        n += 1;
        // Where this consumer is, for its heartbeat to the host daemon (the dashboard).
        if metrics.consumer_epoch.swap(s.epoch, Ordering::Relaxed) != s.epoch || n == 1 {
            metrics.consumer_position.store(0, Ordering::Relaxed);
            metrics
                .consumer_epoch_len
                .store(stream.epoch_len().unwrap_or(0) as u64, Ordering::Relaxed);
        }
        metrics.consumer_position.fetch_add(1, Ordering::Relaxed);
        // This command's simulated training steps a sample at a time (`--step-ms`).
        metrics.batch_handed();
        if let Some(w) = out.as_mut() {
            let line = format!(
                "{} {} {} {} {} {} {}\n",
                s.epoch,
                s.position,
                s.id.source,
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
    report(&stream.metrics(), n, t0.elapsed().as_secs_f64(), first, a.json)?;
    Ok(ExitCode::SUCCESS)
}

/// The run's summary: its counters as JSON, or two lines for people.
fn report(
    m: &ramjet_engine::metrics::MetricsSnapshot,
    n: u64,
    secs: f64,
    first: Option<f64>,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(m)?);
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
        let parts: Vec<String> = ramjet_engine::stall::NAMES
            .iter()
            .map(|n| {
                let share = m.stall.get(&format!("wait_share_{n}")).copied().unwrap_or(0.0);
                format!("{} {:.1}%", n.replace('_', " "), share * 100.0)
            })
            .collect();
        println!("stream: where the time went: {}", parts.join(", "));
    }
    Ok(())
}
