//! Peer networking for ramjet: the host cache daemon (`ramjet serve`), the consistent-hash
//! ring of daemons, cluster-wide singleflight, and the authenticated wire protocol.
//!
//! This crate is a placeholder in the foundation release: the cluster issue fills it. It
//! depends on `ramjet-engine` and nothing depends on it except `tools` and `bindings`.
#![deny(missing_docs)]

/// Version of the peer wire protocol this build will speak.
pub const WIRE_PROTOCOL_VERSION: u16 = 0;
