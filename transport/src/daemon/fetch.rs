//! The shard chain of the daemon: the cache, else one flight per shard through the engine's
//! fetch chain (`ramjet_engine::chain`: the cache again, the owner peer when this daemon is
//! not the owner and the request is local, the origin), verified, then cached; and the health
//! of the peers asked.

use super::{Body, FlightOut, Inner, PeerState, Req};
use crate::error::Error;
use crate::peer::ShardGet;
use crate::stats::PeerHealth;
use bytes::Bytes;
use ramjet_engine::cache::ShardId;
use ramjet_engine::chain::{Outcome, ShardAt, Step, Upstream, UpstreamFetch};
use ramjet_engine::FetchedFrom;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// The shard's owner peer as a step of the daemon's fetch chain: its bytes are verified by
/// the chain; its health follows each answer.
struct OwnerPeer<'a> {
    inner: &'a Arc<Inner>,
    owner: String,
    what: String,
    /// `owner` is the split shard's reader, not its ring owner: it keeps the shard.
    reader: bool,
}

impl Upstream for OwnerPeer<'_> {
    fn fetch<'a>(&'a self, at: &'a ShardAt<'a>) -> UpstreamFetch<'a> {
        Box::pin(async move {
            let get = ShardGet {
                manifest_url: at.ds.manifest_url().to_owned(),
                shard: at.shard as u32,
                checksum: at.id.checksum,
                bytes: at.id.bytes,
                what: self.what.clone(),
                keep: self.reader,
            };
            let b = self.inner.transport.fetch(&self.owner, &get).await?;
            Ok((b, FetchedFrom::CachePeer))
        })
    }

    fn outcome(&self, at: &ShardAt<'_>, outcome: Outcome) {
        match outcome {
            Outcome::Delivered(_) => {
                self.inner
                    .stats
                    .peer_fetched_bytes
                    .fetch_add(at.id.bytes, Ordering::Relaxed);
                self.inner.peer_ok(&self.owner)
            }
            Outcome::Corrupt(e) => {
                self.inner.stats.peer_corrupt.fetch_add(1, Ordering::Relaxed);
                self.inner.peer_failed(
                    &self.owner,
                    Error::peer(&self.owner, format!("sent a corrupt {}: {e}", self.what)),
                );
            }
            Outcome::Failed(e) => {
                let why = match e.downcast::<Error>() {
                    Ok(e) => *e,
                    Err(e) => Error::peer(&self.owner, e.to_string()),
                };
                self.inner.peer_failed(&self.owner, why);
            }
        }
    }
}

/// Who asks the daemon for a shard, which decides where a flight may read it and whether the
/// daemon keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Asker {
    /// Another daemon (this one owns the shard on the ring): the origin only.
    Peer,
    /// A loader on this host: the owner peer when another daemon owns the shard, else the
    /// origin; kept when this daemon owns it.
    Local,
    /// A loader on this host whose shard is its node's own share every epoch (a node-affine
    /// deal of a sticky order): the origin, never a peer, and kept here whoever owns it, so
    /// the node's later epochs read its own disk.
    Keeper,
    /// A keeper's shard that another node reads too (a cut between two nodes' windows splits
    /// it): the request's `via` peer (the shard's reader), else the owner peer when another
    /// daemon owns the shard (so the origin serves it once for the cluster), else the origin;
    /// kept here whoever owns it.
    SplitKeeper,
    /// Another daemon whose node reads this split shard too, this daemon's node being its
    /// reader: the origin only, and kept here for this node's loaders.
    PeerKeeper,
}

impl Asker {
    /// Whether a flight for this asker may read the shard from its owner peer.
    fn may_ask_peer(self) -> bool {
        matches!(self, Asker::Local | Asker::SplitKeeper)
    }
}

/// Whether the daemon caches what `asker` asked for whoever owns it on the ring.
fn keep_here(asker: Asker) -> bool {
    matches!(asker, Asker::Keeper | Asker::SplitKeeper | Asker::PeerKeeper)
}

impl Inner {
    /// A shard for a local loader or a peer: the cache, else the flight for it.
    pub(super) async fn serve(self: &Arc<Self>, req: &Req, asker: Asker) -> Result<(Body, FetchedFrom, u64), Error> {
        let (c, id) = (self.cache.clone(), req.id);
        let hit = tokio::task::spawn_blocking(move || c.shard(id))
            .await
            .map_err(|e| Error::Internal(format!("cache task: {e}")))??;
        if let Some(f) = hit {
            return Ok((Body::File(f), FetchedFrom::CacheLocal, id.bytes));
        }
        let (bytes, src) = self.obtain(req, asker.may_ask_peer(), keep_here(asker)).await?;
        let (c, b) = (self.cache.clone(), bytes.clone());
        let keep = keep_here(asker);
        let f = tokio::task::spawn_blocking(move || {
            // A flight this request joined (another's, that left the shard to its owner); a
            // keeper keeps it all the same.
            if keep && !c.contains(id) {
                if let Err(e) = c.insert(id, &b) {
                    tracing::warn!(error = %e, "cache insert of the node's own shard failed; serving from memory");
                }
            }
            c.shard(id)
        })
        .await
        .map_err(|e| Error::Internal(format!("cache task: {e}")))?;
        let body = match f {
            Ok(Some(f)) => Body::File(f),
            _ => Body::Memory(bytes),
        };
        Ok((body, src, id.bytes))
    }

    /// Joins the flight for the shard, or starts it; a flight started with `keep` caches the
    /// shard here whoever owns it.
    pub(super) async fn obtain(self: &Arc<Self>, req: &Req, allow_peer: bool, keep: bool) -> FlightOut {
        // Whether a flight started here would ask a peer: only for a local request, when the
        // owner is another daemon that is not backing off. A peer's request joins only flights
        // that go to the origin, so a request never returns to a daemon it came from.
        let asks_peer = allow_peer && {
            let peer = req.via.clone().or_else(|| {
                self.membership
                    .read()
                    .expect("membership lock")
                    .ring()
                    .owner(req.id)
                    .map(str::to_owned)
            });
            peer.is_some_and(|o| o != self.me && self.peer_usable(&o))
        };
        // The flight runs as its own task (`ramjet_engine::singleflight`): it completes (and
        // fills the cache) even if the request that started it goes away.
        let join: &[(ShardId, bool)] = if allow_peer {
            &[(req.id, false), (req.id, true)]
        } else {
            &[(req.id, false)]
        };
        let (me, r) = (self.clone(), req.clone());
        let (flight, joined) = self.flights.join_or_start(
            join,
            (req.id, asks_peer),
            move || {
                let stopped = me.stopped();
                async move {
                    tokio::select! {
                        out = me.fetch_and_store(&r, asks_peer, keep) => out,
                        _ = stopped => Err(Error::Stopping),
                    }
                }
            },
            |why| Err(Error::Internal(format!("fetch task failed: {why}"))),
        );
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
                self.origin(req).await.map(|b| (b, FetchedFrom::Origin))
            }
        }
    }

    pub(super) async fn origin(&self, req: &Req) -> Result<Bytes, Error> {
        req.ds
            .fetch_shard_parallel(
                req.shard,
                req.ds
                    .store()
                    .origin()
                    .map_or(self.cfg.range_bytes, |o| o.range_bytes(self.cfg.range_bytes)),
                self.cfg.ranges_in_flight,
                &self.metrics,
            )
            .await
            .map_err(Error::from)
    }

    /// The flight, through the fetch chain (`ramjet_engine::chain`, the same as a loader's
    /// stream): the cache (a flight that finished between this request's cache lookup and its
    /// start has left the shard there), else the owner peer (for local requests), else the
    /// origin; verified; cached when this daemon owns the shard, or keeps it (`keep`: a
    /// keeper's flight caches before it completes, so a second loader of the node asking just
    /// after it finds the cache, not a new flight to the origin).
    pub(super) async fn fetch_and_store(self: &Arc<Self>, req: &Req, allow_peer: bool, keep: bool) -> FlightOut {
        let owner = {
            let m = self.membership.read().expect("membership lock");
            m.ring().owner(req.id).map(str::to_owned)
        };
        let at = ShardAt {
            ds: &req.ds,
            shard: req.shard,
            id: req.id,
            // The origin control's rule (`ramjet_engine::tune::OriginTune::range_bytes`).
            range_bytes: req
                .ds
                .store()
                .origin()
                .map_or(self.cfg.range_bytes, |o| o.range_bytes(self.cfg.range_bytes)),
            ranges_in_flight: self.cfg.ranges_in_flight,
        };
        let peer = req
            .via
            .clone()
            .or_else(|| owner.clone())
            .filter(|o| allow_peer && *o != self.me && self.peer_usable(o))
            .map(|peer| OwnerPeer {
                inner: self,
                owner: peer,
                what: req.describe(),
                reader: req.via.is_some(),
            });
        let mut steps = vec![Step::Cache(&self.cache)];
        if let Some(p) = &peer {
            steps.push(Step::Upstream(p));
        }
        steps.push(Step::Origin);
        let got = ramjet_engine::chain::fetch(&steps, &at, &self.metrics).await?;
        let (bytes, src) = (got.bytes, got.from);
        // Each node caches the shards it owns, so the cluster's caches add up instead of
        // all holding the same hot set; the others are served from memory.
        if src == FetchedFrom::CacheLocal || (!keep && owner.as_deref().is_some_and(|o| o != self.me)) {
            return Ok((bytes, src));
        }
        let (c, id, b) = (self.cache.clone(), req.id, bytes.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(e) = c.insert(id, &b) {
                tracing::warn!(error = %e, "cache insert failed; serving from memory");
            }
        })
        .await
        .map_err(|e| Error::Internal(format!("cache insert task: {e}")))?;
        Ok((bytes, src))
    }

    pub(super) fn peer_usable(&self, peer: &str) -> bool {
        let peers = self.peers.lock().expect("peers lock");
        peers
            .get(peer)
            .and_then(|p| p.down_until)
            .is_none_or(|t| Instant::now() >= t)
    }

    pub(super) fn peer_ok(&self, peer: &str) {
        let mut peers = self.peers.lock().expect("peers lock");
        let p = peer_entry(&mut peers, peer);
        p.health.healthy = true;
        p.health.fetched += 1;
        p.down_until = None;
    }

    pub(super) fn peer_failed(&self, peer: &str, why: Error) {
        tracing::warn!(peer, error = %why, "peer fetch failed; reading the origin");
        let mut peers = self.peers.lock().expect("peers lock");
        let p = peer_entry(&mut peers, peer);
        p.health.healthy = false;
        p.health.failures += 1;
        p.health.last_error = Some(why.to_string());
        p.down_until = Some(Instant::now() + self.cfg.peer_backoff);
        drop(peers);
        self.transport.forget(peer);
    }
}

pub(super) fn new_peer() -> PeerState {
    PeerState {
        health: PeerHealth {
            healthy: true,
            ..Default::default()
        },
        down_until: None,
    }
}

pub(super) fn peer_entry<'a>(peers: &'a mut HashMap<String, PeerState>, peer: &str) -> &'a mut PeerState {
    peers.entry(peer.to_owned()).or_insert_with(new_peer)
}
