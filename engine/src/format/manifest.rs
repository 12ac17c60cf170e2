//! The dataset manifest: schema, shard list and a content-derived version id.
//!
//! A manifest lists its shards in the JSON, or, for a large dataset, names a binary shard
//! table beside it (`ShardTable`: 48 bytes a shard, read as is, no per-shard objects), whose
//! checksum the JSON carries, so the version covers the table too.
//!
//! The version is the xxh3-128 of the manifest's canonical JSON with the `version` field
//! empty, so two manifests share a version exactly when they describe the same bytes.
//! Packing writes `manifests/<version>.json` and then, last, `manifest.json`: a reader that
//! finds `manifest.json` finds every shard it lists already in place.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use super::schema::Schema;
use crate::error::{Error, Result};

/// Value of the `format` field.
pub const MANIFEST_FORMAT: &str = "ramjet-manifest";
/// Manifest format version of a manifest that lists its shards in the JSON.
pub const MANIFEST_VERSION: u32 = 1;
/// Manifest format version of a manifest whose shards are in a binary shard table (a reader
/// from before tables refuses it by this number rather than misreading it).
pub const MANIFEST_VERSION_TABLE: u32 = 2;
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
fn hex16(s: &str) -> Option<u64> {
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
pub const SHARD_TABLE_MAGIC: &[u8; 8] = b"RJSTAB01";
/// Bytes of the shard table's header.
pub const SHARD_TABLE_HEADER_LEN: usize = 32;
/// Bytes of one shard's record in the table.
pub const SHARD_TABLE_RECORD_LEN: usize = 48;
/// Largest shard table a reader will download (about 44 million shards).
pub const SHARD_TABLE_BYTES_MAX: u64 = 2 << 30;
/// Pack lists more shards than this in a binary table rather than in the JSON.
pub const SHARD_TABLE_AUTO_MIN: usize = 4096;

/// A binary shard table: the shards of a large dataset, 48 bytes each, read in place
/// (`docs/format.md`). Keys are not stored: shard `i` is `shards/<k:06>-<checksum:016x>.rjs`
/// for its stored key index `k`, and its sidecar `columns/<k:06>-<sidecar checksum>.rjs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardTable {
    bytes: Bytes,
    count: usize,
    columns: bool,
}

impl ShardTable {
    /// The table of `shards`, whose keys must be pack's (`shards/<k>-<checksum>.rjs`, key
    /// indices rising), and which all have a sidecar or none does.
    pub fn build(shards: &[ShardInfo]) -> std::result::Result<ShardTable, String> {
        let columns = shards.first().is_some_and(|s| s.columns.is_some());
        let mut b = Vec::with_capacity(SHARD_TABLE_HEADER_LEN + shards.len() * SHARD_TABLE_RECORD_LEN);
        b.extend_from_slice(SHARD_TABLE_MAGIC);
        b.extend_from_slice(&(shards.len() as u64).to_le_bytes());
        b.extend_from_slice(&(SHARD_TABLE_RECORD_LEN as u32).to_le_bytes());
        b.extend_from_slice(&(columns as u32).to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        let mut prev: Option<u64> = None;
        for s in shards {
            let checksum = s
                .checksum_u64()
                .ok_or_else(|| format!("shard {:?}: bad checksum", s.key))?;
            let k = key_index(&s.key, "shards/", checksum)
                .ok_or_else(|| format!("shard key {:?} is not shards/<index>-<checksum>.rjs", s.key))?;
            if prev.is_some_and(|p| k <= p) {
                return Err(format!("shard key {:?}: key indices must rise", s.key));
            }
            prev = Some(k);
            let (cb, cc) = match (&s.columns, columns) {
                (Some(c), true) => {
                    let cc = c
                        .checksum_u64()
                        .ok_or_else(|| format!("columns {:?}: bad checksum", c.key))?;
                    if key_index(&c.key, "columns/", cc) != Some(k) {
                        return Err(format!("columns key {:?} is not columns/<index>-<checksum>.rjs", c.key));
                    }
                    (c.bytes, cc)
                }
                (None, false) => (0, 0),
                _ => return Err("some shards have a columns sidecar and some do not".into()),
            };
            for v in [s.samples, s.bytes, checksum, k, cb, cc] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        Ok(ShardTable {
            bytes: Bytes::from(b),
            count: shards.len(),
            columns,
        })
    }

    /// Reads a table's header and checks its length (the records are checked by
    /// [`Manifest::attach_table`]).
    pub fn parse(bytes: Bytes) -> std::result::Result<ShardTable, String> {
        if bytes.len() < SHARD_TABLE_HEADER_LEN || &bytes[..8] != SHARD_TABLE_MAGIC {
            return Err("not a shard table (bad magic or shorter than its header)".into());
        }
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let (count, record, flags) = (u64_at(8), u32_at(16) as usize, u32_at(20));
        if record != SHARD_TABLE_RECORD_LEN || flags > 1 || u64_at(24) != 0 {
            return Err(format!("unsupported header (record length {record}, flags {flags})"));
        }
        let want = (count as u128) * SHARD_TABLE_RECORD_LEN as u128 + SHARD_TABLE_HEADER_LEN as u128;
        if want != bytes.len() as u128 {
            return Err(format!(
                "{} bytes, but its header says {count} shards ({want} bytes)",
                bytes.len()
            ));
        }
        Ok(ShardTable {
            count: count as usize,
            columns: flags == 1,
            bytes,
        })
    }

    /// The table's bytes, as stored.
    pub fn as_bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// xxh3-64 of the whole table (what the manifest records).
    pub fn checksum(&self) -> u64 {
        xxh3_64(&self.bytes)
    }

    /// Number of shards.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether it lists no shard.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn field(&self, i: usize, f: usize) -> u64 {
        let o = SHARD_TABLE_HEADER_LEN + i * SHARD_TABLE_RECORD_LEN + f * 8;
        u64::from_le_bytes(self.bytes[o..o + 8].try_into().expect("8 bytes"))
    }

    fn info(&self, i: usize) -> ShardInfo {
        let (samples, bytes, checksum, k) = (self.field(i, 0), self.field(i, 1), self.field(i, 2), self.field(i, 3));
        ShardInfo {
            key: super::shard_key(k as usize, checksum),
            bytes,
            samples,
            checksum: format!("{checksum:016x}"),
            columns: self.columns.then(|| {
                let cc = self.field(i, 5);
                ColumnsInfo {
                    key: super::columns_key(k as usize, cc),
                    bytes: self.field(i, 4),
                    checksum: format!("{cc:016x}"),
                }
            }),
        }
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
            table: None,
            starts: OnceLock::new(),
        };
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
        let (samples, bytes) = (0..table.len()).fold((0u64, 0u64), |(n, b), i| {
            (n.saturating_add(table.field(i, 0)), b.saturating_add(table.field(i, 1)))
        });
        let mut m = Manifest {
            format: MANIFEST_FORMAT.into(),
            format_version: MANIFEST_VERSION_TABLE,
            version: String::new(),
            source: source.into(),
            schema,
            meta,
            samples,
            bytes,
            shards: Vec::new(),
            shard_table: Some(ShardTableRef {
                key: key.into(),
                bytes: table.bytes.len() as u64,
                checksum: format!("{:016x}", table.checksum()),
                shards: table.len() as u64,
            }),
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

    /// Shard `i` (panics past the end, as indexing does; see [`Manifest::get_shard`]).
    pub fn shard(&self, i: usize) -> ShardInfo {
        self.get_shard(i)
            .unwrap_or_else(|| panic!("shard {i} of {}", self.shard_count()))
    }

    /// Shard `i`, or `None` past the end (or while the shard table is not loaded).
    pub fn get_shard(&self, i: usize) -> Option<ShardInfo> {
        match &self.table {
            Some(t) => (i < t.len()).then(|| t.info(i)),
            None => self.shards.get(i).cloned(),
        }
    }

    /// The shards in order.
    pub fn shards(&self) -> impl ExactSizeIterator<Item = ShardInfo> + '_ {
        let n = match &self.table {
            Some(t) => t.len(),
            None => self.shards.len(),
        };
        (0..n).map(|i| self.shard(i))
    }

    /// The listed shards, to edit (tools and tests that write a manifest by hand; the
    /// version must then be recomputed). Empty for a manifest with a shard table.
    pub fn shards_mut(&mut self) -> &mut Vec<ShardInfo> {
        self.starts = OnceLock::new();
        &mut self.shards
    }

    /// Samples of shard `i`, without building its [`ShardInfo`].
    pub fn shard_samples(&self, i: usize) -> u64 {
        match &self.table {
            Some(t) => t.field(i, 0),
            None => self.shards[i].samples,
        }
    }

    /// Bytes and checksum of shard `i`, without building its [`ShardInfo`].
    pub fn shard_bytes_checksum(&self, i: usize) -> (u64, u64) {
        match &self.table {
            Some(t) => (t.field(i, 1), t.field(i, 2)),
            None => (self.shards[i].bytes, self.shards[i].checksum_u64().expect("validated")),
        }
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

    /// Checks `bytes`, read from `object`, against the table the manifest names, and attaches
    /// it: its size and checksum, its header, and every record (sample counts within the shard
    /// limit, key indices rising, totals equal to the manifest's, sidecars only where the
    /// schema has columns for them).
    pub fn attach_table(&mut self, bytes: Bytes, object: &str) -> Result<()> {
        let bad = |reason: String| Error::Manifest {
            object: object.to_owned(),
            reason,
        };
        let r = self
            .shard_table
            .as_ref()
            .ok_or_else(|| bad("the manifest names no shard table".into()))?;
        if bytes.len() as u64 != r.bytes {
            return Err(bad(format!("{} bytes, the manifest says {}", bytes.len(), r.bytes)));
        }
        let sum = xxh3_64(&bytes);
        if Some(sum) != hex16(&r.checksum) {
            return Err(bad(format!(
                "checksum {sum:016x}, the manifest says {}: the table was edited or damaged",
                r.checksum
            )));
        }
        let t = ShardTable::parse(bytes).map_err(bad)?;
        if t.len() as u64 != r.shards {
            return Err(bad(format!("{} shards, the manifest says {}", t.len(), r.shards)));
        }
        let (mut samples, mut total) = (0u64, 0u64);
        let mut prev: Option<u64> = None;
        for i in 0..t.len() {
            let (n, b, k) = (t.field(i, 0), t.field(i, 1), t.field(i, 3));
            if n > crate::format::SHARD_SAMPLES_MAX {
                return Err(bad(format!(
                    "shard {i} claims {n} samples, over the shard limit of {}",
                    crate::format::SHARD_SAMPLES_MAX
                )));
            }
            if prev.is_some_and(|p| k <= p) {
                return Err(bad(format!("shard {i}: key index {k} does not rise")));
            }
            prev = Some(k);
            samples = samples
                .checked_add(n)
                .ok_or_else(|| bad("sample counts overflow 64 bits".into()))?;
            total = total
                .checked_add(b)
                .ok_or_else(|| bad("byte counts overflow 64 bits".into()))?;
        }
        if samples != self.samples || total != self.bytes {
            return Err(bad(format!(
                "its shards hold {samples} samples in {total} bytes; the manifest says {} in {}",
                self.samples, self.bytes
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
        let want_version = if m.shard_table.is_some() {
            MANIFEST_VERSION_TABLE
        } else {
            MANIFEST_VERSION
        };
        if m.format_version != want_version {
            return Err(bad(format!(
                "format_version {} is not supported for a manifest {} a shard table (this build reads {want_version})",
                m.format_version,
                if m.shard_table.is_some() { "with" } else { "without" }
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
            let want = SHARD_TABLE_HEADER_LEN as u64 + r.shards * SHARD_TABLE_RECORD_LEN as u64;
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

    /// Index of the shard holding global sample `index`, and the sample's index inside it:
    /// a binary search of the shards' prefix sums (built once), `O(log shards)`.
    pub fn locate(&self, index: u64) -> Option<(usize, u64)> {
        let starts = self.starts_with_total();
        if index >= *starts.last().expect("at least the total") {
            return None;
        }
        let i = starts.partition_point(|&s| s <= index) - 1;
        Some((i, index - starts[i]))
    }

    /// Global index of each shard's first sample.
    pub fn shard_starts(&self) -> Vec<u64> {
        let s = self.starts_with_total();
        s[..s.len() - 1].to_vec()
    }

    /// Each shard's first global sample, then the total (`shards + 1` entries).
    fn starts_with_total(&self) -> &Arc<Vec<u64>> {
        self.starts.get_or_init(|| {
            let n = self.shard_count();
            let mut v = Vec::with_capacity(n + 1);
            let mut acc = 0u64;
            v.push(0);
            for i in 0..n {
                acc += self.shard_samples(i);
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
            &o.table,
        )
    }
}

/// A key a manifest may name: relative, no `.` or `..` segments, no empty segments, no
/// backslashes or control characters. Keys never escape the dataset prefix.
pub fn validate_key(key: &str) -> std::result::Result<(), String> {
    if key.is_empty() || key.len() > 1024 {
        return Err("must be 1..=1024 bytes".into());
    }
    if key.starts_with('/') {
        return Err("must be relative".into());
    }
    if key.chars().any(|c| c.is_control() || c == '\\') {
        return Err("contains a control character or backslash".into());
    }
    if key.split('/').any(|seg| seg.is_empty() || seg == "." || seg == "..") {
        return Err("contains an empty, '.' or '..' segment".into());
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
                }
            })
            .collect()
    }

    fn schema() -> Schema {
        Schema::new([("x".to_string(), ColumnType::Int64)]).unwrap()
    }

    /// Built, stored and attached, a table gives back the shards it was built from, and a
    /// manifest with it answers like the listed one.
    #[test]
    fn a_shard_table_round_trips() {
        let shards = infos(50);
        let listed = Manifest::new("t", schema(), Default::default(), shards.clone());
        let t = ShardTable::build(&shards).unwrap();
        let m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "tables/x.rjt");
        let mut read = Manifest::parse(&m.to_bytes(), "m").unwrap();
        assert_eq!(read.shard_count(), 50);
        assert!(read.get_shard(0).is_none(), "not attached yet");
        read.attach_table(t.as_bytes().clone(), "tables/x.rjt").unwrap();
        assert_eq!(read.shards().collect::<Vec<_>>(), shards);
        assert_eq!((read.samples, read.bytes), (listed.samples, listed.bytes));
        for g in 0..listed.samples + 1 {
            assert_eq!(read.locate(g), listed.locate(g));
        }
        assert_eq!(read.shard_starts(), listed.shard_starts());
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

    /// A table whose records contradict the manifest (totals), exceed the shard limit, or
    /// whose header lies about its length, is refused with the reason.
    #[test]
    fn a_table_that_contradicts_its_manifest_is_refused() {
        let shards = infos(4);
        let t = ShardTable::build(&shards).unwrap();
        let mut m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "t.rjt");
        m.samples += 1;
        m.version = m.compute_version();
        let mut m = Manifest::parse(&m.to_bytes(), "m").unwrap();
        let e = m.attach_table(t.as_bytes().clone(), "t.rjt").unwrap_err().to_string();
        assert!(e.contains("the manifest says"), "{e}");
        // A record claiming too many samples, with the manifest made to agree.
        let mut raw = t.as_bytes().to_vec();
        raw[SHARD_TABLE_HEADER_LEN..SHARD_TABLE_HEADER_LEN + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let bad = ShardTable::parse(Bytes::from(raw)).unwrap();
        let mut m = Manifest::with_table("t", schema(), Default::default(), bad.clone(), "t.rjt");
        m.samples = 0;
        m.version = m.compute_version();
        let mut m = Manifest::parse(&m.to_bytes(), "m").unwrap();
        let e = m.attach_table(bad.as_bytes().clone(), "t.rjt").unwrap_err().to_string();
        assert!(e.contains("over the shard limit"), "{e}");
        // A header that counts one shard more than the bytes hold.
        let mut raw = t.as_bytes().to_vec();
        raw[8..16].copy_from_slice(&5u64.to_le_bytes());
        assert!(ShardTable::parse(Bytes::from(raw))
            .unwrap_err()
            .contains("header says 5"));
    }
}
