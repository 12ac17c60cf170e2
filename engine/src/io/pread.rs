//! `pread`/`pwrite`: the fallback where io_uring is unavailable.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use bytes::Bytes;

use super::hash::ChunkHasher;
use super::{no_memory, CacheIo, IO_CHUNK_BYTES};
use crate::buf::BufPool;

/// `pread`/`pwrite`, buffered through the page cache.
#[derive(Debug, Default)]
pub struct PreadIo;

impl CacheIo for PreadIo {
    fn name(&self) -> &'static str {
        "pread"
    }
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let f = File::open(path)?;
        let len = f.metadata()?.len() as usize;
        // SAFETY: read_exact_at fills all of [0, len) or fails, and the buffer is dropped unread.
        let mut buf = unsafe { BufPool::global().try_take(len) }.ok_or_else(|| no_memory(len))?;
        let mut h = ChunkHasher::new(len, hash_skip_tail);
        let dst = buf.as_mut_slice();
        let mut off = 0;
        while off < len {
            let n = (len - off).min(IO_CHUNK_BYTES);
            f.read_exact_at(&mut dst[off..off + n], off as u64)?;
            h.done(off / IO_CHUNK_BYTES, |r| &dst[r]);
            off += n;
        }
        Ok((buf.into_bytes(), h.finish()))
    }
    fn write_file(&self, path: &Path, data: Bytes) -> io::Result<()> {
        let f = OpenOptions::new().write(true).create_new(true).open(path)?;
        f.write_all_at(&data, 0)
    }
}
