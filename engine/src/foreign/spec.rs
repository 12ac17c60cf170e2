//! What a foreign dataset is: its format and columns, and each shard object as stored.

use serde::{Deserialize, Serialize};

use super::wds;
use crate::format::Checksum;

/// The format of a foreign dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForeignFormat {
    /// MosaicML Streaming's MDS (`index.json` version 2, `.mds` shards).
    Mds,
    /// WebDataset tar shards.
    Wds,
    /// LitData's optimized chunks (`index.json`, `chunk-*.bin`), read through the MDS path
    /// ([`super::lit`]).
    #[serde(rename = "litdata")]
    Lit,
}

impl ForeignFormat {
    /// Name used in manifests and messages.
    pub fn name(self) -> &'static str {
        match self {
            ForeignFormat::Mds => "mds",
            ForeignFormat::Wds => "wds",
            ForeignFormat::Lit => "litdata",
        }
    }
}

/// One column of a foreign dataset: how its bytes become the schema column of the same name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ForeignColumn {
    /// Column name (the schema's).
    pub name: String,
    /// MDS: the column's MDS encoding (`jpeg`, `int`, `ndarray:uint8:2,2`, ...). WebDataset:
    /// the member extension (lowercase), or `__key__`.
    pub encoding: String,
    /// MDS: the column's fixed size in bytes, `None` when each sample gives its size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

/// How a manifest's foreign shards are laid out (the manifest's `foreign` field).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ForeignSpec {
    /// Their format.
    pub format: ForeignFormat,
    /// Their columns, in the foreign record order.
    pub columns: Vec<ForeignColumn>,
    /// Set by `ramjet index --jpeg-restarts`: the ramjet shard a foreign shard transcodes to
    /// holds each JPEG value (a value of a column that [`ForeignSpec::may_hold_jpeg`] whose
    /// bytes start with a JPEG's SOI marker) transcoded losslessly with a restart marker at
    /// least every this many pixels ([`crate::image::turbo::with_restarts_or_given`]), so that a crop
    /// decodes only its part of the image. The foreign objects are not changed; the caches
    /// hold the transcoded shards. `None`: the JPEGs as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jpeg_restart_px: Option<u32>,
}

impl ForeignSpec {
    /// Whether `column`'s values may be JPEG files as written: an MDS `jpeg` or `bytes` column
    /// (MosaicML's `pil`, `ndarray` and `jpeg_array` layouts are not), every WebDataset
    /// member (not `__key__`). Which of its values are JPEGs, their bytes tell.
    pub fn may_hold_jpeg(&self, column: &ForeignColumn) -> bool {
        match self.format {
            ForeignFormat::Mds | ForeignFormat::Lit => column.encoding == "jpeg" || column.encoding == "bytes",
            ForeignFormat::Wds => column.encoding != wds::KEY_COLUMN && column.encoding != wds::NPY_EXT,
        }
    }
}

/// A foreign shard object as stored (a manifest shard entry's `foreign` field).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignObject {
    /// Size of the object in bytes, as stored (compressed, if it is).
    pub bytes: u64,
    /// xxh3-64 of the object as stored (16 lowercase hex digits in the JSON).
    pub checksum: Checksum,
    /// Its compression (`zstd`, `gz`), `None` when stored plain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<String>,
    /// Its sample index (a plain object only): where each sample lies in the object, so a
    /// sample can be read alone with one ranged GET.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<SampleIndexRef>,
}

/// A foreign shard's sample index (`.rjx`): for sample `i`, at byte `24 i`, three `u64`s (the
/// layout of a ramjet index entry): the offset and length of the sample's bytes in the foreign
/// object, and the [`crate::format::sample_checksum`] of the ramjet record it transcodes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleIndexRef {
    /// Object key relative to the dataset prefix.
    pub key: String,
    /// Size in bytes (24 a sample).
    pub bytes: u64,
    /// XXH3-64 of the whole index (16 lowercase hex digits in the JSON).
    pub checksum: Checksum,
}

/// Bytes of one sample index entry.
pub const SAMPLE_INDEX_ENTRY_LEN: u64 = 24;

/// The key of shard `n`'s sample index, whose XXH3-64 is `checksum`.
pub fn sample_index_key(n: usize, checksum: u64) -> String {
    format!("ramjet-index/{n:06}-{checksum:016x}.rjx")
}

impl ForeignObject {
    /// The checksum as a number.
    pub fn checksum_u64(&self) -> u64 {
        self.checksum.get()
    }
}
