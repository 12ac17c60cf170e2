//! `ramjet pack`: pack an image folder, a YOLO layout or a JSONL file into shards plus a manifest.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use crate::pack::{pack, PackOptions, SourceKind};
use crate::ui::{bytes_bar, human_bytes, parse_size};

#[derive(clap::Args)]
pub struct Args {
    /// Input: a folder (YOLO or one subfolder per class) or a .jsonl file.
    pub src: PathBuf,
    /// Output: a local folder, file://, or s3://bucket/prefix (also gs://, az://).
    pub dst: String,
    /// Target shard size, e.g. 64MiB.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    pub shard_size: u64,
    /// Input layout (detected when omitted).
    #[arg(long, value_enum)]
    pub format: Option<SourceKind>,
    /// Skip unreadable or unsupported inputs, then list them, instead of aborting.
    #[arg(long)]
    pub skip_bad: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// List the shards in a binary shard table beside the manifest (48 bytes a shard)
    /// rather than in its JSON: `auto` does so above 4,096 shards.
    #[arg(long, value_enum, default_value = "auto")]
    pub shard_table: crate::pack::ShardTableMode,
    /// Store JPEGs transcoded losslessly (the same pixels, not the same bytes) with a
    /// restart marker every 32 pixels of each MCU row and optimal Huffman tables: a random
    /// crop then decodes only the part of the image it needs, about 1.3x faster.
    #[arg(long)]
    pub jpeg_restarts: bool,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Args {
        src,
        dst,
        shard_size,
        format,
        skip_bad,
        threads,
        shard_table,
        jpeg_restarts,
    } = a;
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
    Ok(ExitCode::SUCCESS)
}
