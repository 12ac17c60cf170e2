//! The transport's one error type. Every variant names what failed: the peer, the request (its
//! manifest URL and shard), the RDMA device, or the malformed value.
//!
//! Flights are shared by every request waiting on the same shard, so the error is `Clone`, and
//! causes from other crates (the engine's errors, `io::Error`) are kept as their message.

/// What went wrong in the daemon, its peers or its client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// The origin, the cache or verification failed (the engine's error, as text).
    #[error("{0}")]
    Engine(String),
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

impl From<ramjet_engine::Error> for Error {
    fn from(e: ramjet_engine::Error) -> Error {
        Error::Engine(e.to_string())
    }
}

/// The transport's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
