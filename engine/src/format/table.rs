//! The binary shard table: a large dataset's shard list beside its manifest, 48 bytes a shard
//! in blocks of 1,024, read a block at a time when first used, and a counts section of 4 bytes
//! a shard, read whole by an order that needs the counts of many blocks (`docs/format.md`).

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::checksum::Checksum;
use super::manifest::{ColumnsInfo, ShardInfo};
use super::table_counts::{Brief, Counts, CountsReader, COUNTS_PIECE_BYTES};
use crate::error::{Error, Invalid, Result};

/// Where a manifest's binary shard table is, and what it must be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardTableRef {
    /// Object key relative to the dataset prefix.
    pub key: String,
    /// Size in bytes.
    pub bytes: u64,
    /// xxh3-64 of the table's head (header and directory).
    pub checksum: Checksum,
    /// Number of shards it lists.
    pub shards: u64,
    /// xxh3-64 of the table's counts section, when it has one (tables from before it have
    /// none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counts: Option<Checksum>,
}

/// Magic of a binary shard table.
pub const SHARD_TABLE_MAGIC: &[u8; 8] = b"RJSTAB02";
/// Bytes of the shard table's header.
pub const SHARD_TABLE_HEADER_LEN: usize = 48;
/// Bytes of one shard's record in the table.
pub const SHARD_TABLE_RECORD_LEN: usize = 48;
/// Bytes of one block's entry in the table's directory.
pub const SHARD_TABLE_DIR_ENTRY_LEN: usize = 32;
/// Records per block of the table: a block is read and checked as a whole, on first use.
pub const SHARD_TABLE_BLOCK_RECORDS: usize = 1024;
/// Largest shard table a manifest may name (about 44 million shards).
pub const SHARD_TABLE_BYTES_MAX: u64 = 2 << 30;
/// Pack lists more shards than this in a binary table rather than in the JSON.
pub const SHARD_TABLE_AUTO_MIN: usize = 4096;
/// Header flag: every shard has a columns sidecar.
const FLAG_COLUMNS: u32 = 1;
/// Header flag: the table ends in a counts section (`u32` samples a shard, in shard order).
const FLAG_COUNTS: u32 = 2;
/// Header flag: every shard but the last holds the same number of samples, the header's
/// `uniform` field (offset 44), and the last from 1 to it, so a shard's count and a sample's
/// place are arithmetic: the order reads neither a block nor the counts section for them.
const FLAG_UNIFORM: u32 = 4;
/// The order reads a table's counts section whole once it has read this many blocks for their
/// counts alone (a round of many partitions touches every block).
pub const SHARD_TABLE_COUNTS_AFTER_BLOCKS: usize = 8;

/// Every count the counts section can hold (a u32) is within the shard limit.
const U32_WITHIN_LIMIT: () = assert!(crate::format::SHARD_SAMPLES_MAX > u32::MAX as u64);

/// Blocks of a table of `count` shards.
fn table_blocks(count: u64) -> u64 {
    count.div_ceil(SHARD_TABLE_BLOCK_RECORDS as u64)
}

/// Bytes of the head (header and directory) of a table of `count` shards.
pub fn shard_table_head_len(count: u64) -> u64 {
    SHARD_TABLE_HEADER_LEN as u64 + table_blocks(count) * SHARD_TABLE_DIR_ENTRY_LEN as u64
}

/// Bytes of a whole table of `count` shards, with its counts section or without.
pub fn shard_table_len(count: u64, counts: bool) -> u64 {
    shard_table_head_len(count) + count * SHARD_TABLE_RECORD_LEN as u64 + if counts { 4 * count } else { 0 }
}

/// Reads byte ranges of a stored shard table. Called on first use of each block, from wherever
/// the order or a reader needs it, so it blocks (a dataset's reader runs the store's request to
/// completion on its own).
pub trait TableReader: Send + Sync + std::fmt::Debug {
    /// The bytes of `range` (exactly its length, or an error).
    fn read(&self, range: Range<u64>) -> Result<Bytes>;

    /// The bytes of `range` handed to `f` in order, in pieces of about `piece` bytes, so a large
    /// range is never held whole where the store can read it in parts (a local table). By
    /// default one [`read`](Self::read), cut.
    fn read_pieces(&self, range: Range<u64>, piece: usize, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let b = self.read(range)?;
        b.chunks(piece.max(1)).for_each(f);
        Ok(())
    }
}

/// A table held whole in memory (built by pack, or read whole).
#[derive(Debug)]
pub(super) struct WholeTable(pub(super) Bytes);

impl TableReader for WholeTable {
    fn read(&self, r: Range<u64>) -> Result<Bytes> {
        Ok(self.0.slice(r.start as usize..(r.end as usize).min(self.0.len())))
    }
}

/// One block of records, checked, with its shards' sample counts summed.
#[derive(Debug)]
struct TableBlock {
    records: Bytes,
    /// `ends[j]`: samples in the block's records `0..=j`.
    ends: Vec<u64>,
}

impl TableBlock {
    fn field(&self, j: usize, f: usize) -> u64 {
        let o = j * SHARD_TABLE_RECORD_LEN + f * 8;
        u64::from_le_bytes(self.records[o..o + 8].try_into().expect("8 bytes"))
    }
}

/// A binary shard table (`docs/format.md`): the shards of a large dataset, 48 bytes each, in
/// blocks of [`SHARD_TABLE_BLOCK_RECORDS`] behind a directory. Opening it reads and checks the
/// header and directory only; a block is read and checked the first time one of its shards is
/// asked for, so opening a table costs the same for a thousand shards or a million. Keys are not
/// stored: shard `i` is `shards/<k:06>-<checksum:016x>.rjs` for its stored key index `k`, and its
/// sidecar `columns/<k:06>-<sidecar checksum>.rjs`.
#[derive(Clone)]
pub struct ShardTable {
    /// Header and directory, checked against the manifest.
    head: Bytes,
    count: usize,
    pub(super) samples: u64,
    pub(super) bytes: u64,
    pub(super) columns: bool,
    /// The whole table, when it is held in memory.
    whole: Option<Bytes>,
    reader: Arc<dyn TableReader>,
    /// The table's object, for errors.
    object: String,
    blocks: Box<[OnceLock<Arc<TableBlock>>]>,
    /// Blocks read for their sample counts alone (the order's reads): each block's `ends`,
    /// 8 bytes a shard instead of the record's 48, so an order that touches every block (a
    /// round of thousands of partitions) does not hold the whole table.
    ends: Box<[OnceLock<Arc<[u64]>>]>,
    /// The counts section's checksum (from the manifest), when the table has one.
    counts_sum: Option<u64>,
    /// The counts section, read a piece at a time on first use, its checksum checked against
    /// the manifest's and each block against the directory, and held packed
    /// ([`table_counts`](super::table_counts)).
    counts: OnceLock<Arc<Counts>>,
    /// Blocks read for their counts alone so far.
    counted: Arc<std::sync::atomic::AtomicUsize>,
    /// Samples of every shard but the last, when the header says they are all the same
    /// ([`FLAG_UNIFORM`]); checked against the directory at open and each record when read.
    uniform: Option<u64>,
    /// Held while a block is read.
    loading: Arc<std::sync::Mutex<()>>,
}

impl std::fmt::Debug for ShardTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardTable")
            .field("object", &self.object)
            .field("shards", &self.count)
            .field("samples", &self.samples)
            .field("bytes", &self.bytes)
            .field("columns", &self.columns)
            .field(
                "loaded_blocks",
                &self.blocks.iter().filter(|b| b.get().is_some()).count(),
            )
            .finish()
    }
}

impl PartialEq for ShardTable {
    /// The head's checksum covers the blocks' checksums, so equal heads mean equal tables.
    fn eq(&self, o: &ShardTable) -> bool {
        self.head == o.head
    }
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}

/// Builds a [`ShardTable`] a shard at a time, holding 48 bytes a shard (a merge of a large
/// pack never holds its shards' JSON).
#[derive(Debug, Default)]
pub struct ShardTableBuilder {
    records: Vec<u8>,
    columns: Option<bool>,
    prev: Option<u64>,
    samples: u64,
    bytes: u64,
}

impl ShardTableBuilder {
    /// Shards pushed so far.
    pub fn len(&self) -> usize {
        self.records.len() / SHARD_TABLE_RECORD_LEN
    }

    /// Whether no shard was pushed.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Appends shard `s`: its key must be pack's, its key index above the last one's, and it
    /// has a sidecar exactly when the first shard has one.
    pub fn push(&mut self, s: &ShardInfo) -> std::result::Result<(), Invalid> {
        let checksum = s.checksum.get();
        let k = key_index(&s.key, "shards/", checksum)
            .ok_or_else(|| format!("shard key {:?} is not shards/<index>-<checksum>.rjs", s.key))?;
        if self.prev.is_some_and(|p| k <= p) {
            return Err(Invalid::from(format!("shard key {:?}: key indices must rise", s.key)));
        }
        let columns = *self.columns.get_or_insert(s.columns.is_some());
        let (cb, cc) = match (&s.columns, columns) {
            (Some(c), true) => {
                let cc = c.checksum.get();
                if key_index(&c.key, "columns/", cc) != Some(k) {
                    return Err(Invalid::from(format!(
                        "columns key {:?} is not columns/<index>-<checksum>.rjs",
                        c.key
                    )));
                }
                (c.bytes, cc)
            }
            (None, false) => (0, 0),
            _ => return Err(Invalid::from("some shards have a columns sidecar and some do not")),
        };
        let samples = self
            .samples
            .checked_add(s.samples)
            .ok_or("sample counts overflow 64 bits")?;
        let bytes = self.bytes.checked_add(s.bytes).ok_or("byte counts overflow 64 bits")?;
        (self.samples, self.bytes, self.prev) = (samples, bytes, Some(k));
        for v in [s.samples, s.bytes, checksum, k, cb, cc] {
            self.records.extend_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    /// The table, held in memory.
    pub fn finish(self) -> std::result::Result<ShardTable, Invalid> {
        let records = self.records;
        let count = (records.len() / SHARD_TABLE_RECORD_LEN) as u64;
        // A count of 2^32 (the shard limit) does not fit the counts section: no section then.
        let counts = records
            .chunks(SHARD_TABLE_RECORD_LEN)
            .all(|r| u64_at(r, 0) <= u32::MAX as u64);
        let uniform = uniform_samples(&records);
        let mut b = Vec::with_capacity(shard_table_len(count, counts) as usize);
        b.extend_from_slice(SHARD_TABLE_MAGIC);
        for v in [count, self.samples, self.bytes] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let flags = if counts { FLAG_COUNTS } else { 0 }
            | if self.columns.unwrap_or(false) { FLAG_COLUMNS } else { 0 }
            | if uniform.is_some() { FLAG_UNIFORM } else { 0 };
        for v in [
            SHARD_TABLE_RECORD_LEN as u32,
            flags,
            SHARD_TABLE_BLOCK_RECORDS as u32,
            uniform.unwrap_or(0),
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let mut first = 0u64;
        for chunk in records.chunks(SHARD_TABLE_BLOCK_RECORDS * SHARD_TABLE_RECORD_LEN) {
            let key = u64_at(chunk, 24);
            let (mut block_samples, mut block_bytes) = (0u64, 0u64);
            for r in chunk.chunks(SHARD_TABLE_RECORD_LEN) {
                block_samples += u64_at(r, 0);
                block_bytes += u64_at(r, 8);
            }
            for v in [first, key, block_bytes, xxh3_64(chunk)] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            first += block_samples;
        }
        b.extend_from_slice(&records);
        let at = b.len();
        if counts {
            for r in records.chunks(SHARD_TABLE_RECORD_LEN) {
                b.extend_from_slice(&(u64_at(r, 0) as u32).to_le_bytes());
            }
        }
        drop(records);
        let counts = counts.then(|| xxh3_64(&b[at..]));
        let whole = Bytes::from(b);
        ShardTable::open(
            whole.slice(..shard_table_head_len(count) as usize),
            Arc::new(WholeTable(whole.clone())),
            "shard table",
            counts,
        )
        .map(|mut t| {
            t.whole = Some(whole);
            t
        })
    }
}

impl ShardTable {
    /// The table of `shards`, whose keys must be pack's (`shards/<k>-<checksum>.rjs`, key
    /// indices rising), and which all have a sidecar or none does. Held in memory.
    pub fn build(shards: &[ShardInfo]) -> std::result::Result<ShardTable, Invalid> {
        let mut b = ShardTableBuilder::default();
        for s in shards {
            b.push(s)?;
        }
        b.finish()
    }
    /// Reads a whole table held in memory, checking its header, directory and length (the
    /// blocks are checked on first use, the counts section against the records as they are).
    pub fn parse(bytes: Bytes) -> std::result::Result<ShardTable, Invalid> {
        if bytes.len() < SHARD_TABLE_HEADER_LEN {
            return Err(Invalid::from("shorter than its header"));
        }
        let (count, counts) = (u64_at(&bytes, 8), u32_at(&bytes, 36) & FLAG_COUNTS != 0);
        if shard_table_len(count, counts) != bytes.len() as u64 {
            return Err(Invalid::from(format!(
                "{} bytes, but its header says {count} shards ({} bytes)",
                bytes.len(),
                shard_table_len(count, counts)
            )));
        }
        let head = bytes.slice(..shard_table_head_len(count) as usize);
        let sum = counts.then(|| xxh3_64(&bytes[shard_table_len(count, false) as usize..]));
        let mut t = ShardTable::open(head, Arc::new(WholeTable(bytes.clone())), "shard table", sum)?;
        t.whole = Some(bytes);
        Ok(t)
    }

    /// A table from its `head` (header and directory), whose blocks `reader` reads on demand,
    /// and its counts section's checksum (from the manifest; `None`: it has none). Checks the
    /// header and the directory: block sample starts rising from 0 within the total, first key
    /// indices rising, block byte sums adding up to the total, and a counts section exactly
    /// when the header says so.
    pub fn open(
        head: Bytes,
        reader: Arc<dyn TableReader>,
        object: &str,
        counts: Option<u64>,
    ) -> std::result::Result<ShardTable, Invalid> {
        if head.starts_with(b"RJSTAB01") {
            return Err(Invalid::from(
                "a shard table of the first layout (RJSTAB01, before blocks): pack the dataset again",
            ));
        }
        if head.len() < SHARD_TABLE_HEADER_LEN || &head[..8] != SHARD_TABLE_MAGIC {
            return Err(Invalid::from(
                "not a shard table (bad magic or shorter than its header)",
            ));
        }
        let (count, samples, bytes) = (u64_at(&head, 8), u64_at(&head, 16), u64_at(&head, 24));
        let (record, flags, per_block, uniform) = (
            u32_at(&head, 32) as usize,
            u32_at(&head, 36),
            u32_at(&head, 40) as usize,
            u32_at(&head, 44),
        );
        if record != SHARD_TABLE_RECORD_LEN
            || flags > FLAG_COLUMNS | FLAG_COUNTS | FLAG_UNIFORM
            || per_block != SHARD_TABLE_BLOCK_RECORDS
            || (flags & FLAG_UNIFORM == 0 && uniform != 0)
        {
            return Err(Invalid::from(format!(
                "unsupported header (record length {record}, flags {flags}, block records {per_block})"
            )));
        }
        if (flags & FLAG_COUNTS != 0) != counts.is_some() {
            return Err(Invalid::from(if counts.is_some() {
                "the manifest names a counts section, but the table's header has none"
            } else {
                "the table's header says it has a counts section, but the manifest names none"
            }));
        }
        if count > u32::MAX as u64 || shard_table_len(count, counts.is_some()) > SHARD_TABLE_BYTES_MAX {
            return Err(Invalid::from(format!("{count} shards is over the table limit")));
        }
        if head.len() as u64 != shard_table_head_len(count) {
            return Err(Invalid::from(format!(
                "its head is {} bytes, but {count} shards need {}",
                head.len(),
                shard_table_head_len(count)
            )));
        }
        let blocks = table_blocks(count) as usize;
        let dir = |b: usize, f: usize| u64_at(&head, SHARD_TABLE_HEADER_LEN + b * SHARD_TABLE_DIR_ENTRY_LEN + f * 8);
        let mut byte_sum = 0u64;
        for b in 0..blocks {
            let first = dir(b, 0);
            let end = if b + 1 < blocks { dir(b + 1, 0) } else { samples };
            let n = (SHARD_TABLE_BLOCK_RECORDS as u64).min(count - (b * SHARD_TABLE_BLOCK_RECORDS) as u64);
            if (b == 0 && first != 0) || end < first || end - first > n * crate::format::SHARD_SAMPLES_MAX {
                return Err(Invalid::from(format!(
                    "directory entry {b}: sample start {first} out of order"
                )));
            }
            if b > 0 && dir(b, 1) <= dir(b - 1, 1) {
                return Err(Invalid::from(format!(
                    "directory entry {b}: key index {} does not rise",
                    dir(b, 1)
                )));
            }
            byte_sum = byte_sum.checked_add(dir(b, 2)).ok_or("byte counts overflow 64 bits")?;
        }
        if byte_sum != bytes || (count == 0 && samples != 0) {
            return Err(Invalid::from(format!(
                "its blocks hold {byte_sum} bytes, its header says {bytes} (or samples without shards)"
            )));
        }
        let uniform = (flags & FLAG_UNIFORM != 0).then_some(uniform as u64);
        if let Some(c) = uniform {
            check_uniform(c, count, samples, &dir)?;
        }
        Ok(ShardTable {
            head,
            count: count as usize,
            samples,
            bytes,
            columns: flags & FLAG_COLUMNS != 0,
            whole: None,
            reader,
            object: object.to_owned(),
            blocks: (0..blocks).map(|_| OnceLock::new()).collect(),
            ends: (0..blocks).map(|_| OnceLock::new()).collect(),
            counts_sum: counts,
            counts: OnceLock::new(),
            counted: Default::default(),
            loading: Default::default(),
            uniform,
        })
    }

    /// The table's bytes, when held in memory (built or parsed whole).
    pub fn as_bytes(&self) -> Option<&Bytes> {
        self.whole.as_ref()
    }

    /// xxh3-64 of the table's head (header and directory): what the manifest records. The
    /// directory holds each block's checksum, so it covers every record.
    pub fn checksum(&self) -> u64 {
        xxh3_64(&self.head)
    }

    /// Number of shards.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether it lists no shard.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Total samples (from the header, checked against the manifest and every block).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Blocks read so far.
    pub fn loaded_blocks(&self) -> usize {
        self.blocks.iter().filter(|b| b.get().is_some()).count()
    }

    /// Blocks read so far for their sample counts alone (not held whole).
    pub fn counted_blocks(&self) -> usize {
        let whole = |i: usize| self.blocks[i].get().is_some();
        (0..self.ends.len())
            .filter(|&i| !whole(i) && self.ends[i].get().is_some())
            .count()
    }

    fn dir(&self, b: usize, f: usize) -> u64 {
        u64_at(
            &self.head,
            SHARD_TABLE_HEADER_LEN + b * SHARD_TABLE_DIR_ENTRY_LEN + f * 8,
        )
    }

    fn bad(&self, reason: String) -> Error {
        Error::Manifest {
            object: self.object.clone(),
            reason,
        }
    }

    /// Block `b`, read and checked on first use: its checksum, each shard's sample count
    /// against the shard limit and their sum against the directory, key indices rising from the
    /// directory's first one and below the next block's, and the byte sum. A failed read is not
    /// kept: the next use reads again.
    fn block(&self, b: usize) -> Result<&TableBlock> {
        if let Some(t) = self.blocks[b].get() {
            return Ok(t);
        }
        // One read per block: a second user waits for the first's (loads are rare, so one lock
        // per table serves; nothing else takes it).
        let _loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = self.blocks[b].get() {
            return Ok(t);
        }
        let t = self.read_block(b)?;
        let _ = self.blocks[b].set(Arc::new(t));
        Ok(self.blocks[b].get().expect("set above"))
    }

    /// Block `b`'s running sample counts (`TableBlock::ends`): the held block's, else read and
    /// checked as [`block`](Self::block) does, keeping only them.
    fn block_ends(&self, b: usize) -> Result<&[u64]> {
        if let Some(e) = self.held_ends(b) {
            return Ok(e);
        }
        let _loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = self.ends[b].get() {
            return Ok(e);
        }
        let t = self.read_block(b)?;
        let _ = self.ends[b].set(t.ends.into());
        self.counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.ends[b].get().expect("set above"))
    }

    /// Block `b`'s running sample counts when they are held (the block, or its counts alone).
    fn held_ends(&self, b: usize) -> Option<&[u64]> {
        match self.blocks[b].get() {
            Some(t) => Some(&t.ends),
            None => self.ends[b].get().map(|e| &e[..]),
        }
    }

    /// Whether the counts section has been read.
    pub fn counts_loaded(&self) -> bool {
        self.counts.get().is_some()
    }

    /// Bytes the counts section takes in memory, packed (0 until it is read).
    pub fn counts_bytes(&self) -> usize {
        self.counts.get().map_or(0, |c| c.held_bytes())
    }

    /// The counts section's checksum, when the table has one (what the manifest records).
    pub fn counts_checksum(&self) -> Option<u64> {
        self.counts_sum
    }

    /// The counts section (`None`: the table has none), read on first use a piece at a time
    /// and held packed: its length and checksum against the manifest's (a mismatch refuses the
    /// whole section), and each block's counts (from 1 to the shard limit, summing to the
    /// block's span in the directory, agreeing with the block's records when they are held)
    /// checked as it is read; a block that fails is kept as its failure, named when one of its
    /// shards is used. A failed read is not kept.
    fn counts(&self) -> Result<Option<&Counts>> {
        let Some(sum) = self.counts_sum else {
            return Ok(None);
        };
        if let Some(c) = self.counts.get() {
            return Ok(Some(c));
        }
        let _loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = self.counts.get() {
            return Ok(Some(c));
        }
        let at = shard_table_len(self.count as u64, false);
        let mut r = CountsReader::new(self.count, |b, part: &[u32], brief| {
            self.check_counts(b, part, brief).err().map(|why| why.to_string())
        });
        self.reader
            .read_pieces(at..at + 4 * self.count as u64, COUNTS_PIECE_BYTES, &mut |p| r.feed(p))?;
        let (counts, got) = r
            .finish()
            .map_err(|n| self.bad(format!("counts section: {n} bytes, expected {}", 4 * self.count)))?;
        if got != sum {
            return Err(self.bad(format!(
                "counts section: checksum {got:016x}, the manifest says {sum:016x}: the table was edited or damaged"
            )));
        }
        let _ = self.counts.set(Arc::new(counts));
        Ok(self.counts.get().map(|c| &**c))
    }

    /// Shard `i`'s count from the counts section (`None`: the table has none), or why its block
    /// was refused.
    pub(super) fn section_count(&self, i: usize) -> Result<Option<u32>> {
        match self.counts()? {
            None => Ok(None),
            Some(c) => c.get(i).map(Some).map_err(|why| self.bad(why.to_string())),
        }
    }

    /// Block `b`'s part of the counts section, `part` (`brief` its extremes and sum), against
    /// the shard limit, the directory and the block's records when they are held: why it is
    /// refused, if it is.
    fn check_counts(&self, b: usize, part: &[u32], brief: Brief) -> std::result::Result<(), Invalid> {
        let lo = b * SHARD_TABLE_BLOCK_RECORDS;
        // A u32 is within the shard limit always (`U32_WITHIN_LIMIT`); 0 is not a shard's count.
        let () = U32_WITHIN_LIMIT;
        if brief.zero {
            let j = part.iter().position(|&c| c == 0).expect("a zero");
            return Err(Invalid::from(format!(
                "counts section: shard {} claims 0 samples (from 1 to the shard limit of {})",
                lo + j,
                crate::format::SHARD_SAMPLES_MAX
            )));
        }
        let last = b + 1 == self.blocks.len();
        let span = if last { self.samples } else { self.dir(b + 1, 0) } - self.dir(b, 0);
        if brief.sum != span {
            return Err(Invalid::from(format!(
                "counts section: block {b} (shards {lo}..{}) holds {} samples; the directory says {span}",
                lo + part.len(),
                brief.sum
            )));
        }
        if let Some(j) = (0..part.len()).find(|&j| self.uniform_count(lo + j).is_some_and(|u| u != part[j] as u64)) {
            return Err(Invalid::from(format!(
                "counts section: shard {} holds {} samples; the table's header says {}",
                lo + j,
                part[j],
                self.uniform_count(lo + j).expect("uniform")
            )));
        }
        match self.held_ends(b) {
            Some(ends) => agree(lo, ends, part.iter().copied()),
            None => Ok(()),
        }
    }

    /// Shard `i`'s samples when the header says every shard but the last holds the same
    /// number (`i` below the shard count).
    fn uniform_count(&self, i: usize) -> Option<u64> {
        let c = self.uniform?;
        Some(if i + 1 == self.count {
            self.samples - c * (self.count as u64 - 1)
        } else {
            c
        })
    }

    /// Whether every shard but the last holds the same number of samples (the header's
    /// uniform flag): then counts and places are arithmetic.
    pub fn is_uniform(&self) -> bool {
        self.uniform.is_some()
    }

    /// Reads and checks block `b` (see [`block`](Self::block)); keeps nothing.
    fn read_block(&self, b: usize) -> Result<TableBlock> {
        let lo = b * SHARD_TABLE_BLOCK_RECORDS;
        let n = SHARD_TABLE_BLOCK_RECORDS.min(self.count - lo);
        let at = self.head.len() as u64 + (lo * SHARD_TABLE_RECORD_LEN) as u64;
        let records = self.reader.read(at..at + (n * SHARD_TABLE_RECORD_LEN) as u64)?;
        let what = format!("block {b} (shards {lo}..{})", lo + n);
        if records.len() != n * SHARD_TABLE_RECORD_LEN {
            return Err(self.bad(format!(
                "{what}: {} bytes, expected {}",
                records.len(),
                n * SHARD_TABLE_RECORD_LEN
            )));
        }
        let sum = xxh3_64(&records);
        if sum != self.dir(b, 3) {
            return Err(self.bad(format!(
                "{what}: checksum {sum:016x}, the directory says {:016x}: the table was edited or damaged",
                self.dir(b, 3)
            )));
        }
        let mut t = TableBlock {
            records,
            ends: Vec::with_capacity(n),
        };
        let (mut acc, mut bytes, mut prev) = (0u64, 0u64, None::<u64>);
        for j in 0..n {
            let (samples, k) = (t.field(j, 0), t.field(j, 3));
            if samples == 0 {
                return Err(self.bad(format!(
                    "shard {} lists 0 samples; a shard holds at least one (no writer lists an empty one)",
                    lo + j
                )));
            }
            if samples > crate::format::SHARD_SAMPLES_MAX {
                return Err(self.bad(format!(
                    "shard {} claims {samples} samples, over the shard limit of {}",
                    lo + j,
                    crate::format::SHARD_SAMPLES_MAX
                )));
            }
            if let Some(u) = self.uniform_count(lo + j).filter(|&u| u != samples) {
                return Err(self.bad(format!(
                    "shard {} lists {samples} samples; the table's header says {u}: the table was edited or damaged",
                    lo + j
                )));
            }
            let rises = match prev {
                None => k == self.dir(b, 1),
                Some(p) => k > p,
            };
            if !rises {
                return Err(self.bad(format!("shard {}: key index {k} does not rise", lo + j)));
            }
            prev = Some(k);
            acc += samples;
            bytes = bytes.saturating_add(t.field(j, 1));
            t.ends.push(acc);
        }
        let last = b + 1 == self.blocks.len();
        let span = if last { self.samples } else { self.dir(b + 1, 0) } - self.dir(b, 0);
        if acc != span || bytes != self.dir(b, 2) || (!last && prev.is_some_and(|p| p >= self.dir(b + 1, 1))) {
            return Err(self.bad(format!(
                "{what}: its shards hold {acc} samples in {bytes} bytes; the directory says {span} in {}",
                self.dir(b, 2)
            )));
        }
        if let Some(c) = self.counts.get() {
            // A block the section refused is refused here too, for the same reason.
            let part = (lo..lo + n)
                .map(|i| c.get(i))
                .collect::<std::result::Result<Vec<u32>, _>>();
            part.map_err(|why| Invalid::from(why.to_string()))
                .and_then(|part| agree(lo, &t.ends, part.into_iter()))
                .map_err(|why| self.bad(why.to_string()))?;
        }
        Ok(t)
    }

    fn record(&self, i: usize) -> Result<(&TableBlock, usize)> {
        if i >= self.count {
            return Err(self.bad(format!("no shard {i}: the table lists {}", self.count)));
        }
        Ok((
            self.block(i / SHARD_TABLE_BLOCK_RECORDS)?,
            i % SHARD_TABLE_BLOCK_RECORDS,
        ))
    }

    /// Samples of shard `i`.
    pub fn shard_samples(&self, i: usize) -> Result<u64> {
        let (t, j) = self.record(i)?;
        Ok(t.field(j, 0))
    }

    /// Bytes and checksum of shard `i`.
    pub fn shard_bytes_checksum(&self, i: usize) -> Result<(u64, u64)> {
        let (t, j) = self.record(i)?;
        Ok((t.field(j, 1), t.field(j, 2)))
    }

    /// Global index of shard `i`'s first sample.
    pub fn shard_start(&self, i: usize) -> Result<u64> {
        let (t, j) = self.record(i)?;
        let before = if j == 0 { 0 } else { t.ends[j - 1] };
        Ok(self.dir(i / SHARD_TABLE_BLOCK_RECORDS, 0) + before)
    }

    /// Shard `i` as the JSON would list it.
    pub fn info(&self, i: usize) -> Result<ShardInfo> {
        let (t, j) = self.record(i)?;
        let (samples, bytes, checksum, k) = (t.field(j, 0), t.field(j, 1), t.field(j, 2), t.field(j, 3));
        Ok(ShardInfo {
            key: super::shard_key(k as usize, checksum),
            bytes,
            samples,
            checksum: Checksum(checksum),
            columns: self.columns.then(|| {
                let cc = t.field(j, 5);
                ColumnsInfo {
                    key: super::columns_key(k as usize, cc),
                    bytes: t.field(j, 4),
                    checksum: Checksum(cc),
                }
            }),
            foreign: None,
        })
    }

    /// The shard holding global sample `g`, and the sample's index in it (`None` past the
    /// end): a binary search of the directory, then of one block.
    pub fn locate(&self, g: u64) -> Result<Option<(usize, u64)>> {
        if g >= self.samples {
            return Ok(None);
        }
        if let Some(c) = self.uniform {
            // The last shard holds at most `c` (checked at open), so `g / c` is a shard.
            let i = (g / c).min(self.count as u64 - 1);
            return Ok(Some((i as usize, g - i * c)));
        }
        let (mut lo, mut hi) = (0usize, self.blocks.len());
        // The last block whose first sample is at or before g (empty blocks come before it).
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.dir(mid, 0) <= g {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let ends = self.block_ends(lo)?;
        let local = g - self.dir(lo, 0);
        let j = ends.partition_point(|&e| e <= local);
        let before = if j == 0 { 0 } else { ends[j - 1] };
        Ok(Some((lo * SHARD_TABLE_BLOCK_RECORDS + j, local - before)))
    }
}

impl crate::order::ShardCounts for ShardTable {
    fn shards(&self) -> u64 {
        self.count as u64
    }
    fn total(&self) -> u64 {
        self.samples
    }
    fn samples(&self, shard: u64) -> Result<u64> {
        let i = shard as usize;
        if i >= self.count {
            return Err(self.bad(format!("no shard {i}: the table lists {}", self.count)));
        }
        if let Some(u) = self.uniform_count(i) {
            return Ok(u);
        }
        let (b, j) = (i / SHARD_TABLE_BLOCK_RECORDS, i % SHARD_TABLE_BLOCK_RECORDS);
        let diff = |ends: &[u64]| ends[j] - if j == 0 { 0 } else { ends[j - 1] };
        if let Some(ends) = self.held_ends(b) {
            // A block the counts section disagrees with stays refused, held or not.
            if let Some(Err(why)) = self.counts.get().map(|c| c.get(i)) {
                return Err(self.bad(why.to_string()));
            }
            return Ok(diff(ends));
        }
        // Past a few blocks, the counts section (4 bytes a shard) instead of every block (48).
        let many = self.counted.load(std::sync::atomic::Ordering::Relaxed) >= SHARD_TABLE_COUNTS_AFTER_BLOCKS;
        if self.counts_loaded() || (many && self.counts_sum.is_some()) {
            if let Some(c) = self.section_count(i)? {
                return Ok(c as u64);
            }
        }
        Ok(diff(self.block_ends(b)?))
    }
    fn uniform(&self) -> Option<(u64, u64)> {
        let c = self.uniform?;
        Some((c, self.uniform_count(self.count - 1).expect("uniform")))
    }
    fn locate(&self, o: u64) -> Result<(u64, u64)> {
        let (s, i) = ShardTable::locate(self, o)?
            .ok_or_else(|| self.bad(format!("no sample {o}: it holds {}", self.samples)))?;
        Ok((s as u64, i))
    }
}

/// The samples of every shard of `records` but the last, when they are all the same, at least
/// 1, fit the header's u32 and the last holds from 1 to as many: what the uniform flag says.
fn uniform_samples(records: &[u8]) -> Option<u32> {
    let mut counts = records.chunks(SHARD_TABLE_RECORD_LEN).map(|r| u64_at(r, 0));
    let c = counts.next().filter(|&c| c >= 1 && c <= u32::MAX as u64)?;
    let n = records.len() / SHARD_TABLE_RECORD_LEN;
    let (mut seen, mut last) = (1, c);
    for x in counts {
        if seen < n - 1 && x != c {
            return None;
        }
        (seen, last) = (seen + 1, x);
    }
    (1..=c).contains(&last).then_some(c as u32)
}

/// Checks a header's uniform count `c` against its shard count, total and directory (`dir`):
/// every shard but the last holds `c`, the last from 1 to `c`, and block `b` starts at
/// `b * 1024 * c`.
fn check_uniform(
    c: u64,
    count: u64,
    samples: u64,
    dir: &dyn Fn(usize, usize) -> u64,
) -> std::result::Result<(), Invalid> {
    let before_last = c.checked_mul(count.saturating_sub(1));
    let last = before_last.and_then(|s| samples.checked_sub(s));
    if c == 0 || count == 0 || !last.is_some_and(|l| (1..=c).contains(&l)) {
        return Err(Invalid::from(format!(
            "its header says every shard but the last holds {c} samples, but {count} shards hold {samples}"
        )));
    }
    let per_block = c * SHARD_TABLE_BLOCK_RECORDS as u64;
    match (0..table_blocks(count) as usize).find(|&b| dir(b, 0) != b as u64 * per_block) {
        Some(b) => Err(Invalid::from(format!(
            "directory entry {b}: sample start {} disagrees with the header's {c} samples a shard",
            dir(b, 0)
        ))),
        None => Ok(()),
    }
}

/// Whether the running counts `ends` of the block whose first shard is `lo` say what the counts
/// section's `part` says: why not, if they do not.
fn agree(lo: usize, ends: &[u64], part: impl Iterator<Item = u32>) -> std::result::Result<(), Invalid> {
    for (j, c) in part.enumerate() {
        let n = ends[j] - if j == 0 { 0 } else { ends[j - 1] };
        if n != c as u64 {
            return Err(Invalid::from(format!(
                "shard {}: its record says {n} samples, the counts section {c}: the table was edited or damaged",
                lo + j
            )));
        }
    }
    Ok(())
}

/// `k` for a key `<prefix><k:06>-<checksum:016x>.rjs` (exactly as pack names it).
fn key_index(key: &str, prefix: &str, checksum: u64) -> Option<u64> {
    let rest = key.strip_prefix(prefix)?;
    let k: u64 = rest.split('-').next()?.parse().ok()?;
    let named = if prefix == "shards/" {
        super::shard_key(k as usize, checksum)
    } else {
        super::columns_key(k as usize, checksum)
    };
    (named == key).then_some(k)
}
