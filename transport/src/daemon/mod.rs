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
//!
//! Split by concept: `config` (settings, member lists, URL prefixes), `validate` (a request
//! checked against the allowed prefixes and its manifest), `fetch` (the shard chain: cache,
//! owner peer, origin, with one flight per shard), `local` (loaders on the Unix socket, fd
//! passing), `peers` (peer connections over TCP or RDMA), `http` (the dashboard, `/cluster`,
//! `/stats`, `/metrics`, `/health`, `/ready`), `cluster` (the dashboard's view: rates, summaries,
//! the ring's gathered), `jobs` (consumers' heartbeats), `budget` (connection budgets by class
//! and source address); this file holds the running daemon and its shared state.

mod budget;
mod cluster;
mod config;
mod directory;
mod fetch;
mod http;
mod jobs;
mod local;
mod pace;
mod peers;
mod ready;
mod validate;

use budget::{Budget, Class, Permit};
pub use cluster::{RATES_EVERY, SUMMARY_TIMEOUT};
pub use config::{
    read_members, url_under, DaemonConfig, TransportKind, CONNECTIONS_MAX_DEFAULT, DATASETS_OPEN_MAX_DEFAULT,
    HANDSHAKES_MAX_DEFAULT, PER_ADDRESS_MAX_DEFAULT,
};
use http::serve_http;
pub use jobs::{JOBS_MAX, JOB_SILENT_DROP};
use local::serve_local;
use peers::serve_peers;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ramjet_engine::cache::{Cache, ShardId};
use ramjet_engine::metrics::Metrics;
use ramjet_engine::singleflight::Flights;
use ramjet_engine::{Dataset, FetchedFrom};
use tokio::net::{TcpListener, UnixListener};

use crate::error::Error;
use crate::peer::{LinkConfig, PeerTransport, TcpTransport};
use crate::ring::Membership;
use crate::stats::ReadyDoc;
use crate::stats::{PeerHealth, Stats, StatsDoc};

type FlightOut = Result<(Bytes, FetchedFrom), Error>;

struct PeerState {
    health: PeerHealth,
    down_until: Option<Instant>,
}

/// A dataset's opening, shared by every request for it while it runs: the engine's error
/// whole (behind an `Arc`, as every waiter gets it).
type Opened = std::result::Result<Arc<Dataset>, Arc<ramjet_engine::Error>>;

struct Inner {
    cfg: DaemonConfig,
    me: String,
    cache: Cache,
    metrics: Arc<Metrics>,
    stats: Stats,
    membership: RwLock<Membership>,
    datasets: Mutex<HashMap<String, HeldDataset>>,
    /// Datasets being opened, by URL: one open at a time for all the requests naming one. An
    /// open runs as a task of its own, so one that outlasts a request's wait (a foreign
    /// source being learned, `ramjet_engine::foreign::open_learned`) goes on, and later
    /// requests join it instead of starting another.
    opening: Arc<Flights<String, Opened>>,
    /// Flights by shard and whether they ask a peer: a peer's request joins only flights that
    /// go to the origin, so two daemons whose rings disagree never wait on each other.
    flights: Arc<Flights<(ShardId, bool), FlightOut>>,
    /// Connection budgets by class: local, authenticated peers, peer handshakes, HTTP.
    budgets: [Budget; 4],
    peers: Mutex<HashMap<String, PeerState>>,
    transport: Box<dyn PeerTransport>,
    /// Peer link settings, for the readiness probe's handshakes.
    link: LinkConfig,
    /// `/ready`'s last probe of the members (`ready`).
    readiness: ready::Readiness,
    /// The device this owner writes shards from, when it runs the RDMA transport.
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<crate::rdma::RdmaDevice>>,
    started: Instant,
    /// Read rates of the last minutes, and the last gathered cluster view (the dashboard).
    history: cluster::History,
    /// This host's consumers, from their heartbeats.
    jobs: jobs::Jobs,
    /// Other nodes' daemons by job and node, as the cluster view names them (split shards'
    /// readers).
    directory: directory::Directory,
    /// Sealed in-memory copies of cached shards that several local consumers map
    /// (`local::shared_copy`).
    shared: std::sync::Mutex<local::SharedShards>,
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
    /// The daemon a flight for this request asks instead of the shard's ring owner: the
    /// daemon of the node that reads this split shard from the origin (its reader), which
    /// keeps it for its own node.
    via: Option<String>,
}

impl Req {
    fn describe(&self) -> String {
        match self.ds.manifest().shard(self.shard) {
            Ok(info) => format!("shard {} ({})", self.shard, self.ds.store().url(&info.key)),
            Err(_) => format!("shard {} of {}", self.shard, self.ds.manifest_url()),
        }
    }
}

/// What is sent back: the cache file, or the bytes (a shard the cache did not admit).
enum Body {
    /// The cached copy, pinned against eviction until it is sent.
    File(ramjet_engine::cache::CachedShard),
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

/// The most bytes a members file may hold (a 10,000-member ring is a few hundred KB).
const MEMBERS_FILE_BYTES_MAX: u64 = 16 << 20;

/// The text of the members file `f`: a regular file of at most [`MEMBERS_FILE_BYTES_MAX`].
fn members_text(f: &Path) -> std::io::Result<String> {
    let b = ramjet_engine::io::read_file_bounded(f, MEMBERS_FILE_BYTES_MAX).map_err(std::io::Error::other)?;
    String::from_utf8(b)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", f.display())))
}

/// The ring's members at start: `--peers-file` when given (it is watched afterwards), else
/// `--peers`, else this daemon alone.
fn first_members(cfg: &DaemonConfig, me: &String) -> std::io::Result<Vec<String>> {
    let mut members = cfg.peers.clone();
    if let Some(f) = &cfg.peers_file {
        members = read_members(&members_text(f)?).map_err(std::io::Error::other)?;
    }
    if members.is_empty() {
        members.push(me.clone());
    }
    if !members.contains(me) {
        tracing::warn!(me = %me, ?members, "this daemon is not in the member list: it owns no shards");
    }
    Ok(members)
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
        // A key that guards a port others can reach (peers, or the HTTP credential) must be
        // one nobody guesses.
        for (what, a) in [("peers", cfg.listen), ("HTTP", cfg.http)] {
            let Some(a) = a.filter(|a| !a.ip().is_loopback()) else {
                continue;
            };
            if cfg.api_key.as_ref().is_some_and(|k| !k.strong()) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "refusing to serve {what} on {a} with a weak RAMJET_API_KEY: it must hold at least {} bytes that are not blanks (for example `openssl rand -hex 32`)",
                        crate::wire::API_KEY_BYTES_MIN
                    ),
                ));
            }
        }
        let rt = ramjet_engine::rt::handle().map_err(std::io::Error::other)?;
        let metrics = Arc::new(Metrics::default());
        let cache = Cache::open(
            cfg.cache.clone(),
            ramjet_engine::io::detect().map_err(std::io::Error::other)?,
            metrics.clone(),
        )
        .map_err(std::io::Error::other)?;
        let me = cfg.me();
        let members = first_members(&cfg, &me)?;
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
            TransportKind::Tcp => Box::new(TcpTransport::new(link.clone())),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma { .. } => Box::new(crate::rdma::RdmaTransport::new(
                link.clone(),
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
            opening: Arc::default(),
            flights: Arc::default(),
            budgets: [
                Budget::new(Class::Local, cfg.connections_max, usize::MAX),
                Budget::new(Class::Peer, cfg.connections_max, usize::MAX),
                Budget::new(Class::Handshake, cfg.handshakes_max, cfg.per_address_max),
                Budget::new(Class::Http, cfg.connections_max, cfg.per_address_max),
            ],
            peers: Mutex::default(),
            transport,
            link,
            readiness: Default::default(),
            #[cfg(feature = "rdma")]
            rdma,
            started: Instant::now(),
            history: Default::default(),
            directory: Default::default(),
            jobs: Default::default(),
            shared: std::sync::Mutex::new(local::SharedShards::new(cfg.shared_shard_bytes)),
            stop: tokio::sync::watch::channel(false).0,
            cfg,
        });
        let _g = rt.enter();
        let local = bind_unix(&inner.cfg.socket)?;
        inner.spawn(serve_local(inner.clone(), local));
        let mut peer_addr = None;
        if let Some(a) = inner.cfg.listen {
            let (l, at) = bind_tcp(a)?;
            peer_addr = Some(at);
            inner.spawn(serve_peers(inner.clone(), l));
        }
        let mut http_addr = None;
        if let Some(a) = inner.cfg.http {
            let (l, at) = bind_tcp(a)?;
            http_addr = Some(at);
            inner.spawn(serve_http(inner.clone(), l));
        }
        inner.spawn(cluster::sample_rates(inner.clone()));
        inner.spawn(pace::gather_paces(inner.clone()));
        inner.spawn(ready::probe_members(inner.clone()));
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
        let _ = std::fs::remove_file(&self.inner.cfg.socket);
        self.inner.stop.send_replace(true);
    }
}

/// A listener on `a` for the runtime, and the address it bound (port 0 picks one).
fn bind_tcp(a: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let l = std::net::TcpListener::bind(a)?;
    l.set_nonblocking(true)?;
    let at = l.local_addr()?;
    Ok((TcpListener::from_std(l)?, at))
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
    /// A place in `class`'s budget for a connection from `addr` (`None` on the Unix socket),
    /// or `None` (counted by class, logged at most once a second per class) when the class,
    /// or this address's share of it, is full.
    fn conn_permit(&self, class: Class, addr: Option<std::net::IpAddr>) -> Option<Permit> {
        let b = &self.budgets[class as usize];
        debug_assert_eq!(b.class(), class);
        match b.try_take(addr) {
            Ok(p) => Some(p),
            Err(why) => {
                self.stats.connections_refused[class as usize].fetch_add(1, Ordering::Relaxed);
                if self.stats.refusal_log_due(class as usize) {
                    tracing::warn!(
                        class = class.name(),
                        from = ?addr,
                        limit = b.max(),
                        per_address = b.per_addr(),
                        reason = ?why,
                        "connection refused: its class (or this address's share) is full"
                    );
                }
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
        d.tuner.origins = ramjet_engine::tune::origins().into_iter().collect();
        d.tuner.decode_threads = self.cfg.decode_threads as u64;
        d.tuner.host_memory_bytes = self.cfg.host_memory_bytes;
        d.tuner.grants = self
            .jobs
            .grants(self.cfg.decode_threads as u64, self.cfg.host_memory_bytes);
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
}

impl Inner {
    /// The readiness probe (run by `ready::probe_members`, never by a request): this daemon is
    /// in its own member list, and every other member completes an authenticated handshake now
    /// (all at once, each within the peer timeout). A member that does not is named with the
    /// reason. The probe leaves the peers' health in `/stats` as the fetches set it.
    async fn ready_doc(self: &Arc<Self>) -> ReadyDoc {
        let (ring_version, members) = {
            let m = self.membership.read().expect("membership lock");
            (m.ring().version(), m.ring().members().to_vec())
        };
        let mut problems = Vec::new();
        if !members.contains(&self.me) {
            problems.push(format!("{} is not in its own member list {members:?}", self.me));
        }
        let probes = members.iter().filter(|m| **m != self.me).map(|peer| async move {
            let r = crate::peer::connect(&self.link, peer).await.map(drop);
            (peer.clone(), r.err().map(|e| e.to_string()))
        });
        let mut peers = std::collections::BTreeMap::new();
        for (peer, err) in futures::future::join_all(probes).await {
            if let Some(e) = &err {
                problems.push(format!("peer {peer}: {e}"));
            }
            peers.insert(peer, err);
        }
        ReadyDoc {
            node: self.me.clone(),
            ring_version,
            members,
            ready: problems.is_empty(),
            peers,
            problems,
        }
    }
}

async fn watch_members(inner: Arc<Inner>, path: PathBuf) {
    let mut last = String::new();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let p = path.clone();
        let Ok(Ok(text)) = tokio::task::spawn_blocking(move || members_text(&p)).await else {
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
