//! MosaicML Streaming's MDS format: `index.json` and `.mds` shards.

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64;

use super::{compression_name, ForeignColumn};
use crate::error::{Error, Invalid, Location, Result};
use crate::format::array::{Array, ArraySpec, Dims, Dtype};
use crate::format::{ColumnType, Schema, Value};

/// MDS encodings refused: unpickling is code execution.
pub const REFUSED: &[&str] = &["pkl"];

/// The ramjet column type an MDS encoding is read as, or why it is refused.
///
/// | MDS | ramjet |
/// |---|---|
/// | `bytes`, `jpeg`, `png`, `pil`, `jpeg_array`, `list[...]` | `bytes` (the MDS bytes as stored) |
/// | `ndarray`, `ndarray:DTYPE`, `ndarray:DTYPE:D0,D1,...` | an array: `any[*]`, `DTYPE[*]`, `DTYPE[D0,D1,...]` |
/// | `str`, `str_decimal` | `str` |
/// | `int`, `int8`..`int64`, `uint8`..`uint64`, `str_int` | `int64` |
/// | `float16`, `float32`, `float64`, `str_float` | `float64` |
/// | `json` | `json` |
pub fn column_type(encoding: &str) -> std::result::Result<ColumnType, Invalid> {
    let name = encoding.split(':').next().unwrap_or(encoding);
    Ok(match name {
        "bytes" | "jpeg" | "png" | "pil" | "jpeg_array" | "jpegarray" | "list[pil]" | "list[jpeg]" | "list[png]" => {
            ColumnType::Bytes
        }
        "ndarray" => ColumnType::Array(ndarray_spec(encoding)?),
        "litdata-numpy" => ColumnType::Array(litdata_numpy_spec(encoding)?),
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

/// MosaicML's element types by their code in a dynamic-dtype `ndarray` value.
const NDARRAY_DTYPES: [(u8, Dtype); 11] = [
    (8, Dtype::U8),
    (9, Dtype::I8),
    (16, Dtype::U16),
    (17, Dtype::I16),
    (18, Dtype::F16),
    (32, Dtype::U32),
    (33, Dtype::I32),
    (34, Dtype::F32),
    (64, Dtype::U64),
    (65, Dtype::I64),
    (66, Dtype::F64),
];

/// The array an `ndarray[:DTYPE[:D0,D1,...]]` encoding declares.
fn ndarray_spec(encoding: &str) -> std::result::Result<ArraySpec, Invalid> {
    let mut parts = encoding.split(':').skip(1);
    let dtype = match parts.next() {
        None | Some("") => None,
        Some(d) => Some(
            NDARRAY_DTYPES
                .iter()
                .map(|&(_, t)| t)
                .find(|t| t.name() == d)
                .ok_or_else(|| Invalid::from(format!("ndarray dtype {d:?} is not one MosaicML writes")))?,
        ),
    };
    let dims = match parts.next() {
        None => Dims::Any,
        Some(shape) => {
            let axes: Vec<u64> = shape
                .split(',')
                .map(|x| x.trim().parse::<u64>().map_err(|_| format!("ndarray shape {shape:?}")))
                .collect::<std::result::Result<_, _>>()?;
            let text = format!(
                "{}[{}]",
                dtype.map_or("any", Dtype::name),
                axes.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
            );
            return if parts.next().is_some() {
                Err(Invalid::from(format!(
                    "encoding {encoding:?} has more than dtype and shape"
                )))
            } else {
                ArraySpec::parse(&text)
            };
        }
    };
    Ok(ArraySpec { dtype, dims })
}

/// LitData's NumPy dtype at index `i` of its serializers' list: ramjet's dtypes in code order
/// without bfloat16 (NumPy has none); the rest of its list (complex, bool, object, ...) `None`.
pub fn litdata_dtype(i: usize) -> Option<Dtype> {
    crate::format::array::DTYPES
        .iter()
        .copied()
        .filter(|&d| d != Dtype::Bf16)
        .nth(i)
}

/// LitData's arrays: `litdata-numpy` (its `numpy` serializer: any dtype and shape, given in
/// each value) or `litdata-numpy:DTYPE` (its `no_header_numpy`: one dtype, a flat array).
fn litdata_numpy_spec(encoding: &str) -> std::result::Result<ArraySpec, Invalid> {
    match encoding.split_once(':') {
        None => Ok(ArraySpec {
            dtype: None,
            dims: Dims::Any,
        }),
        Some((_, d)) => ArraySpec::parse(&format!("{d}[?]")),
    }
}

/// A LitData array value: with a header (`u32` dtype index, `u32` ndim, `u32` dims), or
/// the elements alone of a flat array of the encoding's dtype.
fn litdata_numpy_value(spec: &ArraySpec, b: &[u8]) -> std::result::Result<Array, Invalid> {
    let u32_at = |i: usize| -> std::result::Result<u64, Invalid> {
        b.get(4 * i..4 * i + 4)
            .map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")) as u64)
            .ok_or_else(|| Invalid::from(format!("a LitData array of {} bytes ends in its header", b.len())))
    };
    let (dtype, shape, data) = match spec.dtype {
        Some(d) => {
            let n = b.len() as u64 / d.size() as u64;
            (d, vec![n], b.to_vec())
        }
        None => {
            let code = u32_at(0)? as usize;
            let d = litdata_dtype(code)
                .ok_or_else(|| Invalid::from(format!("LitData dtype index {code} is not one ramjet reads")))?;
            let ndim = u32_at(1)? as usize;
            let shape = (0..ndim)
                .map(|i| u32_at(2 + i))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            (d, shape, b[(8 + 4 * ndim).min(b.len())..].to_vec())
        }
    };
    spec.check(dtype, &shape)?;
    Array::new(dtype, shape, data)
}

/// An `ndarray` value as MosaicML writes it: `[dtype code]` unless the encoding fixes the
/// dtype, `[ndim << 2 | shape width][shape]` unless it fixes the shape, then the elements.
fn ndarray_value(spec: &ArraySpec, b: &[u8]) -> std::result::Result<Array, Invalid> {
    let mut at = 0usize;
    let mut take = |n: usize| -> std::result::Result<&[u8], Invalid> {
        let s = b
            .get(at..at + n)
            .ok_or_else(|| Invalid::from(format!("an ndarray value of {} bytes ends in its header", b.len())))?;
        at += n;
        Ok(s)
    };
    let dtype = match spec.dtype {
        Some(d) => d,
        None => {
            let code = take(1)?[0];
            NDARRAY_DTYPES
                .iter()
                .find(|(c, _)| *c == code)
                .map(|&(_, d)| d)
                .ok_or_else(|| Invalid::from(format!("unknown ndarray dtype code {code}")))?
        }
    };
    let shape = match spec.fixed_shape() {
        Some(s) => s,
        None => {
            let byte = take(1)?[0];
            let (ndim, width) = ((byte >> 2) as usize, 1usize << (byte & 3));
            let raw = take(ndim * width)?;
            raw.chunks(width)
                .map(|c| {
                    let mut x = [0u8; 8];
                    x[..width].copy_from_slice(c);
                    u64::from_le_bytes(x)
                })
                .collect()
        }
    };
    let data = b[at..].to_vec();
    spec.check(dtype, &shape)?;
    Array::new(dtype, shape, data)
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

fn le<const N: usize>(b: &[u8]) -> std::result::Result<[u8; N], Invalid> {
    b.try_into()
        .map_err(|_| Invalid::from(format!("{} bytes, expected {N}", b.len())))
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
        ColumnType::Array(spec) if name == "litdata-numpy" => Value::Array(litdata_numpy_value(&spec, b)?),
        ColumnType::Array(spec) => Value::Array(ndarray_value(&spec, b)?),
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
