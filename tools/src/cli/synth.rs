//! `ramjet synth`: write a deterministic synthetic dataset: photo-like 640x480 JPEGs plus YOLO
//! labels, or (`--profile imagenet`) ImageNet-like sizes and JPEG layouts.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::synth::{synth, Profile, SynthOptions};
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
    /// Which images: `yolo` (640x480 scenes with boxes) or `imagenet` (200 to 4,000 px a side;
    /// 4:2:0, 4:2:2, 4:4:4, 4:1:1, progressive, grey and CMYK JPEGs).
    #[arg(long, value_enum, default_value_t = Profile::Yolo)]
    pub profile: Profile,
    /// With `--profile imagenet`: this many per thousand are damaged (entropy data
    /// overwritten, headers intact); the loader then stops at the first, naming it.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub damaged_per_mille: u32,
    /// This many images per thousand are written as WebP (`NNNNNN.webp`; one in four
    /// lossless, the rest lossy at quality 90) instead of JPEG.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub webp_per_mille: u32,
    /// This many JPEGs per thousand are stored turned or mirrored, with the EXIF orientation
    /// (2 to 8) that shows them as rendered (their labels stay right for a reader that
    /// applies it).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub exif_per_mille: u32,
    /// This many images per thousand are byte copies of an earlier image (labels too), for
    /// `ramjet pack --dedupe content` to find.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub duplicate_per_mille: u32,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Args {
        dir,
        samples,
        seed,
        profile,
        damaged_per_mille,
        webp_per_mille,
        exif_per_mille,
        duplicate_per_mille,
    } = a;
    let t0 = std::time::Instant::now();
    let opts = SynthOptions {
        samples,
        seed,
        profile,
        damaged_per_mille,
        webp_per_mille,
        exif_per_mille,
        duplicate_per_mille,
    };
    let r = synth(&dir, &opts, &count_bar("synth"))?;
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
    let kinds: Vec<String> = r.kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    println!("synth: kinds: {}", kinds.join(", "));
    Ok(ExitCode::SUCCESS)
}
