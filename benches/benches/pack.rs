//! Packing throughput against `cp -r` of the same files, and reads per sample by index.
//!
//! Targets (issue: foundation): pack runs at least 0.7x as fast as `cp -r`; reading one
//! sample by index from a local shard costs at most 2 reads.
//!
//! `cargo bench -p ramjet-benches --bench pack` (5,315 images); under `cargo test` it runs
//! once on 200 images.

use std::cell::Cell;
use std::process::Command;

use ramjet_benches::{full_run, median_time, save_results, synth_dataset, warm_page_cache};
use ramjet_engine::format::{ReadAt, ShardReader};
use ramjet_tools::pack::{pack, PackOptions};

struct CountingFile {
    f: std::fs::File,
    reads: Cell<u64>,
}

impl ReadAt for CountingFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.reads.set(self.reads.get() + 1);
        self.f.read_exact_at(buf, offset)
    }
    fn size(&self) -> std::io::Result<u64> {
        self.f.size()
    }
}

fn main() {
    let full = full_run();
    let (n, reps) = if full { (5315, 5) } else { (200, 1) };
    let src = synth_dataset(n);
    let input_bytes = warm_page_cache(&src);
    let work = tempfile::tempdir_in(ramjet_benches::bench_dir()).unwrap();
    let cp_dst = work.path().join("cp");
    let pack_dst = work.path().join("pack");
    let rm = |p: &std::path::Path| {
        let _ = std::fs::remove_dir_all(p);
    };

    // Alternate the contenders so drift on a noisy machine hits both alike.
    let mut cp_times = Vec::new();
    let mut pack_times = Vec::new();
    let hidden = indicatif::ProgressBar::hidden();
    for _ in 0..reps {
        cp_times.push(median_time(
            1,
            || rm(&cp_dst),
            || {
                let ok = Command::new("cp")
                    .arg("-r")
                    .arg(&src)
                    .arg(&cp_dst)
                    .status()
                    .unwrap()
                    .success();
                assert!(ok, "cp -r failed");
            },
        ));
        pack_times.push(median_time(
            1,
            || rm(&pack_dst),
            || {
                pack(
                    src.to_str().unwrap(),
                    pack_dst.to_str().unwrap(),
                    &PackOptions::default(),
                    &hidden,
                )
                .expect("pack");
            },
        ));
    }
    cp_times.sort();
    pack_times.sort();
    let (cp_t, pack_t) = (cp_times[reps / 2], pack_times[reps / 2]);
    let mib = input_bytes as f64 / (1 << 20) as f64;
    let speed_ratio = cp_t.as_secs_f64() / pack_t.as_secs_f64();

    // Reads per sample by index, on the first shard.
    let manifest = ramjet_engine::format::Manifest::parse(
        &std::fs::read(pack_dst.join("manifest.json")).unwrap(),
        "manifest.json",
    )
    .unwrap();
    let key = &manifest.shard(0).unwrap().key;
    let cf = CountingFile {
        f: std::fs::File::open(pack_dst.join(key)).unwrap(),
        reads: Cell::new(0),
    };
    let reader = ShardReader::open(&cf, key).unwrap();
    let open_reads = cf.reads.get();
    let samples = reader.samples();
    let probes = samples.min(1000);
    let t = std::time::Instant::now();
    for k in 0..probes {
        let i = (k * 7919) % samples;
        reader.read_record(i).unwrap();
    }
    let per_sample_us = t.elapsed().as_secs_f64() * 1e6 / probes as f64;
    let reads_per_sample = (cf.reads.get() - open_reads) as f64 / probes as f64;

    println!("pack benchmark: {n} synthetic images, {mib:.0} MiB, median of {reps}, page cache warm");
    println!("| contender | time (s) | MiB/s |");
    println!("|---|---|---|");
    println!(
        "| cp -r | {:.3} | {:.0} |",
        cp_t.as_secs_f64(),
        mib / cp_t.as_secs_f64()
    );
    println!(
        "| ramjet pack (64 MiB shards) | {:.3} | {:.0} |",
        pack_t.as_secs_f64(),
        mib / pack_t.as_secs_f64()
    );
    println!("pack speed / cp -r speed = {speed_ratio:.2}x (target >= 0.70)");
    println!(
        "random sample by index: {reads_per_sample:.2} reads per sample (target <= 2), {open_reads} reads to open a shard, {per_sample_us:.1} us per sample"
    );
    save_results(
        if full { "pack" } else { "pack-quick" },
        &serde_json::json!({
            "samples": n, "input_bytes": input_bytes, "reps": reps,
            "cp_seconds": cp_t.as_secs_f64(), "pack_seconds": pack_t.as_secs_f64(),
            "pack_vs_cp_speed": speed_ratio, "reads_per_sample": reads_per_sample,
            "open_reads": open_reads, "sample_read_us": per_sample_us,
        }),
    );
    assert!(
        reads_per_sample <= 2.0,
        "reading a sample by index took {reads_per_sample} reads"
    );
}
