//! Peer connections: the authenticated handshake, shard requests, and the bytes sent over TCP
//! (sendfile) or written over RDMA.

use super::budget::Class;
use super::budget::Permit;
use super::fetch::Asker;
use super::{Body, Inner};
use crate::error::Error;
use crate::sys;
use crate::wire;
use crate::wire::HandshakeError;
use crate::wire::Msg;
use std::fs::File;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpListener;
use tokio::net::TcpStream;

pub(super) async fn serve_peers(inner: Arc<Inner>, l: TcpListener) {
    loop {
        match l.accept().await {
            Ok((s, from)) => {
                // Until the handshake completes, the connection holds a place among the
                // handshakes (bounded per address); then one among the peers.
                let Some(permit) = inner.conn_permit(Class::Handshake, Some(from.ip())) else {
                    continue;
                };
                let inner2 = inner.clone();
                inner.spawn(async move {
                    let inner = inner2;
                    if let Err(e) = peer_conn(&inner, s, from, permit).await {
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

/// The peer handshake (authenticated with the API key), bounded by the handshake timeout;
/// `None` when the peer was refused or too slow (counted, logged), an error when the
/// connection failed.
async fn handshake(inner: &Inner, s: &mut TcpStream, from: SocketAddr) -> std::io::Result<Option<wire::Session>> {
    let hs = tokio::time::timeout(inner.cfg.handshake_timeout, wire::accept(s, inner.cfg.api_key.as_ref())).await;
    if matches!(hs, Ok(Ok(_))) {
        inner.stats.handshakes.fetch_add(1, Ordering::Relaxed);
    } else {
        inner.stats.auth_refused.fetch_add(1, Ordering::Relaxed);
    }
    match hs {
        Ok(Ok(session)) => Ok(Some(session)),
        Ok(Err(HandshakeError::Refused(why))) => {
            tracing::warn!(%from, reason = %why, "peer refused");
            Ok(None)
        }
        Ok(Err(HandshakeError::Io(e))) => Err(e),
        Err(_) => {
            tracing::debug!(%from, timeout = ?inner.cfg.handshake_timeout, "peer handshake timed out");
            Ok(None)
        }
    }
}

pub(super) async fn peer_conn(
    inner: &Arc<Inner>,
    mut s: TcpStream,
    from: SocketAddr,
    handshaking: Permit,
) -> std::io::Result<()> {
    let _ = s.set_nodelay(true);
    let Some(session) = handshake(inner, &mut s, from).await? else {
        return Ok(());
    };
    drop(handshaking);
    let Some(_permit) = inner.conn_permit(Class::Peer, Some(from.ip())) else {
        return Ok(());
    };
    // Every frame from here on is bound to this session.
    let mut s = wire::Channel { stream: s, session };
    let mut rdma = ServerRdma::default();
    loop {
        let msg = match tokio::time::timeout(Duration::from_secs(600), s.recv()).await {
            Ok(m) => m?,
            Err(_) => return Ok(()),
        };
        let (manifest_url, shard, checksum, bytes, keep, target) = match msg {
            Msg::Get {
                manifest_url,
                shard,
                checksum,
                bytes,
                // A peer's request is served as one (origin only, kept by the owner), or, from
                // a node that reads a split shard this node reads from the origin, kept here.
                keep,
                split: _,
                reader: _,
                job: _,
            } => (manifest_url, shard, checksum, bytes, keep, None),
            Msg::GetRdma {
                manifest_url,
                shard,
                checksum,
                bytes,
                addr,
                rkey,
            } => (manifest_url, shard, checksum, bytes, false, Some((addr, rkey))),
            Msg::SummaryRequest => {
                s.send(&inner.summary_msg()).await?;
                continue;
            }
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
            Ok(req) => {
                let asker = if keep { Asker::PeerKeeper } else { Asker::Peer };
                inner.serve(&req, asker).await
            }
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
                    Some(Body::File(f)) => {
                        let file = f.hand_out().map_err(std::io::Error::other)?;
                        send_file(&s.stream, &file, n).await?
                    }
                    Some(Body::Memory(b)) => s.stream.write_all(&b).await?,
                    None => {}
                }
                inner.stats.peer_served.fetch_add(1, Ordering::Relaxed);
                inner.stats.peer_served_bytes.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                let message = e.to_string();
                inner.stats.failures.fetch_add(1, Ordering::Relaxed);
                s.send(&Msg::Fail { message }).await?;
            }
        }
    }
}

/// The owner's RDMA link on one peer connection, once the requester asked for one.
#[cfg(feature = "rdma")]
pub(super) type ServerRdma = Option<crate::rdma::ServerLink>;
/// Without the `rdma` feature there is never a link.
#[cfg(not(feature = "rdma"))]
#[derive(Default)]
pub(super) struct ServerRdma {
    _none: (),
}

/// Answers `rdma_connect`: this side's queue pair, or `fail` when this daemon has no RDMA.
#[cfg(feature = "rdma")]
pub(super) async fn rdma_accept(inner: &Inner, remote: wire::QpInfo, link: &mut ServerRdma) -> Msg {
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
        Err(e) => Msg::Fail { message: e.to_string() },
    }
}

#[cfg(not(feature = "rdma"))]
pub(super) async fn rdma_accept(inner: &Inner, _remote: wire::QpInfo, _link: &mut ServerRdma) -> Msg {
    Msg::Fail {
        message: format!("{} was built without RDMA (cargo feature `rdma`)", inner.me),
    }
}

/// Writes a shard into the requester's region.
#[cfg(feature = "rdma")]
pub(super) async fn rdma_write(link: &ServerRdma, body: Body, n: u64, addr: u64, rkey: u32) -> Result<(), Error> {
    let Some(link) = link else {
        return Err(Error::Rdma("get_rdma before rdma_connect".into()));
    };
    let data = match body {
        Body::File(f) => {
            let file = f
                .hand_out()
                .map_err(|e| Error::Internal(format!("open the cached shard: {e}")))?;
            sys::read_private(&file, n).map_err(|e| Error::Internal(format!("read the cached shard: {e}")))?
        }
        Body::Memory(b) => b,
    };
    link.write(data, addr, rkey).await
}

#[cfg(not(feature = "rdma"))]
pub(super) async fn rdma_write(_link: &ServerRdma, _body: Body, _n: u64, _addr: u64, _rkey: u32) -> Result<(), Error> {
    Err(Error::Rdma(
        "this daemon was built without RDMA (cargo feature `rdma`)".into(),
    ))
}

/// Sends a file with `sendfile`: the bytes go from the page cache to the socket without
/// passing through this process.
pub(super) async fn send_file(s: &TcpStream, f: &File, len: u64) -> std::io::Result<()> {
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
