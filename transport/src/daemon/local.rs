//! Loaders on the Unix socket: requests answered with the cache file's descriptor (or the
//! bytes), from this user only.

use super::budget::Class;
use super::{Body, Inner};
use crate::sys;
use crate::wire;
use crate::wire::Msg;
use ramjet_engine::cache::ShardId;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;
use tokio::io::Interest;
use tokio::net::UnixListener;
use tokio::net::UnixStream;

pub(super) async fn serve_local(inner: Arc<Inner>, l: UnixListener) {
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
                let Some(permit) = inner.conn_permit(Class::Local, None) else {
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

/// Serves one loader connection. Freezes taken on it are leases: those it has not released
/// when it closes (the holder exited, was killed, or dropped its lease) are released then,
/// so a killed trainer never leaves the ring frozen.
pub(super) async fn local_conn(inner: &Arc<Inner>, s: UnixStream) -> std::io::Result<()> {
    let mut held = 0u32;
    let r = local_requests(inner, s, &mut held).await;
    if held > 0 {
        let mut m = inner.membership.write().expect("membership lock");
        for _ in 0..held {
            m.unfreeze();
        }
        tracing::info!(
            released = held,
            frozen = m.frozen(),
            "freeze lease released: its connection closed"
        );
    }
    r
}

async fn local_requests(inner: &Arc<Inner>, mut s: UnixStream, held: &mut u32) -> std::io::Result<()> {
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
                        let (_pinned, file) = match body {
                            Body::File(f) => match f.hand_out() {
                                Ok(file) => (Some(f), file),
                                Err(e) => {
                                    inner.stats.failures.fetch_add(1, Ordering::Relaxed);
                                    let message = e.to_string();
                                    wire::write_msg(&mut s, &Msg::Fail { message }).await?;
                                    continue;
                                }
                            },
                            Body::Memory(b) => (None, sys::memfd_with("ramjet-shard", &b)?),
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
                        wire::write_msg(
                            &mut s,
                            &Msg::Fail {
                                message: message.to_string(),
                            },
                        )
                        .await?;
                    }
                }
            }
            Msg::Corrupt { checksum, bytes } => {
                inner.stats.local_corrupt.fetch_add(1, Ordering::Relaxed);
                inner.cache.remove(ShardId { checksum, bytes });
                wire::write_msg(&mut s, &Msg::Ok).await?;
            }
            Msg::Heartbeat(beat) => {
                let reply = match inner.jobs.beat(beat) {
                    Ok(()) => Msg::Ok,
                    Err(message) => Msg::Fail { message },
                };
                wire::write_msg(&mut s, &reply).await?;
            }
            Msg::Freeze => {
                inner.membership.write().expect("membership lock").freeze();
                *held += 1;
                wire::write_msg(&mut s, &Msg::Ok).await?;
            }
            Msg::Unfreeze if *held == 0 => {
                let message = "unfreeze on a connection that holds no freeze: a freeze is released \
                               by the connection that took it (or when that connection closes)"
                    .to_owned();
                wire::write_msg(&mut s, &Msg::Fail { message }).await?;
            }
            Msg::Unfreeze => {
                *held -= 1;
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
pub(super) async fn send_frame_with_fd(s: &UnixStream, frame: &[u8], file: &File) -> std::io::Result<()> {
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
