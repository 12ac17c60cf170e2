//! Times whole-shard cache reads per I/O implementation: `cargo run --release -p ramjet-engine --example cache_read -- FILE...`
use std::time::Instant;

use ramjet_engine::cache::io::{CacheIo, PreadIo, UringIo};

fn main() {
    let files: Vec<std::path::PathBuf> = std::env::args().skip(1).map(Into::into).collect();
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).unwrap().len()).sum();
    let ios: Vec<Box<dyn CacheIo>> = vec![
        Box::new(PreadIo),
        Box::new(UringIo::new(false).unwrap()),
        Box::new(UringIo::new(true).unwrap()),
    ];
    for io in &ios {
        for _ in 0..2 {
            let t = Instant::now();
            let mut hash = 0u64;
            for f in &files {
                let (b, _) = io.read_file(f, usize::MAX).unwrap();
                hash ^= b[b.len() / 2] as u64;
            }
            let read = t.elapsed().as_secs_f64();
            let t = Instant::now();
            for f in &files {
                let (_, h) = io.read_file(f, 16).unwrap();
                hash ^= h.unwrap();
            }
            let both = t.elapsed().as_secs_f64();
            println!(
                "{:>18}: read {:.0} MiB/s, read+xxh3 {:.0} MiB/s ({hash})",
                io.name(),
                total as f64 / read / 1048576.0,
                total as f64 / both / 1048576.0
            );
        }
    }
}
