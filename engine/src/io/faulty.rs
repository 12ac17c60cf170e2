//! A [`CacheIo`] that injects faults into another, for tests: flipped bytes, a full disk.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::hash::hash_prefix;
use super::CacheIo;

/// Faults to inject.
#[derive(Debug, Default)]
pub struct Faults {
    /// Flip a byte in the middle of the next this-many reads.
    pub corrupt_reads: AtomicU64,
    /// Fail the next this-many writes with ENOSPC ("no space left on device").
    pub enospc_writes: AtomicU64,
}

/// A [`CacheIo`] that injects [`Faults`] into another.
pub struct FaultyIo {
    inner: Arc<dyn CacheIo>,
    /// The faults still to inject.
    pub faults: Arc<Faults>,
}

impl FaultyIo {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn CacheIo>) -> FaultyIo {
        FaultyIo {
            inner,
            faults: Arc::default(),
        }
    }
}

fn take(a: &AtomicU64) -> bool {
    a.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

impl CacheIo for FaultyIo {
    fn name(&self) -> &'static str {
        "faulty"
    }
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let (b, _) = self.inner.read_file(path, hash_skip_tail)?;
        let mut v = b.to_vec();
        if take(&self.faults.corrupt_reads) && !v.is_empty() {
            let mid = v.len() / 2;
            v[mid] ^= 0x40;
        }
        // Hash what is returned, so an injected flip is seen by the checksum as a real one would be.
        let h = hash_prefix(&v, hash_skip_tail);
        Ok((Bytes::from(v), h))
    }
    fn write_file(&self, path: &Path, data: Bytes) -> io::Result<()> {
        if take(&self.faults.enospc_writes) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.inner.write_file(path, data)
    }
}
