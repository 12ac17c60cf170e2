//! `ramjet serve`: the host cache daemon.
//!
//! ```text
//!  loader ──unix socket──► local request ─┐                      ┌─► cache hit: pass the file's fd
//!  peer   ──tcp (hmac)──► peer request  ──┴─► validate ─► cache ─┤
//!                                                                └─► miss: singleflight(shard)
//!                                             owner is a peer (and the request is local): ask it,
//!                                             verify; else, or when that fails: origin. Then cache.
//! ```
//!
//! One flight per shard per daemon: concurrent requests for a shard (local loaders and peers
//! alike) wait on it. Peer requests never go on to another peer, so a shard is fetched from
//! the origin once per cluster, at its owner, while membership agrees. See `docs/cluster.md`.

use std::collections::HashMap;
use std::fs::File;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use ramjet_engine::cache::{io as cache_io, Cache, CacheConfig, ShardId};
use ramjet_engine::metrics::Metrics;
use ramjet_engine::{Dataset, ReadSource};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::peer::{LinkConfig, PeerTransport, ShardGet, TcpTransport};
use crate::ring::{Membership, VNODES_DEFAULT};
use crate::stats::{PeerHealth, Stats, StatsDoc};
use crate::sys;
use crate::wire::{self, ApiKey, HandshakeError, Msg, SHARD_MAX, URL_MAX};

/// Settings of a daemon.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Unix socket for the host's loaders.
    pub socket: PathBuf,
    /// The node-local cache.
    pub cache: CacheConfig,
    /// TCP address for peers; `None` runs without peers.
    pub listen: Option<SocketAddr>,
    /// This daemon's name in the member list (`host:port`); defaults to `listen`.
    pub advertise: Option<String>,
    /// Members (`host:port`), this daemon included.
    pub peers: Vec<String>,
    /// A file of members (one `host:port` or hostlist per line), re-read every second.
    pub peers_file: Option<PathBuf>,
    /// HTTP address for `/stats` and `/metrics`.
    pub http: Option<SocketAddr>,
    /// Cluster secret (`RAMJET_API_KEY`).
    pub api_key: Option<ApiKey>,
    /// Waiters on a flight give up after this and read the origin (`RAMJET_SINGLEFLIGHT_TIMEOUT_MS`).
    pub singleflight_timeout: Duration,
    /// A peer that sends nothing for this long is given up on (`RAMJET_PEER_TIMEOUT_MS`).
    pub peer_timeout: Duration,
    /// A failed peer is skipped for this long before it is tried again.
    pub peer_backoff: Duration,
    /// Only datasets under these URL prefixes are served (empty: any). A prefix matches on
    /// URL components (scheme, host, whole path segments), never as a bare string prefix.
    pub allow_prefixes: Vec<String>,
    /// Listen for peers on a non-loopback address without an API key (`--insecure`).
    pub insecure: bool,
    /// Datasets (manifests) held open at once; the least recently used is dropped beyond it.
    pub datasets_open_max: usize,
    /// Connections served at once, local, peer and HTTP together; more are closed on accept.
    pub connections_max: usize,
    /// A held manifest is loaded again when older than this (`RAMJET_MANIFEST_REVALIDATE_MS`),
    /// so a dataset re-packed under the same URL is served as it is now.
    pub manifest_revalidate_after: Duration,
    /// The slowest whole-shard transfer accepted from a peer (see [`LinkConfig`]).
    pub transfer_min_bytes_per_s: u64,
    /// Virtual nodes per member.
    pub vnodes: usize,
    /// Origin range size and ranges in flight per shard.
    pub range_bytes: u64,
    /// Ranged GETs in flight per shard.
    pub ranges_in_flight: usize,
    /// Network runtime workers, when the daemon is the first in its process to use the shared
    /// runtime (0: the runtime's default, see `ramjet_engine::rt`).
    pub threads: usize,
    /// How shard bytes move between peers.
    pub transport: TransportKind,
}

/// How shard bytes move between peers. Control frames always use the authenticated TCP
/// connection.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// The shard follows its `data` frame on the TCP connection (`sendfile` at the owner).
    #[default]
    Tcp,
    /// RDMA WRITE into the requester's registered buffer (cargo feature `rdma`). Owners
    /// without RDMA are read over TCP.
    Rdma {
        /// The device (`mlx5_0`, ...); `None`: the first one.
        device: Option<String>,
        /// The port's GID index (RoCE v2: usually 1 or 3).
        gid_index: u8,
    },
}

/// Default of [`DaemonConfig::datasets_open_max`].
pub const DATASETS_OPEN_MAX_DEFAULT: usize = 64;
/// Default of [`DaemonConfig::connections_max`].
pub const CONNECTIONS_MAX_DEFAULT: usize = 1024;

/// Whether `url` lies under `prefix`, compared by URL components: the same scheme, host and
/// port, and the prefix's path segments as the first whole segments of the URL's. So
/// `s3://bucket/data` admits `s3://bucket/data/x/m.json`, and neither `s3://bucket/database/..`
/// nor `s3://bucket-evil/data/..`. A URL with credentials, a query, a fragment, or an encoded
/// dot or slash in its path matches nothing.
pub fn url_under(url: &str, prefix: &str) -> bool {
    let (Ok(u), Ok(p)) = (url::Url::parse(url), url::Url::parse(prefix)) else {
        return false;
    };
    if u.scheme() != p.scheme()
        || u.host_str() != p.host_str()
        || u.port() != p.port()
        || !u.username().is_empty()
        || u.password().is_some()
        || u.query().is_some()
        || u.fragment().is_some()
    {
        return false;
    }
    let encoded = |s: &str| {
        let l = s.to_ascii_lowercase();
        l.contains("%2e") || l.contains("%2f") || l.contains("%5c")
    };
    if encoded(u.path()) {
        return false;
    }
    let segs = |x: &url::Url| -> Vec<String> {
        x.path()
            .split('/')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let (us, ps) = (segs(&u), segs(&p));
    ps.len() <= us.len() && us[..ps.len()] == ps[..]
}

fn env_ms(name: &str, default: u64) -> Duration {
    Duration::from_millis(std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default))
}

impl DaemonConfig {
    /// A standalone daemon (no peers) on `socket` with `cache`; timeouts and key from the
    /// environment.
    pub fn new(socket: impl Into<PathBuf>, cache: CacheConfig) -> DaemonConfig {
        DaemonConfig {
            socket: socket.into(),
            cache,
            listen: None,
            advertise: None,
            peers: Vec::new(),
            peers_file: None,
            http: None,
            api_key: ApiKey::from_env(),
            singleflight_timeout: env_ms("RAMJET_SINGLEFLIGHT_TIMEOUT_MS", 30_000),
            peer_timeout: env_ms("RAMJET_PEER_TIMEOUT_MS", 5_000),
            peer_backoff: Duration::from_secs(2),
            allow_prefixes: Vec::new(),
            insecure: false,
            datasets_open_max: DATASETS_OPEN_MAX_DEFAULT,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            manifest_revalidate_after: env_ms("RAMJET_MANIFEST_REVALIDATE_MS", 30_000),
            transfer_min_bytes_per_s: std::env::var("RAMJET_PEER_MIN_BYTES_PER_S")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(crate::peer::TRANSFER_MIN_BYTES_PER_S_DEFAULT),
            vnodes: VNODES_DEFAULT,
            range_bytes: 32 << 20,
            ranges_in_flight: 4,
            threads: 0,
            transport: TransportKind::Tcp,
        }
    }

    fn me(&self) -> String {
        self.advertise
            .clone()
            .or_else(|| self.listen.map(|a| a.to_string()))
            .unwrap_or_else(|| "local".into())
    }
}

/// Reads a member list: `host:port` entries (or hostlists with a `:port`), separated by
/// commas or lines; `#` starts a comment.
pub fn read_members(text: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let lines = text.lines().map(|l| l.split('#').next().unwrap_or(""));
    for line in lines.flat_map(|l| crate::hostlist::split_top(l).unwrap_or_else(|_| vec![l])) {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (hosts, port) = match line.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.contains('[') => (h, Some(p)),
            _ => (line, None),
        };
        for h in crate::hostlist::expand(hosts)? {
            out.push(match port {
                Some(p) => format!("{h}:{p}"),
                None => h,
            });
        }
    }
    Ok(out)
}

type FlightOut = Result<(Bytes, ReadSource), String>;
type Flight = Shared<BoxFuture<'static, FlightOut>>;

struct PeerState {
    health: PeerHealth,
    down_until: Option<Instant>,
}

struct Inner {
    cfg: DaemonConfig,
    me: String,
    cache: Cache,
    metrics: Arc<Metrics>,
    stats: Stats,
    membership: RwLock<Membership>,
    datasets: Mutex<HashMap<String, HeldDataset>>,
    /// Flights by shard and whether they ask a peer: a peer's request joins only flights that
    /// go to the origin, so two daemons whose rings disagree never wait on each other.
    flights: Mutex<HashMap<(ShardId, bool), Flight>>,
    /// One permit per connection served (`connections_max`).
    conns: Arc<tokio::sync::Semaphore>,
    peers: Mutex<HashMap<String, PeerState>>,
    transport: Box<dyn PeerTransport>,
    /// The device this owner writes shards from, when it runs the RDMA transport.
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<crate::rdma::RdmaDevice>>,
    started: Instant,
    stopping: AtomicBool,
    /// Set when the daemon stops: every task it started ends at its next await (they run on
    /// the process's shared runtime, which outlives the daemon).
    stop: tokio::sync::watch::Sender<bool>,
}

impl Inner {
    /// Resolves once the daemon is stopping.
    fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    /// Runs `f` on the runtime until it ends or the daemon stops.
    fn spawn(&self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        let stopped = self.stopped();
        tokio::spawn(async move {
            tokio::select! {
                _ = stopped => {}
                _ = f => {}
            }
        });
    }
}

/// A manifest the daemon holds open.
struct HeldDataset {
    ds: Arc<Dataset>,
    loaded: Instant,
    used: Instant,
}

/// A shard request after validation.
#[derive(Clone)]
struct Req {
    ds: Arc<Dataset>,
    shard: usize,
    id: ShardId,
}

impl Req {
    fn describe(&self) -> String {
        format!(
            "shard {} ({})",
            self.shard,
            self.ds.store().url(&self.ds.manifest().shards[self.shard].key)
        )
    }
}

/// What is sent back: the cache file, or the bytes (a shard the cache did not admit).
enum Body {
    File(File),
    Memory(Bytes),
}

/// A running daemon. Dropping it stops it.
pub struct Daemon {
    inner: Arc<Inner>,
    /// The process's shared runtime (the daemon's tasks end on stop; the runtime lives on).
    rt: tokio::runtime::Handle,
    peer_addr: Option<SocketAddr>,
    http_addr: Option<SocketAddr>,
}

impl Daemon {
    /// Opens the cache, binds the socket(s) and starts serving on the process's runtime
    /// (`cfg.threads` sizes it when the daemon is the first to use it).
    pub fn start(cfg: DaemonConfig) -> std::io::Result<Daemon> {
        if cfg.threads > 0 {
            ramjet_engine::rt::prefer_net_threads(cfg.threads);
        }
        if let Some(a) = cfg.listen {
            if !a.ip().is_loopback() && cfg.api_key.is_none() && !cfg.insecure {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "refusing to listen for peers on {a} without an API key: set RAMJET_API_KEY (or pass --insecure on a trusted network)"
                    ),
                ));
            }
        }
        let rt = ramjet_engine::rt::handle().map_err(std::io::Error::other)?;
        let metrics = Arc::new(Metrics::default());
        let cache =
            Cache::open(cfg.cache.clone(), cache_io::detect(), metrics.clone()).map_err(std::io::Error::other)?;
        let me = cfg.me();
        let mut members = cfg.peers.clone();
        if let Some(f) = &cfg.peers_file {
            let text = std::fs::read_to_string(f)?;
            members = read_members(&text).map_err(std::io::Error::other)?;
        }
        if members.is_empty() {
            members.push(me.clone());
        }
        if !members.contains(&me) {
            tracing::warn!(me = %me, ?members, "this daemon is not in the member list: it owns no shards");
        }
        let link = LinkConfig {
            api_key: cfg.api_key.clone(),
            peer_timeout: cfg.peer_timeout,
            reply_timeout: cfg.singleflight_timeout,
            transfer_min_bytes_per_s: cfg.transfer_min_bytes_per_s,
        };
        #[cfg(feature = "rdma")]
        let rdma = match &cfg.transport {
            TransportKind::Tcp => None,
            TransportKind::Rdma { device, gid_index } => {
                Some(crate::rdma::RdmaDevice::open(device.as_deref(), *gid_index).map_err(std::io::Error::other)?)
            }
        };
        let transport: Box<dyn PeerTransport> = match &cfg.transport {
            TransportKind::Tcp => Box::new(TcpTransport::new(link)),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma { .. } => Box::new(crate::rdma::RdmaTransport::new(
                link,
                rdma.clone().expect("opened above"),
            )),
            #[cfg(not(feature = "rdma"))]
            TransportKind::Rdma { .. } => {
                return Err(std::io::Error::other(
                    "RDMA transport requested, but this build has no RDMA (cargo feature `rdma`)",
                ))
            }
        };
        let inner = Arc::new(Inner {
            membership: RwLock::new(Membership::new(members, cfg.vnodes)),
            me,
            cache,
            metrics,
            stats: Stats::default(),
            datasets: Mutex::default(),
            flights: Mutex::default(),
            conns: Arc::new(tokio::sync::Semaphore::new(cfg.connections_max.max(1))),
            peers: Mutex::default(),
            transport,
            #[cfg(feature = "rdma")]
            rdma,
            started: Instant::now(),
            stopping: AtomicBool::new(false),
            stop: tokio::sync::watch::channel(false).0,
            cfg,
        });
        let _g = rt.enter();
        let local = bind_unix(&inner.cfg.socket)?;
        inner.spawn(serve_local(inner.clone(), local));
        let mut peer_addr = None;
        if let Some(a) = inner.cfg.listen {
            let l = std::net::TcpListener::bind(a)?;
            l.set_nonblocking(true)?;
            peer_addr = Some(l.local_addr()?);
            inner.spawn(serve_peers(inner.clone(), TcpListener::from_std(l)?));
        }
        let mut http_addr = None;
        if let Some(a) = inner.cfg.http {
            let l = std::net::TcpListener::bind(a)?;
            l.set_nonblocking(true)?;
            http_addr = Some(l.local_addr()?);
            inner.spawn(serve_http(inner.clone(), TcpListener::from_std(l)?));
        }
        if let Some(f) = inner.cfg.peers_file.clone() {
            inner.spawn(watch_members(inner.clone(), f));
        }
        tracing::info!(socket = %inner.cfg.socket.display(), peers = ?peer_addr, http = ?http_addr, node = %inner.me, "ramjet daemon serving");
        Ok(Daemon {
            inner,
            rt,
            peer_addr,
            http_addr,
        })
    }

    /// The bound peer address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// The bound HTTP address.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// The Unix socket path.
    pub fn socket(&self) -> &Path {
        &self.inner.cfg.socket
    }

    /// The `/stats` document.
    pub fn stats(&self) -> StatsDoc {
        self.inner.stats_doc()
    }

    /// Datasets (manifests) held open now (at most `datasets_open_max`).
    pub fn datasets_open(&self) -> usize {
        self.inner.datasets_open()
    }

    /// Holds the ring version.
    pub fn freeze(&self) {
        self.inner.membership.write().expect("membership lock").freeze();
    }

    /// Releases one freeze.
    pub fn unfreeze(&self) {
        self.inner.membership.write().expect("membership lock").unfreeze();
    }

    /// Proposes a member set (applied unless frozen).
    pub fn set_members(&self, members: Vec<String>) {
        self.inner.membership.write().expect("membership lock").propose(members);
    }

    /// Serves until SIGINT or SIGTERM.
    pub fn run_until_signal(self) {
        self.rt.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        });
        tracing::info!("ramjet daemon stopping");
        // Drop stops the tasks and removes the socket.
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::Relaxed);
        let _ = std::fs::remove_file(&self.inner.cfg.socket);
        self.inner.stop.send_replace(true);
    }
}

fn bind_unix(path: &Path) -> std::io::Result<UnixListener> {
    if path.exists() {
        // A live daemon answers; a dead one left its socket file behind.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("a daemon already serves {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    if let Some(d) = path.parent() {
        if path == crate::client::default_socket() && std::env::var_os("RAMJET_SOCKET").is_none() {
            crate::client::ensure_private_dir(d)?;
        } else {
            std::fs::create_dir_all(d)?;
        }
    }
    let l = UnixListener::bind(path)?;
    // Loaders of the same user only: the socket hands out descriptors of cache files.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

impl Inner {
    /// A connection permit, or `None` (counted, logged) when `connections_max` are served.
    fn conn_permit(&self, kind: &str) -> Option<tokio::sync::OwnedSemaphorePermit> {
        match self.conns.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                self.stats.requests_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    kind,
                    limit = self.cfg.connections_max,
                    "connection refused: connections_max reached"
                );
                None
            }
        }
    }

    fn stats_doc(&self) -> StatsDoc {
        let m = self.membership.read().expect("membership lock");
        let mut d = StatsDoc {
            node: self.me.clone(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            ring_version: m.ring().version(),
            members: m.ring().members().to_vec(),
            frozen: m.frozen(),
            pending_members: m.pending().map(|p| p.to_vec()),
            cache_limit_bytes: self.cfg.cache.limit_bytes,
            ..Default::default()
        };
        drop(m);
        d.fill(&self.stats);
        let s = self.metrics.snapshot();
        d.origin_requests = s.origin_requests;
        d.origin_bytes = s.origin_bytes;
        if let Ok(rd) = std::fs::read_dir(self.cfg.cache.dir.join("shards")) {
            for e in rd.flatten() {
                d.cache_shards += 1;
                d.cache_bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        let peers = self.peers.lock().expect("peers lock");
        for member in &d.members {
            if *member != self.me {
                let h = peers.get(member).map(|p| p.health.clone()).unwrap_or(PeerHealth {
                    healthy: true,
                    ..Default::default()
                });
                d.peers.insert(member.clone(), h);
            }
        }
        d
    }

    /// Validates a request: a well-formed URL under an allowed prefix, a manifest that opens,
    /// a shard in it whose identity matches.
    async fn resolve(&self, manifest_url: &str, shard: u32, checksum: u64, bytes: u64) -> Result<Req, String> {
        let bad = |why: &str| Err(format!("refused {manifest_url:?} shard {shard}: {why}"));
        if manifest_url.len() > URL_MAX || manifest_url.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return bad("malformed URL");
        }
        let Some((scheme, path)) = manifest_url.split_once("://") else {
            return bad("not a URL");
        };
        if !["s3", "gs", "az", "azure", "abfs", "file", "http", "https"].contains(&scheme) {
            return bad("unsupported scheme");
        }
        if path.split('/').any(|seg| seg == ".." || seg == ".") || !manifest_url.ends_with(".json") {
            return bad("not a manifest path (path traversal or not .json)");
        }
        if !self.cfg.allow_prefixes.is_empty() && !self.cfg.allow_prefixes.iter().any(|p| url_under(manifest_url, p)) {
            return bad("outside the allowed prefixes");
        }
        let (mut ds, fresh) = self.dataset(manifest_url, false).await?;
        let matches = |ds: &Dataset| {
            ds.manifest()
                .shards
                .get(shard as usize)
                .is_some_and(|i| i.bytes == bytes && i.checksum_u64() == Some(checksum))
        };
        if !fresh && !matches(&ds) {
            // The requester may hold a newer manifest (re-packed under the same URL).
            ds = self.dataset(manifest_url, true).await?.0;
        }
        let Some(info) = ds.manifest().shards.get(shard as usize) else {
            return bad("no such shard in the manifest");
        };
        let id = ShardId {
            checksum: info.checksum_u64().ok_or("manifest checksum unreadable")?,
            bytes: info.bytes,
        };
        if id.checksum != checksum || id.bytes != bytes || bytes > SHARD_MAX {
            return bad("checksum or size does not match the manifest");
        }
        Ok(Req {
            ds,
            shard: shard as usize,
            id,
        })
    }

    /// The dataset of `url`: the one held, unless it is older than `manifest_revalidate_after`
    /// or `reload` asks (and it is at least a second old); else loaded now. Also whether it
    /// was loaded by this call.
    async fn dataset(&self, url: &str, reload: bool) -> Result<(Arc<Dataset>, bool), String> {
        let now = Instant::now();
        {
            let mut held = self.datasets.lock().expect("datasets lock");
            if let Some(h) = held.get_mut(url) {
                let age = now.duration_since(h.loaded);
                let stale = age >= self.cfg.manifest_revalidate_after || (reload && age >= Duration::from_secs(1));
                if !stale {
                    h.used = now;
                    return Ok((h.ds.clone(), false));
                }
            }
        }
        let d = tokio::time::timeout(Duration::from_secs(60), Dataset::open(url))
            .await
            .map_err(|_| format!("refused {url:?}: manifest did not load in 60 s"))?
            .map_err(|e| format!("refused {url:?}: {e}"))?;
        let d = Arc::new(d);
        let mut held = self.datasets.lock().expect("datasets lock");
        if !held.contains_key(url) && held.len() >= self.cfg.datasets_open_max.max(1) {
            // Requests in flight keep their own reference to an evicted dataset.
            if let Some(lru) = held.iter().min_by_key(|(_, h)| h.used).map(|(k, _)| k.clone()) {
                held.remove(&lru);
            }
        }
        held.insert(
            url.to_owned(),
            HeldDataset {
                ds: d.clone(),
                loaded: now,
                used: now,
            },
        );
        Ok((d, true))
    }

    /// Datasets held open now.
    fn datasets_open(&self) -> usize {
        self.datasets.lock().expect("datasets lock").len()
    }

    /// A shard for a local loader or a peer: the cache, else the flight for it.
    async fn serve(self: &Arc<Self>, req: &Req, from_peer: bool) -> Result<(Body, ReadSource, u64), String> {
        let (c, id) = (self.cache.clone(), req.id);
        let hit = tokio::task::spawn_blocking(move || c.open_file(id))
            .await
            .expect("cache task")
            .map_err(|e| e.to_string())?;
        if let Some(f) = hit {
            return Ok((Body::File(f), ReadSource::CacheLocal, id.bytes));
        }
        let (bytes, src) = self.obtain(req, !from_peer).await?;
        let c = self.cache.clone();
        let f = tokio::task::spawn_blocking(move || c.open_file(id))
            .await
            .expect("cache task");
        let body = match f {
            Ok(Some(f)) => Body::File(f),
            _ => Body::Memory(bytes),
        };
        Ok((body, src, id.bytes))
    }

    /// Joins the flight for the shard, or starts it.
    async fn obtain(self: &Arc<Self>, req: &Req, allow_peer: bool) -> FlightOut {
        // Whether a flight started here would ask a peer: only for a local request, when the
        // owner is another daemon that is not backing off. A peer's request joins only flights
        // that go to the origin, so a request never returns to a daemon it came from.
        let asks_peer = allow_peer && {
            let owner = self
                .membership
                .read()
                .expect("membership lock")
                .ring()
                .owner(req.id)
                .map(str::to_owned);
            owner.is_some_and(|o| o != self.me && self.peer_usable(&o))
        };
        let (flight, joined) = {
            let mut flights = self.flights.lock().expect("flights lock");
            let existing =
                flights
                    .get(&(req.id, false))
                    .or_else(|| if allow_peer { flights.get(&(req.id, true)) } else { None });
            match existing {
                Some(f) => (f.clone(), true),
                None => {
                    let key = (req.id, asks_peer);
                    let (me, r) = (self.clone(), req.clone());
                    // The flight runs as its own task: it completes (and fills the cache) even if
                    // the request that started it goes away.
                    let stopped = me.stopped();
                    let task = tokio::spawn(async move {
                        let out = tokio::select! {
                            out = me.fetch_and_store(&r, asks_peer) => out,
                            _ = stopped => Err("the daemon is stopping".to_string()),
                        };
                        me.flights.lock().expect("flights lock").remove(&key);
                        out
                    });
                    let f = async move { task.await.unwrap_or_else(|e| Err(format!("fetch task failed: {e}"))) }
                        .boxed()
                        .shared();
                    flights.insert(key, f.clone());
                    (f, false)
                }
            }
        };
        if joined {
            self.stats.coalesced.fetch_add(1, Ordering::Relaxed);
        }
        // The request that started the flight waits no longer than those that joined it: the
        // flight goes on (and fills the cache), and this request reads the origin itself.
        match tokio::time::timeout(self.cfg.singleflight_timeout, flight).await {
            Ok(r) => r,
            Err(_) => {
                self.stats.singleflight_timeouts.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(shard = %req.describe(), "gave up waiting on the fetch in flight; reading the origin");
                self.origin(req).await.map(|b| (b, ReadSource::Origin))
            }
        }
    }

    async fn origin(&self, req: &Req) -> Result<Bytes, String> {
        req.ds
            .fetch_shard_parallel(
                req.shard,
                self.cfg.range_bytes,
                self.cfg.ranges_in_flight,
                &self.metrics,
            )
            .await
            .map_err(|e| e.to_string())
    }

    /// The flight: the owner peer (for local requests), else the origin; verified; cached.
    async fn fetch_and_store(self: &Arc<Self>, req: &Req, allow_peer: bool) -> FlightOut {
        // A flight that finished between this request's cache lookup and its start has left
        // the shard in the cache: read it there rather than fetch it again.
        let (c, id) = (self.cache.clone(), req.id);
        if let Ok(Some(b)) = tokio::task::spawn_blocking(move || c.get(id))
            .await
            .expect("cache task")
        {
            return Ok((b, ReadSource::CacheLocal));
        }
        let owner = {
            let m = self.membership.read().expect("membership lock");
            m.ring().owner(req.id).map(str::to_owned)
        };
        let mut got = None;
        if let Some(owner) = owner
            .clone()
            .filter(|o| allow_peer && *o != self.me && self.peer_usable(o))
        {
            match self.fetch_from_peer(&owner, req).await {
                Ok(b) => {
                    let (ds, shard, b2) = (req.ds.clone(), req.shard, b.clone());
                    let check = tokio::task::spawn_blocking(move || ds.check_shard(shard, &b2))
                        .await
                        .expect("check task");
                    match check {
                        Ok(()) => {
                            self.peer_ok(&owner);
                            got = Some((b, ReadSource::CachePeer));
                        }
                        Err(e) => {
                            self.stats.peer_corrupt.fetch_add(1, Ordering::Relaxed);
                            self.peer_failed(&owner, format!("sent a corrupt {}: {e}", req.describe()));
                        }
                    }
                }
                Err(e) => self.peer_failed(&owner, e),
            }
        }
        let (bytes, src) = match got {
            Some(g) => g,
            None => (self.origin(req).await?, ReadSource::Origin),
        };
        // Each node caches the shards it owns, so the cluster's caches add up instead of
        // all holding the same hot set; the others are served from memory.
        if owner.as_deref().is_some_and(|o| o != self.me) {
            return Ok((bytes, src));
        }
        let (c, id, b) = (self.cache.clone(), req.id, bytes.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(e) = c.insert(id, &b) {
                tracing::warn!(error = %e, "cache insert failed; serving from memory");
            }
        })
        .await
        .expect("insert task");
        Ok((bytes, src))
    }

    fn peer_usable(&self, peer: &str) -> bool {
        let peers = self.peers.lock().expect("peers lock");
        peers
            .get(peer)
            .and_then(|p| p.down_until)
            .is_none_or(|t| Instant::now() >= t)
    }

    fn peer_ok(&self, peer: &str) {
        let mut peers = self.peers.lock().expect("peers lock");
        let p = peer_entry(&mut peers, peer);
        p.health.healthy = true;
        p.health.fetched += 1;
        p.down_until = None;
    }

    fn peer_failed(&self, peer: &str, why: String) {
        tracing::warn!(peer, error = %why, "peer fetch failed; reading the origin");
        let mut peers = self.peers.lock().expect("peers lock");
        let p = peer_entry(&mut peers, peer);
        p.health.healthy = false;
        p.health.failures += 1;
        p.health.last_error = Some(why);
        p.down_until = Some(Instant::now() + self.cfg.peer_backoff);
        drop(peers);
        self.transport.forget(peer);
    }

    async fn fetch_from_peer(&self, peer: &str, req: &Req) -> Result<Bytes, String> {
        let get = ShardGet {
            manifest_url: req.ds.manifest_url().to_owned(),
            shard: req.shard as u32,
            checksum: req.id.checksum,
            bytes: req.id.bytes,
            what: req.describe(),
        };
        self.transport.fetch(peer, &get).await
    }
}

fn new_peer() -> PeerState {
    PeerState {
        health: PeerHealth {
            healthy: true,
            ..Default::default()
        },
        down_until: None,
    }
}

fn peer_entry<'a>(peers: &'a mut HashMap<String, PeerState>, peer: &str) -> &'a mut PeerState {
    peers.entry(peer.to_owned()).or_insert_with(new_peer)
}

async fn serve_local(inner: Arc<Inner>, l: UnixListener) {
    let me = sys::my_uid();
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                // The socket is mode 0600, and this checks it again: only this user (or root)
                // may ask for descriptors of cache files.
                match sys::peer_uid(s.as_raw_fd()) {
                    Ok(uid) if uid == me || uid == 0 => {}
                    other => {
                        inner.stats.requests_refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(peer_uid = ?other.ok(), "local connection from another user refused");
                        continue;
                    }
                }
                let Some(permit) = inner.conn_permit("local") else {
                    continue;
                };
                let inner2 = inner.clone();
                inner.spawn(async move {
                    let inner = inner2;
                    let _permit = permit;
                    if let Err(e) = local_conn(&inner, s).await {
                        if e.kind() != std::io::ErrorKind::UnexpectedEof {
                            tracing::debug!(error = %e, "local connection ended");
                        }
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on the local socket failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn local_conn(inner: &Arc<Inner>, mut s: UnixStream) -> std::io::Result<()> {
    loop {
        let msg = wire::read_msg(&mut s).await?;
        match msg {
            Msg::Get {
                manifest_url,
                shard,
                checksum,
                bytes,
            } => {
                let t = Instant::now();
                let r = match inner.resolve(&manifest_url, shard, checksum, bytes).await {
                    Ok(req) => inner.serve(&req, false).await,
                    Err(e) => {
                        inner.stats.requests_refused.fetch_add(1, Ordering::Relaxed);
                        Err(e)
                    }
                };
                match r {
                    Ok((body, src, n)) => {
                        let file = match body {
                            Body::File(f) => f,
                            Body::Memory(b) => sys::memfd_with("ramjet-shard", &b)?,
                        };
                        let frame = wire::encode(&Msg::Data {
                            bytes: n,
                            source: src.name().into(),
                        });
                        send_frame_with_fd(&s, &frame, &file).await?;
                        inner.stats.record(src, n, t.elapsed());
                    }
                    Err(message) => {
                        inner.stats.failures.fetch_add(1, Ordering::Relaxed);
                        wire::write_msg(&mut s, &Msg::Fail { message }).await?;
                    }
                }
            }
            Msg::Corrupt { checksum, bytes } => {
                inner.stats.local_corrupt.fetch_add(1, Ordering::Relaxed);
                inner.cache.remove(ShardId { checksum, bytes });
                wire::write_msg(&mut s, &Msg::Ok).await?;
            }
            Msg::Freeze => {
                inner.membership.write().expect("membership lock").freeze();
                wire::write_msg(&mut s, &Msg::Ok).await?;
            }
            Msg::Unfreeze => {
                inner.membership.write().expect("membership lock").unfreeze();
                wire::write_msg(&mut s, &Msg::Ok).await?;
            }
            m => {
                let message = format!("unexpected message {m:?}");
                wire::write_msg(&mut s, &Msg::Fail { message }).await?;
                return Ok(());
            }
        }
    }
}

/// Writes a frame with a descriptor attached to its first byte.
async fn send_frame_with_fd(s: &UnixStream, frame: &[u8], file: &File) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < frame.len() {
        s.writable().await?;
        let r = s.try_io(Interest::WRITABLE, || {
            if sent == 0 {
                sys::send_with_fd(s.as_raw_fd(), frame, file.as_raw_fd())
            } else {
                s.try_write(&frame[sent..])
            }
        });
        match r {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn serve_peers(inner: Arc<Inner>, l: TcpListener) {
    loop {
        match l.accept().await {
            Ok((s, from)) => {
                let Some(permit) = inner.conn_permit("peer") else {
                    continue;
                };
                let inner2 = inner.clone();
                inner.spawn(async move {
                    let inner = inner2;
                    let _permit = permit;
                    if let Err(e) = peer_conn(&inner, s, from).await {
                        tracing::debug!(%from, error = %e, "peer connection ended");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept on the peer port failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn peer_conn(inner: &Arc<Inner>, mut s: TcpStream, from: SocketAddr) -> std::io::Result<()> {
    let _ = s.set_nodelay(true);
    let hs = tokio::time::timeout(
        Duration::from_secs(10),
        wire::accept(&mut s, inner.cfg.api_key.as_ref()),
    )
    .await;
    let session = match hs {
        Ok(Ok(session)) => session,
        Ok(Err(HandshakeError::Refused(why))) => {
            inner.stats.auth_refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, reason = %why, "peer refused");
            return Ok(());
        }
        Ok(Err(HandshakeError::Io(e))) => {
            inner.stats.auth_refused.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        Err(_) => {
            inner.stats.auth_refused.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
    };
    // Every frame from here on is bound to this session.
    let mut s = wire::Channel { stream: s, session };
    let mut rdma = ServerRdma::default();
    loop {
        let msg = match tokio::time::timeout(Duration::from_secs(600), s.recv()).await {
            Ok(m) => m?,
            Err(_) => return Ok(()),
        };
        let (manifest_url, shard, checksum, bytes, target) = match msg {
            Msg::Get {
                manifest_url,
                shard,
                checksum,
                bytes,
            } => (manifest_url, shard, checksum, bytes, None),
            Msg::GetRdma {
                manifest_url,
                shard,
                checksum,
                bytes,
                addr,
                rkey,
            } => (manifest_url, shard, checksum, bytes, Some((addr, rkey))),
            Msg::RdmaConnect(remote) => {
                let reply = rdma_accept(inner, remote, &mut rdma).await;
                s.send(&reply).await?;
                continue;
            }
            msg => {
                let message = format!("unexpected message {msg:?}");
                s.send(&Msg::Fail { message }).await?;
                return Ok(());
            }
        };
        let r = match inner.resolve(&manifest_url, shard, checksum, bytes).await {
            Ok(req) => inner.serve(&req, true).await,
            Err(e) => {
                inner.stats.requests_refused.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        };
        let r = match (r, target) {
            // RDMA: the bytes go first, then the `data` frame tells the requester they landed.
            (Ok((body, src, n)), Some((addr, rkey))) => {
                rdma_write(&rdma, body, n, addr, rkey).await.map(|()| (None, src, n))
            }
            (Ok((body, src, n)), None) => Ok((Some(body), src, n)),
            (Err(e), _) => Err(e),
        };
        match r {
            Ok((body, src, n)) => {
                s.send(&Msg::Data {
                    bytes: n,
                    source: src.name().into(),
                })
                .await?;
                match body {
                    Some(Body::File(f)) => send_file(&s.stream, &f, n).await?,
                    Some(Body::Memory(b)) => s.stream.write_all(&b).await?,
                    None => {}
                }
                inner.stats.peer_served.fetch_add(1, Ordering::Relaxed);
                inner.stats.peer_served_bytes.fetch_add(n, Ordering::Relaxed);
            }
            Err(message) => {
                inner.stats.failures.fetch_add(1, Ordering::Relaxed);
                s.send(&Msg::Fail { message }).await?;
            }
        }
    }
}

/// The owner's RDMA link on one peer connection, once the requester asked for one.
#[cfg(feature = "rdma")]
type ServerRdma = Option<crate::rdma::ServerLink>;
/// Without the `rdma` feature there is never a link.
#[cfg(not(feature = "rdma"))]
#[derive(Default)]
struct ServerRdma {
    _none: (),
}

/// Answers `rdma_connect`: this side's queue pair, or `fail` when this daemon has no RDMA.
#[cfg(feature = "rdma")]
async fn rdma_accept(inner: &Inner, remote: wire::QpInfo, link: &mut ServerRdma) -> Msg {
    let Some(dev) = &inner.rdma else {
        return Msg::Fail {
            message: format!("{} does not run the RDMA transport", inner.me),
        };
    };
    match crate::rdma::ServerLink::accept(dev, remote, inner.cfg.peer_timeout).await {
        Ok((l, info)) => {
            *link = Some(l);
            Msg::RdmaConnect(info)
        }
        Err(message) => Msg::Fail { message },
    }
}

#[cfg(not(feature = "rdma"))]
async fn rdma_accept(inner: &Inner, _remote: wire::QpInfo, _link: &mut ServerRdma) -> Msg {
    Msg::Fail {
        message: format!("{} was built without RDMA (cargo feature `rdma`)", inner.me),
    }
}

/// Writes a shard into the requester's region.
#[cfg(feature = "rdma")]
async fn rdma_write(link: &ServerRdma, body: Body, n: u64, addr: u64, rkey: u32) -> Result<(), String> {
    let Some(link) = link else {
        return Err("get_rdma before rdma_connect".into());
    };
    let data = match body {
        Body::File(f) => sys::read_private(&f, n).map_err(|e| format!("read the cached shard: {e}"))?,
        Body::Memory(b) => b,
    };
    link.write(data, addr, rkey).await
}

#[cfg(not(feature = "rdma"))]
async fn rdma_write(_link: &ServerRdma, _body: Body, _n: u64, _addr: u64, _rkey: u32) -> Result<(), String> {
    Err("this daemon was built without RDMA (cargo feature `rdma`)".into())
}

/// Sends a file with `sendfile`: the bytes go from the page cache to the socket without
/// passing through this process.
async fn send_file(s: &TcpStream, f: &File, len: u64) -> std::io::Result<()> {
    let mut off: i64 = 0;
    while (off as u64) < len {
        s.writable().await?;
        let left = (len - off as u64).min(1 << 30) as usize;
        match s.try_io(Interest::WRITABLE, || {
            sys::sendfile_once(s.as_raw_fd(), f, &mut off, left)
        }) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "file ended early",
                ))
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn watch_members(inner: Arc<Inner>, path: PathBuf) {
    let mut last = String::new();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Ok(text) = tokio::fs::read_to_string(&path).await else {
            continue;
        };
        if text == last {
            continue;
        }
        match read_members(&text) {
            Ok(m) if !m.is_empty() => {
                let changed = inner.membership.write().expect("membership lock").propose(m);
                if changed {
                    tracing::info!(file = %path.display(), "ring membership changed");
                }
                last = text;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(file = %path.display(), error = %e, "member file not applied"),
        }
    }
}

/// Serves `/stats`, `/metrics` and `/health` with hyper (HTTP/1.1). Read-only: the ring is
/// frozen and unfrozen over the Unix socket, which only this user can reach.
async fn serve_http(inner: Arc<Inner>, l: TcpListener) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    loop {
        let Ok((s, _)) = l.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Some(permit) = inner.conn_permit("http") else {
            continue;
        };
        let inner2 = inner.clone();
        inner.spawn(async move {
            let inner = inner2;
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req| {
                let r = http_route(&inner, &req);
                async move { Ok::<_, std::convert::Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .max_buf_size(16 << 10)
                .serve_connection(TokioIo::new(s), svc);
            // A client that holds a connection open is cut off after a minute.
            let _ = tokio::time::timeout(Duration::from_secs(60), conn).await;
        });
    }
}

fn http_route<B>(inner: &Inner, req: &hyper::Request<B>) -> hyper::Response<http_body_util::Full<Bytes>> {
    use hyper::{Method, StatusCode};
    let (status, ctype, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/stats") => (
            StatusCode::OK,
            "application/json",
            serde_json::to_string_pretty(&inner.stats_doc()).expect("json"),
        ),
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "text/plain; version=0.0.4",
            inner.stats_doc().prometheus(),
        ),
        (&Method::GET, "/health") => (StatusCode::OK, "text/plain", "ok\n".into()),
        (_, "/freeze" | "/unfreeze") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "the ring is frozen over the daemon's Unix socket (ramjet.init / DaemonClient::freeze), not over HTTP\n"
                .into(),
        ),
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    };
    hyper::Response::builder()
        .status(status)
        .header("content-type", ctype)
        .body(http_body_util::Full::new(Bytes::from(body)))
        .expect("valid response")
}

#[cfg(test)]
mod tests {
    use super::{read_members, url_under};

    /// Regression: `--allow s3://bucket/data` was a bare string prefix, and admitted
    /// `s3://bucket/database/..` and `s3://bucket/data-other/..`.
    #[test]
    fn allow_prefixes_match_url_components_not_string_prefixes() {
        let p = "s3://bucket/data";
        assert!(url_under("s3://bucket/data/x/manifest.json", p));
        assert!(url_under("s3://bucket/data/manifest.json", "s3://bucket/data/"));
        for bad in [
            "s3://bucket/database/manifest.json",
            "s3://bucket/data-other/manifest.json",
            "s3://bucket-evil/data/manifest.json",
            "gs://bucket/data/manifest.json",
            "s3://user:pw@bucket/data/manifest.json",
            "s3://bucket/data/%2e%2e/secret/manifest.json",
            "s3://bucket/data/x/manifest.json?y=1",
            "not a url",
        ] {
            assert!(!url_under(bad, p), "{bad} admitted under {p}");
        }
        assert!(url_under("http://h:9000/b/d/m.json", "http://h:9000/b"));
        assert!(!url_under("http://h:9001/b/d/m.json", "http://h:9000/b"));
    }

    #[test]
    fn member_files_take_hostlists_and_comments() {
        let m = read_members("# ring\nnode[01-02]:7341\n10.0.0.9:7000  # spare\n\n").unwrap();
        assert_eq!(m, ["node01:7341", "node02:7341", "10.0.0.9:7000"]);
        let m = read_members("n[1-2,4]:9,127.0.0.2:7341").unwrap();
        assert_eq!(m, ["n1:9", "n2:9", "n4:9", "127.0.0.2:7341"]);
        assert!(read_members("n[1-:7341").is_err());
    }
}
