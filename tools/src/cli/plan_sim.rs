//! `ramjet plan-sim`: measure the cost of starting an epoch over a simulated dataset of any size: a real.

use std::path::PathBuf;
use std::process::ExitCode;

use ramjet_engine::order::{OrderSpec, Shuffle};

#[derive(clap::Args)]
pub struct Args {
    /// Folder for the simulated manifests (kept and reused per size).
    #[arg(long)]
    pub dir: PathBuf,
    /// Samples in the dataset.
    #[arg(long)]
    pub samples: u64,
    /// Samples per shard.
    #[arg(long, default_value_t = 1000)]
    pub shard_samples: u64,
    /// Shuffle: none or block (the stub serves whole shards, so not global).
    #[arg(long, default_value = "block")]
    pub shuffle: String,
    /// Measure in this process (the parent prepares, then runs this in a child).
    #[arg(long, hide = true)]
    pub measure: bool,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Args {
        dir,
        samples,
        shard_samples,
        shuffle,
        measure,
    } = a;
    let shuffle = match shuffle.as_str() {
        "none" => Shuffle::None,
        "block" => OrderSpec::default().shuffle,
        other => anyhow::bail!("plan-sim --shuffle: {other:?} is not none or block"),
    };
    let (url, shard) = crate::plansim::prepare(&dir, samples, shard_samples)?;
    if measure {
        let r = crate::plansim::first_sample(&url, shard, shuffle)?;
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
    Ok(ExitCode::SUCCESS)
}
