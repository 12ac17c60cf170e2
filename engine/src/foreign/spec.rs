//! What a foreign dataset is: its format and columns, and each shard object as stored.

use serde::{Deserialize, Serialize};

use super::wds;
use crate::error::Invalid;
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
    /// Apache Parquet files (as Hugging Face's hub and `datasets` write them): one row group
    /// is one shard ([`super::parquet_rows`]).
    Parquet,
}

impl ForeignFormat {
    /// Name used in manifests and messages.
    pub fn name(self) -> &'static str {
        match self {
            ForeignFormat::Mds => "mds",
            ForeignFormat::Wds => "wds",
            ForeignFormat::Lit => "litdata",
            ForeignFormat::Parquet => "parquet",
        }
    }
}

/// One column of a foreign dataset: how its bytes become the schema column of the same name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ForeignColumn {
    /// Column name (the schema's).
    pub name: String,
    /// MDS: the column's MDS encoding (`jpeg`, `int`, `ndarray:uint8:2,2`, ...). WebDataset:
    /// the member extension (lowercase), or `__key__`. Parquet: how the top-level field is read
    /// ([`super::parquet_schema::Kind`]: `int`, `float`, `str`, `str-or-null`, `json`,
    /// `bytes`, `image`, `list:DTYPE`).
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
            ForeignFormat::Parquet => column.encoding == "bytes" || column.encoding == "image",
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
    /// A Parquet row group: the object is the row group's bytes inside a file (the shard's
    /// own key is `FILE#rg=N`), and how to read them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parquet: Option<ParquetPart>,
}

/// Where a Parquet row group lies in its file, and the file's footer that says how to read it.
/// The row group's column chunks are `bytes` long from `offset` (the [`ForeignObject`]'s size,
/// and its XXH3-64 is theirs); the footer (the file's Thrift `FileMetaData`, without the
/// 8-byte tail) has its own size and XXH3-64, so a file replaced since it was indexed fails
/// either check, naming the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParquetPart {
    /// The file's key, relative to the dataset prefix.
    pub file: String,
    /// The file's size in bytes.
    pub file_bytes: u64,
    /// The row group's number in the file.
    pub row_group: u32,
    /// Where the row group's first column chunk starts in the file.
    pub offset: u64,
    /// Where the footer starts.
    pub footer_offset: u64,
    /// The footer's size.
    pub footer_bytes: u64,
    /// The footer's XXH3-64.
    pub footer_checksum: Checksum,
}

impl ParquetPart {
    /// Checks that the row group (`bytes` long) and the footer lie inside the file, apart.
    pub fn check(&self, bytes: u64) -> std::result::Result<(), Invalid> {
        let end = self.offset.checked_add(bytes);
        let footer_end = self.footer_offset.checked_add(self.footer_bytes);
        match (end, footer_end) {
            (Some(e), Some(f)) if e <= self.footer_offset && f <= self.file_bytes && self.footer_bytes > 0 => Ok(()),
            _ => Err(format!(
                "row group {} of {:?} at [{}, +{bytes}) and its footer at [{}, +{}) do not fit apart in the {}-byte file",
                self.row_group, self.file, self.offset, self.footer_offset, self.footer_bytes, self.file_bytes
            ).into()),
        }
    }
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

    /// Where the object's bytes are read from: the key of what holds them (the shard's own
    /// `key`, or a row group's file) and their first byte's offset there.
    pub fn stored_at<'a>(&'a self, key: &'a str) -> (&'a str, u64) {
        match &self.parquet {
            Some(p) => (&p.file, p.offset),
            None => (key, 0),
        }
    }
}
