//! Loaders on the Unix socket: requests answered with the cache file's descriptor (or the
//! bytes), from this user only.

use super::budget::Class;
use super::fetch::Asker;
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

/// Sealed in-memory copies of cached shards, by shard, least recently used first out, at most
/// `max` bytes. A host of N ranks reads each shard whole in every rank: handing each the cache
/// file made each copy it into its own memory (a loader copies a file it does not own, so no
/// other process can change it under it), N copies into fresh pages. A sealed memfd can never
/// change, so every rank maps the same pages instead: one copy on the host. Each rank still
/// verifies what it maps.
///
/// A lone consumer gets one too when it reads a shard again that was handed out within the
/// last `max` bytes (`seen`): another epoch, or a trainer restarted on the host, whose working
/// set the copies can hold. Its next read then maps pages that already exist instead of
/// copying into fresh ones. A single pass over a dataset larger than `max` makes no copies.
pub(super) struct SharedShards {
    map: std::collections::HashMap<ShardId, (File, u64, u64)>,
    bytes: u64,
    max: u64,
    tick: u64,
    /// Shards handed out without a copy, oldest first, at most `max` bytes of them.
    seen: std::collections::VecDeque<(ShardId, u64)>,
    seen_ids: std::collections::HashSet<ShardId>,
    seen_bytes: u64,
}

impl SharedShards {
    pub(super) fn new(max: u64) -> SharedShards {
        SharedShards {
            map: Default::default(),
            bytes: 0,
            max,
            tick: 0,
            seen: Default::default(),
            seen_ids: Default::default(),
            seen_bytes: 0,
        }
    }

    /// Whether a request for shard `id` (`n` bytes) should get the shared copy: one exists,
    /// several consumers are live, or the shard was handed out lately (a re-read). A shard
    /// handed out without a copy is remembered for the next request.
    fn wanted(&mut self, id: ShardId, n: u64, consumers: usize) -> bool {
        if self.max == 0 || n > self.max {
            return false;
        }
        if self.map.contains_key(&id) || consumers >= 2 || self.seen_ids.contains(&id) {
            return true;
        }
        self.seen.push_back((id, n));
        self.seen_ids.insert(id);
        self.seen_bytes += n;
        while self.seen_bytes > self.max {
            let Some((old, b)) = self.seen.pop_front() else { break };
            self.seen_ids.remove(&old);
            self.seen_bytes -= b;
        }
        false
    }

    fn get(&mut self, id: ShardId) -> Option<std::io::Result<File>> {
        self.tick += 1;
        let tick = self.tick;
        self.map.get_mut(&id).map(|e| {
            e.2 = tick;
            e.0.try_clone()
        })
    }

    fn insert(&mut self, id: ShardId, f: &File, n: u64) {
        if n > self.max || self.map.contains_key(&id) {
            return;
        }
        while self.bytes + n > self.max {
            let Some(old) = self.map.iter().min_by_key(|(_, e)| e.2).map(|(k, _)| *k) else {
                break;
            };
            if let Some(e) = self.map.remove(&old) {
                self.bytes -= e.1;
            }
        }
        if let Ok(c) = f.try_clone() {
            self.tick += 1;
            self.map.insert(id, (c, n, self.tick));
            self.bytes += n;
        }
    }
}

/// The shared sealed copy of a cached shard (`SharedShards`), made from the cache file when
/// there is none yet (a kernel copy, off the runtime's threads).
async fn shared_copy(
    inner: &Arc<Inner>,
    id: ShardId,
    f: &ramjet_engine::cache::CachedShard,
    n: u64,
) -> std::io::Result<File> {
    if let Some(r) = inner.shared.lock().expect("shared lock").get(id) {
        inner.stats.shared_hits.fetch_add(1, Ordering::Relaxed);
        return r;
    }
    let src = f.hand_out().map_err(std::io::Error::other)?;
    let copy = tokio::task::spawn_blocking(move || sys::memfd_from_file("ramjet-shared-shard", &src, n))
        .await
        .map_err(std::io::Error::other)??;
    inner.shared.lock().expect("shared lock").insert(id, &copy, n);
    inner.stats.shared_copies.fetch_add(1, Ordering::Relaxed);
    Ok(copy)
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
                keep,
                split,
                reader,
                job,
            } => {
                let t = Instant::now();
                // A split shard with a reader node: through that node's daemon, once the job's
                // heartbeats name it; else from the origin.
                let via = match (keep && split, reader, &job) {
                    (true, Some(n), Some(job)) => Some(inner.reader_daemon(job, n).await),
                    _ => None,
                };
                let asker = match (keep, split, &via) {
                    (true, true, Some(None)) => Asker::Keeper,
                    (true, true, _) => Asker::SplitKeeper,
                    (true, false, _) => Asker::Keeper,
                    _ => Asker::Local,
                };
                let r = match inner.resolve(&manifest_url, shard, checksum, bytes).await {
                    Ok(mut req) => {
                        req.via = via.flatten();
                        inner.serve(&req, asker).await
                    }
                    Err(e) => {
                        inner.stats.requests_refused.fetch_add(1, Ordering::Relaxed);
                        Err(e)
                    }
                };
                match r {
                    Ok((body, src, n)) => {
                        let id = ShardId { checksum, bytes };
                        // Several consumers on this host, or a shard read again: one sealed copy
                        // they all map.
                        let live = inner.jobs.live();
                        let share = matches!(body, Body::File(_))
                            && inner.shared.lock().expect("shared lock").wanted(id, n, live);
                        let (_pinned, file) = match body {
                            Body::File(f) if share => match shared_copy(inner, id, &f, n).await {
                                Ok(file) => (Some(f), file),
                                Err(e) => {
                                    inner.stats.failures.fetch_add(1, Ordering::Relaxed);
                                    let message = format!("shared copy of shard {checksum:016x}: {e}");
                                    wire::write_msg(&mut s, &Msg::Fail { message }).await?;
                                    continue;
                                }
                            },
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
                let (consumer, job, rank, pace) = (beat.consumer.clone(), beat.job.clone(), beat.rank, beat.pace);
                let reply = match inner.jobs.beat(beat) {
                    // The consumer's share of the host's budgets (none for one that does not
                    // decode), and its job's pace to a loader that asks.
                    Ok(()) => {
                        let grant =
                            inner
                                .jobs
                                .grant(&consumer, inner.cfg.decode_threads as u64, inner.cfg.host_memory_bytes);
                        match (pace, grant) {
                            (true, grant) => Msg::Beat {
                                grant,
                                job: inner.job_pace(&job, rank),
                            },
                            (false, Some(g)) => Msg::Grant(g),
                            (false, None) => Msg::Ok,
                        }
                    }
                    Err(e) => Msg::Fail { message: e.to_string() },
                };
                wire::write_msg(&mut s, &reply).await?;
            }
            Msg::Ping => wire::write_msg(&mut s, &Msg::Ok).await?,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn id(i: u64) -> ShardId {
        ShardId {
            checksum: i,
            bytes: 100,
        }
    }

    #[test]
    fn a_shard_asked_for_again_within_the_budget_is_shared_and_a_longer_pass_is_not() {
        let mut s = SharedShards::new(300);
        // A lone consumer's first pass: nothing shared, each shard remembered.
        assert!(!s.wanted(id(1), 100, 1));
        assert!(!s.wanted(id(2), 100, 1));
        // Asked for again within 300 bytes of shards handed out: shared.
        assert!(s.wanted(id(1), 100, 1));
        // Two more push shard 1 out of the last 300 bytes (1, 2, 3, 4: 400).
        assert!(!s.wanted(id(3), 100, 1));
        assert!(!s.wanted(id(4), 100, 1));
        assert!(!s.wanted(id(1), 100, 1));
        // Several consumers: always; a held copy: always; larger than the budget, or none: never.
        assert!(s.wanted(id(9), 100, 2));
        let f = tempfile::tempfile().expect("temp file");
        s.insert(id(7), &f, 100);
        assert!(s.wanted(id(7), 100, 1));
        assert!(!s.wanted(id(8), 301, 3));
        assert!(!SharedShards::new(0).wanted(id(1), 1, 3));
    }
}
