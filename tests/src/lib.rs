//! Shared helpers of ramjet's integration tests: the real local S3 server, the `ramjet`
//! binary, small synthetic datasets, byte surgery on real files and objects, and a TCP proxy
//! that injects HTTP 503s and stalls in front of the S3 server.
#![deny(missing_docs)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

mod engine_batches;
pub mod fuzzing;
mod ports;
pub use ports::free_port;
mod request_fault;
pub use request_fault::RequestFaultProxy;

pub use engine_batches::{engine_batches, EngineSplit};

/// Asserts that what started at `t0` took less than `limit`, naming `what` and the time taken.
pub fn assert_under(t0: std::time::Instant, limit: Duration, what: &str) {
    let took = t0.elapsed();
    assert!(took < limit, "{what}: took {took:?}, the limit is {limit:?}");
}

/// Repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Path of the `ramjet` binary of the profile these tests were built with.
pub fn ramjet_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash>
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>");
    let bin = profile_dir.join("ramjet");
    assert!(
        bin.exists(),
        "{} is missing: build it first with `cargo build -p ramjet-tools` (tools/test.sh does)",
        bin.display()
    );
    bin
}

/// The folder of learned manifests (`ramjet_engine::foreign::learned_dir`) of the `ramjet` processes the
/// tests run, under `target/`, so that tests never write into the user's own.
pub fn test_index_dir() -> PathBuf {
    ramjet_bin().with_file_name("test-learned-manifest")
}

/// Runs `ramjet ARGS` with extra environment variables; returns its output.
pub fn ramjet(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(ramjet_bin());
    c.args(args).env("RAMJET_INDEX_DIR", test_index_dir());
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run ramjet")
}

/// stdout and stderr of a finished command, for assertions and failure messages.
pub fn text(o: &Output) -> String {
    format!(
        "exit={:?}\n--- stdout\n{}--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Runs `ramjet ARGS` and panics with its output unless it succeeds.
pub fn ramjet_ok(args: &[&str]) -> String {
    let o = ramjet(args, &[]);
    assert!(o.status.success(), "ramjet {args:?} failed:\n{}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs `ramjet ARGS`, which must fail with output that contains every one of `needles`;
/// returns that output.
pub fn ramjet_fails_naming(args: &[&str], needles: &[&str]) -> String {
    let o = ramjet(args, &[]);
    let t = text(&o);
    assert!(!o.status.success(), "ramjet {args:?} should fail:\n{t}");
    for n in needles {
        assert!(t.contains(n), "ramjet {args:?} output lacks {n:?}:\n{t}");
    }
    t
}

/// The JSON object a command printed last (`--json` output after any progress lines).
pub fn json_of(out: &str) -> serde_json::Value {
    let at = out.find('{').unwrap_or_else(|| panic!("no JSON in {out}"));
    serde_json::from_str(&out[at..]).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Settings of the local S3 server, as `tools/env.sh` sets them.
#[derive(Debug, Clone)]
pub struct S3 {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    /// Bucket created at start.
    pub bucket: String,
}

/// Starts the local S3 server once per test process (idempotent across processes: the
/// script keeps a PID file) and exports its credentials into this process's environment.
pub fn s3() -> &'static S3 {
    static S3_ONCE: OnceLock<S3> = OnceLock::new();
    S3_ONCE.get_or_init(|| {
        let root = repo_root();
        let lock = std::fs::File::create(std::env::temp_dir().join("ramjet-s3-start.lock")).expect("lock file");
        // Serialise starts across test binaries running at once.
        // SAFETY: flock on a file descriptor we own; released when `lock` is dropped.
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
        let out = Command::new("bash")
            .arg(root.join("tools/s3-server.sh"))
            .arg("start")
            .output()
            .expect("run tools/s3-server.sh");
        assert!(
            out.status.success(),
            "the local S3 server did not start (tools/s3-server.sh start):\n{}",
            text(&out)
        );
        let env = Command::new("bash")
            .arg(root.join("tools/s3-server.sh"))
            .arg("env")
            .output()
            .expect("env");
        let mut s3 = S3 {
            endpoint: String::new(),
            bucket: String::new(),
        };
        for line in String::from_utf8_lossy(&env.stdout).lines() {
            let Some((k, v)) = line.strip_prefix("export ").and_then(|l| l.split_once('=')) else {
                continue;
            };
            // Done once, before any test of this process reads these variables.
            std::env::set_var(k, v);
            match k {
                "AWS_ENDPOINT_URL" => s3.endpoint = v.to_owned(),
                "RAMJET_S3_BUCKET" => s3.bucket = v.to_owned(),
                _ => {}
            }
        }
        assert!(!s3.endpoint.is_empty(), "tools/s3-server.sh env printed no endpoint");
        s3
    })
}

/// A fresh `s3://bucket/tests/NAME-PID-N` prefix.
pub fn s3_prefix(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let s = s3();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "s3://{}/tests/{name}-{}-{}-{nanos}",
        s.bucket,
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// The folder that the processes of one test run share: under cargo-nextest (one process per
/// test) the run's `NEXTEST_RUN_ID`; under `cargo test`, this process.
pub fn run_dir() -> PathBuf {
    let run = std::env::var("NEXTEST_RUN_ID").unwrap_or_else(|_| format!("pid{}", std::process::id()));
    let dir = std::env::temp_dir().join(format!("ramjet-tests-{run}"));
    std::fs::create_dir_all(&dir).expect("run folder");
    dir
}

/// Runs `make` once per test run and returns what it made, shared by every test process of the
/// run (a dataset packed once, not once per test). Processes that ask at the same time wait on
/// a file lock for the first one; a `make` that panics leaves nothing behind, so the next asks
/// again.
pub fn once_per_run(key: &str, make: impl FnOnce() -> String) -> String {
    let dir = run_dir();
    let lock = std::fs::File::create(dir.join(format!("{key}.lock"))).expect("lock file");
    // SAFETY: flock on a file descriptor we own; released when `lock` is dropped.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock {key}.lock: {}", std::io::Error::last_os_error());
    let done = dir.join(key);
    if let Ok(v) = std::fs::read_to_string(&done) {
        return v;
    }
    let v = make();
    let tmp = dir.join(format!("{key}.tmp"));
    std::fs::write(&tmp, &v).expect("write run value");
    std::fs::rename(&tmp, &done).expect("publish run value");
    v
}

/// A synthetic YOLO dataset of `n` images, generated once per test run and size.
pub fn synth_dataset(n: usize) -> PathBuf {
    static CACHE: OnceLock<Mutex<Vec<(usize, PathBuf)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut c = cache.lock().unwrap();
    if let Some((_, d)) = c.iter().find(|(k, _)| *k == n) {
        return d.clone();
    }
    let out = PathBuf::from(once_per_run(&format!("synth-{n}"), || {
        let out = run_dir().join(format!("synth-{n}.d"));
        let _ = std::fs::remove_dir_all(&out);
        ramjet_ok(&["synth", out.to_str().unwrap(), "--samples", &n.to_string()]);
        out.to_string_lossy().into_owned()
    }));
    c.push((n, out.clone()));
    out
}

/// Copies a folder tree (to damage a copy, not the shared original).
pub fn copy_tree(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), to).unwrap();
        }
    }
}

/// Flips every bit of the byte at `offset` of a local file.
pub fn flip_byte(path: &Path, offset: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[offset as usize] ^= 0xFF;
    std::fs::write(path, b).unwrap();
}

/// What a [`FaultProxy`] does to a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer `503 Service Unavailable` and close.
    Status503,
    /// Read the request and never answer (until the client gives up).
    Stall,
    /// Forward to the upstream server.
    Pass,
    /// Forward, with the server's answers sent at most this many bytes a second (a slow link:
    /// a small answer comes at once, a large one takes its time).
    Throttle(u32),
}

/// A TCP proxy in front of an HTTP server that applies a fault to the first `n` connections
/// (or to all of them), then forwards. It counts connections. Dropping it stops it.
pub struct FaultProxy {
    /// `http://127.0.0.1:PORT` to give clients.
    pub url: String,
    connections: Arc<AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    addr: SocketAddr,
}

impl FaultProxy {
    /// Proxies to `upstream` (`host:port`), applying `fault` to the first `n` connections.
    pub fn start(upstream: &str, fault: Fault, n: usize) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (conns, stop2, upstream) = (connections.clone(), stop.clone(), upstream.to_owned());
        std::thread::spawn(move || {
            for s in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = s else { continue };
                let k = conns.fetch_add(1, Ordering::SeqCst);
                let f = if k < n { fault } else { Fault::Pass };
                let up = upstream.clone();
                std::thread::spawn(move || serve(client, f, &up));
            }
        });
        FaultProxy {
            url: format!("http://{addr}"),
            connections,
            stop,
            addr,
        }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn serve(mut client: TcpStream, fault: Fault, upstream: &str) {
    match fault {
        Fault::Status503 => {
            let mut buf = [0u8; 8192];
            let _ = client.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = client.read(&mut buf);
            let body = "<Error><Code>ServiceUnavailable</Code><Message>injected by FaultProxy</Message></Error>";
            let _ = write!(
                client,
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
        Fault::Stall => {
            let mut buf = [0u8; 8192];
            let _ = client.set_read_timeout(Some(Duration::from_secs(30)));
            // Hold the connection open, answering nothing, until the client closes it.
            while matches!(client.read(&mut buf), Ok(n) if n > 0) {}
        }
        Fault::Throttle(rate) => forward(client, upstream, Some(rate)),
        Fault::Pass => forward(client, upstream, None),
    }
}

/// Forwards one connection to `upstream`, the server's answers sent at most `rate` bytes a
/// second when given (each chunk sent at once, then the link busy for its time).
fn forward(client: TcpStream, upstream: &str, rate: Option<u32>) {
    let Ok(server) = TcpStream::connect(upstream) else {
        return;
    };
    let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    let t = std::thread::spawn(move || {
        let _ = std::io::copy(&mut c2, &mut s2);
        let _ = s2.shutdown(std::net::Shutdown::Write);
    });
    let (mut s3, mut c3) = (server, client);
    match rate {
        None => {
            let _ = std::io::copy(&mut s3, &mut c3);
        }
        Some(rate) => {
            let mut buf = vec![0u8; 16 << 10];
            while let Ok(n) = s3.read(&mut buf) {
                if n == 0 || c3.write_all(&buf[..n]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_secs_f64(n as f64 / rate.max(1) as f64));
            }
        }
    }
    let _ = c3.shutdown(std::net::Shutdown::Write);
    let _ = t.join();
}

/// A TCP proxy in front of an HTTP server that records every request line (`GET /path`),
/// to count what reaches the origin. Dropping it stops it.
pub struct CountingProxy {
    /// `http://127.0.0.1:PORT` to give clients.
    pub url: String,
    requests: Arc<Mutex<Vec<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    addr: SocketAddr,
}

impl CountingProxy {
    /// Proxies to `upstream` (`host:port`).
    pub fn start(upstream: &str) -> CountingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (reqs, stop2, upstream) = (requests.clone(), stop.clone(), upstream.to_owned());
        std::thread::spawn(move || {
            for s in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = s else { continue };
                let (up, reqs) = (upstream.clone(), reqs.clone());
                std::thread::spawn(move || {
                    let Ok(server) = TcpStream::connect(&up) else {
                        return;
                    };
                    let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                    let t = std::thread::spawn(move || {
                        // Requests to the origin carry no bodies here (GET/HEAD), so every
                        // request line starts a line of the client's byte stream.
                        let mut buf = vec![0u8; 64 << 10];
                        let mut line = Vec::new();
                        let mut at_start = true;
                        while let Ok(n) = c2.read(&mut buf) {
                            if n == 0 || s2.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            for &b in &buf[..n] {
                                if b == b'\n' {
                                    let l = String::from_utf8_lossy(&line).trim().to_owned();
                                    if at_start && !l.is_empty() {
                                        reqs.lock().unwrap().push(l.clone());
                                    }
                                    at_start = l.is_empty();
                                    line.clear();
                                } else if line.len() < 4096 {
                                    line.push(b);
                                }
                            }
                        }
                        let _ = s2.shutdown(std::net::Shutdown::Write);
                    });
                    let (mut s3, mut c3) = (server, client);
                    let _ = std::io::copy(&mut s3, &mut c3);
                    let _ = c3.shutdown(std::net::Shutdown::Write);
                    let _ = t.join();
                });
            }
        });
        CountingProxy {
            url: format!("http://{addr}"),
            requests,
            stop,
            addr,
        }
    }

    /// Request lines seen so far whose method is `method` and whose path contains `needle`.
    pub fn count(&self, method: &str, needle: &str) -> usize {
        let prefix = format!("{method} ");
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with(&prefix) && l.contains(needle))
            .count()
    }

    /// Distinct request lines (a retried or repeated request counted once) whose method is
    /// `method` and whose path contains `needle`.
    pub fn count_distinct(&self, method: &str, needle: &str) -> usize {
        let prefix = format!("{method} ");
        let reqs = self.requests.lock().unwrap();
        let set: std::collections::BTreeSet<&String> = reqs
            .iter()
            .filter(|l| l.starts_with(&prefix) && l.contains(needle))
            .collect();
        set.len()
    }

    /// Forgets what was recorded.
    pub fn reset(&self) {
        self.requests.lock().unwrap().clear();
    }
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Runs a future on a fresh runtime (tests that touch the store directly).
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// libjpeg-turbo's decode of a GPU route's region at the route's scale, as interleaved RGB
/// rows of `3 * decoded width` bytes: what nvJPEG must give for it (`tests/nvjpeg_gpu.rs`),
/// and the CPU stand-in for nvJPEG where there is no GPU (`tests/gpu_decode_plan.rs`).
pub fn cpu_region(bytes: &[u8], g: &ramjet_engine::image::route::Geometry) -> Vec<u8> {
    let full = ramjet_engine::image::decode_rgb(bytes, 8 / g.eighths, None).expect("the CPU decodes the region");
    let (x0, y0) = ((g.roi.x * g.eighths / 8) as usize, (g.roi.y * g.eighths / 8) as usize);
    let (w, h) = (g.decoded.0 as usize, g.decoded.1 as usize);
    let mut out = Vec::with_capacity(w * h * 3);
    for y in y0..y0 + h {
        let row = (y * full.width as usize + x0) * 3;
        out.extend_from_slice(&full.data[row..row + w * 3]);
    }
    out
}

/// The fused kernel's job for a GPU route's decoded region at byte offset `src` of the
/// source buffer.
pub fn kernel_job(src: u64, g: &ramjet_engine::image::route::Geometry) -> ramjet_cuda::kernel::Job {
    ramjet_cuda::kernel::Job {
        src,
        w: g.decoded.0 as i32,
        h: g.decoded.1 as i32,
        stride: 3 * g.decoded.0 as i32,
        flip: g.plan.flip as i32,
        cx: g.crop.x as f32,
        cy: g.crop.y as f32,
        cw: g.crop.w as f32,
        ch: g.crop.h as f32,
    }
}
