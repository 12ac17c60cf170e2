//! The transport's one error type. Every variant names what failed: the peer, the request (its
//! manifest URL and shard), the RDMA device, or the malformed value.
//!
//! Flights are shared by every request waiting on the same shard, so the error is `Clone`: the
//! engine's error is kept whole behind an `Arc` (its kind and the object it names intact), and
//! only causes that are no error of ramjet's (a task that panicked) are kept as their message.

use std::sync::Arc;

/// What went wrong in the daemon, its peers or its client.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request refused before anything was fetched: a malformed or disallowed URL, a
    /// manifest that does not open, a shard whose identity does not match.
    #[error("{0}")]
    Refused(String),
    /// A peer failed, stalled, lied or could not be reached.
    #[error("peer {peer}: {reason}")]
    Peer {
        /// The peer, `host:port`.
        peer: String,
        /// What happened.
        reason: String,
    },
    /// The origin, the cache or verification failed: the engine's error itself.
    #[error("{0}")]
    Engine(Arc<ramjet_engine::Error>),
    /// A task of the daemon's own failed (panicked or was cancelled), or a cached shard could
    /// not be handed out: what it was doing and why.
    #[error("{0}")]
    Internal(String),
    /// The RDMA device, a registration or a transfer failed.
    #[error("{0}")]
    Rdma(String),
    /// A malformed value: a member list, a host list.
    #[error("{0}")]
    Invalid(String),
    /// The daemon is stopping: work in flight was abandoned.
    #[error("the daemon is stopping")]
    Stopping,
}

impl Error {
    /// A peer's failure.
    pub fn peer(peer: &str, reason: impl Into<String>) -> Error {
        Error::Peer {
            peer: peer.to_owned(),
            reason: reason.into(),
        }
    }
}

impl Error {
    /// The engine's error inside, if this is one.
    pub fn engine(&self) -> Option<&ramjet_engine::Error> {
        match self {
            Error::Engine(e) => Some(e),
            _ => None,
        }
    }
}

impl From<ramjet_engine::Error> for Error {
    fn from(e: ramjet_engine::Error) -> Error {
        Error::Engine(Arc::new(e))
    }
}

/// Equal kinds with equal messages (the engine's error has no equality of its own).
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other) && self.to_string() == other.to_string()
    }
}

impl Eq for Error {}

/// The transport's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
