//! The dataset manifest: schema, shard list and a content-derived version id.
//!
//! The version is the xxh3-128 of the manifest's canonical JSON with the `version` field
//! empty, so two manifests share a version exactly when they describe the same bytes.
//! Packing writes `manifests/<version>.json` and then, last, `manifest.json`: a reader that
//! finds `manifest.json` finds every shard it lists already in place.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_128;

use super::schema::Schema;
use crate::error::{Error, Result};

/// Value of the `format` field.
pub const MANIFEST_FORMAT: &str = "ramjet-manifest";
/// Manifest format version this code writes and reads.
pub const MANIFEST_VERSION: u32 = 1;
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Shards in sample order.
    pub shards: Vec<ShardInfo>,
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
        };
        m.version = m.compute_version();
        m
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
        if m.format_version != MANIFEST_VERSION {
            return Err(bad(format!(
                "format_version {} is not supported (this build reads {MANIFEST_VERSION})",
                m.format_version
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

    /// Index of the shard holding global sample `index`, and the sample's index inside it.
    pub fn locate(&self, index: u64) -> Option<(usize, u64)> {
        let mut first = 0u64;
        for (i, s) in self.shards.iter().enumerate() {
            if index < first + s.samples {
                return Some((i, index - first));
            }
            first += s.samples;
        }
        None
    }

    /// Global index of each shard's first sample.
    pub fn shard_starts(&self) -> Vec<u64> {
        let mut acc = 0;
        self.shards
            .iter()
            .map(|s| {
                let start = acc;
                acc += s.samples;
                start
            })
            .collect()
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
