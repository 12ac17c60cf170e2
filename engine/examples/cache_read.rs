//! Whole-shard cache reads per I/O implementation, side by side: pread, io_uring on the I/O
//! core, io_uring with O_DIRECT. Each round reads every file with each contender (their order
//! rotating round by round), hashing as it reads (as the cache does), and with
//! `--drop-caches` (root) empties the page cache before each contender, so the disk path is
//! measured. Prints each round, then medians of wall time, MiB/s and CPU seconds per GiB, and
//! the per-round ratios to pread.
//!
//! `cargo run --release -p ramjet-engine --example cache_read -- [--rounds N] [--drop-caches] FILE...`
use std::time::Instant;

use ramjet_engine::io::{CacheIo, PreadIo, UringIo};

fn cpu_s() -> f64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF counts every thread of the
    // process (the I/O core's and the kernel's io_uring workers included).
    let r = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(r.ru_utime) + t(r.ru_stime)
}

fn drop_caches() {
    // SAFETY: sync has no arguments and no memory effects.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "1").expect("--drop-caches needs root");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let mut rounds = 5;
    let mut drop = false;
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => rounds = args.next().and_then(|n| n.parse().ok()).expect("--rounds N"),
            "--drop-caches" => drop = true,
            _ => files.push(a.into()),
        }
    }
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).unwrap().len()).sum();
    let gib = total as f64 / (1u64 << 30) as f64;
    let ios: Vec<Box<dyn CacheIo>> = vec![
        Box::new(PreadIo),
        Box::new(UringIo::new(false).unwrap()),
        Box::new(UringIo::new(true).unwrap()),
    ];
    let mut wall = vec![Vec::new(); ios.len()];
    let mut cpu = vec![Vec::new(); ios.len()];
    println!(
        "{} files, {:.0} MiB, {rounds} rounds, page cache {}",
        files.len(),
        total as f64 / 1048576.0,
        if drop { "dropped before each read" } else { "warm" }
    );
    for r in 0..rounds {
        let mut line = format!("round {}:", r + 1);
        for k in 0..ios.len() {
            let i = (k + r) % ios.len();
            if drop {
                drop_caches();
            }
            let (t, c) = (Instant::now(), cpu_s());
            let mut x = 0u64;
            for f in &files {
                let (_, h) = ios[i].read_file(f, 16).unwrap();
                x ^= h.unwrap();
            }
            let (w, c) = (t.elapsed().as_secs_f64(), cpu_s() - c);
            wall[i].push(w);
            cpu[i].push(c);
            line += &format!(" {} {:.3} s ({x:x})", ios[i].name(), w);
        }
        println!("{line}");
    }
    println!("| I/O | wall (s, median) | MiB/s | CPU s per GiB | per-round time ratio pread/this |");
    println!("|---|---|---|---|---|");
    for (i, io) in ios.iter().enumerate() {
        let ratios: Vec<String> = (0..rounds).map(|r| format!("{:.2}", wall[0][r] / wall[i][r])).collect();
        let w = median(wall[i].clone());
        println!(
            "| {} | {:.3} | {:.0} | {:.3} | {} (median {:.2}) |",
            io.name(),
            w,
            total as f64 / w / 1048576.0,
            median(cpu[i].clone()) / gib,
            ratios.join(" "),
            median((0..rounds).map(|r| wall[0][r] / wall[i][r]).collect())
        );
    }
}
