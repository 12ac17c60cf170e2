//! Helpers shared by ramjet's benchmarks: run modes, timing, a cached synthetic dataset, and
//! the results file.
//!
//! Every benchmark compares ramjet with a baseline measured in the same run on the same data
//! and prints the ratio: the machines are small and noisy, so absolute times are not stable,
//! ratios are. Run with `cargo bench -p ramjet-benches`; under `cargo test` (no `--bench`
//! argument) each benchmark runs once on a small dataset so it cannot rot.
#![deny(missing_docs)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

// The benchmarks measure the engine with the allocator ramjet's binaries and Python extension
// use (tools/src/bin/ramjet.rs, bindings/src/lib.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// CPU seconds (user + system) used so far by this process (every thread, the kernel's
/// io_uring workers included) or, with `children`, by its waited-for child processes.
pub fn cpu_seconds(children: bool) -> f64 {
    let who = if children {
        libc::RUSAGE_CHILDREN
    } else {
        libc::RUSAGE_SELF
    };
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given (zeroed, so valid even if it fails).
    let r = unsafe {
        libc::getrusage(who, u.as_mut_ptr());
        u.assume_init()
    };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(r.ru_utime) + t(r.ru_stime)
}

/// Whether this is a real run (`cargo bench`) or a quick test-mode run (`cargo test`).
pub fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Folder for benchmark data and results, kept between runs: `target/bench`.
pub fn bench_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&d).expect("create target/bench");
    d
}

/// The synthetic YOLO dataset of `n` images, generated once and reused.
pub fn synth_dataset(n: usize) -> PathBuf {
    let dir = bench_dir().join(format!("synth-{n}"));
    let done = dir.join(".complete");
    if !done.exists() {
        let _ = std::fs::remove_dir_all(&dir);
        let pb = ramjet_tools::ui::count_bar("synth");
        ramjet_tools::synth::synth(
            &dir,
            &ramjet_tools::synth::SynthOptions {
                samples: n,
                ..Default::default()
            },
            &pb,
        )
        .expect("synth");
        std::fs::write(&done, b"").unwrap();
    }
    dir
}

/// The set-up both engine benchmarks share: whether this is a full run (`cargo bench`, not
/// test mode), its runtime, and the packed set (5,315 images in a full run, 200 in test mode):
/// its URL, the opened dataset, its bytes and its image count.
pub fn bench_setup() -> (
    bool,
    tokio::runtime::Runtime,
    String,
    ramjet_engine::Dataset,
    u64,
    usize,
) {
    let full = full_run();
    let n = if full { 5315 } else { 200 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (url, ds) = bench_dataset(&rt, n);
    let total = ds.manifest().bytes;
    (full, rt, url, ds, total, n)
}

/// The synthetic set of `n` images packed (once) at `s3://BUCKET/bench/stream-N` on the local
/// S3 server, which is started if needed. Returns its URL and the opened dataset.
pub fn bench_dataset(rt: &tokio::runtime::Runtime, n: usize) -> (String, ramjet_engine::Dataset) {
    packed_dataset(rt, n, &format!("stream-{n}"), &Default::default())
}

/// The synthetic set of `n` images packed (once) with `opts` at `s3://BUCKET/bench/NAME`.
pub fn packed_dataset(
    rt: &tokio::runtime::Runtime,
    n: usize,
    name: &str,
    opts: &ramjet_tools::pack::PackOptions,
) -> (String, ramjet_engine::Dataset) {
    let s3 = ramjet_tests::s3();
    let url = format!("s3://{}/bench/{name}", s3.bucket);
    if rt.block_on(ramjet_engine::Dataset::open(&url)).is_err() {
        let src = synth_dataset(n);
        ramjet_tools::pack::pack(src.to_str().unwrap(), &url, opts, &indicatif::ProgressBar::hidden()).expect("pack");
    }
    let ds = rt
        .block_on(ramjet_engine::Dataset::open(&url))
        .expect("open the packed set");
    (url, ds)
}

/// Reads `cfg`'s stream to its end through its host daemon, which must deliver every shard.
pub fn drain_through_daemon(cfg: ramjet_engine::StreamConfig) {
    use ramjet_engine::Opened;
    let mut s = ramjet_engine::Stream::open(cfg).expect("stream");
    while s.next_sample().expect("sample").is_some() {}
    let m = s.metrics();
    assert_eq!(m.daemon_failures, 0, "{m:?}");
}

/// Median of `reps` timings of `f`, run after `setup` each time (setup is not timed).
pub fn median_time(reps: usize, mut setup: impl FnMut(), mut f: impl FnMut()) -> Duration {
    let mut ts: Vec<Duration> = (0..reps)
        .map(|_| {
            setup();
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    ts.sort();
    ts[ts.len() / 2]
}

/// Reads every file under `dir` once, so the page cache holds it for every contender.
pub fn warm_page_cache(dir: &Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            n += warm_page_cache(&p);
        } else {
            n += std::fs::read(&p).map(|b| b.len() as u64).unwrap_or(0);
        }
    }
    n
}

/// Writes `value` to `target/bench/NAME.json` and says where.
pub fn save_results(name: &str, value: &serde_json::Value) {
    let p = bench_dir().join(format!("{name}.json"));
    std::fs::write(&p, serde_json::to_vec_pretty(value).unwrap()).unwrap();
    println!("results written to {}", p.display());
}
