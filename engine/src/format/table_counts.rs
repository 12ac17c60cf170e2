//! A shard table's counts section as held in memory: read once, a piece at a time, checked
//! block by block, and kept packed (`docs/format.md`, "The counts section in memory").
//!
//! Each block of [`SHARD_TABLE_BLOCK_RECORDS`] counts keeps once the high bits its counts all
//! share, and a count at a time only the bits below them: a block of equal counts takes no
//! bits, counts from 300 to 600 take 10 bits a shard instead of the section's 32.
//! A block whose counts fail their checks is kept as that failure, so using one of its shards
//! names it and every other block stays usable.

use std::sync::Arc;

use xxhash_rust::xxh3::Xxh3;

use super::table::SHARD_TABLE_BLOCK_RECORDS;

/// Bytes of the section read at a time (256 blocks' counts): the whole section is never held
/// as read.
pub(super) const COUNTS_PIECE_BYTES: usize = 4 * SHARD_TABLE_BLOCK_RECORDS * 256;

/// One block's counts, packed, or why they were refused.
#[derive(Debug, Clone)]
enum Block {
    Packed { base: u32, bits: u32, word: usize },
    Refused(Arc<str>),
}

/// The counts section, packed block by block.
#[derive(Debug, Default)]
pub(super) struct Counts {
    blocks: Vec<Block>,
    words: Vec<u64>,
}

impl Counts {
    /// Shard `i`'s count, or why its block was refused (`i` below the section's shards).
    pub(super) fn get(&self, i: usize) -> Result<u32, Arc<str>> {
        let (b, j) = (i / SHARD_TABLE_BLOCK_RECORDS, i % SHARD_TABLE_BLOCK_RECORDS);
        match &self.blocks[b] {
            Block::Refused(why) => Err(why.clone()),
            Block::Packed { base, bits: 0, .. } => Ok(*base),
            &Block::Packed { base, bits, word } => {
                let bit = j * bits as usize;
                let (w, s) = (word + bit / 64, (bit % 64) as u32);
                let mut v = self.words[w] >> s;
                if s + bits > 64 {
                    v |= self.words[w + 1] << (64 - s);
                }
                Ok(base | (v & ((1u64 << bits) - 1)) as u32)
            }
        }
    }

    /// Appends the next block, `counts` (its checks passed; `brief` its brief), packed: the
    /// bits the counts share with the first are kept once, the rest a count at a time.
    fn push(&mut self, counts: &[u32], brief: Brief) {
        let bits = brief.bits();
        let low = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
        let base = counts.first().map_or(0, |&c| c & !low);
        let word = self.words.len();
        self.blocks.push(Block::Packed { base, bits, word });
        if bits == 0 {
            return;
        }
        self.words.resize(word + (counts.len() * bits as usize).div_ceil(64), 0);
        for (j, &c) in counts.iter().enumerate() {
            let (v, bit) = (u64::from(c & low), j * bits as usize);
            let (w, s) = (word + bit / 64, (bit % 64) as u32);
            self.words[w] |= v << s;
            if s + bits > 64 {
                self.words[w + 1] |= v >> (64 - s);
            }
        }
    }

    /// Bytes held.
    pub(super) fn held_bytes(&self) -> usize {
        self.words.len() * 8 + self.blocks.len() * std::mem::size_of::<Block>()
    }
}

/// One block's counts in brief, for its checks and its packing: whether one is 0, their sum,
/// and the bits in which they differ from the first (their spread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Brief {
    pub(super) zero: bool,
    pub(super) sum: u64,
    spread: u32,
}

impl Brief {
    /// The brief of `counts`, in one pass of plain SIMD (or, xor, add: no unsigned minimum,
    /// which the baseline x86-64 lacks).
    fn of(counts: &[u32]) -> Brief {
        let first = counts.first().copied().unwrap_or(0);
        let (mut zero, mut sum, mut spread) = (false, 0u64, 0u32);
        for &c in counts {
            zero |= c == 0;
            sum += u64::from(c);
            spread |= c ^ first;
        }
        Brief { zero, sum, spread }
    }

    /// Bits a count of the block keeps: those below the highest in which two counts differ.
    fn bits(&self) -> u32 {
        32 - self.spread.leading_zeros()
    }
}

/// Builds [`Counts`] from the section's bytes as they arrive, hashing them: block `b`'s counts
/// and their [`Brief`] go to `check(b, counts, brief)`, which says why they are refused, if
/// they are.
pub(super) struct CountsReader<F> {
    hash: Xxh3,
    pending: Vec<u32>,
    partial: Vec<u8>,
    counts: Counts,
    shards: usize,
    seen: usize,
    check: F,
}

impl<F: FnMut(usize, &[u32], Brief) -> Option<String>> CountsReader<F> {
    /// A reader of a section of `shards` counts.
    pub(super) fn new(shards: usize, check: F) -> Self {
        CountsReader {
            hash: Xxh3::new(),
            pending: Vec::with_capacity(SHARD_TABLE_BLOCK_RECORDS),
            partial: Vec::with_capacity(4),
            counts: Counts::default(),
            shards,
            seen: 0,
            check,
        }
    }

    /// The next bytes of the section, any length.
    pub(super) fn feed(&mut self, mut bytes: &[u8]) {
        self.hash.update(bytes);
        self.seen += bytes.len();
        while !self.partial.is_empty() && !bytes.is_empty() {
            self.partial.push(bytes[0]);
            bytes = &bytes[1..];
            if self.partial.len() == 4 {
                let c = u32::from_le_bytes(self.partial[..].try_into().expect("4 bytes"));
                self.partial.clear();
                if self.room() > 0 {
                    self.take(std::iter::once(c), 1);
                }
            }
        }
        while bytes.len() >= 4 && self.room() > 0 {
            let n = self.room().min(bytes.len() / 4);
            let words = bytes[..4 * n].chunks_exact(4);
            self.take(words.map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))), n);
            bytes = &bytes[4 * n..];
        }
        if self.room() > 0 {
            self.partial.extend_from_slice(bytes); // under 4 bytes; past the section, dropped
        }
    }

    /// Counts the current block still takes (0 past the section).
    fn room(&self) -> usize {
        let first = self.counts.blocks.len() * SHARD_TABLE_BLOCK_RECORDS;
        SHARD_TABLE_BLOCK_RECORDS.min(self.shards.saturating_sub(first)) - self.pending.len()
    }

    /// Takes `n` counts (at most [`room`](Self::room)) into the current block, closing it when full.
    fn take(&mut self, counts: impl Iterator<Item = u32>, n: usize) {
        debug_assert!(n <= self.room());
        self.pending.extend(counts.take(n));
        if self.room() == 0 {
            self.close_block();
        }
    }

    fn close_block(&mut self) {
        let b = self.counts.blocks.len();
        let brief = Brief::of(&self.pending);
        match (self.check)(b, &self.pending, brief) {
            None => self.counts.push(&self.pending, brief),
            Some(why) => self.counts.blocks.push(Block::Refused(why.into())),
        }
        self.pending.clear();
    }

    /// The counts and the section's xxh3-64, once exactly `4 x shards` bytes were fed; else the
    /// bytes fed.
    pub(super) fn finish(self) -> Result<(Counts, u64), usize> {
        if self.seen != 4 * self.shards {
            return Err(self.seen);
        }
        Ok((self.counts, self.hash.digest()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(counts: &[u32], piece: usize) -> (Counts, u64) {
        let bytes: Vec<u8> = counts.iter().flat_map(|c| c.to_le_bytes()).collect();
        let mut r = CountsReader::new(counts.len(), |_, part: &[u32], brief: Brief| {
            assert_eq!(
                (brief.zero, brief.sum),
                (part.contains(&0), part.iter().map(|&c| c as u64).sum())
            );
            brief.zero.then(|| "a zero".to_string())
        });
        for p in bytes.chunks(piece) {
            r.feed(p);
        }
        r.finish().unwrap()
    }

    /// Every count comes back as it was, whatever the spread of its block (none, a few bits,
    /// 32 bits), the pieces' cut (mid-count, mid-block) and a short last block; the checksum is
    /// the whole section's.
    #[test]
    fn packed_counts_come_back_exactly() {
        let n = 3 * SHARD_TABLE_BLOCK_RECORDS + 77;
        let counts: Vec<u32> = (0..n)
            .map(|i| match i / SHARD_TABLE_BLOCK_RECORDS {
                0 => 435,
                1 => 300 + (i as u32 * 7919) % 301,
                2 => {
                    if i % 2 == 0 {
                        1
                    } else {
                        u32::MAX
                    }
                }
                _ => 1 + (i as u32 % 3),
            })
            .collect();
        let bytes: Vec<u8> = counts.iter().flat_map(|c| c.to_le_bytes()).collect();
        for piece in [1, 3, 4, 4095, 4096, 1 << 20] {
            let (c, sum) = read(&counts, piece);
            assert_eq!(sum, xxhash_rust::xxh3::xxh3_64(&bytes), "piece {piece}");
            for (i, &want) in counts.iter().enumerate() {
                assert_eq!(c.get(i).unwrap(), want, "shard {i}, piece {piece}");
            }
        }
        // The equal block takes no words; 10 bits a shard for the second (300 to 600 differ
        // from 300 below bit 10); 32 for the third; 2 for the last (1 to 3).
        let (c, _) = read(&counts, 4096);
        assert_eq!(
            c.words.len(),
            1024 * 10 / 64 + 1024 * 32 / 64 + (77 * 2usize).div_ceil(64)
        );
    }

    /// A refused block answers with its reason; the others stay usable; a short section is
    /// reported with the bytes it had.
    #[test]
    fn a_refused_block_names_itself_alone() {
        let mut counts = vec![5u32; 2 * SHARD_TABLE_BLOCK_RECORDS];
        counts[SHARD_TABLE_BLOCK_RECORDS + 3] = 0;
        let (c, _) = read(&counts, 1000);
        assert_eq!(&*c.get(SHARD_TABLE_BLOCK_RECORDS).unwrap_err(), "a zero");
        assert_eq!(c.get(10).unwrap(), 5);
        let mut r = CountsReader::new(10, |_, _: &[u32], _| None);
        r.feed(&[0; 39]);
        assert_eq!(r.finish().err(), Some(39));
    }
}
