//! ramjet's host daemon and peer cluster: the consistent-hash ring, cluster-wide
//! singleflight, the authenticated wire protocol, and the client loaders use.
//!
//! See `docs/cluster.md` (operators) and `docs/protocol.md` (the bytes).
#![deny(missing_docs)]

pub mod client;
pub mod daemon;
pub mod error;
pub mod hostlist;
pub mod peer;
pub mod prometheus;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod ring;
pub mod skew;
pub mod stats;
pub mod sys;
pub mod wire;

pub use client::{default_socket, ensure_daemon, DaemonClient, FreezeLease, HostDaemon};
pub use daemon::{read_members, Daemon, DaemonConfig, TransportKind};
pub use error::Error;
pub use peer::{PeerTransport, ShardGet, TcpTransport};
pub use ring::{Membership, Ring};
pub use stats::{ClusterDoc, NodeSummary, ReadyDoc, StatsDoc};
