//! `ramjet synth`: write a deterministic synthetic YOLO dataset (photo-like 640x480 JPEGs plus labels).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::synth::{synth, SynthOptions};
use crate::ui::{count_bar, human_bytes};

#[derive(clap::Args)]
pub struct Args {
    /// Output folder.
    pub dir: PathBuf,
    /// Number of images.
    #[arg(long, default_value_t = 5315)]
    pub samples: usize,
    /// Dataset seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Args { dir, samples, seed } = a;
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
    Ok(ExitCode::SUCCESS)
}
