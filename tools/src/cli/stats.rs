//! `ramjet stats`: print a cluster view from daemons' /stats (HOST is host:port of their --http).

use std::process::ExitCode;

use anyhow::Context;

use crate::ui::human_bytes;
use ramjet_transport::ClusterDoc;

#[derive(clap::Args)]
pub struct Args {
    /// Daemons' HTTP addresses.
    #[arg(required = true)]
    pub hosts: Vec<String>,
    /// Print the raw JSON documents.
    #[arg(long)]
    pub json: bool,
    /// First wait until the ring is complete: every daemon answers /ready (it is a member
    /// and has completed an authenticated handshake with every other member), all report
    /// the same members and ring version, and the members are as many as HOSTS. Exits 1
    /// after --timeout, naming each daemon that is not ready and why.
    #[arg(long)]
    pub wait: bool,
    /// Seconds --wait waits.
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// The dashboard's view in the terminal, refreshed in place every --every seconds: every
    /// ring member with its state, cache and reads, and every consumer with its rate, data
    /// wait and where that wait goes, from the first HOST's /cluster (that daemon asks the
    /// others). Ctrl-C ends it.
    #[arg(long)]
    pub watch: bool,
    /// Seconds between --watch's refreshes.
    #[arg(long, default_value_t = 2.0)]
    pub every: f64,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let Args {
        hosts,
        json,
        wait,
        timeout,
        watch,
        every,
    } = a;
    let timeout =
        std::time::Duration::try_from_secs_f64(timeout).map_err(|e| anyhow::anyhow!("--timeout {timeout}: {e}"))?;
    if wait && !wait_ready(&hosts, timeout)? {
        return Ok(ExitCode::FAILURE);
    }
    if watch {
        let every = std::time::Duration::try_from_secs_f64(every)
            .ok()
            .filter(|d| *d >= std::time::Duration::from_millis(100))
            .ok_or_else(|| anyhow::anyhow!("--every {every}: give at least 0.1 seconds"))?;
        return watch_cmd(&hosts[0], every);
    }
    stats_cmd(&hosts, json)
}

/// Waits until every daemon at `hosts` (HTTP addresses) is ready and they agree on one ring of
/// `hosts.len()` members. Prints progress on stderr whenever the picture changes. False on
/// timeout, after naming what is missing.
fn wait_ready(hosts: &[String], timeout: std::time::Duration) -> anyhow::Result<bool> {
    let t0 = std::time::Instant::now();
    let mut last = String::new();
    loop {
        let mut problems = Vec::new();
        let mut rings = std::collections::BTreeSet::new();
        let mut not_ready = 0;
        for h in hosts {
            let seen = problems.len();
            match http_get_any(h, "/ready")
                .and_then(|(_, b)| Ok(serde_json::from_str::<ramjet_transport::ReadyDoc>(&b)?))
            {
                Ok(d) => {
                    if !d.ready {
                        problems.push(format!("{h} ({}): {}", d.node, d.problems.join("; ")));
                    } else if d.members.len() != hosts.len() {
                        problems.push(format!(
                            "{h} ({}): {} members {:?}, but {} daemons were named",
                            d.node,
                            d.members.len(),
                            d.members,
                            hosts.len()
                        ));
                    }
                    rings.insert((d.ring_version, d.members));
                }
                Err(e) => problems.push(format!("{h}: not answering ({e:#})")),
            }
            not_ready += usize::from(problems.len() > seen);
        }
        if rings.len() > 1 {
            problems.push(format!("the daemons disagree on the ring: {rings:?}"));
        }
        if problems.is_empty() {
            let (version, members) = rings.into_iter().next().expect("one ring");
            eprintln!(
                "ramjet stats --wait: ring ready after {:.1} s: {} members, version {version}: {}",
                t0.elapsed().as_secs_f64(),
                members.len(),
                members.join(" ")
            );
            return Ok(true);
        }
        let now = format!(
            "{} of {} daemons ready: {}",
            hosts.len() - not_ready,
            hosts.len(),
            problems.join(" | ")
        );
        if t0.elapsed() >= timeout {
            eprintln!(
                "ramjet stats --wait: gave up after {:.0} s: {now}",
                timeout.as_secs_f64()
            );
            return Ok(false);
        }
        if now != last {
            eprintln!("ramjet stats --wait: {:.1} s: {now}", t0.elapsed().as_secs_f64());
            last = now;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
}

/// The most bytes `ramjet stats` reads of one answer (a 1,000-member `/cluster` is a few MB).
const STATS_RESPONSE_BYTES_MAX: u64 = 64 << 20;

/// The longest `ramjet stats` waits for one whole answer.
const STATS_RESPONSE_TIME_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// GET over plain HTTP/1.1 (the daemons' stats port): the status code and body.
fn http_get_any(host: &str, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::{Read, Write};
    let addr = host.trim_start_matches("http://").trim_end_matches('/');
    let sock = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .with_context(|| format!("resolve {addr}"))?
        .next()
        .with_context(|| format!("resolve {addr}: no address"))?;
    let mut s = std::net::TcpStream::connect_timeout(&sock, std::time::Duration::from_secs(5))
        .with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    let auth = token()
        .map(|t| format!("authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {sock}\r\n{auth}connection: close\r\n\r\n"
    )?;
    // Bounded in bytes and in time: a hostile or broken server can neither fill this
    // process's memory (it buffered 1.86 GB in 4 s) nor trickle a byte every 29 s forever.
    let deadline = std::time::Instant::now() + STATS_RESPONSE_TIME_MAX;
    let mut raw = Vec::new();
    let mut chunk = [0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        anyhow::ensure!(
            !left.is_zero(),
            "{addr}{path}: no complete answer within {STATS_RESPONSE_TIME_MAX:?}"
        );
        s.set_read_timeout(Some(left.min(std::time::Duration::from_secs(30))))?;
        let n = s.read(&mut chunk).with_context(|| format!("read {addr}{path}"))?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&chunk[..n]);
        anyhow::ensure!(
            raw.len() as u64 <= STATS_RESPONSE_BYTES_MAX,
            "{addr}{path}: the answer is larger than {STATS_RESPONSE_BYTES_MAX} bytes; refused"
        );
    }
    let resp = String::from_utf8(raw).with_context(|| format!("{addr}{path}: the answer is not UTF-8"))?;
    let (head, body) = resp.split_once("\r\n\r\n").context("malformed HTTP response")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("malformed HTTP status line")?;
    Ok((code, body.to_owned()))
}

/// The HTTP credential to send: `RAMJET_TOKEN`, else the one `RAMJET_API_KEY` gives (a port
/// on loopback asks for none, and ignores it).
fn token() -> Option<String> {
    std::env::var("RAMJET_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| ramjet_transport::wire::ApiKey::from_env().map(|k| k.http_token()))
}

/// `ramjet stats --watch`: the cluster view, refreshed in place (on a terminal), or printed
/// again each time (to a file).
fn watch_cmd(host: &str, every: std::time::Duration) -> anyhow::Result<ExitCode> {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    loop {
        let view = match http_get(host, "/cluster").and_then(|b| Ok(serde_json::from_str::<ClusterDoc>(&b)?)) {
            Ok(d) => render_cluster(&d),
            Err(e) => format!("{host}: {e:#}\n"),
        };
        if tty {
            // Home, the view, then clear what the last one left below it.
            print!("\x1b[H{}\x1b[J", view.replace('\n', "\x1b[K\n"));
        } else {
            println!("{view}");
        }
        use std::io::Write;
        std::io::stdout().flush()?;
        std::thread::sleep(every);
    }
}

/// The cluster view as text: the members, then the consumers.
pub fn render_cluster(d: &ClusterDoc) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let up = d.nodes.iter().filter(|n| n.state != "down").count();
    let _ = writeln!(
        o,
        "ramjet cluster via {}: {up}/{} members up, origin {}/s, loaders served {}/s, {} consumers",
        d.served_by,
        d.nodes.len(),
        human_bytes(d.origin_bytes_per_s as u64),
        human_bytes(d.read_bytes_per_s.values().sum::<f64>() as u64),
        d.jobs.len()
    );
    let _ = writeln!(
        o,
        "{:<22} {:<7} {:>6} {:>10} {:>8} {:>8} {:>8} {:>10} {:>7} {:>7}",
        "node", "state", "fill", "cached", "local", "peer", "origin", "fetched", "coalesc", "corrupt"
    );
    for n in &d.nodes {
        match &n.summary {
            Some(s) => {
                let fill = if s.cache_limit_bytes == 0 {
                    0.0
                } else {
                    s.cache_bytes as f64 / s.cache_limit_bytes as f64
                };
                let r = |k: &str| s.reads.get(k).copied().unwrap_or(0);
                let _ = writeln!(
                    o,
                    "{:<22} {:<7} {:>5.1}% {:>10} {:>8} {:>8} {:>8} {:>10} {:>7} {:>7}",
                    n.name,
                    n.state,
                    fill * 100.0,
                    human_bytes(s.cache_bytes),
                    r("cache_local"),
                    r("cache_peer"),
                    r("origin"),
                    human_bytes(s.origin_bytes),
                    s.singleflight_coalesced,
                    s.corrupt_caught
                );
            }
            None => {
                let _ = writeln!(o, "{:<22} {:<7} {}", n.name, n.state, n.error.as_deref().unwrap_or(""));
            }
        }
    }
    let _ = writeln!(
        o,
        "\n{:<16} {:<22} {:>7} {:>6} {:>5} {:>15} {:>9} {:>6}  where the time goes",
        "job", "node", "rank", "worker", "epoch", "progress", "samples/s", "wait"
    );
    for j in &d.jobs {
        let b = &j.beat;
        let progress = if b.epoch_len > 0 {
            format!("{}/{}", b.position, b.epoch_len)
        } else {
            b.position.to_string()
        };
        let split: Vec<String> = b
            .split
            .iter()
            .filter(|(_, v)| **v >= 0.005)
            .map(|(k, v)| format!("{k} {:.0}%", v * 100.0))
            .collect();
        let _ = writeln!(
            o,
            "{:<16} {:<22} {:>7} {:>6} {:>5} {:>15} {:>9.1} {:>5.1}%  {}{}",
            b.job,
            j.node,
            format!("{}/{}", b.rank, b.world),
            format!("{}/{}", b.worker, b.workers),
            b.epoch,
            progress,
            b.samples_per_s,
            b.data_wait_share * 100.0,
            split.join(", "),
            if b.data_wait_share > 0.2 {
                "  <- waiting for data"
            } else {
                ""
            }
        );
    }
    o
}

/// GET over plain HTTP/1.1 (the daemons' stats port); an error unless it answers 200.
fn http_get(host: &str, path: &str) -> anyhow::Result<String> {
    let (code, body) = http_get_any(host, path)?;
    anyhow::ensure!(code == 200, "{host}{path}: HTTP {code}: {}", body.trim());
    Ok(body)
}

fn stats_cmd(hosts: &[String], json: bool) -> anyhow::Result<ExitCode> {
    let mut docs = Vec::new();
    let mut failed = false;
    for h in hosts {
        match http_get(h, "/stats").and_then(|b| Ok(serde_json::from_str::<ramjet_transport::StatsDoc>(&b)?)) {
            Ok(d) => docs.push((h.clone(), d)),
            Err(e) => {
                eprintln!("{h}: {e:#}");
                failed = true;
            }
        }
    }
    if json {
        let all: Vec<_> = docs
            .iter()
            .map(|(h, d)| serde_json::json!({"host": h, "stats": d}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        println!(
            "{:<22} {:>5} {:>8} {:>8} {:>8} {:>10} {:>10} {:>7} {:>7} {:>6}  peers",
            "node", "ring", "local", "peer", "origin", "origin", "cached", "coalesc", "refused", "p50ms"
        );
        for (_, d) in &docs {
            let p50 = d
                .latency
                .values()
                .filter(|l| l.count > 0)
                .map(|l| l.p50_us)
                .max()
                .unwrap_or(0);
            let down: Vec<&str> = d
                .peers
                .iter()
                .filter(|(_, h)| !h.healthy)
                .map(|(p, _)| p.as_str())
                .collect();
            println!(
                "{:<22} {:>5} {:>8} {:>8} {:>8} {:>10} {:>10} {:>7} {:>7} {:>6.1}  {} members{}{}",
                d.node,
                d.ring_version,
                d.reads["cache_local"],
                d.reads["cache_peer"],
                d.reads["origin"],
                human_bytes(d.origin_bytes),
                human_bytes(d.cache_bytes),
                d.singleflight_coalesced,
                d.auth_refused,
                p50 as f64 / 1e3,
                d.members.len(),
                if d.frozen { ", frozen" } else { "" },
                if down.is_empty() {
                    String::new()
                } else {
                    format!(", down: {}", down.join(" "))
                }
            );
        }
        let total = |f: &dyn Fn(&ramjet_transport::StatsDoc) -> u64| docs.iter().map(|(_, d)| f(d)).sum::<u64>();
        println!(
            "cluster: {} nodes, origin {} in {} requests, {} shards from peers, {} from local caches",
            docs.len(),
            human_bytes(total(&|d| d.origin_bytes)),
            total(&|d| d.origin_requests),
            total(&|d| d.reads["cache_peer"]),
            total(&|d| d.reads["cache_local"])
        );
    }
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}
