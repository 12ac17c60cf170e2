//! How a daemon fetches a whole shard from the peer that owns it.
//!
//! [`PeerTransport`] is the seam: the daemon asks for a shard by manifest, index and identity,
//! and gets exactly its bytes back (or an error naming the peer and the shard). The daemon
//! verifies them, tracks peer health and falls back to the origin; a transport only moves bytes.
//!
//! - [`TcpTransport`]: the control frames of `docs/protocol.md`, then the shard's raw bytes on
//!   the same connection (sent with `sendfile` by the owner), received in large chunks into a
//!   pooled buffer. Connections are authenticated once and reused.
//! - `RdmaTransport` (cargo feature `rdma`, [`crate::rdma`]): the same authenticated TCP
//!   connection carries the control frames; the owner writes the shard straight into the
//!   requester's registered buffer with RDMA WRITE.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::error::Error;
use crate::wire::{self, ApiKey, Channel, Msg};

/// One request for a whole shard, as the owner will validate it.
#[derive(Debug, Clone)]
pub struct ShardGet {
    /// The dataset's manifest URL.
    pub manifest_url: String,
    /// Shard index in that manifest.
    pub shard: u32,
    /// Whole-shard xxh3 (from the manifest).
    pub checksum: u64,
    /// Shard size (from the manifest); the reply must be exactly this long.
    pub bytes: u64,
    /// How errors name the shard: `shard N (URL)`.
    pub what: String,
    /// The asking node reads this split shard too, and the peer's node is its reader: the
    /// peer keeps it for its own node (`Msg::Get`'s `keep`).
    pub keep: bool,
}

impl ShardGet {
    pub(crate) fn msg(&self) -> Msg {
        Msg::Get {
            manifest_url: self.manifest_url.clone(),
            shard: self.shard,
            checksum: self.checksum,
            bytes: self.bytes,
            keep: self.keep,
            split: false,
            reader: None,
            job: None,
        }
    }
}

/// Moves shard bytes from an owner peer to this daemon.
pub trait PeerTransport: Send + Sync + 'static {
    /// `tcp` or `rdma`, for logs and stats.
    fn name(&self) -> &'static str;
    /// Fetches the whole shard from `peer` (`host:port` of its daemon). The bytes are not yet
    /// verified; errors name the peer and the shard.
    fn fetch<'a>(&'a self, peer: &'a str, get: &'a ShardGet) -> BoxFuture<'a, Result<Bytes, Error>>;
    /// Drops pooled connections to `peer` (it failed).
    fn forget(&self, peer: &str);
}

/// What every transport's control connection needs.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Cluster secret.
    pub api_key: Option<ApiKey>,
    /// Connect, handshake and "no byte for this long" limit.
    pub peer_timeout: Duration,
    /// How long the owner may take before its first reply (it may be fetching from the origin).
    pub reply_timeout: Duration,
    /// The slowest whole-shard transfer accepted once bytes flow: a shard of `n` bytes must
    /// arrive within `peer_timeout + n / transfer_min_bytes_per_s`, so a peer that trickles a
    /// byte now and then (never idle long enough for `peer_timeout`) is still cut off
    /// (`RAMJET_PEER_MIN_BYTES_PER_S`).
    pub transfer_min_bytes_per_s: u64,
}

/// Default of [`LinkConfig::transfer_min_bytes_per_s`]: 4 MiB/s, far below any working link.
pub const TRANSFER_MIN_BYTES_PER_S_DEFAULT: u64 = 4 << 20;

impl LinkConfig {
    /// The deadline of a whole transfer of `bytes` bytes.
    pub fn transfer_deadline(&self, bytes: u64) -> Duration {
        self.peer_timeout + Duration::from_secs_f64(bytes as f64 / self.transfer_min_bytes_per_s.max(1) as f64)
    }
}

/// Authenticated connections to peers, pooled per peer.
pub(crate) struct Pool<C> {
    idle: Mutex<HashMap<String, Vec<C>>>,
}

impl<C> Default for Pool<C> {
    fn default() -> Self {
        Pool {
            idle: Mutex::new(HashMap::new()),
        }
    }
}

impl<C> Pool<C> {
    pub(crate) fn take(&self, peer: &str) -> Option<C> {
        self.idle.lock().expect("pool lock").get_mut(peer).and_then(Vec::pop)
    }

    pub(crate) fn put(&self, peer: &str, c: C) {
        self.idle
            .lock()
            .expect("pool lock")
            .entry(peer.to_owned())
            .or_default()
            .push(c);
    }

    pub(crate) fn forget(&self, peer: &str) {
        self.idle.lock().expect("pool lock").remove(peer);
    }
}

/// Opens a TCP connection to `peer` and runs the mutual handshake.
pub(crate) async fn connect(cfg: &LinkConfig, peer: &str) -> Result<Channel<TcpStream>, Error> {
    let t = cfg.peer_timeout;
    let mut s = tokio::time::timeout(t, TcpStream::connect(peer))
        .await
        .map_err(|_| Error::peer(peer, "connect timed out"))?
        .map_err(|e| Error::peer(peer, format!("connect: {e}")))?;
    let _ = s.set_nodelay(true);
    let session = tokio::time::timeout(t, wire::connect(&mut s, cfg.api_key.as_ref()))
        .await
        .map_err(|_| Error::peer(peer, "handshake timed out"))?
        .map_err(|e| Error::peer(peer, format!("handshake: {e}")))?;
    Ok(Channel { stream: s, session })
}

/// Sends `m` and waits for the owner's first reply, allowing it the reply timeout.
pub(crate) async fn request(
    cfg: &LinkConfig,
    s: &mut Channel<TcpStream>,
    peer: &str,
    get: &ShardGet,
    m: &Msg,
) -> Result<Msg, Error> {
    let io = |e: std::io::Error| Error::peer(peer, format!("{}: {e}", get.what));
    s.send(m).await.map_err(io)?;
    tokio::time::timeout(cfg.reply_timeout + cfg.peer_timeout, s.recv())
        .await
        .map_err(|_| Error::peer(peer, format!("no reply for {} in time", get.what)))?
        .map_err(io)
}

/// Checks a `Data` reply against the request.
pub(crate) fn expect_data(reply: Msg, peer: &str, get: &ShardGet) -> Result<(), Error> {
    match reply {
        Msg::Data { bytes, .. } if bytes == get.bytes => Ok(()),
        Msg::Data { bytes, .. } => Err(Error::peer(
            peer,
            format!("announced {bytes} bytes for {} of {} bytes", get.what, get.bytes),
        )),
        Msg::Fail { message } => Err(Error::peer(peer, message)),
        m => Err(Error::peer(peer, format!("unexpected reply {m:?}"))),
    }
}

/// The TCP transport.
pub struct TcpTransport {
    cfg: LinkConfig,
    pool: Pool<Channel<TcpStream>>,
}

/// The receive chunk: large reads keep syscalls per shard few.
const CHUNK: usize = 8 << 20;

impl TcpTransport {
    /// A transport with no connections yet.
    pub fn new(cfg: LinkConfig) -> TcpTransport {
        TcpTransport {
            cfg,
            pool: Pool::default(),
        }
    }

    async fn fetch_inner(&self, peer: &str, get: &ShardGet) -> Result<Bytes, Error> {
        let mut s = match self.pool.take(peer) {
            Some(s) => s,
            None => connect(&self.cfg, peer).await?,
        };
        let reply = request(&self.cfg, &mut s, peer, get, &get.msg()).await?;
        expect_data(reply, peer, get)?;
        let n = get.bytes as usize;
        // SAFETY: every byte of the buffer is written by the reads below before it is used;
        // a short read returns an error and the buffer is dropped unread.
        let Some(mut buf) = (unsafe { ramjet_engine::buf::BufPool::global().try_take(n) }) else {
            return Err(Error::Internal(format!(
                "no memory for {} ({n} bytes) from peer {peer}",
                get.what
            )));
        };
        let dst = buf.as_mut_slice();
        let mut off = 0;
        let limit = self.cfg.transfer_deadline(get.bytes);
        let deadline = tokio::time::Instant::now() + limit;
        while off < n {
            let end = (off + CHUNK).min(n);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(Error::peer(peer, format!("{} took longer than its transfer deadline of {:.1} s (byte {off} of {n}): too slow or trickling",
                    get.what,
                    limit.as_secs_f64()
                )));
            }
            let r = tokio::time::timeout(self.cfg.peer_timeout.min(left), s.stream.read(&mut dst[off..end]))
                .await
                .map_err(|_| {
                    Error::peer(
                        peer,
                        format!(
                            "stalled at byte {off} of {} (or its transfer deadline passed)",
                            get.what
                        ),
                    )
                })?
                .map_err(|e| Error::peer(peer, format!("{}: {e}", get.what)))?;
            if r == 0 {
                return Err(Error::peer(
                    peer,
                    format!("connection closed at byte {off} of {n} of {}", get.what),
                ));
            }
            off += r;
        }
        self.pool.put(peer, s);
        Ok(buf.into_bytes())
    }
}

impl PeerTransport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn fetch<'a>(&'a self, peer: &'a str, get: &'a ShardGet) -> BoxFuture<'a, Result<Bytes, Error>> {
        Box::pin(self.fetch_inner(peer, get))
    }

    fn forget(&self, peer: &str) {
        self.pool.forget(peer);
    }
}
