//! The checksum a read computes in the same pass: chunks hashed in order while they are hot in
//! the CPU's cache.

use super::IO_CHUNK_BYTES;

/// Hashes a file's chunks in order as their reads complete (completions may come out of order).
pub(crate) struct ChunkHasher {
    hasher: Option<crate::format::ShardHasher>,
    limit: usize,
    next: usize,
    ready: Vec<bool>,
}

impl ChunkHasher {
    pub(crate) fn new(len: usize, skip_tail: usize) -> Self {
        ChunkHasher {
            hasher: (len >= skip_tail).then(crate::format::ShardHasher::default),
            limit: len.saturating_sub(skip_tail),
            next: 0,
            ready: vec![false; len.div_ceil(IO_CHUNK_BYTES)],
        }
    }

    /// Chunk `i` is complete: hash every chunk now contiguous from the start. `bytes(range)`
    /// gives the bytes of a range of completed chunks (and is only asked for such ranges).
    pub(crate) fn done<'a>(&mut self, i: usize, bytes: impl Fn(std::ops::Range<usize>) -> &'a [u8]) {
        self.ready[i] = true;
        while self.next < self.ready.len() && self.ready[self.next] {
            if let Some(h) = self.hasher.as_mut() {
                let start = (self.next * IO_CHUNK_BYTES).min(self.limit);
                let end = ((self.next + 1) * IO_CHUNK_BYTES).min(self.limit);
                h.update(bytes(start..end));
            }
            self.next += 1;
        }
    }

    pub(crate) fn finish(self) -> Option<u64> {
        self.hasher.map(|h| h.digest())
    }
}

/// xxh3-64 of the first `len - skip_tail` bytes, when there are at least `skip_tail`.
pub(crate) fn hash_prefix(b: &[u8], skip_tail: usize) -> Option<u64> {
    (b.len() >= skip_tail).then(|| crate::format::shard_checksum(&b[..b.len() - skip_tail]))
}
