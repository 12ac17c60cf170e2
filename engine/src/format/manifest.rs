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

use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use super::checksum::Checksum;
use super::schema::Schema;
use super::table::{
    shard_table_head_len, shard_table_len, ShardTable, ShardTableRef, TableReader, SHARD_TABLE_BYTES_MAX,
};
use crate::error::{Error, Invalid, Result};
use crate::foreign::{ForeignObject, ForeignSpec};

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
    /// Whole-shard xxh3-64 (16 lowercase hex digits in the JSON).
    pub checksum: Checksum,
    /// The shard's columns sidecar: the same samples with every column except the `bytes`
    /// ones, so labels and sizes are read without the images. Absent in datasets packed
    /// before it existed, and when the schema has no `bytes` column or nothing else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub columns: Option<ColumnsInfo>,
    /// A foreign shard (MDS, WebDataset) read in place: the object as stored at `key`. Then
    /// `bytes` and `checksum` are those of the ramjet shard it transcodes to (see
    /// [`crate::foreign`]).
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
    /// Whole-file xxh3-64 (16 lowercase hex digits in the JSON).
    pub checksum: Checksum,
}

impl ColumnsInfo {
    /// The checksum as a number.
    pub fn checksum_u64(&self) -> u64 {
        self.checksum.get()
    }
}

impl ShardInfo {
    /// The checksum as a number.
    pub fn checksum_u64(&self) -> u64 {
        self.checksum.get()
    }
}

/// How a manifest lists its shards: one kind a format version.
#[derive(Debug, Clone, PartialEq)]
pub enum ShardList {
    /// Listed in the JSON, in sample order ([`MANIFEST_VERSION`]).
    Listed(Vec<ShardInfo>),
    /// In a binary shard table beside the manifest ([`MANIFEST_VERSION_TABLE`]): where it is,
    /// and its content once [`Manifest::attach_table`] has read its head.
    Table {
        /// Where the table is, and what it must be.
        table_ref: ShardTableRef,
        /// The table, once attached.
        table: Option<Arc<ShardTable>>,
    },
    /// Foreign shards (MDS, WebDataset) read in place, listed in the JSON, each with its
    /// [`ShardInfo::foreign`] object ([`MANIFEST_VERSION_FOREIGN`]).
    Foreign {
        /// The shards, in sample order.
        shards: Vec<ShardInfo>,
        /// Their layout.
        spec: ForeignSpec,
    },
}

/// A dataset manifest. Its JSON form is in `docs/format.md`; in memory, the shards are a
/// [`ShardList`] of one kind, and every checksum is a number.
#[derive(Debug, Clone)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// [`MANIFEST_VERSION`], [`MANIFEST_VERSION_TABLE`] or [`MANIFEST_VERSION_FOREIGN`], as
    /// its [`ShardList`] is.
    pub format_version: u32,
    /// Content-derived version id (32 hex digits).
    pub version: String,
    /// What the dataset was packed from: `yolo`, `imagefolder`, `jsonl`, or a caller's word
    /// (the JSON's `source` field).
    pub packed_from: String,
    /// Schema of every shard.
    pub schema: Schema,
    /// Free-form metadata (class names, ...). Keys are sorted, so it serialises canonically.
    pub meta: serde_json::Map<String, serde_json::Value>,
    /// Total samples.
    pub samples: u64,
    /// Total shard bytes.
    pub bytes: u64,
    /// The shards. Read them through [`Manifest::shard`], [`Manifest::shards`] and
    /// [`Manifest::shard_count`], which see every kind.
    list: ShardList,
    /// Each listed shard's first global sample, and the total (built on first use).
    starts: OnceLock<Arc<Vec<u64>>>,
}

/// The manifest's JSON, as written: field order is the canonical order the version hashes.
#[derive(Serialize)]
struct JsonOut<'a> {
    format: &'a str,
    format_version: u32,
    version: &'a str,
    source: &'a str,
    schema: &'a Schema,
    meta: &'a serde_json::Map<String, serde_json::Value>,
    samples: u64,
    bytes: u64,
    shards: &'a [ShardInfo],
    #[serde(skip_serializing_if = "Option::is_none")]
    shard_table: Option<&'a ShardTableRef>,
    #[serde(skip_serializing_if = "Option::is_none")]
    foreign: Option<&'a ForeignSpec>,
}

/// The manifest's JSON, as read.
#[derive(Deserialize)]
struct JsonIn {
    format: String,
    format_version: u32,
    version: String,
    source: String,
    schema: Schema,
    #[serde(default)]
    meta: serde_json::Map<String, serde_json::Value>,
    samples: u64,
    bytes: u64,
    shards: Vec<ShardInfo>,
    #[serde(default)]
    shard_table: Option<ShardTableRef>,
    #[serde(default)]
    foreign: Option<ForeignSpec>,
}

impl Serialize for Manifest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let (shards, shard_table, foreign): (&[ShardInfo], _, _) = match &self.list {
            ShardList::Listed(v) => (v, None, None),
            ShardList::Table { table_ref, .. } => (&[], Some(table_ref), None),
            ShardList::Foreign { shards, spec } => (shards, None, Some(spec)),
        };
        JsonOut {
            format: &self.format,
            format_version: self.format_version,
            version: &self.version,
            source: &self.packed_from,
            schema: &self.schema,
            meta: &self.meta,
            samples: self.samples,
            bytes: self.bytes,
            shards,
            shard_table,
            foreign,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Manifest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Manifest, D::Error> {
        let j = JsonIn::deserialize(d)?;
        let list = match (j.shard_table, j.foreign) {
            (None, None) => ShardList::Listed(j.shards),
            (None, Some(spec)) => ShardList::Foreign { shards: j.shards, spec },
            (Some(_), Some(_)) => {
                return Err(serde::de::Error::custom(
                    "foreign shards are listed in the manifest, not in a shard table",
                ))
            }
            (Some(_), None) if !j.shards.is_empty() => {
                return Err(serde::de::Error::custom(
                    "it lists shards and names a shard table: one or the other",
                ))
            }
            (Some(table_ref), None) => ShardList::Table { table_ref, table: None },
        };
        Ok(Manifest {
            format: j.format,
            format_version: j.format_version,
            version: j.version,
            packed_from: j.source,
            schema: j.schema,
            meta: j.meta,
            samples: j.samples,
            bytes: j.bytes,
            list,
            starts: OnceLock::new(),
        })
    }
}

impl Manifest {
    /// A manifest over `shards`, with totals and the version computed.
    pub fn new(
        packed_from: impl Into<String>,
        schema: Schema,
        meta: serde_json::Map<String, serde_json::Value>,
        shards: Vec<ShardInfo>,
    ) -> Self {
        let mut m = Manifest {
            format: MANIFEST_FORMAT.into(),
            format_version: MANIFEST_VERSION,
            version: String::new(),
            packed_from: packed_from.into(),
            schema,
            meta,
            samples: shards.iter().map(|s| s.samples).sum(),
            bytes: shards.iter().map(|s| s.bytes).sum(),
            list: ShardList::Listed(shards),
            starts: OnceLock::new(),
        };
        m.version = m.compute_version();
        m
    }

    /// A manifest over foreign shards read in place (`ramjet index`): every shard has its
    /// [`ShardInfo::foreign`], laid out as `spec` says.
    pub fn new_foreign(
        packed_from: impl Into<String>,
        schema: Schema,
        meta: serde_json::Map<String, serde_json::Value>,
        shards: Vec<ShardInfo>,
        spec: ForeignSpec,
    ) -> Self {
        let mut m = Self::new(packed_from, schema, meta, shards);
        m.format_version = MANIFEST_VERSION_FOREIGN;
        let ShardList::Listed(shards) = std::mem::replace(&mut m.list, ShardList::Listed(Vec::new())) else {
            unreachable!("Manifest::new lists its shards")
        };
        m.list = ShardList::Foreign { shards, spec };
        m.version = m.compute_version();
        m
    }

    /// A manifest whose shards are listed in `table`, stored under `key`.
    pub fn with_table(
        packed_from: impl Into<String>,
        schema: Schema,
        meta: serde_json::Map<String, serde_json::Value>,
        table: ShardTable,
        key: impl Into<String>,
    ) -> Self {
        let mut m = Manifest {
            format: MANIFEST_FORMAT.into(),
            format_version: MANIFEST_VERSION_TABLE,
            version: String::new(),
            packed_from: packed_from.into(),
            schema,
            meta,
            samples: table.samples,
            bytes: table.bytes,
            list: ShardList::Table {
                table_ref: ShardTableRef {
                    key: key.into(),
                    bytes: shard_table_len(table.len() as u64, table.counts_checksum().is_some()),
                    checksum: Checksum(table.checksum()),
                    shards: table.len() as u64,
                    counts: table.counts_checksum().map(Checksum),
                },
                table: Some(Arc::new(table)),
            },
            starts: OnceLock::new(),
        };
        m.version = m.compute_version();
        m
    }

    /// How the shards are listed.
    pub fn list(&self) -> &ShardList {
        &self.list
    }

    /// The foreign layout, for a manifest over foreign shards.
    pub fn foreign(&self) -> Option<&ForeignSpec> {
        match &self.list {
            ShardList::Foreign { spec, .. } => Some(spec),
            _ => None,
        }
    }

    /// Where its shard table is, for a manifest with one.
    pub fn table_ref(&self) -> Option<&ShardTableRef> {
        match &self.list {
            ShardList::Table { table_ref, .. } => Some(table_ref),
            _ => None,
        }
    }

    /// Where its shard table is, to edit (tools and tests that write a manifest by hand; the
    /// version must then be recomputed).
    pub fn table_ref_mut(&mut self) -> Option<&mut ShardTableRef> {
        match &mut self.list {
            ShardList::Table { table_ref, .. } => Some(table_ref),
            _ => None,
        }
    }

    /// The shards listed in the JSON (`None` with a shard table).
    fn listed_shards(&self) -> Option<&[ShardInfo]> {
        match &self.list {
            ShardList::Listed(v) | ShardList::Foreign { shards: v, .. } => Some(v),
            ShardList::Table { .. } => None,
        }
    }

    /// The listed shards, or the attached table, or the error that the table is not loaded.
    fn either(&self) -> Result<std::result::Result<&[ShardInfo], &ShardTable>> {
        match &self.list {
            ShardList::Listed(v) | ShardList::Foreign { shards: v, .. } => Ok(Ok(v)),
            ShardList::Table { table: Some(t), .. } => Ok(Err(t)),
            ShardList::Table { table_ref, table: None } => Err(Error::Manifest {
                object: table_ref.key.clone(),
                reason: "the shard table is not loaded".into(),
            }),
        }
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        match &self.list {
            ShardList::Listed(v) | ShardList::Foreign { shards: v, .. } => v.len(),
            ShardList::Table { table: Some(t), .. } => t.len(),
            ShardList::Table { table_ref, table: None } => table_ref.shards as usize,
        }
    }

    fn listed<'a>(&self, v: &'a [ShardInfo], i: usize) -> Result<&'a ShardInfo> {
        v.get(i).ok_or_else(|| Error::Manifest {
            object: format!("manifest {}", self.version),
            reason: format!("no shard {i}: it lists {}", v.len()),
        })
    }

    /// Shard `i`. With a shard table, the first use of a block of shards reads and checks it,
    /// which can fail (`docs/format.md`); past the end is an error too.
    pub fn shard(&self, i: usize) -> Result<ShardInfo> {
        match self.either()? {
            Ok(v) => self.listed(v, i).cloned(),
            Err(t) => t.info(i),
        }
    }

    /// The shards in order (each as [`Manifest::shard`]).
    pub fn shards(&self) -> impl ExactSizeIterator<Item = Result<ShardInfo>> + '_ {
        (0..self.shard_count()).map(|i| self.shard(i))
    }

    /// The listed shards, to edit (tools and tests that write a manifest by hand; the
    /// version must then be recomputed). Empty for a manifest with a shard table.
    pub fn shards_mut(&mut self) -> &mut [ShardInfo] {
        self.starts = OnceLock::new();
        match &mut self.list {
            ShardList::Listed(v) | ShardList::Foreign { shards: v, .. } => v,
            ShardList::Table { .. } => &mut [],
        }
    }

    /// Samples of shard `i`, without building its [`ShardInfo`].
    pub fn shard_samples(&self, i: usize) -> Result<u64> {
        match self.either()? {
            Ok(v) => Ok(self.listed(v, i)?.samples),
            Err(t) => t.shard_samples(i),
        }
    }

    /// Bytes and checksum of shard `i`, without building its [`ShardInfo`].
    pub fn shard_bytes_checksum(&self, i: usize) -> Result<(u64, u64)> {
        match self.either()? {
            Ok(v) => {
                let s = self.listed(v, i)?;
                Ok((s.bytes, s.checksum.get()))
            }
            Err(t) => t.shard_bytes_checksum(i),
        }
    }

    /// Global index of shard `i`'s first sample.
    pub fn shard_start(&self, i: usize) -> Result<u64> {
        match self.either()? {
            Ok(v) => {
                self.listed(v, i)?;
                Ok(self.listed_starts(v)[i])
            }
            Err(t) => t.shard_start(i),
        }
    }

    /// The spacing of the restart markers its JPEGs are stored with, if they were transcoded
    /// to have them: `ramjet pack --jpeg-restarts` records it in `meta.jpeg_restart_px`,
    /// `ramjet index --jpeg-restarts` in `foreign.jpeg_restart_px`.
    pub fn jpeg_restart_px(&self) -> Option<u32> {
        self.foreign().and_then(|f| f.jpeg_restart_px).or_else(|| {
            self.meta
                .get("jpeg_restart_px")
                .and_then(|v| v.as_u64())
                .and_then(|v| u32::try_from(v).ok())
        })
    }

    /// Whether every shard has a columns sidecar (and there is at least one shard).
    pub fn has_columns(&self) -> bool {
        match self.either() {
            Ok(Err(t)) => t.columns && !t.is_empty(),
            Ok(Ok(v)) => !v.is_empty() && v.iter().all(|s| s.columns.is_some()),
            Err(_) => false,
        }
    }

    /// The shard table still to load: the manifest names one and [`Manifest::attach_table`]
    /// was not called.
    pub fn table_to_load(&self) -> Option<&ShardTableRef> {
        match &self.list {
            ShardList::Table { table_ref, table: None } => Some(table_ref),
            _ => None,
        }
    }

    /// The loaded shard table, if the manifest has one.
    pub fn table(&self) -> Option<&ShardTable> {
        match &self.list {
            ShardList::Table { table: Some(t), .. } => Some(t),
            _ => None,
        }
    }

    /// The shards' sample counts as the order reads them: the shard table itself, or the
    /// listed shards' counts.
    pub fn shard_counts(&self) -> Arc<dyn crate::order::ShardCounts> {
        match &self.list {
            ShardList::Table { table: Some(t), .. } => t.clone(),
            _ => Arc::new(crate::order::CountList::new(
                self.listed_shards()
                    .unwrap_or_default()
                    .iter()
                    .map(|s| s.samples)
                    .collect(),
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
            .table_ref()
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
        if sum != r.checksum.get() {
            return Err(bad(format!(
                "checksum {sum:016x}, the manifest says {}: the table was edited or damaged",
                r.checksum
            )));
        }
        let t = ShardTable::open(head, reader, object, r.counts.map(|c| c.get())).map_err(|r| bad(r.into()))?;
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
        if let ShardList::Table { table, .. } = &mut self.list {
            *table = Some(Arc::new(t));
        }
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
        let (want_version, kind) = match &m.list {
            ShardList::Table { .. } => (MANIFEST_VERSION_TABLE, "with a shard table"),
            ShardList::Listed(_) => (MANIFEST_VERSION, "without a shard table"),
            ShardList::Foreign { .. } => (MANIFEST_VERSION_FOREIGN, "over foreign shards"),
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
        let shards = match &m.list {
            ShardList::Listed(v) | ShardList::Foreign { shards: v, .. } => v,
            ShardList::Table { table_ref: r, .. } => {
                m.check_table_ref(r).map_err(|r| bad(r.into()))?;
                // The records are checked when the table is attached.
                return Ok(m);
            }
        };
        m.check_listed(shards).map_err(|r| bad(r.into()))?;
        Ok(m)
    }

    /// The checks of a shard table's reference (its records are checked when attached).
    fn check_table_ref(&self, r: &ShardTableRef) -> std::result::Result<(), Invalid> {
        validate_key(&r.key).map_err(|why| format!("shard table key {:?}: {why}", r.key))?;
        if r.shards > u32::MAX as u64 {
            return Err(format!("{} shards exceeds the limit of {}", r.shards, u32::MAX).into());
        }
        let want = shard_table_len(r.shards, r.counts.is_some());
        if r.bytes != want || r.bytes > SHARD_TABLE_BYTES_MAX {
            return Err(format!(
                "its shard table of {} shards must be {want} bytes (at most {SHARD_TABLE_BYTES_MAX}), not {}",
                r.shards, r.bytes
            )
            .into());
        }
        Ok(())
    }

    /// The checks of the shards listed in the JSON. Checked arithmetic: the counts are
    /// untrusted input, and a sum that wraps would pass the check.
    fn check_listed(&self, shards: &[ShardInfo]) -> std::result::Result<(), Invalid> {
        let samples = shards.iter().try_fold(0u64, |a, s| a.checked_add(s.samples));
        let total = shards.iter().try_fold(0u64, |a, s| a.checked_add(s.bytes));
        let (Some(samples), Some(total)) = (samples, total) else {
            return Err("its shards' sample or byte counts overflow 64 bits".into());
        };
        if samples != self.samples || total != self.bytes {
            return Err(format!(
                "totals ({} samples, {} bytes) do not match its shards ({samples}, {total})",
                self.samples, self.bytes
            )
            .into());
        }
        if shards.len() as u64 > u32::MAX as u64 {
            return Err(format!("{} shards exceeds the limit of {}", shards.len(), u32::MAX).into());
        }
        let foreign = self.foreign().is_some();
        let mut keys = std::collections::HashSet::new();
        for s in shards {
            // A shard listed with 0 samples would be left out of every epoch without a word,
            // whatever it holds: the stream would run short. No writer lists an empty shard.
            if s.samples == 0 {
                return Err(format!(
                    "shard {:?} lists 0 samples; a shard holds at least one (no writer lists an empty one)",
                    s.key
                )
                .into());
            }
            if s.samples > crate::format::SHARD_SAMPLES_MAX {
                return Err(format!(
                    "shard {:?} claims {} samples, over the shard limit of {}",
                    s.key,
                    s.samples,
                    crate::format::SHARD_SAMPLES_MAX
                )
                .into());
            }
            validate_key(&s.key).map_err(|r| format!("shard key {:?}: {r}", s.key))?;
            if !keys.insert(s.key.as_str()) {
                return Err(format!("shard key {:?} listed twice", s.key).into());
            }
            match (&s.foreign, foreign) {
                (Some(f), true) => {
                    if let Some(c) = &f.compression {
                        crate::foreign::compression_name(c).map_err(|r| format!("shard {:?}: {r}", s.key))?;
                    }
                    if let Some(p) = &f.parquet {
                        validate_key(&p.file).map_err(|r| format!("shard {:?}: file key {:?}: {r}", s.key, p.file))?;
                        p.check(f.bytes).map_err(|r| format!("shard {:?}: {r}", s.key))?;
                        if f.compression.is_some() || f.index.is_some() {
                            return Err(format!(
                                "shard {:?}: a Parquet row group has no compression or sample index of its own",
                                s.key
                            )
                            .into());
                        }
                    }
                    if let Some(ix) = &f.index {
                        validate_key(&ix.key).map_err(|r| format!("sample index key {:?}: {r}", ix.key))?;
                        if !keys.insert(ix.key.as_str()) {
                            return Err(format!("key {:?} listed twice", ix.key).into());
                        }
                        if Some(ix.bytes) != s.samples.checked_mul(crate::foreign::SAMPLE_INDEX_ENTRY_LEN)
                            || f.compression.is_some()
                        {
                            return Err(format!(
                                "shard {:?}: its sample index must be 24 bytes a sample, of a plain object",
                                s.key
                            )
                            .into());
                        }
                    }
                }
                (None, false) => {}
                (Some(_), false) => {
                    return Err(format!("shard {:?} is foreign, but the manifest says no format", s.key).into())
                }
                (None, true) => {
                    return Err(format!("shard {:?} is not foreign, in a manifest over foreign shards", s.key).into())
                }
            }
            if let Some(c) = &s.columns {
                validate_key(&c.key).map_err(|r| format!("columns key {:?}: {r}", c.key))?;
                if !keys.insert(c.key.as_str()) {
                    return Err(format!("key {:?} listed twice", c.key).into());
                }
            }
        }
        if shards.iter().any(|s| s.columns.is_some()) && self.schema.without_bytes().is_none() {
            return Err("it lists columns sidecars, but its schema has nothing to put in them".into());
        }
        Ok(())
    }

    /// Index of the shard holding global sample `index`, and the sample's index inside it
    /// (`None` past the end): a binary search of the shards' prefix sums, `O(log shards)`.
    pub fn locate(&self, index: u64) -> Result<Option<(usize, u64)>> {
        match self.either()? {
            Err(t) => t.locate(index),
            Ok(v) => {
                let starts = self.listed_starts(v);
                if index >= *starts.last().expect("at least the total") {
                    return Ok(None);
                }
                let i = starts.partition_point(|&s| s <= index) - 1;
                Ok(Some((i, index - starts[i])))
            }
        }
    }

    /// Each listed shard's first global sample, then the total (`shards + 1` entries).
    fn listed_starts(&self, shards: &[ShardInfo]) -> &Arc<Vec<u64>> {
        self.starts.get_or_init(|| {
            let mut v = Vec::with_capacity(shards.len() + 1);
            let mut acc = 0u64;
            v.push(0);
            for s in shards {
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
            &self.packed_from,
            &self.schema,
            &self.meta,
            self.samples,
            self.bytes,
            &self.list,
        ) == (
            &o.format,
            o.format_version,
            &o.version,
            &o.packed_from,
            &o.schema,
            &o.meta,
            o.samples,
            o.bytes,
            &o.list,
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
    use crate::format::table::WholeTable;
    use crate::format::{shard_key, ColumnType, SHARD_TABLE_HEADER_LEN, SHARD_TABLE_RECORD_LEN};
    use bytes::Bytes;

    fn infos(n: usize) -> Vec<ShardInfo> {
        (0..n)
            .map(|i| {
                let c = 0x1000 + i as u64 * 7;
                ShardInfo {
                    key: shard_key(i * 2, c),
                    bytes: 100 + i as u64,
                    samples: 3 + i as u64 % 5,
                    checksum: Checksum(c),
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
        assert_eq!(t.as_bytes().unwrap().len() as u64, shard_table_len(2500, true));
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

    /// The order reads a table's sample counts without holding its records: every count read
    /// through `shard_counts` leaves no block held whole, and the counts and the samples'
    /// places are the listed manifest's.
    #[test]
    fn the_order_reads_counts_without_holding_the_table() {
        let shards = infos(2500);
        let listed = Manifest::new("t", schema(), Default::default(), shards.clone());
        let t = ShardTable::build(&shards).unwrap();
        let m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "tables/x.rjt");
        let mut read = Manifest::parse(&m.to_bytes(), "m").unwrap();
        read.attach_table(whole(&t), "tables/x.rjt").unwrap();
        let counts = read.shard_counts();
        for (i, s) in shards.iter().enumerate() {
            assert_eq!(counts.samples(i as u64).unwrap(), s.samples, "shard {i}");
        }
        let want = listed.shard_counts();
        for o in (0..listed.samples).step_by(11) {
            assert_eq!(counts.locate(o).unwrap(), want.locate(o).unwrap(), "sample {o}");
        }
        let table = read.table().unwrap();
        assert_eq!((table.loaded_blocks(), table.counted_blocks()), (0, 3));
        assert!(counts.samples(2500).is_err());
        // A record asked for afterwards reads its block whole, and the counts agree with it.
        assert_eq!(read.shard(1500).unwrap(), shards[1500]);
        assert_eq!((table.loaded_blocks(), table.counted_blocks()), (1, 2));
        assert_eq!(counts.samples(1500).unwrap(), shards[1500].samples);
    }

    /// An order that needs the counts of many blocks (a round of thousands of partitions)
    /// reads the table's counts section whole, 4 bytes a shard, once: after
    /// `SHARD_TABLE_COUNTS_AFTER_BLOCKS` blocks read for their counts, no more are read, and
    /// every count is the listed manifest's.
    #[test]
    fn many_blocks_counts_come_from_the_counts_section() {
        let shards = infos(20_000);
        let t = ShardTable::build(&shards).unwrap();
        let m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "tables/x.rjt");
        assert!(m.table_ref().unwrap().counts.is_some());
        let mut read = Manifest::parse(&m.to_bytes(), "m").unwrap();
        read.attach_table(whole(&t), "tables/x.rjt").unwrap();
        let counts = read.shard_counts();
        // Shards spread over every block, as a shuffled round asks for them.
        let n = shards.len();
        for k in 0..n {
            let i = (k * 7919) % n;
            assert_eq!(counts.samples(i as u64).unwrap(), shards[i].samples, "shard {i}");
        }
        let table = read.table().unwrap();
        assert!(table.counts_loaded());
        assert_eq!(
            (table.loaded_blocks(), table.counted_blocks()),
            (0, crate::format::table::SHARD_TABLE_COUNTS_AFTER_BLOCKS)
        );
        // A record read afterwards agrees with the section.
        assert_eq!(read.shard(19_999).unwrap(), shards[19_999]);
    }

    /// A counts section that was changed is refused, naming the table and what is wrong: a
    /// flipped byte against the manifest's checksum, and (its checksum made to agree) two
    /// counts swapped inside one block against the block's records, whichever is read first.
    #[test]
    fn a_tampered_counts_section_is_refused() {
        use crate::order::ShardCounts;
        let shards = infos(20_000);
        let t = ShardTable::build(&shards).unwrap();
        let raw = t.as_bytes().unwrap().to_vec();
        let head = Bytes::copy_from_slice(&raw[..shard_table_head_len(20_000) as usize]);
        let at = shard_table_len(20_000, false) as usize;
        let open = |raw: Vec<u8>, sum: u64| {
            ShardTable::open(head.clone(), Arc::new(WholeTable(Bytes::from(raw))), "t.rjt", Some(sum)).unwrap()
        };
        // One shard from each of blocks 10..19 (more than SHARD_TABLE_COUNTS_AFTER_BLOCKS),
        // then shard 2051 (block 2): its count comes from the section.
        let spread = |t: &ShardTable| -> crate::Result<()> {
            use crate::order::ShardCounts;
            for b in 10..19u64 {
                ShardCounts::samples(t, b * 1024)?;
            }
            ShardCounts::samples(t, 2051).map(|_| ())
        };
        let mut flipped = raw.clone();
        flipped[at + 4 * 5000] ^= 1;
        let e = spread(&open(flipped, t.counts_checksum().unwrap()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("t.rjt") && e.contains("counts section: checksum"), "{e}");
        // Shards 3 and 4 of block 2 hold 3 + (2051 % 5) and 3 + (2052 % 5) samples: swapped, the
        // block's sum still agrees with the directory.
        let mut swapped = raw.clone();
        let (a, b) = (at + 4 * 2051, at + 4 * 2052);
        assert_ne!(swapped[a..a + 4], swapped[b..b + 4]);
        for j in 0..4 {
            swapped.swap(a + j, b + j);
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&swapped[at..]);
        // The section read first: the block's records refuse it when read.
        let t1 = open(swapped.clone(), sum);
        spread(&t1).unwrap();
        let e = t1.shard_samples(2051).unwrap_err().to_string();
        assert!(e.contains("shard 2051") && e.contains("the counts section"), "{e}");
        // The block read first: the section is refused when read.
        let t2 = open(swapped, sum);
        t2.shard_samples(2051).unwrap();
        let e = spread(&t2).unwrap_err().to_string();
        assert!(e.contains("shard 2051") && e.contains("the counts section"), "{e}");
        // A count raised in block 4 (checksum made to agree): the blocks used before it read
        // the section; shard 5000's count is refused when it is first used, naming its block.
        let mut raised = raw.clone();
        raised[at + 4 * 5000] += 1;
        let sum = xxhash_rust::xxh3::xxh3_64(&raised[at..]);
        let t3 = open(raised, sum);
        spread(&t3).unwrap();
        let e = ShardCounts::samples(&t3, 5000).unwrap_err().to_string();
        assert!(
            e.contains("t.rjt") && e.contains("block 4") && e.contains("the directory says"),
            "{e}"
        );
        assert_eq!(
            ShardCounts::samples(&t3, 2051).unwrap(),
            3 + 2051 % 5,
            "other blocks stay usable"
        );
        // A manifest and a header that disagree about the section.
        let e = ShardTable::open(head.clone(), Arc::new(WholeTable(Bytes::from(raw))), "t.rjt", None).unwrap_err();
        assert!(e.contains("manifest names none"), "{e}");
    }

    /// `n` shards of `c` samples each, the last of `last`.
    fn uniform_infos(n: usize, c: u64, last: u64) -> Vec<ShardInfo> {
        let mut s = infos(n);
        for (i, x) in s.iter_mut().enumerate() {
            x.samples = if i + 1 == n { last } else { c };
        }
        s
    }

    /// A table whose shards all hold the same count (the last from 1 to it) says so in its
    /// header, and the order's counts and places are then arithmetic: no block is read for
    /// them and no counts section, and every answer is the listed manifest's. A table whose
    /// counts differ, or whose last shard holds more, does not say so.
    #[test]
    fn a_uniform_table_answers_counts_without_reading() {
        use crate::order::ShardCounts;
        for last in [435, 1, 200] {
            let shards = uniform_infos(20_000, 435, last);
            let t = ShardTable::build(&shards).unwrap();
            assert!(t.is_uniform(), "last {last}");
            let listed = Manifest::new("t", schema(), Default::default(), shards.clone());
            let m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "tables/x.rjt");
            let mut read = Manifest::parse(&m.to_bytes(), "m").unwrap();
            read.attach_table(whole(&t), "tables/x.rjt").unwrap();
            let (counts, want) = (read.shard_counts(), listed.shard_counts());
            for k in 0..shards.len() {
                let i = (k * 7919) % shards.len();
                assert_eq!(counts.samples(i as u64).unwrap(), shards[i].samples, "shard {i}");
            }
            for o in (0..listed.samples).step_by(997).chain([listed.samples - 1]) {
                assert_eq!(counts.locate(o).unwrap(), want.locate(o).unwrap(), "sample {o}");
            }
            let table = read.table().unwrap();
            assert_eq!((table.loaded_blocks(), table.counted_blocks()), (0, 0));
            assert!(!table.counts_loaded());
            assert!(ShardCounts::samples(table, 20_000).is_err());
            assert_eq!(read.shard(19_999).unwrap(), shards[19_999]);
        }
        for s in [uniform_infos(3000, 435, 436), infos(3000), {
            let mut s = uniform_infos(3000, 435, 435);
            s[1500].samples = 434;
            s
        }] {
            assert!(!ShardTable::build(&s).unwrap().is_uniform());
        }
    }

    /// A uniform header that lies is refused naming the table: a count that contradicts the
    /// totals or the directory when opened, and (its block checksum made to agree) a record
    /// that differs when its block is read, or (the section's checksum made to agree) a count
    /// in the counts section that differs when the section is read.
    #[test]
    fn a_uniform_header_that_lies_is_refused() {
        let shards = uniform_infos(3000, 435, 100);
        let t = ShardTable::build(&shards).unwrap();
        let raw = t.as_bytes().unwrap().to_vec();
        let head_len = shard_table_head_len(3000) as usize;
        let open = |raw: &[u8]| {
            let sum = t.counts_checksum();
            let head = Bytes::copy_from_slice(&raw[..head_len]);
            ShardTable::open(head, Arc::new(WholeTable(Bytes::copy_from_slice(raw))), "t.rjt", sum)
        };
        // The header's count raised: the totals no longer add up.
        let mut bad = raw.clone();
        bad[44..48].copy_from_slice(&436u32.to_le_bytes());
        assert!(open(&bad).unwrap_err().contains("every shard but the last holds 436"));
        // The header's count 0.
        bad[44..48].copy_from_slice(&0u32.to_le_bytes());
        assert!(open(&bad).unwrap_err().contains("holds 0 samples"));
        // A count without the flag.
        let mut bad = raw.clone();
        bad[36] &= !4;
        assert!(open(&bad).unwrap_err().contains("unsupported header"));
        // Block 1's start moved by one (the totals still add up).
        let mut bad = raw.clone();
        let at = SHARD_TABLE_HEADER_LEN + 32;
        bad[at..at + 8].copy_from_slice(&(1024 * 435 + 1u64).to_le_bytes());
        assert!(open(&bad).unwrap_err().contains("directory entry 1"));
        // Shards 1500 and 1501 of block 1 hold 434 and 436 (sums and checksum made to agree).
        let mut bad = raw.clone();
        let r = |i: usize| head_len + i * SHARD_TABLE_RECORD_LEN;
        bad[r(1500)..r(1500) + 8].copy_from_slice(&434u64.to_le_bytes());
        bad[r(1501)..r(1501) + 8].copy_from_slice(&436u64.to_le_bytes());
        let block = &bad[r(1024)..r(2048)];
        let sum = xxhash_rust::xxh3::xxh3_64(block).to_le_bytes();
        let d = SHARD_TABLE_HEADER_LEN + 32 + 24;
        bad[d..d + 8].copy_from_slice(&sum);
        let sum = xxhash_rust::xxh3::xxh3_64(&bad[..head_len]);
        let mut m = Manifest::with_table("t", schema(), Default::default(), t.clone(), "t.rjt");
        m.table_ref_mut().unwrap().checksum = Checksum(sum);
        m.version = m.compute_version();
        let mut m = Manifest::parse(&m.to_bytes(), "m").unwrap();
        m.attach_table(Arc::new(WholeTable(Bytes::from(bad))), "t.rjt").unwrap();
        assert_eq!(m.shard(5).unwrap(), shards[5]);
        let e = m.shard(1500).unwrap_err().to_string();
        assert!(
            e.contains("t.rjt") && e.contains("shard 1500 lists 434") && e.contains("header says 435"),
            "{e}"
        );
        // The counts section's shards 10 and 11 swapped for 434 and 436, its checksum made to
        // agree: the section is refused for that block when read.
        let mut bad = raw.clone();
        let c = shard_table_len(3000, false) as usize;
        bad[c + 40..c + 44].copy_from_slice(&434u32.to_le_bytes());
        bad[c + 44..c + 48].copy_from_slice(&436u32.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&bad[c..]);
        let head = Bytes::copy_from_slice(&bad[..head_len]);
        let t2 = ShardTable::open(head, Arc::new(WholeTable(Bytes::from(bad))), "t.rjt", Some(sum)).unwrap();
        let e = t2.section_count(10).unwrap_err().to_string();
        assert!(e.contains("t.rjt") && e.contains("shard 10 holds 434"), "{e}");
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
