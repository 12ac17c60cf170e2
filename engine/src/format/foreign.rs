//! Foreign shards read in place: MosaicML Streaming (MDS) and WebDataset (tar).
//!
//! `ramjet index` writes a ramjet manifest over a foreign dataset's shards without copying
//! them. Each shard entry keeps the foreign object's key, size and xxh3-64 ([`ForeignObject`]),
//! and, as its ramjet size and checksum, those of the ramjet shard that the foreign one
//! *transcodes* to ([`transcode`]): the same samples, as ramjet records with their per-sample
//! checksums. A reader fetches the foreign object, checks its size and xxh3, decompresses it,
//! transcodes it and checks the result against the manifest, so from there on (the disk cache,
//! the host daemon and its peers, the order, resume, decode) a foreign shard is an ordinary
//! verified ramjet shard. `docs/format.md` ("Foreign shards") describes the layouts read here.

use crate::error::Invalid;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::schema::{ColumnType, Schema, Value};
use super::shard::{BuiltShard, ShardBuilder};
use crate::error::{Error, Location, Result};

/// Largest decompressed foreign shard (a bound on what a lying header can make us allocate).
pub const FOREIGN_SHARD_BYTES_MAX: u64 = 4 << 30;

/// The format of a foreign dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForeignFormat {
    /// MosaicML Streaming's MDS (`index.json` version 2, `.mds` shards).
    Mds,
    /// WebDataset tar shards.
    Wds,
}

impl ForeignFormat {
    /// Name used in manifests and messages.
    pub fn name(self) -> &'static str {
        match self {
            ForeignFormat::Mds => "mds",
            ForeignFormat::Wds => "wds",
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

/// The first bytes of every JPEG file: SOI, then the next marker's `FF`.
const JPEG_SOI: [u8; 3] = [0xFF, 0xD8, 0xFF];

impl ForeignSpec {
    /// Whether `column`'s values may be JPEG files as written: an MDS `jpeg` or `bytes` column
    /// (MosaicML's `pil`, `ndarray` and `jpeg_array` layouts are not), every WebDataset
    /// member (not `__key__`). Which of its values are JPEGs, their bytes tell.
    pub fn may_hold_jpeg(&self, column: &ForeignColumn) -> bool {
        match self.format {
            ForeignFormat::Mds => column.encoding == "jpeg" || column.encoding == "bytes",
            ForeignFormat::Wds => column.encoding != wds::KEY_COLUMN,
        }
    }

    /// With [`ForeignSpec::jpeg_restart_px`], the JPEG values of each sample's `values`
    /// transcoded with restart markers, on every core (a JPEG takes a few ms); otherwise
    /// nothing. The result does not depend on the number of cores.
    fn restart_jpegs(&self, samples: &mut [Vec<Value>]) {
        let Some(px) = self.jpeg_restart_px else {
            return;
        };
        let cols: Vec<usize> = (self.columns.iter().enumerate())
            .filter(|(_, c)| self.may_hold_jpeg(c))
            .map(|(i, _)| i)
            .collect();
        if cols.is_empty() || samples.is_empty() {
            return;
        }
        let one = |values: &mut Vec<Value>| {
            for &c in &cols {
                match values.get_mut(c) {
                    Some(Value::Bytes(b)) if b.starts_with(&JPEG_SOI) => {
                        *b = crate::image::turbo::with_restarts_or_given(std::mem::take(b), px);
                    }
                    _ => {}
                }
            }
        };
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(samples.len());
        if threads <= 1 {
            samples.iter_mut().for_each(one);
            return;
        }
        let per = samples.len().div_ceil(threads);
        std::thread::scope(|s| {
            for part in samples.chunks_mut(per) {
                s.spawn(|| part.iter_mut().for_each(one));
            }
        });
    }
}

/// A foreign shard object as stored (a manifest shard entry's `foreign` field).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignObject {
    /// Size of the object in bytes, as stored (compressed, if it is).
    pub bytes: u64,
    /// xxh3-64 of the object as stored, 16 lowercase hex digits.
    pub checksum: String,
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
    /// XXH3-64 of the whole index, 16 lowercase hex digits.
    pub checksum: String,
}

/// Bytes of one sample index entry.
pub const SAMPLE_INDEX_ENTRY_LEN: u64 = 24;

/// The key of shard `n`'s sample index, whose XXH3-64 is `checksum`.
pub fn sample_index_key(n: usize, checksum: u64) -> String {
    format!("ramjet-index/{n:06}-{checksum:016x}.rjx")
}

impl ForeignObject {
    /// The checksum as a number.
    pub fn checksum_u64(&self) -> Option<u64> {
        super::hex16(&self.checksum)
    }
}

/// The compressions a foreign shard may have.
pub const COMPRESSIONS: &[&str] = &["zstd", "gz"];

/// Checks a compression name (`zstd`, `zstd:7`, `gz`; the level is ignored when reading).
pub fn compression_name(c: &str) -> std::result::Result<&str, Invalid> {
    let name = c.split(':').next().unwrap_or(c);
    if COMPRESSIONS.contains(&name) {
        Ok(name)
    } else {
        Err(Invalid::from(format!(
            "compression {c:?} is not supported (ramjet reads {})",
            COMPRESSIONS.join(" and ")
        )))
    }
}

/// `bytes` decompressed with `compression` (`None`: returned as they are), at most `max_out`
/// bytes of it (a bound on what a damaged or hostile stream can make us allocate; at most
/// [`FOREIGN_SHARD_BYTES_MAX`]). `object` names the shard in errors.
pub fn decompress<'a>(
    bytes: &'a [u8],
    compression: Option<&str>,
    max_out: u64,
    object: &str,
) -> Result<std::borrow::Cow<'a, [u8]>> {
    use std::io::Read;
    let Some(c) = compression else {
        return Ok(std::borrow::Cow::Borrowed(bytes));
    };
    let name = compression_name(c).map_err(|r| Error::invalid(object, r))?;
    let bad = |e: std::io::Error| Error::corrupt(Location::object(object), format!("{name} decompression failed: {e}"));
    let max_out = max_out.min(FOREIGN_SHARD_BYTES_MAX);
    let mut out = Vec::with_capacity((bytes.len() as u64 * 3).min(max_out) as usize);
    let limit = max_out + 1;
    match name {
        "zstd" => {
            let d = zstd::stream::read::Decoder::new(bytes).map_err(bad)?;
            d.take(limit).read_to_end(&mut out).map_err(bad)?;
        }
        _ => {
            let d = flate2::read::MultiGzDecoder::new(bytes);
            d.take(limit).read_to_end(&mut out).map_err(bad)?;
        }
    }
    if out.len() as u64 > max_out {
        return Err(Error::corrupt(
            Location::object(object),
            format!("decompresses to more than the {max_out} bytes it may hold"),
        ));
    }
    Ok(std::borrow::Cow::Owned(out))
}

/// Checks a foreign object's bytes as stored against its manifest entry: size, then xxh3-64.
pub fn check_object(bytes: &[u8], obj: &ForeignObject, object: &str) -> Result<()> {
    if bytes.len() as u64 != obj.bytes {
        return Err(Error::Truncated {
            object: object.to_owned(),
            expected: obj.bytes,
            actual: bytes.len() as u64,
        });
    }
    // XXH3-64 as twox-hash computes it (AVX2 picked at run time; the same value as xxh3_64).
    let sum = twox_hash::XxHash3_64::oneshot(bytes);
    if Some(sum) != obj.checksum_u64() {
        return Err(Error::corrupt(
            Location::object(object),
            format!(
                "the object hashes to {sum:016x}, its index says {} (it changed since it was indexed: run `ramjet index` again, or delete the learned index `ramjet inspect` names)",
                obj.checksum
            ),
        ));
    }
    Ok(())
}

/// The ramjet shard that a foreign shard's (decompressed) bytes transcode to: every sample,
/// in order, as a ramjet record of `schema`. Every structural fault names the shard `object`
/// and, where it is in one sample, that sample.
pub fn transcode(spec: &ForeignSpec, schema: &Schema, data: &[u8], object: &str) -> Result<BuiltShard> {
    Ok(transcode_with_spans(spec, schema, data, object)?.0)
}

/// [`transcode`], with where each sample lies in `data` (what a sample index records).
pub fn transcode_with_spans(
    spec: &ForeignSpec,
    schema: &Schema,
    data: &[u8],
    object: &str,
) -> Result<(BuiltShard, Vec<std::ops::Range<u64>>)> {
    let mut b = ShardBuilder::new(schema.clone());
    b.reserve(data.len() + data.len() / 16);
    let mut spans = Vec::new();
    // With restart markers to add, the shard's samples are gathered first and their JPEGs
    // transcoded on every core; otherwise each goes into the shard as it is read.
    let gather = spec.jpeg_restart_px.is_some();
    let (mut held, mut whats): (Vec<Vec<Value>>, Vec<String>) = (Vec::new(), Vec::new());
    let mut put = |values: Vec<Value>, what: String| -> Result<()> {
        if gather {
            held.push(values);
            whats.push(what);
            Ok(())
        } else {
            b.push(&values, &what)
        }
    };
    match spec.format {
        ForeignFormat::Mds => {
            let shard = mds::MdsShard::parse(data, object)?;
            for i in 0..shard.samples() {
                let values = mds::sample_values(&spec.columns, shard.sample(i)?, &Location::sample(object, i))?;
                put(values, format!("{object} sample {i}"))?;
                spans.push(shard.span(i));
            }
        }
        ForeignFormat::Wds => {
            let samples = wds::samples(data, object)?;
            for (i, s) in samples.iter().enumerate() {
                let values = wds::sample_values(&spec.columns, s, data, &Location::sample(object, i as u64))?;
                put(values, format!("{object} sample {i} ({})", s.key))?;
                spans.push(s.span.start as u64..s.span.end as u64);
            }
        }
    }
    spec.restart_jpegs(&mut held);
    for (values, what) in held.iter().zip(&whats) {
        b.push(values, what)?;
    }
    Ok((b.finish(), spans))
}

/// One sample, read alone from its span of a plain foreign object (by its sample index), as
/// the ramjet record it transcodes to. The caller checks the record against the index's
/// checksum.
pub fn transcode_sample(spec: &ForeignSpec, schema: &Schema, raw: &[u8], at: &Location) -> Result<Vec<u8>> {
    let mut values = match spec.format {
        ForeignFormat::Mds => mds::sample_values(&spec.columns, raw, at)?,
        ForeignFormat::Wds => {
            let s = wds::sample_in(raw, at)?;
            wds::sample_values(&spec.columns, &s, raw, at)?
        }
    };
    spec.restart_jpegs(std::slice::from_mut(&mut values));
    let mut rec = Vec::new();
    crate::format::encode_record(schema, &values, &at.to_string(), &mut rec)?;
    Ok(rec)
}

/// MosaicML Streaming's MDS format.
pub mod mds {
    use super::*;

    /// MDS encodings refused: unpickling is code execution.
    pub const REFUSED: &[&str] = &["pkl"];

    /// The ramjet column type an MDS encoding is read as, or why it is refused.
    ///
    /// | MDS | ramjet |
    /// |---|---|
    /// | `bytes`, `jpeg`, `png`, `pil`, `ndarray...`, `jpeg_array`, `list[...]` | `bytes` (the MDS bytes as stored) |
    /// | `str`, `str_decimal` | `str` |
    /// | `int`, `int8`..`int64`, `uint8`..`uint64`, `str_int` | `int64` |
    /// | `float16`, `float32`, `float64`, `str_float` | `float64` |
    /// | `json` | `json` |
    pub fn column_type(encoding: &str) -> std::result::Result<ColumnType, Invalid> {
        let name = encoding.split(':').next().unwrap_or(encoding);
        Ok(match name {
            "bytes" | "jpeg" | "png" | "pil" | "ndarray" | "jpeg_array" | "jpegarray" | "list[pil]"
            | "list[jpeg]" | "list[png]" => ColumnType::Bytes,
            "str" | "str_decimal" => ColumnType::Str,
            "int" | "int8" | "int16" | "int32" | "int64" | "uint8" | "uint16" | "uint32" | "uint64" | "str_int" => {
                ColumnType::Int64
            }
            "float16" | "float32" | "float64" | "str_float" => ColumnType::Float64,
            "json" => ColumnType::Json,
            "pkl" => {
                return Err(Invalid::from("encoding \"pkl\" is refused: unpickling runs arbitrary code; re-encode the column (json, bytes, ndarray) or pack the dataset with `ramjet pack`"))
            }
            other => return Err(Invalid::from(format!("MDS encoding {other:?} is not known to ramjet"))),
        })
    }

    /// The fixed size of a scalar encoding (others: as `index.json` says).
    fn scalar_size(encoding: &str) -> Option<u64> {
        Some(match encoding {
            "int" | "int64" | "uint64" | "float64" => 8,
            "int32" | "uint32" | "float32" => 4,
            "int16" | "uint16" | "float16" => 2,
            "int8" | "uint8" => 1,
            _ => return None,
        })
    }

    /// One `.mds` shard, decompressed: `u32` sample count, `u32` offsets (count + 1, from the
    /// file start), the writer's JSON config, then the samples back to back.
    pub struct MdsShard<'a> {
        data: &'a [u8],
        offsets: Vec<u32>,
        object: &'a str,
    }

    impl<'a> MdsShard<'a> {
        /// Parses the header and checks every offset.
        pub fn parse(data: &'a [u8], object: &'a str) -> Result<MdsShard<'a>> {
            let bad = |r: String| Error::corrupt(Location::object(object), r);
            if data.len() < 8 {
                return Err(bad(format!("{} bytes is too short for an MDS shard", data.len())));
            }
            let n = u32::from_le_bytes(data[0..4].try_into().expect("4 bytes")) as u64;
            let table_end = 4 + 4 * (n + 1);
            if table_end > data.len() as u64 {
                return Err(bad(format!(
                    "its header claims {n} samples, whose offsets run past its {} bytes",
                    data.len()
                )));
            }
            let offsets: Vec<u32> = data[4..table_end as usize]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            if (offsets[0] as u64) < table_end {
                return Err(bad(format!(
                    "its first sample starts at {}, inside its header",
                    offsets[0]
                )));
            }
            for (i, w) in offsets.windows(2).enumerate() {
                if w[1] < w[0] {
                    return Err(Error::corrupt(
                        Location::sample(object, i as u64),
                        format!("it ends at {} before it starts at {}", w[1], w[0]),
                    ));
                }
            }
            let end = offsets[n as usize] as u64;
            if end != data.len() as u64 {
                return Err(bad(format!(
                    "its samples end at {end}, but the shard has {} bytes (truncated or padded)",
                    data.len()
                )));
            }
            Ok(MdsShard { data, offsets, object })
        }

        /// Samples in the shard.
        pub fn samples(&self) -> u64 {
            self.offsets.len() as u64 - 1
        }

        /// Where sample `i` lies in the shard.
        pub fn span(&self, i: u64) -> std::ops::Range<u64> {
            self.offsets[i as usize] as u64..self.offsets[i as usize + 1] as u64
        }

        /// Sample `i`'s bytes (checked in bounds by [`MdsShard::parse`]).
        pub fn sample(&self, i: u64) -> Result<&'a [u8]> {
            if i >= self.samples() {
                return Err(Error::corrupt(
                    Location::sample(self.object, i),
                    format!("past the shard's {} samples", self.samples()),
                ));
            }
            let (a, b) = (self.offsets[i as usize], self.offsets[i as usize + 1]);
            Ok(&self.data[a as usize..b as usize])
        }
    }

    /// One MDS sample's columns as ramjet values: the sizes of the variable columns (`u32`
    /// each), then every column's bytes in order.
    pub fn sample_values(cols: &[ForeignColumn], raw: &[u8], at: &Location) -> Result<Vec<Value>> {
        let bad = |r: String| Error::corrupt(at.clone(), r);
        let var = cols.iter().filter(|c| c.size.is_none()).count();
        if raw.len() < 4 * var {
            return Err(bad(format!(
                "{} bytes cannot hold the sizes of its {var} variable columns",
                raw.len()
            )));
        }
        let mut sizes = raw[..4 * var]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as u64);
        let mut pos = 4 * var;
        let mut out = Vec::with_capacity(cols.len());
        for c in cols {
            let len = match c.size {
                Some(s) => s,
                None => sizes.next().expect("one size a variable column"),
            };
            let end = (pos as u64)
                .checked_add(len)
                .filter(|&e| e <= raw.len() as u64)
                .ok_or_else(|| {
                    bad(format!(
                        "column {:?} ({} bytes) runs past the sample's {} bytes",
                        c.name,
                        len,
                        raw.len()
                    ))
                })? as usize;
            let b = &raw[pos..end];
            pos = end;
            out.push(value(&c.encoding, b).map_err(|r| bad(format!("column {:?} ({}): {r}", c.name, c.encoding)))?);
        }
        if pos != raw.len() {
            return Err(bad(format!("{} bytes left after its last column", raw.len() - pos)));
        }
        Ok(out)
    }

    fn text(b: &[u8]) -> std::result::Result<&str, Invalid> {
        std::str::from_utf8(b).map_err(|e| Invalid::from(format!("not UTF-8: {e}")))
    }

    fn le<const N: usize>(b: &[u8]) -> std::result::Result<[u8; N], String> {
        b.try_into().map_err(|_| format!("{} bytes, expected {N}", b.len()))
    }

    /// An IEEE half as a double.
    fn f16_to_f64(h: u16) -> f64 {
        let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let exp = ((h >> 10) & 0x1f) as i32;
        let frac = (h & 0x3ff) as f64;
        match exp {
            0 => sign * frac * 2f64.powi(-24),
            31 if frac == 0.0 => sign * f64::INFINITY,
            31 => f64::NAN,
            e => sign * (1.0 + frac / 1024.0) * 2f64.powi(e - 15),
        }
    }

    /// One column's bytes as a ramjet value.
    fn value(encoding: &str, b: &[u8]) -> std::result::Result<Value, Invalid> {
        let name = encoding.split(':').next().unwrap_or(encoding);
        if let Some(want) = scalar_size(name) {
            if b.len() as u64 != want {
                return Err(Invalid::from(format!("{} bytes, expected {want}", b.len())));
            }
        }
        Ok(match column_type(encoding)? {
            ColumnType::Bytes => Value::Bytes(b.to_vec()),
            ColumnType::Str => Value::Str(text(b)?.to_owned()),
            ColumnType::Json => {
                let s = text(b)?;
                serde_json::from_str::<serde::de::IgnoredAny>(s).map_err(|e| format!("not JSON: {e}"))?;
                Value::Json(s.to_owned())
            }
            ColumnType::Int64 => Value::Int64(match name {
                "int" | "int64" => i64::from_le_bytes(le(b)?),
                "int32" => i32::from_le_bytes(le(b)?) as i64,
                "int16" => i16::from_le_bytes(le(b)?) as i64,
                "int8" => i8::from_le_bytes(le(b)?) as i64,
                "uint32" => u32::from_le_bytes(le(b)?) as i64,
                "uint16" => u16::from_le_bytes(le(b)?) as i64,
                "uint8" => b[0] as i64,
                "uint64" => {
                    let v = u64::from_le_bytes(le(b)?);
                    i64::try_from(v).map_err(|_| format!("{v} does not fit a signed 64-bit integer"))?
                }
                _ => text(b)?
                    .trim()
                    .parse::<i64>()
                    .map_err(|e| format!("not an integer: {e}"))?,
            }),
            ColumnType::Float64 => Value::Float64(match name {
                "float64" => f64::from_le_bytes(le(b)?),
                "float32" => f32::from_le_bytes(le(b)?) as f64,
                "float16" => f16_to_f64(u16::from_le_bytes(le(b)?)),
                _ => text(b)?
                    .trim()
                    .parse::<f64>()
                    .map_err(|e| format!("not a number: {e}"))?,
            }),
        })
    }

    /// `index.json`, version 2.
    #[derive(Debug, Deserialize)]
    pub struct Index {
        /// Always 2.
        pub version: u32,
        /// The shards, in sample order.
        pub shards: Vec<IndexShard>,
    }

    /// One shard of `index.json`.
    #[derive(Debug, Deserialize)]
    pub struct IndexShard {
        /// Always `mds` (other MosaicML formats, `json` and `xsv`, are not read).
        pub format: String,
        /// Always 2.
        pub version: u32,
        /// Column names, in record order.
        pub column_names: Vec<String>,
        /// Column encodings.
        pub column_encodings: Vec<String>,
        /// Column sizes (`null`: variable).
        pub column_sizes: Vec<Option<u64>>,
        /// Compression (`zstd`, `zstd:7`, `gz`, ...), `null` when none.
        #[serde(default)]
        pub compression: Option<String>,
        /// The uncompressed shard.
        pub raw_data: IndexFile,
        /// The compressed shard, when compressed.
        #[serde(default)]
        pub zip_data: Option<IndexFile>,
        /// Samples in the shard.
        pub samples: u64,
    }

    /// A file of `index.json`.
    #[derive(Debug, Deserialize)]
    pub struct IndexFile {
        /// Its name, relative to the dataset directory.
        pub basename: String,
        /// Its size.
        pub bytes: u64,
        /// Its hashes, by algorithm (`xxh64`, `xxh3_64`, `sha1`, ...).
        #[serde(default)]
        pub hashes: std::collections::BTreeMap<String, String>,
    }

    impl Index {
        /// Parses and checks `index.json` (read from `object`).
        pub fn parse(bytes: &[u8], object: &str) -> Result<Index> {
            let bad = |r: String| Error::Manifest {
                object: object.to_owned(),
                reason: r,
            };
            let ix: Index = serde_json::from_slice(bytes).map_err(|e| bad(format!("not an MDS index: {e}")))?;
            if ix.version != 2 {
                return Err(bad(format!("MDS index version {} (ramjet reads 2)", ix.version)));
            }
            if ix.shards.is_empty() {
                return Err(bad("it lists no shards".into()));
            }
            for (i, s) in ix.shards.iter().enumerate() {
                if s.format != "mds" || s.version != 2 {
                    return Err(bad(format!(
                        "shard {i} is {:?} version {} (ramjet reads mds version 2)",
                        s.format, s.version
                    )));
                }
                if s.column_names.len() != s.column_encodings.len() || s.column_names.len() != s.column_sizes.len() {
                    return Err(bad(format!(
                        "shard {i}: column names, encodings and sizes differ in number"
                    )));
                }
                if (s.column_names.as_slice(), s.column_encodings.as_slice())
                    != (
                        ix.shards[0].column_names.as_slice(),
                        ix.shards[0].column_encodings.as_slice(),
                    )
                {
                    return Err(bad(format!("shard {i} has other columns than shard 0")));
                }
                if let Some(c) = &s.compression {
                    compression_name(c).map_err(|r| bad(format!("shard {i} ({}): {r}", s.raw_data.basename)))?;
                    if s.zip_data.is_none() {
                        return Err(bad(format!("shard {i} is compressed but names no compressed file")));
                    }
                }
            }
            Ok(ix)
        }

        /// The columns, and the ramjet schema they are read as. A refused encoding (`pkl`) is
        /// an error naming its column.
        pub fn columns(&self, object: &str) -> Result<(Vec<ForeignColumn>, Schema)> {
            let s = &self.shards[0];
            let mut cols = Vec::new();
            let mut schema = Vec::new();
            for ((name, enc), size) in s.column_names.iter().zip(&s.column_encodings).zip(&s.column_sizes) {
                let ty = column_type(enc).map_err(|r| Error::invalid(object, format!("column {name:?}: {r}")))?;
                let name_ = enc.split(':').next().unwrap_or(enc);
                if let (Some(want), Some(got)) = (scalar_size(name_), size) {
                    if want != *got {
                        return Err(Error::invalid(
                            object,
                            format!("column {name:?} ({enc}) has size {got}, expected {want}"),
                        ));
                    }
                }
                cols.push(ForeignColumn {
                    name: name.clone(),
                    encoding: enc.clone(),
                    size: *size,
                });
                schema.push((name.clone(), ty));
            }
            Ok((cols, Schema::new(schema)?))
        }
    }

    /// Checks the hashes `index.json` gives for a file against its bytes: the xxHash ones
    /// (`xxh64`, `xxh3_64`); others (`sha1`, `md5`, ...) are not computed. Returns how many
    /// were checked.
    pub fn check_hashes(file: &IndexFile, bytes: &[u8], object: &str) -> Result<usize> {
        let mut n = 0;
        for (algo, want) in &file.hashes {
            let got = match algo.as_str() {
                "xxh64" => format!("{:016x}", xxhash_rust::xxh64::xxh64(bytes, 0)),
                "xxh3_64" => format!("{:016x}", xxh3_64(bytes)),
                _ => continue,
            };
            if !got.eq_ignore_ascii_case(want) {
                return Err(Error::corrupt(
                    Location::object(object),
                    format!("its {algo} is {got}, the MDS index says {want}"),
                ));
            }
            n += 1;
        }
        Ok(n)
    }
}

/// WebDataset's tar shards.
pub mod wds {
    use super::*;

    /// The column holding each sample's key.
    pub const KEY_COLUMN: &str = "__key__";

    /// One sample: its key and its members' (extension, byte range in the tar).
    #[derive(Debug, Clone)]
    pub struct TarSample {
        /// WebDataset's `__key__`: the member path up to the first dot of its file name.
        pub key: String,
        /// (extension, lowercased; range of the member's bytes in the tar), in tar order.
        pub members: Vec<(String, std::ops::Range<usize>)>,
        /// The sample's bytes in the tar: from its first member's first header block (a pax
        /// or long-name header included) to its last member's last byte.
        pub span: std::ops::Range<usize>,
    }

    /// A regular member of a tar: its path, its data, and its first header block's offset.
    pub struct Member {
        /// Path (from a pax `path` record or GNU long name when present).
        pub path: String,
        /// Its data.
        pub data: std::ops::Range<usize>,
        /// Where its headers start.
        pub start: usize,
    }

    fn octal(field: &[u8]) -> Option<u64> {
        // GNU base-256 for sizes of 8 GiB and more.
        if field.first().is_some_and(|b| b & 0x80 != 0) {
            let mut v: u64 = (field[0] & 0x7f) as u64;
            for &b in &field[1..] {
                v = v.checked_mul(256)?.checked_add(b as u64)?;
            }
            return Some(v);
        }
        let s: Vec<u8> = field
            .iter()
            .copied()
            .skip_while(|b| *b == b' ')
            .take_while(|b| *b != 0 && *b != b' ')
            .collect();
        if s.is_empty() {
            return Some(0);
        }
        u64::from_str_radix(std::str::from_utf8(&s).ok()?, 8).ok()
    }

    /// A 512-byte tar header's checksum: the sum of its bytes, its checksum field counted as
    /// spaces.
    pub fn header_sum(h: &[u8]) -> u64 {
        h[..148]
            .iter()
            .chain([b' '; 8].iter())
            .chain(h[156..512].iter())
            .map(|b| *b as u64)
            .sum()
    }

    fn cstr(field: &[u8]) -> &[u8] {
        let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
        &field[..end]
    }

    /// The key and extension of a member path, by WebDataset's rule (everything up to the
    /// first dot of the file name, and the rest); `None` for a name without one.
    pub fn key_ext(path: &str) -> Option<(&str, &str)> {
        let base_start = path.rfind('/').map_or(0, |i| i + 1);
        let dot = path[base_start..].find('.')? + base_start;
        if dot == base_start {
            return None;
        }
        Some((&path[..dot], &path[dot + 1..]))
    }

    /// Whether WebDataset skips a member as metadata (`__x__` at the top or a `__x__/` dir).
    fn is_meta(path: &str) -> bool {
        if !path.starts_with("__") {
            return false;
        }
        let rest = &path[2..];
        match rest.find("__") {
            Some(i) => {
                let name = &rest[..i];
                !name.contains('/') && {
                    let after = &rest[i + 2..];
                    after.is_empty() || after.starts_with('/')
                }
            }
            None => false,
        }
    }

    /// Every regular member of a (decompressed) tar. Checks each header's checksum; reads
    /// ustar, GNU long names and pax `path` records. `whole`: the tar must end with its
    /// end-of-archive block; otherwise (one sample's span) it ends after the last member's data.
    pub fn members(tar: &[u8], object: &str) -> Result<Vec<Member>> {
        members_of(tar, &Location::object(object), true)
    }

    fn members_of(tar: &[u8], at: &Location, whole: bool) -> Result<Vec<Member>> {
        let mut out = Vec::new();
        let mut pos = 0usize;
        let mut long_name: Option<String> = None;
        let mut start: Option<usize> = None;
        let bad = |pos: usize, r: String| Error::corrupt(at.clone(), format!("tar byte {pos}: {r}"));
        loop {
            if !whole && pos >= tar.len() && start.is_none() {
                return Ok(out);
            }
            if pos + 512 > tar.len() {
                // Every tar writer ends the archive with zero blocks: without one, the tar
                // was cut short (perhaps between two members, which nothing else shows).
                return Err(bad(
                    pos,
                    format!(
                        "truncated: the tar ends after {} bytes without its end-of-archive block",
                        tar.len()
                    ),
                ));
            }
            let h = &tar[pos..pos + 512];
            if h.iter().all(|b| *b == 0) {
                return Ok(out);
            }
            let want = octal(&h[148..156]).ok_or_else(|| bad(pos, "unreadable header checksum".into()))?;
            let sum = header_sum(h);
            if sum != want {
                return Err(bad(pos, format!("header checksum {sum:o}, the header says {want:o}")));
            }
            let size = octal(&h[124..136]).ok_or_else(|| bad(pos, "unreadable member size".into()))?;
            let data = pos + 512;
            let end = (data as u64)
                .checked_add(size)
                .filter(|&e| e <= tar.len() as u64)
                .ok_or_else(|| {
                    bad(
                        pos,
                        format!("a member of {size} bytes runs past the tar's {} bytes", tar.len()),
                    )
                })? as usize;
            let next = data + (size as usize).div_ceil(512) * 512;
            let typ = h[156];
            let first = *start.get_or_insert(pos);
            let name = || -> String {
                let mut n = String::from_utf8_lossy(cstr(&h[0..100])).into_owned();
                if &h[257..262] == b"ustar" {
                    let prefix = cstr(&h[345..500]);
                    if !prefix.is_empty() {
                        n = format!("{}/{n}", String::from_utf8_lossy(prefix));
                    }
                }
                n
            };
            match typ {
                b'L' => long_name = Some(String::from_utf8_lossy(cstr(&tar[data..end])).into_owned()),
                b'x' => {
                    for rec in pax_records(&tar[data..end]) {
                        if let Some(p) = rec.strip_prefix("path=") {
                            long_name = Some(p.to_owned());
                        }
                    }
                }
                b'0' | 0 | b'7' => {
                    let path = long_name.take().unwrap_or_else(name);
                    out.push(Member {
                        path,
                        data: data..end,
                        start: first,
                    });
                    start = None;
                }
                _ => {
                    long_name = None;
                    start = None;
                }
            }
            if !whole && end == tar.len() && start.is_none() {
                return Ok(out);
            }
            pos = next;
        }
    }

    fn pax_records(b: &[u8]) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = b;
        while let Some(sp) = rest.iter().position(|c| *c == b' ') {
            let Some(len) = std::str::from_utf8(&rest[..sp])
                .ok()
                .and_then(|s| s.parse::<usize>().ok())
            else {
                break;
            };
            if len <= sp + 1 || len > rest.len() {
                break;
            }
            let rec = &rest[sp + 1..len];
            let rec = rec.strip_suffix(b"\n").unwrap_or(rec);
            out.push(String::from_utf8_lossy(rec).into_owned());
            rest = &rest[len..];
        }
        out
    }

    /// The samples of a (decompressed) tar, by WebDataset's rules: consecutive members with
    /// the same key form a sample; extensions are lowercased; names without a dot and
    /// `__x__` metadata are skipped; an extension twice in one sample is an error.
    pub fn samples(tar: &[u8], object: &str) -> Result<Vec<TarSample>> {
        group(members(tar, object)?, &|i| Location::sample(object, i))
    }

    /// The one sample a span of a tar holds (see [`TarSample::span`]); its member ranges are
    /// relative to `span`.
    pub fn sample_in(span: &[u8], at: &Location) -> Result<TarSample> {
        let mut s = group(members_of(span, at, false)?, &|_| at.clone())?;
        if s.len() != 1 {
            return Err(Error::corrupt(
                at.clone(),
                format!(
                    "its span holds {} samples, not one (the tar changed since it was indexed)",
                    s.len()
                ),
            ));
        }
        Ok(s.remove(0))
    }

    fn group(members: Vec<Member>, at: &dyn Fn(u64) -> Location) -> Result<Vec<TarSample>> {
        let mut out: Vec<TarSample> = Vec::new();
        for m in members {
            if is_meta(&m.path) {
                continue;
            }
            let Some((key, ext)) = key_ext(&m.path) else {
                continue;
            };
            let ext = ext.to_lowercase();
            match out.last_mut() {
                Some(s) if s.key == key => {
                    if s.members.iter().any(|(e, _)| *e == ext) {
                        return Err(Error::corrupt(
                            at(out.len() as u64 - 1),
                            format!("sample {key:?} has two members with extension {ext:?}"),
                        ));
                    }
                    s.span.end = m.data.end;
                    s.members.push((ext, m.data));
                }
                _ => out.push(TarSample {
                    key: key.to_owned(),
                    span: m.start..m.data.end,
                    members: vec![(ext, m.data)],
                }),
            }
        }
        Ok(out)
    }

    /// The columns of samples with these extensions: `__key__`, then one `bytes` column per
    /// extension, sorted.
    pub fn columns(exts: &std::collections::BTreeSet<String>) -> Result<(Vec<ForeignColumn>, Schema)> {
        let mut cols = vec![ForeignColumn {
            name: KEY_COLUMN.into(),
            encoding: KEY_COLUMN.into(),
            size: None,
        }];
        let mut schema = vec![(KEY_COLUMN.to_owned(), ColumnType::Str)];
        for e in exts {
            cols.push(ForeignColumn {
                name: e.clone(),
                encoding: e.clone(),
                size: None,
            });
            schema.push((e.clone(), ColumnType::Bytes));
        }
        Ok((cols, Schema::new(schema)?))
    }

    /// One sample's columns as ramjet values: its key, then each extension's member bytes. A
    /// sample without one of the dataset's extensions, or with another, is an error.
    pub fn sample_values(cols: &[ForeignColumn], s: &TarSample, tar: &[u8], at: &Location) -> Result<Vec<Value>> {
        let mut out = Vec::with_capacity(cols.len());
        for c in cols {
            if c.encoding == KEY_COLUMN {
                out.push(Value::Str(s.key.clone()));
                continue;
            }
            let Some((_, r)) = s.members.iter().find(|(e, _)| *e == c.encoding) else {
                return Err(Error::corrupt(
                    at.clone(),
                    format!(
                        "sample {:?} has no {:?} member, which the dataset's index lists",
                        s.key, c.encoding
                    ),
                ));
            };
            out.push(Value::Bytes(tar[r.clone()].to_vec()));
        }
        if let Some((e, _)) = s.members.iter().find(|(e, _)| !cols.iter().any(|c| c.encoding == *e)) {
            return Err(Error::corrupt(
                at.clone(),
                format!(
                    "sample {:?} has a {e:?} member, which the dataset's index does not list",
                    s.key
                ),
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webdataset_keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(wds::key_ext("a/b/000.seg.png"), Some(("a/b/000", "seg.png")));
        assert_eq!(wds::key_ext("x.y/000.jpg"), Some(("x.y/000", "jpg")));
        assert_eq!(wds::key_ext("noext"), None);
        assert_eq!(wds::key_ext("dir/.hidden"), None);
    }

    #[test]
    fn a_decompression_past_its_bound_is_refused_not_allocated() {
        let zeros = vec![0u8; 8 << 20];
        let z = zstd::encode_all(&zeros[..], 3).unwrap();
        assert!(z.len() < 4096);
        let e = decompress(&z, Some("zstd"), 1 << 20, "bomb.mds.zstd")
            .unwrap_err()
            .to_string();
        assert!(e.contains("bomb.mds.zstd") && e.contains("more than"), "{e}");
        assert_eq!(decompress(&z, Some("zstd:9"), 8 << 20, "x").unwrap(), zeros);
        let e = decompress(&z, Some("br"), 8 << 20, "x.br").unwrap_err().to_string();
        assert!(e.contains("not supported"), "{e}");
    }

    #[test]
    fn pickled_columns_are_refused_by_name() {
        let e = mds::column_type("pkl").unwrap_err();
        assert!(e.contains("arbitrary code"), "{e}");
        assert_eq!(mds::column_type("ndarray:uint8:2,2").unwrap(), ColumnType::Bytes);
        assert_eq!(mds::column_type("str_int").unwrap(), ColumnType::Int64);
    }

    #[test]
    fn a_tar_header_with_a_flipped_byte_is_named() {
        let mut t = vec![0u8; 512 * 4];
        t[..5].copy_from_slice(b"a.txt");
        t[124..135].copy_from_slice(b"00000000003");
        t[156] = b'0';
        t[257..263].copy_from_slice(b"ustar\0");
        let sum = wds::header_sum(&t);
        t[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        t[512..515].copy_from_slice(b"abc");
        let s = wds::samples(&t, "x.tar").unwrap();
        assert_eq!(
            (s.len(), s[0].key.as_str(), &t[s[0].members[0].1.clone()]),
            (1, "a", &b"abc"[..])
        );
        t[3] ^= 1;
        let e = wds::samples(&t, "x.tar").unwrap_err().to_string();
        assert!(e.contains("x.tar") && e.contains("checksum"), "{e}");
    }

    use crate::image::tests::jpeg;

    /// A ustar of `files` (name, bytes), ended by its two zero blocks.
    fn tar_of(files: &[(String, Vec<u8>)]) -> Vec<u8> {
        let mut t = Vec::new();
        for (name, data) in files {
            let mut h = vec![0u8; 512];
            h[..name.len()].copy_from_slice(name.as_bytes());
            h[124..135].copy_from_slice(format!("{:011o}", data.len()).as_bytes());
            h[156] = b'0';
            h[257..263].copy_from_slice(b"ustar\0");
            let sum = wds::header_sum(&h);
            h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
            t.extend_from_slice(&h);
            t.extend_from_slice(data);
            t.resize(t.len().div_ceil(512) * 512, 0);
        }
        t.resize(t.len() + 1024, 0);
        t
    }

    #[test]
    fn jpeg_restarts_transcode_the_jpeg_members_alike_whole_or_alone_and_keep_their_pixels() {
        let mut files = Vec::new();
        for i in 0..6 {
            files.push((format!("s{i}.cls"), format!("{i}").into_bytes()));
            // Sample 5's starts as a JPEG and is cut short: libjpeg-turbo will not transcode it.
            let j = if i == 5 {
                jpeg(64, 64)[..200].to_vec()
            } else {
                jpeg(200 + 16 * i as u16, 120)
            };
            files.push((format!("s{i}.jpg"), j));
        }
        let tar = tar_of(&files);
        let exts = ["cls", "jpg"].into_iter().map(str::to_owned).collect();
        let (columns, schema) = wds::columns(&exts).unwrap();
        let given = ForeignSpec {
            format: ForeignFormat::Wds,
            columns: columns.clone(),
            jpeg_restart_px: None,
        };
        let rst = ForeignSpec {
            jpeg_restart_px: Some(crate::image::turbo::JPEG_RESTART_PX),
            ..given.clone()
        };
        let jpg = columns.iter().position(|c| c.encoding == "jpg").unwrap();
        let cls = columns.iter().position(|c| c.encoding == "cls").unwrap();
        let key = columns.iter().position(|c| c.encoding == wds::KEY_COLUMN).unwrap();
        assert!(rst.may_hold_jpeg(&columns[jpg]) && rst.may_hold_jpeg(&columns[cls]));
        assert!(!rst.may_hold_jpeg(&columns[key]));

        let (a, spans) = transcode_with_spans(&given, &schema, &tar, "x.tar").unwrap();
        let (b, spans_b) = transcode_with_spans(&rst, &schema, &tar, "x.tar").unwrap();
        assert_eq!(spans, spans_b);
        assert_ne!(a.checksum, b.checksum);
        let (va, vb) = (
            crate::format::ShardView::parse(&a.bytes, "a").unwrap(),
            crate::format::ShardView::parse(&b.bytes, "b").unwrap(),
        );
        for i in 0..6u64 {
            let at = Location::sample("x.tar", i);
            let (ra, rb) = (va.record(i).unwrap(), vb.record(i).unwrap());
            let get = |r, col: usize| match crate::format::decode_record(&schema, r, &at).unwrap()[col] {
                crate::format::ValueRef::Bytes(b) => b.to_vec(),
                _ => unreachable!(),
            };
            let (ja, jb) = (get(ra, jpg), get(rb, jpg));
            // A member that is not a JPEG is stored as given.
            assert_eq!(get(rb, cls), format!("{i}").into_bytes());
            assert_eq!(ja, files[2 * i as usize + 1].1, "the given bytes");
            if i == 5 {
                // A damaged JPEG: stored as given (and decoded, or refused, as given).
                assert_eq!(jb, ja);
            } else {
                assert_ne!(jb, ja);
                assert!(
                    jb.windows(2).any(|w| w == [0xFF, 0xDD]),
                    "sample {i} has no restart interval"
                );
                let (pa, pb) = (
                    crate::image::decode_rgb(&ja, 1, None).unwrap(),
                    crate::image::decode_rgb(&jb, 1, None).unwrap(),
                );
                assert!(pa.data == pb.data, "sample {i}: other pixels");
            }
            // Read alone from its span, a sample transcodes to the record the whole shard
            // holds (the whole shard's JPEGs were transcoded on several threads).
            let span = spans[i as usize].start as usize..spans[i as usize].end as usize;
            let alone = transcode_sample(&rst, &schema, &tar[span], &at).unwrap();
            assert_eq!(alone, rb, "sample {i}");
        }
    }
}
