//! `ramjet verify`: re-read every shard and check every checksum. Exits 1 and names each bad shard and sample.

use std::process::ExitCode;

use ramjet_engine::Dataset;

use super::runtime;
use crate::ui::{bytes_bar, human_bytes};

#[derive(clap::Args)]
pub struct Args {
    /// Dataset URL (a prefix, or a manifest .json).
    pub url: String,
    /// Shards checked at once.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Args { url, parallel } = a;
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
    Ok(ExitCode::SUCCESS)
}
