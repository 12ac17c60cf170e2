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
use ramjet_engine::{Error, Fetched, FetchedFrom, Result, ShardProvider, ShardRequest};

use crate::daemon::{Daemon, DaemonConfig};
use crate::sys;
use crate::wire::{self, Msg};

/// The default socket path: `$RAMJET_SOCKET`, else `daemon.sock` in the private directory
/// `$XDG_RUNTIME_DIR/ramjet/`, else `/tmp/ramjet-<uid>/` (created with mode 0700 and checked
/// to be ours by [`ensure_private_dir`] before a daemon binds there).
pub fn default_socket() -> PathBuf {
    if let Ok(p) = std::env::var("RAMJET_SOCKET") {
        return p.into();
    }
    let dir = match std::env::var("XDG_RUNTIME_DIR") {
        Ok(d) if !d.is_empty() => Path::new(&d).join("ramjet"),
        _ => std::env::temp_dir().join(format!("ramjet-{}", sys::my_uid())),
    };
    dir.join("daemon.sock")
}

/// Creates `dir` with mode 0700 if it is missing, then checks that it is a real directory
/// (not a symbolic link), owned by us, that no one else may enter or write. In a shared `/tmp`
/// another user could otherwise create the directory first and serve its own socket there.
pub fn ensure_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let m = std::fs::symlink_metadata(dir)?;
    let me = sys::my_uid();
    if !m.file_type().is_dir() || m.uid() != me || m.mode() & 0o077 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a private directory of uid {me} (owner uid {}, mode {:o}, {}); refusing to use it for the daemon socket",
                dir.display(),
                m.uid(),
                m.mode() & 0o7777,
                if m.file_type().is_symlink() { "a symbolic link" } else if m.is_dir() { "a directory" } else { "not a directory" }
            ),
        ));
    }
    Ok(())
}

/// Connects to the daemon socket and checks, with `SO_PEERCRED`, that the process serving it
/// runs as our user: a socket path alone proves nothing about who listens there.
pub fn connect_checked(socket: &Path) -> std::io::Result<UnixStream> {
    let c = UnixStream::connect(socket)?;
    let (theirs, ours) = (sys::peer_uid(c.as_raw_fd())?, sys::my_uid());
    if theirs != ours {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "the daemon at {} runs as uid {theirs}, not as this user (uid {ours}); refused",
                socket.display()
            ),
        ));
    }
    Ok(c)
}

/// How long a loader waits for the host daemon's answer before it gives up on that request
/// and reads the origin itself (`RAMJET_DAEMON_TIMEOUT_MS`, 90 s unless set): longer than the
/// daemon's own wait for another reader's fetch (`RAMJET_SINGLEFLIGHT_TIMEOUT_MS`, 30 s) plus a
/// shard's fetch, shorter than any test's limit, so a daemon alive but stuck never stalls a
/// loader for long.
pub fn daemon_timeout() -> Duration {
    Duration::from_millis(
        std::env::var("RAMJET_DAEMON_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&ms| ms > 0)
            .unwrap_or(90_000),
    )
}

/// How often a daemon marked down is probed, and how long a probe waits for its answer.
pub const DAEMON_PROBE_EVERY: Duration = Duration::from_secs(1);

/// A blocking client of the host daemon. Connections are pooled; every method may be called
/// from many threads.
///
/// A daemon that does not answer a request within the timeout, or whose socket refuses, is
/// marked down at once: every later request fails without waiting (so the loader reads that
/// shard from its cache or the origin at their own speed), while one background thread pings
/// the daemon every [`DAEMON_PROBE_EVERY`], each ping waiting at most as long. The first answer
/// marks it up again: requests return to the daemon within about two probe periods of it
/// answering (`docs/robustness.md`). A stopped daemon costs one timeout, not one per shard.
#[derive(Debug)]
pub struct DaemonClient {
    socket: PathBuf,
    idle: Mutex<Vec<UnixStream>>,
    timeout: Duration,
    down: std::sync::Arc<Mutex<Option<Down>>>,
}

/// Why and since when the daemon is marked down.
#[derive(Debug, Clone)]
struct Down {
    since: std::time::Instant,
    why: String,
}

impl DaemonClient {
    /// A client of the daemon at `socket` (nothing is connected yet).
    pub fn new(socket: impl Into<PathBuf>) -> DaemonClient {
        DaemonClient {
            socket: socket.into(),
            idle: Mutex::new(Vec::new()),
            timeout: daemon_timeout(),
            down: Default::default(),
        }
    }

    /// Whether the daemon is marked down now (a request timed out or was refused, and no probe
    /// has been answered since).
    pub fn marked_down(&self) -> bool {
        self.down.lock().expect("down lock").is_some()
    }

    /// Fails at once while the daemon is marked down, naming it and why.
    fn check_up(&self, what: &str) -> Result<()> {
        match &*self.down.lock().expect("down lock") {
            None => Ok(()),
            Some(d) => Err(self.err(
                what,
                std::io::Error::other(format!(
                    "marked down {:.1} s ago ({}); read elsewhere until it answers a probe again",
                    d.since.elapsed().as_secs_f64(),
                    d.why
                )),
            )),
        }
    }

    /// A transport failure of a request (not the daemon's own `Fail`): marks the daemon down
    /// and starts the probe, once.
    fn mark_down(&self, e: &std::io::Error) {
        let mut down = self.down.lock().expect("down lock");
        if down.is_some() {
            return;
        }
        tracing::warn!(socket = %self.socket.display(), error = %e, "host daemon marked down; probing it every second");
        *down = Some(Down {
            since: std::time::Instant::now(),
            why: e.to_string(),
        });
        self.idle.lock().expect("pool lock").clear();
        let (flag, socket) = (std::sync::Arc::downgrade(&self.down), self.socket.clone());
        let spawned = std::thread::Builder::new()
            .name("ramjet-daemon-probe".into())
            .spawn(move || probe_until_up(&flag, &socket));
        if spawned.is_err() {
            // No thread to probe with: the next request tries the daemon again.
            *down = None;
        }
    }

    /// The same client with another limit on each read and write of a request (see
    /// [`daemon_timeout`]).
    pub fn with_timeout(mut self, timeout: Duration) -> DaemonClient {
        self.timeout = timeout;
        self
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Whether a daemon answers on the socket.
    pub fn alive(&self) -> bool {
        UnixStream::connect(&self.socket).is_ok()
    }

    /// Whether a daemon of this user answers on the socket (an error says why one of another
    /// user is refused).
    pub fn alive_checked(&self) -> std::io::Result<bool> {
        match connect_checked(&self.socket) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(e),
            Err(_) => Ok(false),
        }
    }

    fn conn(&self) -> std::io::Result<UnixStream> {
        if let Some(c) = self.idle.lock().expect("pool lock").pop() {
            return Ok(c);
        }
        let c = connect_checked(&self.socket)?;
        c.set_read_timeout(Some(self.timeout))?;
        c.set_write_timeout(Some(self.timeout))?;
        Ok(c)
    }

    fn err(&self, what: &str, e: std::io::Error) -> Error {
        Error::io(format!("host daemon at {} ({what})", self.socket.display()), e)
    }

    /// Sends one message and reads the reply with any descriptor that came with it; a
    /// transport failure marks the daemon down.
    fn call(&self, m: &Msg) -> std::io::Result<(Msg, Option<File>)> {
        let r = self.call_once(m);
        if let Err(e) = &r {
            self.mark_down(e);
        }
        r
    }

    fn call_once(&self, m: &Msg) -> std::io::Result<(Msg, Option<File>)> {
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
        // After a `fail` the connection may be closing (a daemon that did not know the
        // request ends it): it is not reused.
        if used == buf.len() && fds.len() <= 1 && !matches!(reply, Msg::Fail { .. }) {
            self.idle.lock().expect("pool lock").push(c);
        }
        Ok((reply, fds.pop().map(File::from)))
    }

    /// Holds the ring version (call when a training run or an epoch starts) until the lease
    /// is released: by [`FreezeLease::release`], or when its connection closes (the lease is
    /// dropped, or its process exits or is killed). A dedicated connection carries it, so a
    /// killed trainer never leaves the ring frozen.
    pub fn freeze(&self) -> Result<FreezeLease> {
        let what = "freeze";
        let mut c = connect_checked(&self.socket).map_err(|e| self.err(what, e))?;
        c.set_read_timeout(Some(self.timeout)).map_err(|e| self.err(what, e))?;
        c.set_write_timeout(Some(self.timeout)).map_err(|e| self.err(what, e))?;
        match call_on(&mut c, &Msg::Freeze).map_err(|e| self.err(what, e))? {
            Msg::Ok => Ok(FreezeLease {
                socket: self.socket.clone(),
                conn: Some(c),
            }),
            r => Err(self.err(what, std::io::Error::other(format!("unexpected reply {r:?}")))),
        }
    }

    fn simple(&self, m: &Msg) -> Result<()> {
        match self.call(m).map_err(|e| self.err("request", e))? {
            (Msg::Ok, _) => Ok(()),
            (r, _) => Err(self.err("request", std::io::Error::other(format!("unexpected reply {r:?}")))),
        }
    }
}

/// Sends `m` on `c` and reads one reply frame (no descriptor expected).
fn call_on(c: &mut UnixStream, m: &Msg) -> std::io::Result<Msg> {
    use std::io::Read;
    c.write_all(&wire::encode(m))?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((reply, _)) = wire::parse_frame(&buf)? {
            return Ok(reply);
        }
        let n = c.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "daemon closed the connection",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A freeze of the ring held on its own connection to the daemon (see
/// [`DaemonClient::freeze`]). Dropping it closes the connection, which releases it too.
#[derive(Debug)]
pub struct FreezeLease {
    socket: PathBuf,
    conn: Option<UnixStream>,
}

impl FreezeLease {
    /// Releases the freeze now and waits for the daemon to confirm it. Releasing a lease
    /// twice is a no-op.
    pub fn release(&mut self) -> Result<()> {
        let Some(mut c) = self.conn.take() else {
            return Ok(());
        };
        let err = |e: std::io::Error| Error::io(format!("host daemon at {} (unfreeze)", self.socket.display()), e);
        match call_on(&mut c, &Msg::Unfreeze).map_err(err)? {
            Msg::Ok => Ok(()),
            Msg::Fail { message } => Err(err(std::io::Error::other(message))),
            r => Err(err(std::io::Error::other(format!("unexpected reply {r:?}")))),
        }
    }

    /// A handle that holds nothing (what is left after [`release`](Self::release)).
    pub fn released() -> FreezeLease {
        FreezeLease {
            socket: PathBuf::new(),
            conn: None,
        }
    }

    /// Whether the lease is still held by this handle (not yet released).
    pub fn held(&self) -> bool {
        self.conn.is_some()
    }
}

/// Pings the daemon at `socket` every [`DAEMON_PROBE_EVERY`] until it answers (then clears the
/// mark) or its client is gone.
fn probe_until_up(down: &std::sync::Weak<Mutex<Option<Down>>>, socket: &Path) {
    loop {
        std::thread::sleep(DAEMON_PROBE_EVERY);
        let Some(flag) = down.upgrade() else { return };
        let answered = connect_checked(socket).and_then(|mut c| {
            c.set_read_timeout(Some(DAEMON_PROBE_EVERY))?;
            c.set_write_timeout(Some(DAEMON_PROBE_EVERY))?;
            call_on(&mut c, &Msg::Ping)
        });
        // Any answer is a daemon at work (one that predates Ping answers Fail).
        if answered.is_ok() {
            tracing::info!(socket = %socket.display(), "host daemon answers again");
            *flag.lock().expect("down lock") = None;
            return;
        }
    }
}

impl ShardProvider for DaemonClient {
    fn fetch(&self, req: &ShardRequest<'_>) -> Result<Fetched> {
        let what = format!("{} shard {}", req.manifest_url, req.shard);
        self.check_up(&what)?;
        let get = Msg::Get {
            manifest_url: req.manifest_url.to_owned(),
            shard: req.shard,
            checksum: req.id.checksum,
            bytes: req.id.bytes,
            keep: req.keep,
            split: req.split,
            reader: req.reader,
            job: req.reader.map(|_| req.job.to_owned()),
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
                let from = FetchedFrom::parse(&source)
                    .ok_or_else(|| self.err(&what, std::io::Error::other(format!("unknown source {source:?}"))))?;
                let bytes = sys::received_shard(&f, bytes).map_err(|e| self.err(&what, e))?;
                Ok(Fetched { bytes, from })
            }
            Msg::Fail { message } => Err(self.err(&what, std::io::Error::other(message))),
            r => Err(self.err(&what, std::io::Error::other(format!("unexpected reply {r:?}")))),
        }
    }

    fn heartbeat(&self, beat: &ramjet_engine::Heartbeat) -> Result<ramjet_engine::pace::BeatReply> {
        use ramjet_engine::pace::BeatReply;
        self.check_up("heartbeat")?;
        match self
            .call(&Msg::Heartbeat(beat.clone()))
            .map_err(|e| self.err("heartbeat", e))?
        {
            (Msg::Ok, _) => Ok(BeatReply::default()),
            (Msg::Grant(g), _) => Ok(BeatReply {
                grant: Some(g),
                job: None,
            }),
            (Msg::Beat { grant, job }, _) => Ok(BeatReply { grant, job }),
            (r, _) => Err(self.err("heartbeat", std::io::Error::other(format!("unexpected reply {r:?}")))),
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
    let alive = client
        .alive_checked()
        .map_err(|e| Error::io(format!("host daemon at {}", socket.display()), e))?;
    if alive {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// Regression: a daemon that stopped answering cost every request the full timeout (a
    /// SIGSTOPped daemon: 15 shards, 82 s at a 10 s timeout). A real socket whose server reads
    /// but never answers: the first request waits its timeout and marks the daemon down, the
    /// next fails at once; once the server answers pings, the probe marks it up again.
    #[test]
    fn a_daemon_that_stops_answering_costs_one_timeout_and_is_probed_back() {
        use std::io::Read;
        use std::sync::atomic::{AtomicBool, Ordering};
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("d.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let answer = std::sync::Arc::new(AtomicBool::new(false));
        let a = answer.clone();
        std::thread::spawn(move || {
            for c in listener.incoming() {
                let Ok(mut c) = c else { return };
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = c.read(&mut buf) {
                        if n == 0 {
                            return;
                        }
                        if a.load(Ordering::SeqCst) {
                            let _ = c.write_all(&wire::encode(&Msg::Ok));
                        }
                    }
                });
            }
        });
        let client = DaemonClient::new(&sock).with_timeout(Duration::from_millis(500));
        let corrupt = Msg::Corrupt { checksum: 1, bytes: 2 };
        let t = std::time::Instant::now();
        assert!(client.call(&corrupt).is_err());
        assert!(
            t.elapsed() >= Duration::from_millis(450),
            "the first request waits its timeout"
        );
        assert!(client.marked_down());
        let t = std::time::Instant::now();
        let e = client.check_up("shard 3").unwrap_err().to_string();
        assert!(e.contains("marked down") && e.contains("shard 3"), "{e}");
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "a request while down fails at once"
        );
        answer.store(true, Ordering::SeqCst);
        let t = std::time::Instant::now();
        while client.marked_down() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the probe never marked the daemon up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(matches!(client.call(&corrupt), Ok((Msg::Ok, None))));
    }

    /// Regression: the default socket was `/tmp/ramjet-<uid>.sock`, in a directory any user may
    /// write, so another user could create it first and serve it.
    #[test]
    fn default_socket_dir_open_to_others_or_a_symlink_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("ramjet");
        ensure_private_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = ensure_private_dir(&dir).unwrap_err();
        assert!(e.to_string().contains("not a private directory"), "{e}");
        let link = d.path().join("link");
        std::os::unix::fs::symlink(d.path(), &link).unwrap();
        let e = ensure_private_dir(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }

    /// Regression: the client never checked who served the socket. A daemon of another user
    /// (here a real process that dropped to uid 65534) is refused by `SO_PEERCRED`.
    #[test]
    fn a_daemon_socket_served_by_another_user_is_refused() {
        if !sys::root_or_skip("start a server as another user") {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let sock = d.path().join("daemon.sock");
        let mut fds = [0; 2];
        // SAFETY: a pipe into a two-element array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child binds a socket as another user, accepts, and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: plain system calls in the child; it never returns into the harness.
            unsafe {
                if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    libc::_exit(2);
                }
                let Ok(l) = std::os::unix::net::UnixListener::bind(&sock) else {
                    libc::_exit(3)
                };
                libc::write(fds[1], [1u8].as_ptr().cast(), 1);
                let _c = l.accept();
                libc::sleep(5);
                libc::_exit(0);
            }
        }
        let mut b = [0u8; 1];
        // SAFETY: reads one byte from our pipe.
        let n = unsafe { libc::read(fds[0], b.as_mut_ptr().cast(), 1) };
        let r = connect_checked(&sock);
        // While the other user's server still listens (a second connection waits in its
        // backlog with the listener's credentials): the liveness probe refuses it too.
        let alive = DaemonClient::new(&sock).alive_checked();
        // SAFETY: ends and reaps our child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert_eq!(n, 1, "the other user's server did not start");
        let e = r.expect_err("a daemon of another user was accepted");
        assert!(e.to_string().contains("uid 65534"), "{e}");
        let e = alive.expect_err("alive_checked accepted a daemon of another user");
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        assert!(e.to_string().contains("uid 65534"), "{e}");
    }
}
