//! Shards from somewhere other than this process: the host's cache daemon.
//!
//! The engine defines the seam; `ramjet-transport` implements it with a client of the
//! host daemon (`ramjet serve`), which owns the node-local cache and the peer ring. A
//! [`Stream`](crate::Stream) with a provider asks it for every whole shard and verifies what
//! comes back; if the provider fails, the stream falls back to its own cache and the origin.

use bytes::Bytes;

use crate::cache::ShardId;
use crate::error::Result;

/// Where a shard's bytes came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FetchedFrom {
    /// This host's cache.
    CacheLocal,
    /// Another host's cache (the shard's owner in the ring).
    CachePeer,
    /// The object store.
    Origin,
}

impl FetchedFrom {
    /// Every place a shard is fetched from, in report order.
    pub const ALL: [FetchedFrom; 3] = [FetchedFrom::CacheLocal, FetchedFrom::CachePeer, FetchedFrom::Origin];

    /// Stable name (`cache_local`, `cache_peer`, `origin`).
    pub fn name(self) -> &'static str {
        match self {
            FetchedFrom::CacheLocal => "cache_local",
            FetchedFrom::CachePeer => "cache_peer",
            FetchedFrom::Origin => "origin",
        }
    }

    /// Parses [`FetchedFrom::name`].
    pub fn parse(s: &str) -> Option<FetchedFrom> {
        Self::ALL.into_iter().find(|x| x.name() == s)
    }

    /// Index into per-source arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// One whole shard, named by its dataset and content.
#[derive(Debug, Clone)]
pub struct ShardRequest<'a> {
    /// URL of the dataset's manifest object.
    pub manifest_url: &'a str,
    /// Shard index in the manifest.
    pub shard: u32,
    /// The shard's content identity (from the manifest).
    pub id: ShardId,
}

/// A shard as a provider delivers it (not yet verified by the caller).
#[derive(Debug, Clone)]
pub struct Fetched {
    /// The whole shard.
    pub bytes: Bytes,
    /// Where it came from.
    pub from: FetchedFrom,
}

/// A supplier of whole shards. Blocking: the stream calls it from a blocking task.
pub trait ShardProvider: Send + Sync + std::fmt::Debug {
    /// Fetches one whole shard.
    fn fetch(&self, req: &ShardRequest<'_>) -> Result<Fetched>;

    /// Tells the provider that the bytes it delivered for `req` failed verification, so it
    /// drops its copy instead of serving it again.
    fn report_corrupt(&self, req: &ShardRequest<'_>);
}
