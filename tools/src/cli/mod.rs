//! The `ramjet` command line: one module per command, each with its arguments and its body;
//! this one holds the command list, the process set-up and the dispatch.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod audit;
mod index;
mod inspect;
mod merge_sim;
mod pack;
mod plan_sim;
mod serve;
mod stats;
mod stream;
mod synth;
mod token;
mod verify;

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
    Synth(synth::Args),
    /// Pack an image folder, a YOLO layout or a JSONL file (local or in an object store) into
    /// shards plus a manifest; on one machine, or split into tasks (--tasks N --task I) and merged
    /// (--merge).
    Pack(pack::Args),
    /// Index a MosaicML (MDS), LitData, WebDataset or Parquet dataset in place: writes a ramjet
    /// manifest beside its shards (no copy), with every shard's size and checksum and every sample's checksum,
    /// so that ramjet reads and verifies it as its own.
    Index(index::Args),
    /// Measure the cost of starting an epoch over a simulated dataset of any size: a real
    /// manifest and shard table, every shard served by a stub from one real tiny shard. Prints
    /// JSON: time to first sample and peak RSS (measured in a fresh child process).
    PlanSim(plan_sim::Args),
    /// Write the plan and parts of a simulated split pack of any size (shard objects not
    /// written), to measure `ramjet pack --merge --no-check-shards` on them.
    MergeSim(merge_sim::Args),
    /// Print a dataset's schema, shard count, sample count and bytes.
    Inspect(inspect::Args),
    /// Stream samples through the engine (order, cache, prefetch) and report throughput.
    Stream(Box<stream::StreamArgs>),
    /// The exactly-once audit: checks saved job or consumer states against the epoch's order
    /// ("each sample exactly once so far", or which count is off). Exit status 0 when each
    /// sample was delivered exactly once, 1 when not.
    Audit(audit::Args),
    /// Run the host cache daemon: owns the node cache, serves local loaders over a Unix
    /// socket and peers over TCP (consistent-hash ring, singleflight, RAMJET_API_KEY).
    Serve(Box<serve::ServeArgs>),
    /// Print a cluster view from daemons' /stats (HOST is host:port of their --http); with
    /// --watch, the dashboard's live view in the terminal.
    Stats(stats::Args),
    /// Print the read-only HTTP credential derived from RAMJET_API_KEY: the dashboard,
    /// /cluster, /stats and /metrics of a daemon whose --http is not on loopback ask for it.
    Token(token::Args),
    /// Re-read every shard and check every checksum. Exits 1 and names each bad shard and sample.
    Verify(verify::Args),
}

/// The `ramjet` binary's `main`: signal and log set-up, then the command.
pub fn main() -> ExitCode {
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

/// A multi-threaded tokio runtime for the commands that open datasets.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Synth(a) => synth::run(a),
        Cmd::Pack(a) => pack::run(a),
        Cmd::Index(a) => index::run(a),
        Cmd::PlanSim(a) => plan_sim::run(a),
        Cmd::MergeSim(a) => merge_sim::run(a),
        Cmd::Inspect(a) => inspect::run(a),
        Cmd::Stream(a) => stream::stream_cmd(*a),
        Cmd::Audit(a) => audit::run(a),
        Cmd::Serve(a) => serve::serve_cmd(*a),
        Cmd::Stats(a) => stats::run(a),
        Cmd::Token(a) => token::run(a),
        Cmd::Verify(a) => verify::run(a),
    }
}
