//! `ramjet`: pack, inspect and verify datasets; generate the synthetic demo set.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use ramjet_engine::Dataset;
use ramjet_tools::pack::{pack, PackOptions, SourceKind};
use ramjet_tools::synth::{synth, SynthOptions};
use ramjet_tools::ui::{bytes_bar, count_bar, human_bytes, parse_size};

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
    },
    /// Print a dataset's schema, shard count, sample count and bytes.
    Inspect {
        /// Dataset URL (a prefix, or a manifest .json).
        url: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
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

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("RAMJET_LOG"))
        .with_writer(std::io::stderr)
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
        } => {
            let opts = PackOptions {
                shard_bytes_target: shard_size,
                skip_bad,
                kind: format,
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
                r.manifest.shards.len(),
                human_bytes(r.manifest.bytes),
                human_bytes(r.input_bytes),
                secs,
                human_bytes((r.input_bytes as f64 / secs.max(1e-9)) as u64),
                r.manifest_url
            );
            println!("pack: manifest version {}", r.manifest.version);
            if !r.skipped.is_empty() {
                println!("pack: skipped {} bad input(s):", r.skipped.len());
                for (what, why) in &r.skipped {
                    println!("  {what}: {why}");
                }
            }
        }
        Cmd::Inspect { url, json } => {
            let ds = runtime()?.block_on(Dataset::open(&url))?;
            let m = ds.manifest();
            if json {
                let v = serde_json::json!({
                    "url": ds.manifest_url(),
                    "version": m.version,
                    "source": m.source,
                    "schema": m.schema,
                    "shards": m.shards.len(),
                    "samples": m.samples,
                    "bytes": m.bytes,
                    "meta": m.meta,
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!("dataset  {}", ds.manifest_url());
                println!("version  {}", m.version);
                println!("source   {}", m.source);
                println!("schema   {}", m.schema.describe());
                println!("shards   {}", m.shards.len());
                println!("samples  {}", m.samples);
                println!(
                    "bytes    {} ({} per sample on average)",
                    human_bytes(m.bytes),
                    human_bytes(m.bytes / m.samples.max(1))
                );
                if let Some(c) = m.meta.get("classes").and_then(|c| c.as_array()) {
                    let names: Vec<&str> = c.iter().filter_map(|x| x.as_str()).collect();
                    println!("classes  {} ({})", names.len(), names.join(", "));
                }
            }
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
