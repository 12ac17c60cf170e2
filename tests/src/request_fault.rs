//! A proxy that fails chosen HTTP requests, not connections: a client that keeps its
//! connections alive (as the origin client does) sends many requests on one, so a fault on
//! "the first connections" never reaches a request in the middle of an epoch.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A proxy in front of an HTTP/1.1 server that answers `503 Service Unavailable` to the `k`-th
/// GET (counted from 0, across connections) whose request line contains a needle, for each
/// `k` it is given, and forwards every other request, one at a time, keeping connections
/// alive. Dropping it stops it.
pub struct RequestFaultProxy {
    /// `http://127.0.0.1:PORT` to give clients.
    pub url: String,
    matched: Arc<AtomicUsize>,
    injected: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

/// What every connection of the proxy shares.
struct Rule {
    upstream: String,
    needle: String,
    fail: Vec<usize>,
    matched: Arc<AtomicUsize>,
    injected: Arc<AtomicUsize>,
}

impl RequestFaultProxy {
    /// Proxies to `upstream` (`host:port`), failing the GETs whose request line contains
    /// `needle` at the indexes in `fail`.
    pub fn start(upstream: &str, needle: &str, fail: &[usize]) -> RequestFaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let (matched, injected) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let rule = Arc::new(Rule {
            upstream: upstream.to_owned(),
            needle: needle.to_owned(),
            fail: fail.to_vec(),
            matched: matched.clone(),
            injected: injected.clone(),
        });
        let stop2 = stop.clone();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let (Ok(client), rule) = (s, rule.clone()) else {
                    continue;
                };
                std::thread::spawn(move || {
                    let _ = relay(client, &rule);
                });
            }
        });
        RequestFaultProxy {
            url: format!("http://{addr}"),
            matched,
            injected,
            stop,
            addr,
        }
    }

    /// GETs seen whose request line contains the needle (the failed ones included).
    pub fn matched(&self) -> usize {
        self.matched.load(Ordering::SeqCst)
    }

    /// 503s sent so far.
    pub fn injected(&self) -> usize {
        self.injected.load(Ordering::SeqCst)
    }
}

impl Drop for RequestFaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// A message head (the lines up to the empty one, as sent) and its `Content-Length`.
fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<(Vec<u8>, u64, bool)>> {
    let (mut head, mut len, mut close) = (Vec::new(), 0u64, false);
    loop {
        let mut line = Vec::new();
        if r.read_until(b'\n', &mut line)? == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&line);
        let text = String::from_utf8_lossy(&line).to_ascii_lowercase();
        if let Some(v) = text.strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if text.starts_with("connection:") && text.contains("close") {
            close = true;
        }
        if line == b"\r\n" || line == b"\n" {
            return Ok(Some((head, len, close)));
        }
    }
}

/// Copies exactly `n` bytes from `r` to `w`.
fn copy_exact(r: &mut impl Read, w: &mut impl Write, n: u64) -> std::io::Result<()> {
    let copied = std::io::copy(&mut r.take(n), w)?;
    if copied != n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Serves one client connection, request by request.
fn relay(client: TcpStream, rule: &Rule) -> std::io::Result<()> {
    let mut from_client = BufReader::new(client.try_clone()?);
    let mut to_client = client;
    let server = TcpStream::connect(&rule.upstream)?;
    let mut from_server = BufReader::new(server.try_clone()?);
    let mut to_server = server;
    while let Some((head, body, _)) = read_head(&mut from_client)? {
        let line = String::from_utf8_lossy(&head[..head.iter().position(|&b| b == b'\n').unwrap_or(0)]).into_owned();
        if line.starts_with("GET ") && line.contains(&rule.needle) {
            let k = rule.matched.fetch_add(1, Ordering::SeqCst);
            if rule.fail.contains(&k) {
                rule.injected.fetch_add(1, Ordering::SeqCst);
                let msg =
                    "<Error><Code>ServiceUnavailable</Code><Message>injected by RequestFaultProxy</Message></Error>";
                write!(
                    to_client,
                    "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{msg}",
                    msg.len()
                )?;
                return Ok(());
            }
        }
        to_server.write_all(&head)?;
        copy_exact(&mut from_client, &mut to_server, body)?;
        let Some((rhead, rbody, close)) = read_head(&mut from_server)? else {
            return Ok(());
        };
        let status = String::from_utf8_lossy(&rhead)
            .split(' ')
            .nth(1)
            .unwrap_or("")
            .to_owned();
        let no_body = line.starts_with("HEAD ") || status == "204" || status == "304";
        to_client.write_all(&rhead)?;
        if !no_body {
            copy_exact(&mut from_server, &mut to_client, rbody)?;
        }
        if close {
            return Ok(());
        }
    }
    Ok(())
}
