//! `ramjet serve`: the host cache daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use crate::ui::parse_size;
use ramjet_engine::cache::CacheConfig;
use ramjet_transport::{Daemon, DaemonConfig};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Unix socket for local loaders (default: $RAMJET_SOCKET, $XDG_RUNTIME_DIR/ramjet.sock
    /// or /tmp/ramjet-UID.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Node-local cache directory.
    #[arg(long, env = "RAMJET_CACHE_DIR")]
    cache_dir: PathBuf,
    /// Cache byte budget.
    #[arg(long, default_value = "100GiB", value_parser = parse_size)]
    cache_limit: u64,
    /// Peer TCP address to listen on (none: no peers).
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// This daemon's name in the member list (default: the listen address, or
    /// HOSTNAME:PORT when the members are host names).
    #[arg(long)]
    advertise: Option<String>,
    /// Members, host:port, comma-separated; hostlists allowed (`node[01-04]:7341`).
    #[arg(long, env = "RAMJET_PEERS")]
    peers: Option<String>,
    /// A member file, one host:port or hostlist per line; re-read every second.
    #[arg(long)]
    peers_file: Option<PathBuf>,
    /// Port of every member when members come from SLURM_JOB_NODELIST.
    #[arg(long, default_value_t = 7341)]
    peer_port: u16,
    /// HTTP address for /stats and /metrics.
    #[arg(long)]
    http: Option<std::net::SocketAddr>,
    /// Serve only datasets under these URL prefixes (comma-separated), matched on URL
    /// components: `s3://bucket/data` admits `s3://bucket/data/...`, not `s3://bucket/database`.
    #[arg(long, value_delimiter = ',')]
    allow: Vec<String>,
    /// Listen for peers on a non-loopback address without RAMJET_API_KEY (trusted networks only).
    #[arg(long)]
    insecure: bool,
    /// Datasets (manifests) held open at once.
    #[arg(long, default_value_t = ramjet_transport::daemon::DATASETS_OPEN_MAX_DEFAULT)]
    datasets_open_max: usize,
    /// The host's decode budget: decode jobs at once, all of the host's ranks together, split
    /// among them by demand (a rank whose trainer waits for data gets more). Default: the cores.
    #[arg(long)]
    decode_threads: Option<usize>,
    /// The host's memory budget for prefetched and decoded batches, split likewise (bytes or a
    /// size such as 8GiB). Default: RAMJET_HOST_MEMORY, else an eighth of the memory, at most
    /// 16 GiB.
    #[arg(long, value_parser = parse_size)]
    host_memory: Option<u64>,
    /// Bytes of sealed in-memory shard copies kept for the host's consumers to map, made while
    /// two or more read or for a shard asked for again within this many bytes handed out (each
    /// shard copied out of the cache once for all of them; 0: never).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    shared_shards: u64,
    /// Connections served at once in each class (local loaders, authenticated peers, HTTP):
    /// each class has a budget of its own, so a flood on one port never refuses another.
    #[arg(long, default_value_t = ramjet_transport::daemon::CONNECTIONS_MAX_DEFAULT)]
    connections_max: usize,
    /// Peer-port connections still in the handshake, at once (each is closed after
    /// RAMJET_HANDSHAKE_TIMEOUT_MS, default 2000).
    #[arg(long, default_value_t = ramjet_transport::daemon::HANDSHAKES_MAX_DEFAULT)]
    handshakes_max: usize,
    /// Connections from one address held at once among those in the handshake and among HTTP
    /// connections.
    #[arg(long, default_value_t = ramjet_transport::daemon::PER_ADDRESS_MAX_DEFAULT)]
    per_address_max: usize,
    /// Network runtime worker threads (default: one per core; an embedded daemon shares its
    /// process's runtime instead, see `RAMJET_NET_THREADS`).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// How shard bytes move between peers: `tcp`, or `rdma` (RDMA WRITE; needs a build with
    /// the cargo feature `rdma` and an RDMA device; peers without RDMA are read over TCP).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
    transport: String,
    /// RDMA device (default: the first one).
    #[arg(long)]
    rdma_device: Option<String>,
    /// GID index on the RDMA port (RoCE v2: usually 1 or 3; InfiniBand: 0).
    #[arg(long, default_value_t = 0)]
    rdma_gid_index: u8,
}

/// Raises this process's soft limit on open files to its hard limit: every connection and
/// every cache file handed out holds a descriptor, and the common soft default (1024) is
/// below `connections_max` for each class. Says so when the hard limit stays below the
/// classes' budgets together.
fn raise_open_files_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    if ok && r.rlim_cur < r.rlim_max {
        let want = libc::rlimit {
            rlim_cur: r.rlim_max,
            rlim_max: r.rlim_max,
        };
        // SAFETY: as above; raising the soft limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            r.rlim_cur = r.rlim_max;
        }
    }
    if ok {
        tracing::info!(open_files_limit = r.rlim_cur, "descriptor limit");
    }
}

pub fn serve_cmd(a: ServeArgs) -> anyhow::Result<ExitCode> {
    // A peer or loader that goes away mid-transfer must cost that transfer an EPIPE, not the
    // daemon its life (`main` restores SIGPIPE's default for the other subcommands, and
    // `sendfile` has no MSG_NOSIGNAL).
    // SAFETY: setting a signal's disposition to ignore, before the daemon starts its threads.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    let socket = a.socket.unwrap_or_else(ramjet_transport::default_socket);
    let mut cfg = DaemonConfig::new(socket, CacheConfig::new(&a.cache_dir, a.cache_limit));
    cfg.listen = a.listen;
    cfg.http = a.http;
    cfg.peers_file = a.peers_file;
    cfg.allow_prefixes = a.allow;
    cfg.insecure = a.insecure;
    cfg.datasets_open_max = a.datasets_open_max;
    cfg.connections_max = a.connections_max;
    cfg.handshakes_max = a.handshakes_max;
    cfg.per_address_max = a.per_address_max;
    if let Some(n) = a.decode_threads {
        cfg.decode_threads = n.max(1);
    }
    cfg.shared_shard_bytes = a.shared_shards;
    if let Some(b) = a.host_memory {
        cfg.host_memory_bytes = b.max(1 << 20);
    }
    raise_open_files_limit();
    cfg.threads = if a.threads > 0 {
        a.threads
    } else {
        ramjet_engine::rt::cores()
    };
    if a.transport == "rdma" {
        cfg.transport = ramjet_transport::TransportKind::Rdma {
            device: a.rdma_device,
            gid_index: a.rdma_gid_index,
        };
    }
    let mut from_slurm = false;
    if let Some(p) = &a.peers {
        cfg.peers = ramjet_transport::read_members(p).map_err(anyhow::Error::msg)?;
    } else if cfg.peers_file.is_none() {
        if let Ok(list) = std::env::var("SLURM_JOB_NODELIST") {
            cfg.peers = ramjet_transport::hostlist::expand(&list)
                .map_err(anyhow::Error::msg)?
                .into_iter()
                .map(|h| format!("{h}:{}", a.peer_port))
                .collect();
            from_slurm = true;
        }
    }
    cfg.advertise = a.advertise.or_else(|| {
        let host = hostname()?;
        let port = cfg.listen.map(|l| l.port()).unwrap_or(a.peer_port);
        let name = format!("{host}:{port}");
        (from_slurm || cfg.peers.contains(&name)).then_some(name)
    });
    anyhow::ensure!(
        cfg.peers.is_empty() && cfg.peers_file.is_none() || cfg.listen.is_some(),
        "members were given but no --listen address for peers"
    );
    let key = ramjet_transport::wire::ApiKey::from_env();
    let d = Daemon::start(cfg).context("start the daemon")?;
    eprintln!(
        "ramjet serve: socket {}, peers {}, http {}",
        d.socket().display(),
        d.peer_addr().map(|a| a.to_string()).unwrap_or("-".into()),
        d.http_addr().map(|a| a.to_string()).unwrap_or("-".into())
    );
    if let Some(at) = d.http_addr() {
        // The page's URL: with the read credential when this port asks for one.
        let host = match at.ip() {
            ip if ip.is_unspecified() => hostname().unwrap_or_else(|| "localhost".into()),
            // An IPv6 address goes in brackets in a URL (RFC 3986).
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        };
        let guarded = !at.ip().is_loopback() && key.is_some();
        let q = key
            .filter(|_| guarded)
            .map(|k| format!("?token={}", k.http_token()))
            .unwrap_or_default();
        eprintln!("ramjet serve: dashboard http://{host}:{}/{q}", at.port());
    }
    d.run_until_signal();
    Ok(ExitCode::SUCCESS)
}

fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}
