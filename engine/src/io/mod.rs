//! The per-process I/O core and the cache's disk I/O: one trait, three implementations.
//!
//! - [`UringIo`]: io_uring on the process's I/O core: N threads (`RAMJET_IO_THREADS`, default
//!   the cores), each owning one ring with registered (fixed) buffers; a request is routed to a
//!   ring by its file (so by shard), or to a less loaded ring when that one is busy, through
//!   that thread's own queue, with no lock shared between rings. A ring runs one file at a time
//!   with up to [`IO_CHUNKS_IN_FLIGHT`] chunks in flight and reaps every completion that is
//!   ready at each wake; several files go to several rings at once. Buffered reads and writes
//!   go straight between the page cache and the caller's memory; O_DIRECT (where the
//!   filesystem allows it) reads into a registered destination and writes from the
//!   registered bounce buffers.
//! - [`PreadIo`]: plain `pread`/`pwrite`, the fallback where io_uring is unavailable.
//! - [`FaultyIo`]: wraps another and flips bytes or fails writes, for tests.
//!
//! [`detect`] picks io_uring when a ring can be created, else pread; `RAMJET_CACHE_IO=pread`
//! or `=uring` forces one.
//!
//! Every read lands in a buffer this process owns and is hashed there. Cache files are never
//! mapped: another process that truncates or rewrites one can then make a read fail its
//! checksum (and be fetched again), but never raise SIGBUS in a trainer or change bytes after
//! they were verified (`docs/cache.md`, "Trust model").

use std::io;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

mod bounded;
mod faulty;
mod hash;
mod pread;
mod uring;

pub use crate::buf::IO_ALIGN;
pub use bounded::{read_file_bounded, read_file_bounded_async};

/// The error for a buffer of `len` bytes that could not be had (an address-space limit, a
/// cgroup): a size that comes from a file must fail as an error, never abort the process.
pub(crate) fn no_memory(len: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::OutOfMemory,
        format!("no memory for a buffer of {len} bytes"),
    )
}
pub use faulty::{Faults, FaultyIo};
pub use pread::PreadIo;
pub use uring::{io_threads, own_ring_on_this_thread, UringIo};

/// Size of one registered buffer, and so of one I/O operation (also the unit the read path
/// hashes while it is hot in the CPU's cache).
pub const IO_CHUNK_BYTES: usize = 1 << 20;
/// Registered buffers per ring, and so operations in flight per thread.
pub const IO_CHUNKS_IN_FLIGHT: usize = 8;
/// Kernel io-wq workers of a cache writer's ring (see [`own_ring_on_this_thread`]).
pub const WRITER_IO_WORKERS_MAX: usize = 2;

/// Whole-file reads and writes for the cache.
pub trait CacheIo: Send + Sync {
    /// Name, for logs and benchmark output.
    fn name(&self) -> &'static str;
    /// Reads the whole file and, in the same pass (while each chunk is still in the CPU's
    /// cache), the xxh3-64 of its first `len - hash_skip_tail` bytes, when the file is at least
    /// that long.
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)>;
    /// Creates `path` (which must not exist) and writes `data`. No fsync: a cache file torn by
    /// a power loss fails the hash every read checks, and is fetched again (`docs/cache.md`).
    /// `data` is owned (a cheap `Bytes` handle): an io_uring write runs on an I/O core thread
    /// and keeps its source alive until the kernel is done with it.
    fn write_file(&self, path: &Path, data: Bytes) -> io::Result<()>;
}

/// Picks the cache I/O: io_uring (O_DIRECT when `RAMJET_CACHE_DIRECT=1`) when a ring can be
/// created, else pread; `RAMJET_CACHE_IO=pread|uring` forces one. Another value, or `uring`
/// where no ring can be made, is an error naming the variable (never a panic).
pub fn detect() -> crate::Result<Arc<dyn CacheIo>> {
    detect_disk_io()
}

/// Whether the environment says io_uring must work here (`RAMJET_EXPECT_IO_URING=1`, which CI
/// sets): then the io_uring test suites fail instead of skipping where a ring cannot be made.
pub fn uring_expected() -> bool {
    std::env::var("RAMJET_EXPECT_IO_URING").is_ok_and(|v| v == "1")
}

fn detect_disk_io() -> crate::Result<Arc<dyn CacheIo>> {
    let direct = std::env::var("RAMJET_CACHE_DIRECT").is_ok_and(|v| v == "1");
    // Cache fills bypass the page cache unless told otherwise: a shard is written once and
    // read again only an epoch later, and the copy into the page cache (plus its writeback)
    // cost a cold epoch more CPU than hashing it (docs/benchmarks-history.md).
    let fill_direct = direct || std::env::var("RAMJET_CACHE_FILL").as_deref() != Ok("buffered");
    choose_io(std::env::var("RAMJET_CACHE_IO").ok().as_deref(), direct, fill_direct)
}

/// The cache I/O for a `RAMJET_CACHE_IO` value (`None`: unset).
fn choose_io(forced: Option<&str>, direct: bool, fill_direct: bool) -> crate::Result<Arc<dyn CacheIo>> {
    match forced {
        Some("pread") => return Ok(Arc::new(PreadIo)),
        Some("uring") => {
            return match UringIo::new(direct) {
                Ok(u) => Ok(Arc::new(u.with_direct_fills(fill_direct))),
                Err(e) => Err(crate::Error::invalid(
                    "RAMJET_CACHE_IO=uring",
                    format!("io_uring is unavailable here ({e}); unset it or set pread"),
                )),
            }
        }
        Some(v) => {
            return Err(crate::Error::invalid(
                format!("RAMJET_CACHE_IO={v:?}"),
                "must be pread or uring (or unset: io_uring where it works, else pread)",
            ))
        }
        None => {}
    }
    Ok(match UringIo::new(direct) {
        Ok(u) => Arc::new(u.with_direct_fills(fill_direct)),
        Err(e) => {
            tracing::info!(error = %e, "io_uring unavailable, cache falls back to pread");
            Arc::new(PreadIo)
        }
    })
}

#[cfg(test)]
pub(crate) mod tests {

    #[test]
    fn a_bad_cache_io_setting_is_an_error_naming_the_variable_not_a_panic() {
        let e = super::choose_io(Some("fast"), false, true).err().expect("refused");
        let m = e.to_string();
        assert!(
            m.contains("RAMJET_CACHE_IO=\"fast\"") && m.contains("pread or uring"),
            "{m}"
        );
        assert_eq!(super::choose_io(Some("pread"), false, true).unwrap().name(), "pread");
        assert!(super::choose_io(None, false, true).is_ok());
    }

    use super::*;
    use crate::buf::AlignedBuf;

    /// One suite, run against every implementation available here.
    pub(crate) fn suite(io: &dyn CacheIo) {
        let d = tempfile::tempdir().unwrap();
        for len in [0usize, 1, 4095, 4096, IO_CHUNK_BYTES + 17, 9 * IO_CHUNK_BYTES + 5] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let p = d.path().join(format!("f{len}"));
            io.write_file(&p, Bytes::from(data.clone())).unwrap();
            assert_eq!(
                std::fs::metadata(&p).unwrap().len() as usize,
                len,
                "{} len {len}",
                io.name()
            );
            let (got, h) = io.read_file(&p, 3).unwrap();
            assert_eq!(&got[..], &data[..], "{} len {len}", io.name());
            let want = (len >= 3).then(|| xxhash_rust::xxh3::xxh3_64(&data[..len - 3]));
            assert_eq!(h, want, "{} len {len}: fused hash", io.name());
            // From an aligned buffer, as a shard fetched into a pooled one is written: with
            // O_DIRECT every whole block goes from it in place, and an unaligned tail is written
            // buffered (never padded: the file must not outgrow its data, even for a moment).
            let mut aligned = AlignedBuf::zeroed(len);
            aligned.as_mut().copy_from_slice(&data);
            let p = d.path().join(format!("a{len}"));
            io.write_file(&p, aligned.into_bytes()).unwrap();
            assert_eq!(
                std::fs::read(&p).unwrap(),
                data,
                "{} len {len}, aligned source",
                io.name()
            );
        }
        assert!(
            io.write_file(&d.path().join("f1"), Bytes::from_static(b"x")).is_err(),
            "write_file must not overwrite"
        );
    }

    #[test]
    fn pread_suite() {
        suite(&PreadIo);
    }
}
