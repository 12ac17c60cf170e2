//! The loader's side of the host daemon: a blocking client over the Unix socket, and the
//! embedded daemon that starts when none is running.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use ramjet_engine::cache::CacheConfig;
use ramjet_engine::{Error, Fetched, ReadSource, Result, ShardProvider, ShardRequest};

use crate::daemon::{Daemon, DaemonConfig};
use crate::sys;
use crate::wire::{self, Msg};

/// The default socket path: `$RAMJET_SOCKET`, else `$XDG_RUNTIME_DIR/ramjet.sock`, else
/// `/tmp/ramjet-<uid>.sock`.
pub fn default_socket() -> PathBuf {
    if let Ok(p) = std::env::var("RAMJET_SOCKET") {
        return p.into();
    }
    if let Ok(d) = std::env::var("XDG_RUNTIME_DIR") {
        return Path::new(&d).join("ramjet.sock");
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("ramjet-{uid}.sock"))
}

/// A blocking client of the host daemon. Connections are pooled; every method may be called
/// from many threads.
#[derive(Debug)]
pub struct DaemonClient {
    socket: PathBuf,
    idle: Mutex<Vec<UnixStream>>,
    timeout: Duration,
}

impl DaemonClient {
    /// A client of the daemon at `socket` (nothing is connected yet).
    pub fn new(socket: impl Into<PathBuf>) -> DaemonClient {
        DaemonClient {
            socket: socket.into(),
            idle: Mutex::new(Vec::new()),
            // Longer than the daemon's own singleflight and peer timeouts.
            timeout: Duration::from_secs(300),
        }
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Whether a daemon answers on the socket.
    pub fn alive(&self) -> bool {
        UnixStream::connect(&self.socket).is_ok()
    }

    fn conn(&self) -> std::io::Result<UnixStream> {
        if let Some(c) = self.idle.lock().expect("pool lock").pop() {
            return Ok(c);
        }
        let c = UnixStream::connect(&self.socket)?;
        c.set_read_timeout(Some(self.timeout))?;
        c.set_write_timeout(Some(self.timeout))?;
        Ok(c)
    }

    fn err(&self, what: &str, e: std::io::Error) -> Error {
        Error::io(format!("host daemon at {} ({what})", self.socket.display()), e)
    }

    /// Sends one message and reads the reply with any descriptor that came with it.
    fn call(&self, m: &Msg) -> std::io::Result<(Msg, Option<File>)> {
        let mut c = self.conn()?;
        c.write_all(&wire::encode(m))?;
        let mut buf = Vec::with_capacity(256);
        let mut chunk = [0u8; 4096];
        let mut fds = Vec::new();
        let (reply, used) = loop {
            if let Some(done) = wire::parse_frame(&buf)? {
                break done;
            }
            let n = sys::recv_with_fds(c.as_raw_fd(), &mut chunk, &mut fds)?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "daemon closed the connection",
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        if used == buf.len() && fds.len() <= 1 {
            self.idle.lock().expect("pool lock").push(c);
        }
        Ok((reply, fds.pop().map(File::from)))
    }

    /// Holds the ring version (call when an epoch starts).
    pub fn freeze(&self) -> Result<()> {
        self.simple(&Msg::Freeze)
    }

    /// Releases one freeze (call when the epoch ends).
    pub fn unfreeze(&self) -> Result<()> {
        self.simple(&Msg::Unfreeze)
    }

    fn simple(&self, m: &Msg) -> Result<()> {
        match self.call(m).map_err(|e| self.err("request", e))? {
            (Msg::Ok, _) => Ok(()),
            (r, _) => Err(self.err("request", std::io::Error::other(format!("unexpected reply {r:?}")))),
        }
    }
}

impl ShardProvider for DaemonClient {
    fn fetch(&self, req: &ShardRequest<'_>) -> Result<Fetched> {
        let what = format!("{} shard {}", req.manifest_url, req.shard);
        let get = Msg::Get {
            manifest_url: req.manifest_url.to_owned(),
            shard: req.shard,
            checksum: req.id.checksum,
            bytes: req.id.bytes,
        };
        let (reply, file) = self.call(&get).map_err(|e| self.err(&what, e))?;
        match reply {
            Msg::Data { bytes, source } => {
                let Some(f) = file else {
                    return Err(self.err(&what, std::io::Error::other("reply carried no file descriptor")));
                };
                if bytes != req.id.bytes {
                    return Err(self.err(&what, std::io::Error::other(format!("announced {bytes} bytes"))));
                }
                let source = ReadSource::parse(&source)
                    .ok_or_else(|| self.err(&what, std::io::Error::other(format!("unknown source {source:?}"))))?;
                let bytes = sys::map_file(&f, bytes).map_err(|e| self.err(&what, e))?;
                Ok(Fetched { bytes, source })
            }
            Msg::Fail { message } => Err(self.err(&what, std::io::Error::other(message))),
            r => Err(self.err(&what, std::io::Error::other(format!("unexpected reply {r:?}")))),
        }
    }

    fn report_corrupt(&self, req: &ShardRequest<'_>) {
        let m = Msg::Corrupt {
            checksum: req.id.checksum,
            bytes: req.id.bytes,
        };
        if let Err(e) = self.simple(&m) {
            tracing::warn!(error = %e, "could not report a corrupt shard to the daemon");
        }
    }
}

/// A daemon for this host: the one already serving `socket`, or an embedded one started in
/// this process (kept running while the returned value lives). A single host needs no
/// set-up: the first loader starts it, later ones share it.
pub struct HostDaemon {
    /// Client of whichever daemon serves the socket.
    pub client: std::sync::Arc<DaemonClient>,
    /// The embedded daemon, if this process started it.
    pub embedded: Option<Daemon>,
}

/// Connects to the daemon at `socket`, or starts an embedded one with `cache` there.
pub fn ensure_daemon(socket: &Path, cache: CacheConfig) -> Result<HostDaemon> {
    let client = std::sync::Arc::new(DaemonClient::new(socket));
    if client.alive() {
        return Ok(HostDaemon { client, embedded: None });
    }
    match Daemon::start(DaemonConfig::new(socket, cache)) {
        Ok(d) => Ok(HostDaemon {
            client,
            embedded: Some(d),
        }),
        // Another process won the race to start one: use it.
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && client.alive() => {
            Ok(HostDaemon { client, embedded: None })
        }
        Err(e) => Err(Error::io(format!("embedded daemon at {}", socket.display()), e)),
    }
}
