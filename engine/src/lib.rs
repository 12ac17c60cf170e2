//! ramjet's core: the shard format and manifest, origin access, and dataset-level
//! operations (open, inspect, verify).
//!
//! The path of one sample reads in one direction: manifest → order → plan → fetch chain →
//! bytes → decode → batch. This crate owns every step that needs neither a GPU nor a network
//! peer. See `docs/architecture.md`.
#![deny(missing_docs)]

pub mod buf;
pub mod cache;
pub mod chain;
pub mod dataset;
pub mod error;
pub mod filter;
pub mod foreign;
pub mod format;
pub mod image;
pub mod io;
pub mod launch;
pub mod loader;
pub mod metrics;
pub mod order;
pub mod pace;
pub mod provider;
pub mod rt;
pub mod singleflight;
pub mod size;
pub mod stall;
pub mod store;
pub mod stream;
pub mod tokens;
pub mod tune;

pub use dataset::{Dataset, ShardProblem, VerifyReport};
pub use error::{Error, Invalid, Location, Result};
pub use loader::{Batch, ColumnData, EpochEnd, Loader, LoaderConfig, Next, OnCorrupt};
pub use provider::{Fetched, FetchedFrom, Heartbeat, HostGrant, ShardProvider, ShardRequest};
pub use store::{DatasetUrl, RetryPolicy, Store, StoreConfig};
pub use stream::{Item, Opened, Sample, SampleReader, SourceConfig, SplitShards, Stream, StreamConfig, StreamState};
