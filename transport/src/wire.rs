//! The wire protocol shared by peers (TCP) and local loaders (Unix socket).
//!
//! Every control message is one frame: a little-endian `u32` length, then that many bytes of
//! JSON (a [`Msg`]). A frame longer than [`FRAME_MAX`] is an error, never an allocation. A
//! `Data` reply is followed by exactly `bytes` raw bytes (TCP), or carries the shard as a file
//! descriptor (Unix socket, `SCM_RIGHTS`). See `docs/protocol.md`.

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Protocol version, sent in `Hello`. Version 2 binds every frame after the handshake to the
/// session (a MAC over direction, sequence number and body).
pub const VERSION: u32 = 2;
/// Bytes of the MAC that ends every frame of a keyed session.
pub const FRAME_TAG_BYTES: usize = 32;
/// The largest control frame.
pub const FRAME_MAX: usize = 64 << 10;
/// The largest shard a peer may announce.
pub const SHARD_MAX: u64 = 16 << 30;
/// What the HTTP credential is a MAC of ([`ApiKey::http_token`]).
const HTTP_TOKEN_ROLE: &str = "ramjet-http-read-v1";
/// A URL in a request.
pub const URL_MAX: usize = 4096;

/// One control message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// Server → client, first: the server's nonce and whether it requires the API key.
    Hello {
        /// Protocol version.
        version: u32,
        /// 32 random bytes, hex.
        nonce: String,
        /// Whether the server holds an API key.
        auth: bool,
    },
    /// Client → server: its nonce and HMAC(key, "ramjet-client" | server nonce | client nonce).
    Auth {
        /// 32 random bytes, hex.
        nonce: String,
        /// Hex MAC; empty without a key.
        mac: String,
    },
    /// Server → client: HMAC(key, "ramjet-server" | client nonce | server nonce), proving the
    /// server holds the key too.
    Welcome {
        /// Hex MAC; empty without a key.
        mac: String,
    },
    /// The connection is refused (then closed).
    Refused {
        /// Why.
        reason: String,
    },
    /// Asks for one whole shard.
    Get {
        /// The dataset's manifest URL.
        manifest_url: String,
        /// Shard index in that manifest.
        shard: u32,
        /// Whole-shard xxh3 (from the manifest).
        checksum: u64,
        /// Shard size (from the manifest).
        bytes: u64,
        /// The shard is the asking node's own share every epoch, so the daemon reads it from
        /// the origin (not the ring owner) and keeps it (absent: false). From a peer: the
        /// asker is a node that reads this split shard too, and this daemon's node its reader.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        keep: bool,
        /// Local only, with `keep`: another node reads this shard too, so the daemon fetches
        /// it through another daemon (the cluster reads it from the origin once) and keeps it
        /// all the same: the daemon of node `reader` of job `job`, else the ring owner
        /// (absent: false).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        split: bool,
        /// Local only, with `split`: the node of the job's deal that reads the shard from the
        /// origin (absent: none, the ring owner).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reader: Option<u32>,
        /// Local only, with `reader`: the asking consumer's job, whose heartbeats name the
        /// reader node's daemon.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<String>,
    },
    /// The shard follows.
    Data {
        /// Its size.
        bytes: u64,
        /// Where the server got it (`cache_local`, `cache_peer`, `origin`).
        source: String,
    },
    /// A request failed.
    Fail {
        /// Why, naming the object or peer.
        message: String,
    },
    /// Local only: the shard last delivered failed verification; drop the cached copy.
    Corrupt {
        /// Shard checksum.
        checksum: u64,
        /// Shard size.
        bytes: u64,
    },
    /// Local only: hold the ring version (a training epoch begins).
    Freeze,
    /// Local only: release one freeze.
    Unfreeze,
    /// Local only: is the daemon answering? (A loader's probe of a daemon it marked down.)
    Ping,
    /// Acknowledges `Freeze`, `Unfreeze`, `Corrupt` or `Ping`.
    Ok,
    /// Requester → owner, then owner → requester: the sender's RDMA queue pair (feature
    /// `rdma`). An owner without RDMA answers `Fail`.
    RdmaConnect(QpInfo),
    /// Asks for one whole shard, written by RDMA into the requester's registered region; the
    /// `Data` reply carries no bytes.
    GetRdma {
        /// The dataset's manifest URL.
        manifest_url: String,
        /// Shard index in that manifest.
        shard: u32,
        /// Whole-shard xxh3 (from the manifest).
        checksum: u64,
        /// Shard size (from the manifest); the region is exactly this long.
        bytes: u64,
        /// The region's address in the requester.
        addr: u64,
        /// The region's remote key.
        rkey: u32,
    },
    /// Local only: a consumer's heartbeat (answered `Ok`, or `Fail` naming what is wrong).
    Heartbeat(ramjet_engine::Heartbeat),
    /// Daemon → loader, the answer to a decoding consumer's `Heartbeat`: its share of the
    /// host's budgets (an older daemon, or a consumer that does not decode, gets `Ok`).
    Grant(ramjet_engine::HostGrant),
    /// Daemon → loader, the answer to a `Heartbeat` that asks for its job's pace (`pace:
    /// true`): the consumer's share of the host's budgets (one whose loader decodes) and its
    /// job's pace across its ranks, when the daemon knows them.
    Beat {
        /// As in `Grant`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grant: Option<ramjet_engine::HostGrant>,
        /// The job's pace ([`ramjet_engine::pace::JobPace`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        job: Option<ramjet_engine::pace::JobPace>,
    },
    /// Peer → peer: asks for the member's dashboard summary.
    SummaryRequest,
    /// The answer to `SummaryRequest`.
    Summary(Box<crate::stats::NodeSummary>),
}

/// The address of an RDMA queue pair.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID, as an IPv6 address.
    pub gid: String,
}

fn decode(body: &[u8]) -> std::io::Result<Msg> {
    serde_json::from_slice(body)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad frame: {e}")))
}

/// Encodes a frame.
pub fn encode(m: &Msg) -> Vec<u8> {
    let body = serde_json::to_vec(m).expect("messages serialise");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

fn check_len(n: usize) -> std::io::Result<()> {
    if n > FRAME_MAX {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds the limit of {FRAME_MAX}"),
        ));
    }
    Ok(())
}

/// Reads one frame.
pub async fn read_msg<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Msg> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let n = u32::from_le_bytes(len) as usize;
    check_len(n)?;
    let mut body = vec![0u8; n];
    r.read_exact(&mut body).await?;
    decode(&body)
}

/// Writes one frame.
pub async fn write_msg<W: AsyncWrite + Unpin>(w: &mut W, m: &Msg) -> std::io::Result<()> {
    w.write_all(&encode(m)).await
}

/// Reads one frame from a blocking reader.
pub fn read_msg_blocking<R: std::io::Read>(r: &mut R) -> std::io::Result<Msg> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    check_len(n)?;
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    decode(&body)
}

/// Parses one complete frame from `buf` if it holds one: `(message, bytes used)`.
pub fn parse_frame(buf: &[u8]) -> std::io::Result<Option<(Msg, usize)>> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let n = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    check_len(n)?;
    if buf.len() < 4 + n {
        return Ok(None);
    }
    Ok(Some((decode(&buf[4..4 + n])?, 4 + n)))
}

/// The shared secret of a cluster (`RAMJET_API_KEY`).
#[derive(Clone)]
pub struct ApiKey(hmac::Key, usize);

/// The shortest secret (blanks at either end not counted) a daemon takes for a port off
/// loopback: a key of one letter, or a space, is guessed at once.
pub const API_KEY_BYTES_MIN: usize = 16;

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

impl ApiKey {
    /// A key from its secret text.
    pub fn new(secret: &str) -> ApiKey {
        ApiKey(
            hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()),
            secret.trim().len(),
        )
    }

    /// Whether the secret is long enough to guard a port others can reach: at least
    /// [`API_KEY_BYTES_MIN`] bytes that are not all blanks.
    pub fn strong(&self) -> bool {
        self.1 >= API_KEY_BYTES_MIN
    }

    /// From `RAMJET_API_KEY`, if set and non-empty.
    pub fn from_env() -> Option<ApiKey> {
        std::env::var("RAMJET_API_KEY")
            .ok()
            .filter(|s| !s.is_empty())
            .map(|s| ApiKey::new(&s))
    }

    /// The read-only HTTP credential (the dashboard, `/cluster`, `/stats`, `/metrics`):
    /// HMAC(key, "ramjet-http-read-v1"), hex. It opens nothing but those pages, and the key
    /// cannot be recovered from it; `ramjet token` prints it.
    pub fn http_token(&self) -> String {
        self.mac(HTTP_TOKEN_ROLE, b"", b"")
    }

    /// Whether `token` is [`ApiKey::http_token`] (compared in constant time).
    pub fn check_http_token(&self, token: &str) -> bool {
        unhex(token.trim()).is_some_and(|t| hmac::verify(&self.0, HTTP_TOKEN_ROLE.as_bytes(), &t).is_ok())
    }

    fn mac(&self, role: &str, a: &[u8], b: &[u8]) -> String {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(role.as_bytes());
        ctx.update(a);
        ctx.update(b);
        hex(ctx.sign().as_ref())
    }

    /// The session key of one connection: HMAC(key, "ramjet-session" | server nonce | client
    /// nonce). Fresh nonces make it unique to the connection.
    fn session_key(&self, sn: &[u8], cn: &[u8]) -> hmac::Key {
        let mut ctx = hmac::Context::with_key(&self.0);
        ctx.update(b"ramjet-session");
        ctx.update(sn);
        ctx.update(cn);
        hmac::Key::new(hmac::HMAC_SHA256, ctx.sign().as_ref())
    }

    fn verify(&self, role: &str, a: &[u8], b: &[u8], mac_hex: &str) -> bool {
        let Some(mac) = unhex(mac_hex) else {
            return false;
        };
        let mut msg = Vec::with_capacity(role.len() + a.len() + b.len());
        msg.extend_from_slice(role.as_bytes());
        msg.extend_from_slice(a);
        msg.extend_from_slice(b);
        hmac::verify(&self.0, &msg, &mac).is_ok()
    }
}

fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    SystemRandom::new().fill(&mut n).expect("system randomness");
    n
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || s.len() > 256 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The other side refused us, or we refused it.
    #[error("refused: {0}")]
    Refused(String),
    /// I/O or protocol error.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Server side of the handshake. The key never crosses the wire: each side proves it holds it
/// by a MAC over both fresh nonces. Without a server key, every client is welcome.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: Option<&ApiKey>,
) -> Result<Session, HandshakeError> {
    let sn = nonce();
    write_msg(
        s,
        &Msg::Hello {
            version: VERSION,
            nonce: hex(&sn),
            auth: key.is_some(),
        },
    )
    .await?;
    let Msg::Auth { nonce: cn_hex, mac } = read_msg(s).await? else {
        return Err(refuse(s, "expected auth").await);
    };
    let Some(cn) = unhex(&cn_hex).filter(|n| n.len() == 32) else {
        return Err(refuse(s, "bad client nonce").await);
    };
    let Some(key) = key else {
        write_msg(s, &Msg::Welcome { mac: String::new() }).await?;
        return Ok(Session::new(None, false));
    };
    if !key.verify("ramjet-client", &sn, &cn, &mac) {
        return Err(refuse(s, "wrong or missing API key (RAMJET_API_KEY)").await);
    }
    write_msg(
        s,
        &Msg::Welcome {
            mac: key.mac("ramjet-server", &cn, &sn),
        },
    )
    .await?;
    Ok(Session::new(Some(key.session_key(&sn, &cn)), false))
}

async fn refuse<S: AsyncWrite + Unpin>(s: &mut S, reason: &str) -> HandshakeError {
    let _ = write_msg(s, &Msg::Refused { reason: reason.into() }).await;
    HandshakeError::Refused(reason.into())
}

/// Client side of the handshake; also checks that the server holds the same key.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: Option<&ApiKey>,
) -> Result<Session, HandshakeError> {
    let Msg::Hello {
        version,
        nonce: sn_hex,
        auth,
    } = read_msg(s).await?
    else {
        return Err(HandshakeError::Refused("expected hello".into()));
    };
    if version != VERSION {
        return Err(HandshakeError::Refused(format!(
            "protocol version {version}, we speak {VERSION}"
        )));
    }
    let sn = unhex(&sn_hex)
        .filter(|n| n.len() == 32)
        .ok_or_else(|| HandshakeError::Refused("bad server nonce".into()))?;
    if auth && key.is_none() {
        return Err(HandshakeError::Refused(
            "the peer requires an API key and RAMJET_API_KEY is not set".into(),
        ));
    }
    if !auth && key.is_some() {
        return Err(HandshakeError::Refused(
            "the peer runs without an API key while we hold one".into(),
        ));
    }
    let cn = nonce();
    let mac = key.map(|k| k.mac("ramjet-client", &sn, &cn)).unwrap_or_default();
    write_msg(s, &Msg::Auth { nonce: hex(&cn), mac }).await?;
    match read_msg(s).await? {
        Msg::Welcome { mac } => match key {
            Some(k) if !k.verify("ramjet-server", &cn, &sn, &mac) => Err(HandshakeError::Refused(
                "the peer could not prove it holds the API key".into(),
            )),
            Some(k) => Ok(Session::new(Some(k.session_key(&sn, &cn)), true)),
            None => Ok(Session::new(None, true)),
        },
        Msg::Refused { reason } => Err(HandshakeError::Refused(reason)),
        m => Err(HandshakeError::Refused(format!("unexpected {m:?}"))),
    }
}

/// The state of one authenticated connection after its handshake. With a key, every frame
/// carries HMAC(session key, direction | sequence | body): a relay that forwarded the handshake
/// cannot inject, replay, reorder or reflect frames. Without a key there is nothing to bind to,
/// and frames go bare (a daemon without a key serves loopback only, unless `--insecure`).
pub struct Session {
    key: Option<hmac::Key>,
    /// Frames sent and received so far: the sequence numbers of the next ones.
    sent: u64,
    received: u64,
    /// Whether this side is the client (its frames are marked `c`, the server's `s`).
    client: bool,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("keyed", &self.key.is_some())
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish()
    }
}

impl Session {
    /// A keyed session without a handshake, for the fuzz targets only.
    #[doc(hidden)]
    pub fn keyed_for_fuzzing(secret: &str, client: bool) -> Session {
        Session::new(Some(hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes())), client)
    }

    fn new(key: Option<hmac::Key>, client: bool) -> Session {
        Session {
            key,
            sent: 0,
            received: 0,
            client,
        }
    }

    fn tag(key: &hmac::Key, dir: u8, seq: u64, body: &[u8]) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(key);
        ctx.update(&[dir]);
        ctx.update(&seq.to_le_bytes());
        ctx.update(body);
        ctx.sign()
    }

    /// Encodes `m` as this side's next frame.
    pub fn seal(&mut self, m: &Msg) -> Vec<u8> {
        let body = serde_json::to_vec(m).expect("messages serialise");
        let Some(key) = &self.key else {
            return encode(m);
        };
        let dir = if self.client { b'c' } else { b's' };
        let tag = Self::tag(key, dir, self.sent, &body);
        self.sent += 1;
        let mut out = Vec::with_capacity(4 + body.len() + FRAME_TAG_BYTES);
        out.extend_from_slice(&((body.len() + FRAME_TAG_BYTES) as u32).to_le_bytes());
        out.extend_from_slice(&body);
        out.extend_from_slice(tag.as_ref());
        out
    }

    /// Checks and decodes the other side's next frame body (the bytes after the length).
    pub fn open(&mut self, frame: &[u8]) -> std::io::Result<Msg> {
        let Some(key) = &self.key else {
            return decode(frame);
        };
        let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_owned());
        if frame.len() < FRAME_TAG_BYTES {
            return Err(bad("frame too short for its session MAC"));
        }
        let (body, tag) = frame.split_at(frame.len() - FRAME_TAG_BYTES);
        let dir = if self.client { b's' } else { b'c' };
        let mut msg = Vec::with_capacity(9 + body.len());
        msg.push(dir);
        msg.extend_from_slice(&self.received.to_le_bytes());
        msg.extend_from_slice(body);
        if hmac::verify(key, &msg, tag).is_err() {
            return Err(bad(
                "frame MAC does not match this session (injected, replayed, reordered or reflected frame)",
            ));
        }
        self.received += 1;
        decode(body)
    }
}

/// A stream and the session bound to it: what every peer connection is after its handshake.
#[derive(Debug)]
pub struct Channel<S> {
    /// The stream, for the raw shard bytes that follow a `Data` frame.
    pub stream: S,
    /// The session its frames are bound to.
    pub session: Session,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Channel<S> {
    /// Sends one frame.
    pub async fn send(&mut self, m: &Msg) -> std::io::Result<()> {
        let f = self.session.seal(m);
        self.stream.write_all(&f).await
    }

    /// Receives one frame, checked against the session.
    pub async fn recv(&mut self) -> std::io::Result<Msg> {
        let mut len = [0u8; 4];
        self.stream.read_exact(&mut len).await?;
        let n = u32::from_le_bytes(len) as usize;
        check_len(n)?;
        let mut body = vec![0u8; n];
        self.stream.read_exact(&mut body).await?;
        self.session.open(&body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(
        server: Option<&str>,
        client: Option<&str>,
    ) -> (Result<Session, HandshakeError>, Result<Session, HandshakeError>) {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let (sk, ck) = (server.map(ApiKey::new), client.map(ApiKey::new));
        // Each side owns its end: a side that gives up closes it, as a real peer would.
        tokio::join!(async move { accept(&mut a, sk.as_ref()).await }, async move {
            connect(&mut b, ck.as_ref()).await
        })
    }

    /// A server that does not hold the key cannot pass for one that does: it asks for a key,
    /// takes the client's proof, and answers with no MAC, a MAC under another key, or the
    /// client's own MAC sent back. The client refuses each, naming why, and makes no session.
    #[tokio::test]
    async fn a_server_that_cannot_prove_the_key_is_refused_by_the_client() {
        for answer in ["none", "another key", "reflected"] {
            let (mut srv, mut cli) = tokio::io::duplex(1 << 16);
            let impostor = async move {
                let sn = nonce();
                let hello = Msg::Hello {
                    version: VERSION,
                    nonce: hex(&sn),
                    auth: true,
                };
                write_msg(&mut srv, &hello).await.unwrap();
                let Msg::Auth { nonce: cn, mac } = read_msg(&mut srv).await.unwrap() else {
                    panic!("the client sent no auth");
                };
                let cn = unhex(&cn).unwrap();
                let mac = match answer {
                    "none" => String::new(),
                    "another key" => ApiKey::new("not-k").mac("ramjet-server", &cn, &sn),
                    _ => mac,
                };
                write_msg(&mut srv, &Msg::Welcome { mac }).await.unwrap();
            };
            let key = ApiKey::new("k");
            let (_, got) = tokio::join!(impostor, connect(&mut cli, Some(&key)));
            match got {
                Err(HandshakeError::Refused(why)) => {
                    assert!(why.contains("could not prove it holds the API key"), "{answer}: {why}")
                }
                Err(e) => panic!("{answer}: refused for another reason: {e}"),
                Ok(_) => panic!("{answer}: a server without the key made a session"),
            }
        }
    }

    /// Both sides' outcomes, each asserted: a refused client must leave the server with an
    /// error too (never a session), and the reason each side gives is the right one.
    #[tokio::test]
    async fn matching_keys_are_welcome_and_wrong_ones_refused_on_both_sides() {
        let (s, c) = pair(Some("k1"), Some("k1")).await;
        assert!(s.unwrap().key.is_some() && c.unwrap().key.is_some(), "keyed both ways");
        let (s, c) = pair(None, None).await;
        assert!(s.unwrap().key.is_none() && c.unwrap().key.is_none());
        // Wrong key: the server refuses and says why; the client hears that reason.
        let (s, c) = pair(Some("k1"), Some("k2")).await;
        assert!(
            matches!(&s, Err(HandshakeError::Refused(r)) if r.contains("wrong or missing API key")),
            "{s:?}"
        );
        assert!(
            matches!(&c, Err(HandshakeError::Refused(r)) if r.contains("wrong or missing API key")),
            "{c:?}"
        );
        // A keyed server, a client without a key: the client stops at the hello; the server's
        // handshake ends in an error (the client hung up), not a session.
        let (s, c) = pair(Some("k1"), None).await;
        assert!(
            matches!(&c, Err(HandshakeError::Refused(r)) if r.contains("requires an API key")),
            "{c:?}"
        );
        assert!(
            s.is_err(),
            "the server made a session with a client that sent no key: {s:?}"
        );
        // A server without a key, a keyed client: the client refuses to talk in the clear.
        let (s, c) = pair(None, Some("k1")).await;
        assert!(
            matches!(&c, Err(HandshakeError::Refused(r)) if r.contains("without an API key")),
            "{c:?}"
        );
        assert!(
            s.is_err(),
            "the server made a session with a client that refused: {s:?}"
        );
    }

    /// Records every byte a stream writes.
    struct Tap<S> {
        inner: S,
        seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    }

    impl<S: AsyncRead + Unpin> AsyncRead for Tap<S> {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    impl<S: AsyncWrite + Unpin> AsyncWrite for Tap<S> {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
            if let std::task::Poll::Ready(Ok(n)) = &r {
                self.seen.lock().unwrap().extend_from_slice(&buf[..*n]);
            }
            r
        }
        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    /// The real `connect` and `accept` over a real TCP connection on loopback, every byte of
    /// both directions recorded, then a sealed request and reply: the key (as text, as hex, as
    /// the session key's input) never appears in either direction, with matching keys and with
    /// a wrong one.
    #[tokio::test]
    async fn the_key_never_crosses_the_wire_in_either_direction() {
        let secret = "correct horse battery staple";
        for client_secret in [secret, "a wrong key of the client"] {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let (to_client, to_server) = (
                std::sync::Arc::new(std::sync::Mutex::new(Vec::new())),
                std::sync::Arc::new(std::sync::Mutex::new(Vec::new())),
            );
            let (sk, ck) = (ApiKey::new(secret), ApiKey::new(client_secret));
            let (tc, ts) = (to_client.clone(), to_server.clone());
            let server = async move {
                let (sock, _) = l.accept().await.unwrap();
                let mut t = Tap { inner: sock, seen: tc };
                let sess = accept(&mut t, Some(&sk)).await;
                if let Ok(mut sess) = sess {
                    let req = read_frame_body(&mut t).await;
                    let m = sess.open(&req).unwrap();
                    write_all(
                        &mut t,
                        &sess.seal(&Msg::Data {
                            bytes: 1,
                            source: "cache_local".into(),
                        }),
                    )
                    .await;
                    return Some(m);
                }
                None
            };
            let client = async move {
                let sock = tokio::net::TcpStream::connect(addr).await.unwrap();
                let mut t = Tap { inner: sock, seen: ts };
                let mut sess = connect(&mut t, Some(&ck)).await.ok()?;
                write_all(&mut t, &sess.seal(&Msg::Freeze)).await;
                let reply = read_frame_body(&mut t).await;
                Some(sess.open(&reply).unwrap())
            };
            let (got, reply) = tokio::join!(server, client);
            if client_secret == secret {
                assert_eq!(got, Some(Msg::Freeze));
                assert!(matches!(reply, Some(Msg::Data { bytes: 1, .. })), "{reply:?}");
            } else {
                assert_eq!((got, reply), (None, None), "a wrong key made a session");
            }
            let (c, s) = (to_client.lock().unwrap().clone(), to_server.lock().unwrap().clone());
            assert!(!c.is_empty() && !s.is_empty(), "both directions carried the handshake");
            for (dir, bytes) in [("server to client", &c), ("client to server", &s)] {
                for key in [secret, client_secret] {
                    let text = String::from_utf8_lossy(bytes);
                    assert!(!text.contains(key), "{dir} carried the key {key:?}");
                    assert!(!text.contains(&hex(key.as_bytes())), "{dir} carried the key as hex");
                    assert!(
                        !bytes.windows(key.len()).any(|w| w == key.as_bytes()),
                        "{dir} carried the key's bytes"
                    );
                }
            }
        }
    }

    async fn write_all<S: AsyncWrite + Unpin>(s: &mut S, b: &[u8]) {
        use tokio::io::AsyncWriteExt;
        s.write_all(b).await.unwrap();
        s.flush().await.unwrap();
    }

    async fn read_frame_body<S: AsyncRead + Unpin>(s: &mut S) -> Vec<u8> {
        use tokio::io::AsyncReadExt;
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.unwrap();
        let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut b).await.unwrap();
        b
    }

    #[test]
    fn oversized_and_garbage_frames_are_errors() {
        let mut big = ((FRAME_MAX + 1) as u32).to_le_bytes().to_vec();
        big.extend(vec![b' '; 16]);
        assert!(parse_frame(&big).is_err());
        assert!(read_msg_blocking(&mut &big[..]).is_err());
        let mut junk = 5u32.to_le_bytes().to_vec();
        junk.extend(b"{{{{{");
        assert!(parse_frame(&junk).is_err());
        assert!(parse_frame(&junk[..6]).unwrap().is_none());
        let ok = encode(&Msg::Freeze);
        assert_eq!(parse_frame(&ok).unwrap(), Some((Msg::Freeze, ok.len())));
    }

    /// Regression: after the handshake, frames were bare JSON, so a relay that forwarded the
    /// handshake could take over the authenticated connection and speak for either side.
    #[tokio::test]
    async fn a_relay_cannot_inject_replay_or_reflect_frames_after_the_handshake() {
        let (s, c) = pair(Some("k"), Some("k")).await;
        let (mut server, mut client) = (s.unwrap(), c.unwrap());
        let body = |f: &[u8]| f[4..].to_vec();
        let get = Msg::Get {
            manifest_url: "s3://b/m.json".into(),
            shard: 1,
            checksum: 2,
            bytes: 3,
            keep: false,
            split: false,
            reader: None,
            job: None,
        };
        let f1 = client.seal(&get);
        assert_eq!(server.open(&body(&f1)).unwrap(), get);
        // Replayed: the same frame again.
        assert!(server.open(&body(&f1)).is_err(), "a replayed frame was accepted");
        // Injected: a frame the relay made, with a made-up MAC.
        let mut forged = body(&encode(&Msg::Freeze));
        forged.extend([0u8; FRAME_TAG_BYTES]);
        assert!(server.open(&forged).is_err(), "an injected frame was accepted");
        // Reflected: the server's own frame sent back to it.
        let f2 = server.seal(&Msg::Ok);
        let e = server.open(&body(&f2)).unwrap_err();
        assert!(e.to_string().contains("frame MAC"), "{e}");
        // The real next frame still passes.
        let f3 = client.seal(&Msg::Freeze);
        assert_eq!(server.open(&body(&f3)).unwrap(), Msg::Freeze);
        // And the server's frames reach the client in order.
        assert_eq!(client.open(&body(&f2)).unwrap(), Msg::Ok);
        // A session of another connection (other nonces) rejects this one's frames.
        let (s2, _) = pair(Some("k"), Some("k")).await;
        assert!(s2.unwrap().open(&body(&client.seal(&Msg::Ok))).is_err());
    }
}
