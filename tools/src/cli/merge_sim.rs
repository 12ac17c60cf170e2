//! `ramjet merge-sim`: writes the plan and parts of a simulated split pack of any size, for
//! measuring `ramjet pack --merge` (benches/python/pack_scale.py).

use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Folder to write `parts/` into (the destination the merge is run on).
    pub dir: PathBuf,
    /// Parts (groups).
    #[arg(long)]
    pub parts: u64,
    /// Samples in all.
    #[arg(long)]
    pub samples: u64,
    /// Samples per shard (447 is a 64 MiB shard of 150 KB images).
    #[arg(long, default_value_t = 447)]
    pub shard_samples: u64,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let t0 = std::time::Instant::now();
    let source = crate::pack::split::simulate(&a.dir, a.parts, a.samples, a.shard_samples)?;
    println!(
        "merge-sim: {} parts of {} samples written in {:.1} s; merge with: ramjet pack {source} {} --merge --no-check-shards",
        a.parts,
        a.samples,
        t0.elapsed().as_secs_f64(),
        a.dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
