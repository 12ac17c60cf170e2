//! The daemon's settings, member lists and URL prefixes.

use crate::error::Error;
use crate::ring::VNODES_DEFAULT;
use crate::wire::ApiKey;
use ramjet_engine::cache::CacheConfig;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Connections served at once in each class: local loaders, authenticated peers and HTTP
    /// clients each have a budget of this many, so a flood on one port never refuses another
    /// class (a loader on the Unix socket is never refused for remote connections). More are
    /// closed on accept and counted (`connections_refused`).
    pub connections_max: usize,
    /// Peer-port connections that have not completed the handshake, at once. Each is cut
    /// off after `handshake_timeout`.
    pub handshakes_max: usize,
    /// Connections from one source address held at once, among those still in the handshake
    /// and among HTTP connections: one address cannot take a whole class's budget.
    pub per_address_max: usize,
    /// A peer-port connection that has not completed the authenticated handshake by then is
    /// closed (`RAMJET_HANDSHAKE_TIMEOUT_MS`).
    pub handshake_timeout: Duration,
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
    /// The host's decode budget: decode jobs at once, split among the host's decoding
    /// consumers by demand (default: the cores; `ramjet serve --decode-threads`).
    pub decode_threads: usize,
    /// The host's memory budget for prefetched and decoded batches, split likewise (default
    /// [`ramjet_engine::tune::host_memory_budget`]; `--host-memory`).
    pub host_memory_bytes: u64,
    /// Bytes of sealed in-memory shard copies kept for several local consumers to map, so a
    /// host of N ranks copies a shard out of the cache once, not N times (0: never share;
    /// `--shared-shards`).
    pub shared_shard_bytes: u64,
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

/// Default of [`DaemonConfig::shared_shard_bytes`].
pub const SHARED_SHARD_BYTES_DEFAULT: u64 = 1 << 30;
/// Default of [`DaemonConfig::datasets_open_max`].
pub const DATASETS_OPEN_MAX_DEFAULT: usize = 64;
/// Default of [`DaemonConfig::connections_max`].
pub const CONNECTIONS_MAX_DEFAULT: usize = 1024;
/// Default of [`DaemonConfig::handshakes_max`].
pub const HANDSHAKES_MAX_DEFAULT: usize = 256;
/// Default of [`DaemonConfig::per_address_max`].
pub const PER_ADDRESS_MAX_DEFAULT: usize = 32;

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
            handshakes_max: HANDSHAKES_MAX_DEFAULT,
            per_address_max: PER_ADDRESS_MAX_DEFAULT,
            handshake_timeout: env_ms("RAMJET_HANDSHAKE_TIMEOUT_MS", 2_000),
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
            decode_threads: ramjet_engine::rt::decode_threads(),
            host_memory_bytes: ramjet_engine::tune::host_memory_budget(),
            shared_shard_bytes: SHARED_SHARD_BYTES_DEFAULT,
        }
    }

    pub(super) fn me(&self) -> String {
        self.advertise
            .clone()
            .or_else(|| self.listen.map(|a| a.to_string()))
            .unwrap_or_else(|| "local".into())
    }
}

/// Reads a member list: `host:port` entries (or hostlists with a `:port`), separated by
/// commas or lines; `#` starts a comment.
pub fn read_members(text: &str) -> Result<Vec<String>, Error> {
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
