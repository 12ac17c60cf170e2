//! Buffers, in one place: the two kinds of memory ramjet reads into and hands out.
//!
//! - [`aligned`]: 4 KiB-aligned buffers for the cache's disk I/O (O_DIRECT needs the block
//!   alignment), reused through one process-wide pool and turned into `Bytes` without a copy.
//! - [`host`]: 64-byte-aligned batch buffers in a bounded pool, allocated through a
//!   [`host::HostAlloc`] (plain memory, or page-locked memory that `ramjet-cuda` supplies);
//!   the device side of pinned memory (`cuda/src/pool.rs`) plugs in here.

pub mod aligned;
pub mod host;

pub use aligned::{AlignedBuf, BufPool, PooledBuf, IO_ALIGN, POOL_RETAINED_BYTES_MAX};
pub use host::{AlignedAlloc, HostAlloc, HostBuf, HostPool, HOST_ALIGN};
