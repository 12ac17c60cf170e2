//! The dataset manifest: schema, shard list and a content-derived version id.
//!
//! A manifest lists its shards in the JSON, or, for a large dataset, names a binary shard
//! table beside it (`ShardTable`: 48 bytes a shard in blocks of 1,024, read a block at a time
//! when first used, no per-shard objects). The JSON carries the checksum of the table's head,
//! whose directory carries each block's, so the version covers the whole table.
//!
//! The version is the xxh3-128 of the manifest's canonical JSON with the `version` field
//! empty, so two manifests share a version exactly when they describe the same bytes.
//! Packing writes `manifests/<version>.json` and then, last, `manifest.json`: a reader that
//! finds `manifest.json` finds every shard it lists already in place.

use crate::error::Invalid;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use super::foreign::{ForeignObject, ForeignSpec};
use super::schema::Schema;
use crate::error::{Error, Result};

/// Value of the `format` field.
pub const MANIFEST_FORMAT: &str = "ramjet-manifest";
/// Manifest format version of a manifest that lists its shards in the JSON.
pub const MANIFEST_VERSION: u32 = 1;
/// Manifest format version of a manifest whose shards are in a binary shard table (a reader
/// from before tables refuses it by this number rather than misreading it).
pub const MANIFEST_VERSION_TABLE: u32 = 2;
/// Manifest format version of a manifest over foreign shards (`ramjet index`): a reader
/// from before them refuses it by this number rather than reading a foreign shard as its own.
pub const MANIFEST_VERSION_FOREIGN: u32 = 3;
/// Object name of the current manifest, relative to the dataset prefix.
pub const MANIFEST_NAME: &str = "manifest.json";
/// Largest manifest a reader will download.
pub const MANIFEST_BYTES_MAX: u64 = 256 << 20;

/// One shard as the manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Object key relative to the dataset prefix.
    pub key: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Number of samples.
    pub samples: u64,
    /// Whole-shard xxh3-64, 16 lowercase hex digits.
    pub checksum: String,
    /// The shard's columns sidecar: the same samples with every column except the `bytes`
    /// ones, so labels and sizes are read without the images. Absent in datasets packed
    /// before it existed, and when the schema has no `bytes` column or nothing else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<ColumnsInfo>,
    /// A foreign shard (MDS, WebDataset) read in place: the object as stored at `key`. Then
    /// `bytes` and `checksum` are those of the ramjet shard it transcodes to (see
    /// [`crate::format::foreign`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub foreign: Option<ForeignObject>,
}

/// A shard's columns sidecar (see [`ShardInfo::columns`]): itself a shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnsInfo {
    /// Object key relative to the dataset prefix.
    pub key: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Whole-file xxh3-64, 16 lowercase hex digits.
    pub checksum: String,
}

/// A checksum written as 16 hex digits, as a number.
pub(crate) fn hex16(s: &str) -> Option<u64> {
    if s.len() != 16 {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

impl ColumnsInfo {
    /// The checksum as a number.
    pub fn checksum_u64(&self) -> Option<u64> {
        hex16(&self.checksum)
    }
}

impl ShardInfo {
    /// The checksum as a number.
    pub fn checksum_u64(&self) -> Option<u64> {
        hex16(&self.checksum)
    }
}

/// A dataset manifest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// Always [`MANIFEST_VERSION`] for manifests this code writes.
    pub format_version: u32,
    /// Content-derived version id (32 hex digits).
    pub version: String,
    /// What the dataset was packed from: `yolo`, `imagefolder`, `jsonl`, or a caller's word.
    pub source: String,
    /// Schema of every shard.
    pub schema: Schema,
    /// Free-form metadata (class names, ...). Keys are sorted, so it serialises canonically.
    #[serde(default)]
    pub meta: serde_json::Map<String, serde_json::Value>,
    /// Total samples.
    pub samples: u64,
    /// Total shard bytes.
    pub bytes: u64,
    /// Shards in sample order, when listed here (empty when `shard_table` is set). Read them
    /// through [`Manifest::shard`], [`Manifest::shards`] and [`Manifest::shard_count`], which
    /// see both forms.
    shards: Vec<ShardInfo>,
    /// The binary shard table that lists the shards instead (large datasets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_table: Option<ShardTableRef>,
    /// The layout of its shards, when they are foreign (MDS, WebDataset) and read in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub foreign: Option<ForeignSpec>,
    /// The table's content, once loaded ([`Manifest::attach_table`]).
    #[serde(skip)]
    table: Option<Arc<ShardTable>>,
    /// Each shard's first global sample, and the total (built on first use).
    #[serde(skip)]
    starts: OnceLock<Arc<Vec<u64>>>,
}

/// Where a manifest's binary shard table is, and what it must be.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardTableRef {
    /// Object key relative to the dataset prefix.
    pub key: String,
    /// Size in bytes.
    pub bytes: u64,
    /// xxh3-64 of the whole object, 16 lowercase hex digits.
    pub checksum: String,
    /// Number of shards it lists.
    pub shards: u64,
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

/// Blocks of a table of `count` shards.
fn table_blocks(count: u64) -> u64 {
    count.div_ceil(SHARD_TABLE_BLOCK_RECORDS as u64)
}

/// Bytes of the head (header and directory) of a table of `count` shards.
pub fn shard_table_head_len(count: u64) -> u64 {
    SHARD_TABLE_HEADER_LEN as u64 + table_blocks(count) * SHARD_TABLE_DIR_ENTRY_LEN as u64
}

/// Bytes of a whole table of `count` shards.
pub fn shard_table_len(count: u64) -> u64 {
    shard_table_head_len(count) + count * SHARD_TABLE_RECORD_LEN as u64
}

/// Reads byte ranges of a stored shard table. Called on first use of each block, from wherever
/// the order or a reader needs it, so it blocks (a dataset's reader runs the store's request to
/// completion on its own).
pub trait TableReader: Send + Sync + std::fmt::Debug {
    /// The bytes of `range` (exactly its length, or an error).
    fn read(&self, range: Range<u64>) -> Result<Bytes>;
}

/// A table held whole in memory (built by pack, or read whole).
#[derive(Debug)]
struct WholeTable(Bytes);

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
    samples: u64,
    bytes: u64,
    columns: bool,
    /// The whole table, when it is held in memory.
    whole: Option<Bytes>,
    reader: Arc<dyn TableReader>,
    /// The table's object, for errors.
    object: String,
    blocks: Box<[OnceLock<Arc<TableBlock>>]>,
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

impl ShardTable {
    /// The table of `shards`, whose keys must be pack's (`shards/<k>-<checksum>.rjs`, key
    /// indices rising), and which all have a sidecar or none does. Held in memory.
    pub fn build(shards: &[ShardInfo]) -> std::result::Result<ShardTable, Invalid> {
        let columns = shards.first().is_some_and(|s| s.columns.is_some());
        let mut records = Vec::with_capacity(shards.len() * SHARD_TABLE_RECORD_LEN);
        let mut prev: Option<u64> = None;
        let (mut samples, mut bytes) = (0u64, 0u64);
        for s in shards {
            let checksum = s
                .checksum_u64()
                .ok_or_else(|| format!("shard {:?}: bad checksum", s.key))?;
            let k = key_index(&s.key, "shards/", checksum)
                .ok_or_else(|| format!("shard key {:?} is not shards/<index>-<checksum>.rjs", s.key))?;
            if prev.is_some_and(|p| k <= p) {
                return Err(Invalid::from(format!("shard key {:?}: key indices must rise", s.key)));
            }
            prev = Some(k);
            let (cb, cc) = match (&s.columns, columns) {
                (Some(c), true) => {
                    let cc = c
                        .checksum_u64()
                        .ok_or_else(|| format!("columns {:?}: bad checksum", c.key))?;
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
            samples = samples.checked_add(s.samples).ok_or("sample counts overflow 64 bits")?;
            bytes = bytes.checked_add(s.bytes).ok_or("byte counts overflow 64 bits")?;
            for v in [s.samples, s.bytes, checksum, k, cb, cc] {
                records.extend_from_slice(&v.to_le_bytes());
            }
        }
        let count = shards.len() as u64;
        let mut b = Vec::with_capacity(shard_table_len(count) as usize);
        b.extend_from_slice(SHARD_TABLE_MAGIC);
        for v in [count, samples, bytes] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [
            SHARD_TABLE_RECORD_LEN as u32,
            columns as u32,
            SHARD_TABLE_BLOCK_RECORDS as u32,
            0,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let mut first = 0u64;
        for (blk, chunk) in records
            .chunks(SHARD_TABLE_BLOCK_RECORDS * SHARD_TABLE_RECORD_LEN)
            .enumerate()
        {
            let s = &shards[blk * SHARD_TABLE_BLOCK_RECORDS..];
            let n = chunk.len() / SHARD_TABLE_RECORD_LEN;
            let key = u64_at(chunk, 24);
            let block_bytes: u64 = s[..n].iter().map(|x| x.bytes).sum();
            for v in [first, key, block_bytes, xxh3_64(chunk)] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            first += s[..n].iter().map(|x| x.samples).sum::<u64>();
        }
        b.extend_from_slice(&records);
        let whole = Bytes::from(b);
        ShardTable::open(
            whole.slice(..shard_table_head_len(count) as usize),
            Arc::new(WholeTable(whole.clone())),
            "shard table",
        )
        .map(|mut t| {
            t.whole = Some(whole);
            t
        })
    }

    /// Reads a whole table held in memory, checking its header, directory and length (the
    /// blocks are checked on first use).
    pub fn parse(bytes: Bytes) -> std::result::Result<ShardTable, Invalid> {
        if bytes.len() < SHARD_TABLE_HEADER_LEN {
            return Err(Invalid::from("shorter than its header"));
        }
        let count = u64_at(&bytes, 8);
        if shard_table_len(count) != bytes.len() as u64 {
            return Err(Invalid::from(format!(
                "{} bytes, but its header says {count} shards ({} bytes)",
                bytes.len(),
                shard_table_len(count)
            )));
        }
        let head = bytes.slice(..shard_table_head_len(count) as usize);
        let mut t = ShardTable::open(head, Arc::new(WholeTable(bytes.clone())), "shard table")?;
        t.whole = Some(bytes);
        Ok(t)
    }

    /// A table from its `head` (header and directory), whose blocks `reader` reads on demand.
    /// Checks the header and the directory: block sample starts rising from 0 within the total,
    /// first key indices rising, block byte sums adding up to the total.
    pub fn open(head: Bytes, reader: Arc<dyn TableReader>, object: &str) -> std::result::Result<ShardTable, Invalid> {
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
        let (record, flags, per_block, reserved) = (
            u32_at(&head, 32) as usize,
            u32_at(&head, 36),
            u32_at(&head, 40) as usize,
            u32_at(&head, 44),
        );
        if record != SHARD_TABLE_RECORD_LEN || flags > 1 || per_block != SHARD_TABLE_BLOCK_RECORDS || reserved != 0 {
            return Err(Invalid::from(format!(
                "unsupported header (record length {record}, flags {flags}, block records {per_block})"
            )));
        }
        if count > u32::MAX as u64 || shard_table_len(count) > SHARD_TABLE_BYTES_MAX {
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
        Ok(ShardTable {
            head,
            count: count as usize,
            samples,
            bytes,
            columns: flags == 1,
            whole: None,
            reader,
            object: object.to_owned(),
            blocks: (0..blocks).map(|_| OnceLock::new()).collect(),
            loading: Default::default(),
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
        let lo = b * SHARD_TABLE_BLOCK_RECORDS;
        let n = SHARD_TABLE_BLOCK_RECORDS.min(self.count - lo);
        let at = self.head.len() as u64 + (lo * SHARD_TABLE_RECORD_LEN) as u64;
        // One read per block: a second user waits for the first's (loads are rare, so one lock
        // per table serves; nothing else takes it).
        let _loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = self.blocks[b].get() {
            return Ok(t);
        }
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
        let _ = self.blocks[b].set(Arc::new(t));
        Ok(self.blocks[b].get().expect("set above"))
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
            checksum: format!("{checksum:016x}"),
            columns: self.columns.then(|| {
                let cc = t.field(j, 5);
                ColumnsInfo {
                    key: super::columns_key(k as usize, cc),
                    bytes: t.field(j, 4),
                    checksum: format!("{cc:016x}"),
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
        let t = self.block(lo)?;
        let local = g - self.dir(lo, 0);
        let j = t.ends.partition_point(|&e| e <= local);
        let before = if j == 0 { 0 } else { t.ends[j - 1] };
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
        self.shard_samples(shard as usize)
    }
    fn locate(&self, o: u64) -> Result<(u64, u64)> {
        let (s, i) = ShardTable::locate(self, o)?
            .ok_or_else(|| self.bad(format!("no sample {o}: it holds {}", self.samples)))?;
        Ok((s as u64, i))
    }
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

impl Manifest {
    /// A manifest over `shards`, with totals and the version computed.
    pub fn new(
        source: impl Into<String>,
        schema: Schema,
        meta: serde_json::Map<String, serde_json::Value>,
        shards: Vec<ShardInfo>,
    ) -> Self {
        let mut m = Manifest {
            format: MANIFEST_FORMAT.into(),
            format_version: MANIFEST_VERSION,
            version: String::new(),
            source: source.into(),
            schema,
            meta,
            samples: shards.iter().map(|s| s.samples).sum(),
            bytes: shards.iter().map(|s| s.bytes).sum(),
            shards,
            shard_table: None,
            foreign: None,
            table: None,
            starts: OnceLock::new(),
        };
        m.version = m.compute_version();
        m
    }

    /// A manifest over foreign shards read in place (`ramjet index`): every shard has its
    /// [`ShardInfo::foreign`], laid out as `spec` says.
    pub fn new_foreign(
        source: impl Into<String>,
        schema: Schema,
        meta: serde_json::Map<String, serde_json::Value>,
        shards: Vec<ShardInfo>,
        spec: ForeignSpec,
    ) -> Self {
        let mut m = Self::new(source, schema, meta, shards);
        m.format_version = MANIFEST_VERSION_FOREIGN;
        m.foreign = Some(spec);
        m.version = m.compute_version();
        m
    }

    /// A manifest whose shards are listed in `table`, stored under `key`.
    pub fn with_table(
        source: impl Into<String>,
        schema: Schema,
        meta: serde_json::Map<String, serde_json::Value>,
        table: ShardTable,
        key: impl Into<String>,
    ) -> Self {
        let mut m = Manifest {
            format: MANIFEST_FORMAT.into(),
            format_version: MANIFEST_VERSION_TABLE,
            version: String::new(),
            source: source.into(),
            schema,
            meta,
            samples: table.samples,
            bytes: table.bytes,
            shards: Vec::new(),
            shard_table: Some(ShardTableRef {
                key: key.into(),
                bytes: shard_table_len(table.len() as u64),
                checksum: format!("{:016x}", table.checksum()),
                shards: table.len() as u64,
            }),
            foreign: None,
            table: Some(Arc::new(table)),
            starts: OnceLock::new(),
        };
        m.version = m.compute_version();
        m
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        match (&self.table, &self.shard_table) {
            (Some(t), _) => t.len(),
            (None, Some(r)) => r.shards as usize,
            (None, None) => self.shards.len(),
        }
    }

    fn no_table(&self) -> Error {
        Error::Manifest {
            object: self.shard_table.as_ref().map_or_else(String::new, |r| r.key.clone()),
            reason: "the shard table is not loaded".into(),
        }
    }

    fn listed(&self, i: usize) -> Result<&ShardInfo> {
        self.shards.get(i).ok_or_else(|| Error::Manifest {
            object: format!("manifest {}", self.version),
            reason: format!("no shard {i}: it lists {}", self.shards.len()),
        })
    }

    /// Shard `i`. With a shard table, the first use of a block of shards reads and checks it,
    /// which can fail (`docs/format.md`); past the end is an error too.
    pub fn shard(&self, i: usize) -> Result<ShardInfo> {
        match (&self.table, &self.shard_table) {
            (Some(t), _) => t.info(i),
            (None, Some(_)) => Err(self.no_table()),
            (None, None) => self.listed(i).cloned(),
        }
    }

    /// The shards in order (each as [`Manifest::shard`]).
    pub fn shards(&self) -> impl ExactSizeIterator<Item = Result<ShardInfo>> + '_ {
        (0..self.shard_count()).map(|i| self.shard(i))
    }

    /// The listed shards, to edit (tools and tests that write a manifest by hand; the
    /// version must then be recomputed). Empty for a manifest with a shard table.
    pub fn shards_mut(&mut self) -> &mut Vec<ShardInfo> {
        self.starts = OnceLock::new();
        &mut self.shards
    }

    /// Samples of shard `i`, without building its [`ShardInfo`].
    pub fn shard_samples(&self, i: usize) -> Result<u64> {
        match (&self.table, &self.shard_table) {
            (Some(t), _) => t.shard_samples(i),
            (None, Some(_)) => Err(self.no_table()),
            (None, None) => Ok(self.listed(i)?.samples),
        }
    }

    /// Bytes and checksum of shard `i`, without building its [`ShardInfo`].
    pub fn shard_bytes_checksum(&self, i: usize) -> Result<(u64, u64)> {
        match (&self.table, &self.shard_table) {
            (Some(t), _) => t.shard_bytes_checksum(i),
            (None, Some(_)) => Err(self.no_table()),
            (None, None) => {
                let s = self.listed(i)?;
                Ok((s.bytes, s.checksum_u64().expect("validated")))
            }
        }
    }

    /// Global index of shard `i`'s first sample.
    pub fn shard_start(&self, i: usize) -> Result<u64> {
        match (&self.table, &self.shard_table) {
            (Some(t), _) => t.shard_start(i),
            (None, Some(_)) => Err(self.no_table()),
            (None, None) => {
                self.listed(i)?;
                Ok(self.listed_starts()[i])
            }
        }
    }

    /// The spacing of the restart markers its JPEGs are stored with, if they were transcoded
    /// to have them: `ramjet pack --jpeg-restarts` records it in `meta.jpeg_restart_px`,
    /// `ramjet index --jpeg-restarts` in `foreign.jpeg_restart_px`.
    pub fn jpeg_restart_px(&self) -> Option<u32> {
        self.foreign.as_ref().and_then(|f| f.jpeg_restart_px).or_else(|| {
            self.meta
                .get("jpeg_restart_px")
                .and_then(|v| v.as_u64())
                .and_then(|v| u32::try_from(v).ok())
        })
    }

    /// Whether every shard has a columns sidecar (and there is at least one shard).
    pub fn has_columns(&self) -> bool {
        match &self.table {
            Some(t) => t.columns && !t.is_empty(),
            None => !self.shards.is_empty() && self.shards.iter().all(|s| s.columns.is_some()),
        }
    }

    /// The shard table still to load: the manifest names one and [`Manifest::attach_table`]
    /// was not called.
    pub fn table_to_load(&self) -> Option<&ShardTableRef> {
        self.shard_table.as_ref().filter(|_| self.table.is_none())
    }

    /// The loaded shard table, if the manifest has one.
    pub fn table(&self) -> Option<&ShardTable> {
        self.table.as_deref()
    }

    /// The shards' sample counts as the order reads them: the shard table itself, or the
    /// listed shards' counts.
    pub fn shard_counts(&self) -> Arc<dyn crate::order::ShardCounts> {
        match &self.table {
            Some(t) => t.clone(),
            None => Arc::new(crate::order::CountList::new(
                self.shards.iter().map(|s| s.samples).collect(),
            )),
        }
    }

    /// Reads the head (header and directory) of the table the manifest names through
    /// `reader`, checks it, and attaches the table: the head's size and checksum against the
    /// manifest, the header, the directory, the shard count and totals against the manifest's,
    /// and sidecars only where the schema has columns for them. Blocks are read and checked on
    /// first use. `object` names the table in errors.
    pub fn attach_table(&mut self, reader: Arc<dyn TableReader>, object: &str) -> Result<()> {
        let bad = |reason: String| Error::Manifest {
            object: object.to_owned(),
            reason,
        };
        let r = self
            .shard_table
            .as_ref()
            .ok_or_else(|| bad("the manifest names no shard table".into()))?;
        let head = reader.read(0..shard_table_head_len(r.shards))?;
        if head.len() as u64 != shard_table_head_len(r.shards) {
            return Err(bad(format!(
                "its head is {} bytes, {} shards need {}",
                head.len(),
                r.shards,
                shard_table_head_len(r.shards)
            )));
        }
        let sum = xxh3_64(&head);
        if Some(sum) != hex16(&r.checksum) {
            return Err(bad(format!(
                "checksum {sum:016x}, the manifest says {}: the table was edited or damaged",
                r.checksum
            )));
        }
        let t = ShardTable::open(head, reader, object).map_err(|r| bad(r.into()))?;
        if t.len() as u64 != r.shards {
            return Err(bad(format!("{} shards, the manifest says {}", t.len(), r.shards)));
        }
        if t.samples != self.samples || t.bytes != self.bytes {
            return Err(bad(format!(
                "its shards hold {} samples in {} bytes; the manifest says {} in {}",
                t.samples, t.bytes, self.samples, self.bytes
            )));
        }
        if t.columns && self.schema.without_bytes().is_none() {
            return Err(bad(
                "it lists columns sidecars, but the schema has nothing to put in them".into(),
            ));
        }
        self.table = Some(Arc::new(t));
        Ok(())
    }

    /// The version id this manifest's content implies.
    pub fn compute_version(&self) -> String {
        let mut unversioned = self.clone();
        unversioned.version.clear();
        let canon = serde_json::to_vec(&unversioned).expect("manifest serialises");
        format!("{:032x}", xxh3_128(&canon))
    }

    /// Canonical bytes to store (pretty-printed, deterministic, trailing newline).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = serde_json::to_vec_pretty(self).expect("manifest serialises");
        b.push(b'\n');
        b
    }

    /// Parses and validates a manifest read from `object`.
    pub fn parse(bytes: &[u8], object: &str) -> Result<Manifest> {
        let bad = |reason: String| Error::Manifest {
            object: object.to_owned(),
            reason,
        };
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(format!("not a manifest: {e}")))?;
        if m.format != MANIFEST_FORMAT {
            return Err(bad(format!("format is {:?}, expected {MANIFEST_FORMAT:?}", m.format)));
        }
        let (want_version, kind) = match (&m.shard_table, &m.foreign) {
            (Some(_), None) => (MANIFEST_VERSION_TABLE, "with a shard table"),
            (None, None) => (MANIFEST_VERSION, "without a shard table"),
            (None, Some(_)) => (MANIFEST_VERSION_FOREIGN, "over foreign shards"),
            (Some(_), Some(_)) => {
                return Err(bad(
                    "foreign shards are listed in the manifest, not in a shard table".into()
                ))
            }
        };
        if m.format_version != want_version {
            return Err(bad(format!(
                "format_version {} is not supported for a manifest {kind} (this build reads {want_version})",
                m.format_version,
            )));
        }
        m.schema.validate().map_err(|r| bad(format!("schema: {r}")))?;
        let computed = m.compute_version();
        if computed != m.version {
            return Err(bad(format!(
                "version {} does not match its content (hashes to {computed}): the manifest was edited or damaged",
                m.version
            )));
        }
        // Checked: the counts are untrusted input, and a sum that wraps would pass the check.
        if let Some(r) = &m.shard_table {
            if !m.shards.is_empty() {
                return Err(bad("it lists shards and names a shard table: one or the other".into()));
            }
            validate_key(&r.key).map_err(|why| bad(format!("shard table key {:?}: {why}", r.key)))?;
            if hex16(&r.checksum).is_none() {
                return Err(bad(format!(
                    "shard table checksum {:?} is not 16 hex digits",
                    r.checksum
                )));
            }
            if r.shards > u32::MAX as u64 {
                return Err(bad(format!("{} shards exceeds the limit of {}", r.shards, u32::MAX)));
            }
            let want = shard_table_len(r.shards);
            if r.bytes != want || r.bytes > SHARD_TABLE_BYTES_MAX {
                return Err(bad(format!(
                    "its shard table of {} shards must be {want} bytes (at most {SHARD_TABLE_BYTES_MAX}), not {}",
                    r.shards, r.bytes
                )));
            }
            // The records are checked when the table is attached.
            return Ok(m);
        }
        let samples = m.shards.iter().try_fold(0u64, |a, s| a.checked_add(s.samples));
        let total = m.shards.iter().try_fold(0u64, |a, s| a.checked_add(s.bytes));
        let (Some(samples), Some(total)) = (samples, total) else {
            return Err(bad("its shards' sample or byte counts overflow 64 bits".into()));
        };
        if samples != m.samples || total != m.bytes {
            return Err(bad(format!(
                "totals ({} samples, {} bytes) do not match its shards ({samples}, {total})",
                m.samples, m.bytes
            )));
        }
        if m.shards.len() as u64 > u32::MAX as u64 {
            return Err(bad(format!(
                "{} shards exceeds the limit of {}",
                m.shards.len(),
                u32::MAX
            )));
        }
        let mut keys = std::collections::HashSet::new();
        for s in &m.shards {
            // A shard listed with 0 samples would be left out of every epoch without a word,
            // whatever it holds: the stream would run short. No writer lists an empty shard.
            if s.samples == 0 {
                return Err(bad(format!(
                    "shard {:?} lists 0 samples; a shard holds at least one (no writer lists an empty one)",
                    s.key
                )));
            }
            if s.samples > crate::format::SHARD_SAMPLES_MAX {
                return Err(bad(format!(
                    "shard {:?} claims {} samples, over the shard limit of {}",
                    s.key,
                    s.samples,
                    crate::format::SHARD_SAMPLES_MAX
                )));
            }
            validate_key(&s.key).map_err(|r| bad(format!("shard key {:?}: {r}", s.key)))?;
            if !keys.insert(s.key.as_str()) {
                return Err(bad(format!("shard key {:?} listed twice", s.key)));
            }
            if s.checksum_u64().is_none() {
                return Err(bad(format!(
                    "shard {:?} checksum {:?} is not 16 hex digits",
                    s.key, s.checksum
                )));
            }
            match (&s.foreign, &m.foreign) {
                (Some(f), Some(_)) => {
                    if f.checksum_u64().is_none() {
                        return Err(bad(format!(
                            "shard {:?} foreign checksum {:?} is not 16 hex digits",
                            s.key, f.checksum
                        )));
                    }
                    if let Some(c) = &f.compression {
                        super::foreign::compression_name(c).map_err(|r| bad(format!("shard {:?}: {r}", s.key)))?;
                    }
                    if let Some(ix) = &f.index {
                        validate_key(&ix.key).map_err(|r| bad(format!("sample index key {:?}: {r}", ix.key)))?;
                        if !keys.insert(ix.key.as_str()) {
                            return Err(bad(format!("key {:?} listed twice", ix.key)));
                        }
                        if hex16(&ix.checksum).is_none()
                            || Some(ix.bytes) != s.samples.checked_mul(super::foreign::SAMPLE_INDEX_ENTRY_LEN)
                            || f.compression.is_some()
                        {
                            return Err(bad(format!(
                                "shard {:?}: its sample index must be 24 bytes a sample with a 16-hex-digit checksum, of a plain object",
                                s.key
                            )));
                        }
                    }
                }
                (None, None) => {}
                (Some(_), None) => {
                    return Err(bad(format!(
                        "shard {:?} is foreign, but the manifest says no format",
                        s.key
                    )))
                }
                (None, Some(_)) => {
                    return Err(bad(format!(
                        "shard {:?} is not foreign, in a manifest over foreign shards",
                        s.key
                    )))
                }
            }
            if let Some(c) = &s.columns {
                validate_key(&c.key).map_err(|r| bad(format!("columns key {:?}: {r}", c.key)))?;
                if !keys.insert(c.key.as_str()) {
                    return Err(bad(format!("key {:?} listed twice", c.key)));
                }
                if c.checksum_u64().is_none() {
                    return Err(bad(format!(
                        "columns {:?} checksum {:?} is not 16 hex digits",
                        c.key, c.checksum
                    )));
                }
            }
        }
        if m.shards.iter().any(|s| s.columns.is_some()) && m.schema.without_bytes().is_none() {
            return Err(bad(
                "it lists columns sidecars, but its schema has nothing to put in them".into(),
            ));
        }
        Ok(m)
    }

    /// Index of the shard holding global sample `index`, and the sample's index inside it
    /// (`None` past the end): a binary search of the shards' prefix sums, `O(log shards)`.
    pub fn locate(&self, index: u64) -> Result<Option<(usize, u64)>> {
        match (&self.table, &self.shard_table) {
            (Some(t), _) => t.locate(index),
            (None, Some(_)) => Err(self.no_table()),
            (None, None) => {
                let starts = self.listed_starts();
                if index >= *starts.last().expect("at least the total") {
                    return Ok(None);
                }
                let i = starts.partition_point(|&s| s <= index) - 1;
                Ok(Some((i, index - starts[i])))
            }
        }
    }

    /// Each listed shard's first global sample, then the total (`shards + 1` entries).
    fn listed_starts(&self) -> &Arc<Vec<u64>> {
        self.starts.get_or_init(|| {
            let mut v = Vec::with_capacity(self.shards.len() + 1);
            let mut acc = 0u64;
            v.push(0);
            for s in &self.shards {
                acc += s.samples;
                v.push(acc);
            }
            Arc::new(v)
        })
    }
}

impl PartialEq for Manifest {
    fn eq(&self, o: &Manifest) -> bool {
        (
            &self.format,
            self.format_version,
            &self.version,
            &self.source,
            &self.schema,
            &self.meta,
            self.samples,
            self.bytes,
            &self.shards,
            &self.shard_table,
            &self.foreign,
            &self.table,
        ) == (
            &o.format,
            o.format_version,
            &o.version,
            &o.source,
            &o.schema,
            &o.meta,
            o.samples,
            o.bytes,
            &o.shards,
            &o.shard_table,
            &o.foreign,
            &o.table,
        )
    }
}

/// A key a manifest may name: relative, no `.` or `..` segments, no empty segments, no
/// backslashes or control characters. Keys never escape the dataset prefix.
pub fn validate_key(key: &str) -> std::result::Result<(), Invalid> {
    if key.is_empty() || key.len() > 1024 {
        return Err(Invalid::from("must be 1..=1024 bytes"));
    }
    if key.starts_with('/') {
        return Err(Invalid::from("must be relative"));
    }
    if key.chars().any(|c| c.is_control() || c == '\\') {
        return Err(Invalid::from("contains a control character or backslash"));
    }
    if key.split('/').any(|seg| seg.is_empty() || seg == "." || seg == "..") {
        return Err(Invalid::from("contains an empty, '.' or '..' segment"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{shard_key, ColumnType};

    fn infos(n: usize) -> Vec<ShardInfo> {
        (0..n)
            .map(|i| {
                let c = 0x1000 + i as u64 * 7;
                ShardInfo {
                    key: shard_key(i * 2, c),
                    bytes: 100 + i as u64,
                    samples: 3 + i as u64 % 5,
                    checksum: format!("{c:016x}"),
                    columns: None,
                    foreign: None,
                }
            })
            .collect()
    }

    fn schema() -> Schema {
        Schema::new([("x".to_string(), ColumnType::Int64)]).unwrap()
    }

    fn whole(t: &ShardTable) -> Arc<dyn TableReader> {
        Arc::new(WholeTable(t.as_bytes().unwrap().clone()))
    }

    /// Built, stored and attached, a table gives back the shards it was built from, and a
    /// manifest with it answers like the listed one; blocks are read only when used.
    #[test]
    fn a_shard_table_round_trips() {
        let shards = infos(2500);
        let listed = Manifest::new("t", schema(), Default::default(), shards.clone());
        let t = ShardTable::build(&shards).unwrap();
        assert_eq!(t.as_bytes().unwrap().len() as u64, shard_table_len(2500));
        let m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "tables/x.rjt");
        let mut read = Manifest::parse(&m.to_bytes(), "m").unwrap();
        assert_eq!(read.shard_count(), 2500);
        assert!(read.shard(0).is_err(), "not attached yet");
        read.attach_table(whole(&t), "tables/x.rjt").unwrap();
        assert_eq!(read.table().unwrap().loaded_blocks(), 0, "the head alone");
        assert_eq!(read.shard(2100).unwrap(), shards[2100]);
        assert_eq!(read.table().unwrap().loaded_blocks(), 1);
        assert_eq!(read.shards().map(|s| s.unwrap()).collect::<Vec<_>>(), shards);
        assert_eq!((read.samples, read.bytes), (listed.samples, listed.bytes));
        for g in (0..listed.samples + 1)
            .step_by(7)
            .chain([listed.samples - 1, listed.samples])
        {
            assert_eq!(read.locate(g).unwrap(), listed.locate(g).unwrap(), "{g}");
        }
        for i in [0, 1023, 1024, 2499] {
            assert_eq!(read.shard_start(i).unwrap(), listed.shard_start(i).unwrap());
        }
        assert!(read.shard(2500).is_err() && listed.shard(2500).is_err());
    }

    /// Keys not named as pack names them, and key indices that do not rise, cannot be put in
    /// a table (they could not be derived back).
    #[test]
    fn a_table_refuses_keys_it_cannot_derive() {
        let mut s = infos(3);
        s[1].key = "shards/elsewhere.rjs".into();
        assert!(ShardTable::build(&s).unwrap_err().contains("elsewhere"));
        let mut s = infos(3);
        s.swap(0, 2);
        assert!(ShardTable::build(&s).unwrap_err().contains("rise"));
    }

    /// A table whose totals contradict the manifest, whose head or a block was changed, or
    /// whose records exceed the shard limit (checksums made to agree), is refused with the
    /// reason: the head when attached, a block when first used.
    #[test]
    fn a_table_that_contradicts_its_manifest_is_refused() {
        let shards = infos(1500);
        let t = ShardTable::build(&shards).unwrap();
        let mut m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "t.rjt");
        m.samples += 1;
        m.version = m.compute_version();
        let mut m = Manifest::parse(&m.to_bytes(), "m").unwrap();
        let e = m.attach_table(whole(&t), "t.rjt").unwrap_err().to_string();
        assert!(e.contains("the manifest says"), "{e}");
        // A flipped byte in a record of block 1: the head is sound, the block is refused.
        let ok = Manifest::with_table("t", schema(), Default::default(), t.clone(), "t.rjt");
        let head = shard_table_head_len(1500) as usize;
        let mut raw = t.as_bytes().unwrap().to_vec();
        raw[head + 1100 * SHARD_TABLE_RECORD_LEN] ^= 1;
        let mut m = Manifest::parse(&ok.to_bytes(), "m").unwrap();
        m.attach_table(Arc::new(WholeTable(Bytes::from(raw))), "t.rjt").unwrap();
        assert_eq!(m.shard(5).unwrap(), shards[5]);
        let e = m.shard(1100).unwrap_err().to_string();
        assert!(
            e.contains("t.rjt") && e.contains("block 1") && e.contains("checksum"),
            "{e}"
        );
        // A flipped byte in the directory: refused when attached.
        let mut raw = t.as_bytes().unwrap().to_vec();
        raw[SHARD_TABLE_HEADER_LEN + 2] ^= 1;
        let mut m = Manifest::parse(&ok.to_bytes(), "m").unwrap();
        let e = m
            .attach_table(Arc::new(WholeTable(Bytes::from(raw))), "t.rjt")
            .unwrap_err()
            .to_string();
        assert!(e.contains("checksum") && e.contains("t.rjt"), "{e}");
        // A record claiming too many samples (its block's checksum and the totals agree).
        let mut s = infos(3);
        s[0].samples = crate::format::SHARD_SAMPLES_MAX + 1;
        let bad = ShardTable::build(&s).unwrap();
        let m = Manifest::with_table("t", schema(), Default::default(), bad.clone(), "t.rjt");
        let mut m = Manifest::parse(&m.to_bytes(), "m").unwrap();
        m.attach_table(whole(&bad), "t.rjt").unwrap();
        let e = m.shard(2).unwrap_err().to_string();
        assert!(e.contains("over the shard limit"), "{e}");
        // A directory whose block claims more than its shards could hold.
        s[1].samples = u64::MAX / 4;
        assert!(ShardTable::build(&s).unwrap_err().contains("out of order"));
        // A header that counts one shard more than the bytes hold.
        let mut raw = t.as_bytes().unwrap().to_vec();
        raw[8..16].copy_from_slice(&1501u64.to_le_bytes());
        assert!(ShardTable::parse(Bytes::from(raw))
            .unwrap_err()
            .contains("header says 1501"));
        // The first layout is named, not misread.
        let mut raw = t.as_bytes().unwrap().to_vec();
        raw[..8].copy_from_slice(b"RJSTAB01");
        assert!(ShardTable::parse(Bytes::from(raw))
            .unwrap_err()
            .contains("pack the dataset again"));
    }
}
