//! Typed schema of a dataset and the byte encoding of one sample (a "record").
//!
//! A record is the sample's columns in schema order, with no padding:
//! `int64` and `float64` are 8 bytes little-endian; `bytes`, `str`, `json` and arrays are a
//! `u64` little-endian length followed by that many bytes. `str` and `json` are UTF-8, and
//! `json` holds one complete JSON value; an array is its dtype, shape and elements
//! ([`super::array`]). See `docs/format.md`.

use crate::error::Invalid;
use serde::{Deserialize, Serialize};

use super::array::{Array, ArrayRef, ArraySpec};

use crate::error::{Error, Location, Result};

/// The type of one column. In schema JSON, its name: `bytes`, `str`, `int64`, `float64`,
/// `json`, or an array's `DTYPE[DIMS]` (`int32[?]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ColumnType {
    /// Opaque bytes (an encoded image, a tensor blob).
    Bytes,
    /// UTF-8 text.
    Str,
    /// Signed 64-bit integer.
    Int64,
    /// IEEE-754 double.
    Float64,
    /// One JSON value stored as UTF-8 text.
    Json,
    /// Typed arrays of this element type and shape.
    Array(ArraySpec),
}

impl ColumnType {
    /// Name used in schema JSON and messages.
    pub fn name(self) -> String {
        match self {
            ColumnType::Bytes => "bytes".into(),
            ColumnType::Str => "str".into(),
            ColumnType::Int64 => "int64".into(),
            ColumnType::Float64 => "float64".into(),
            ColumnType::Json => "json".into(),
            ColumnType::Array(a) => a.text(),
        }
    }

    /// The type called `name` (as [`ColumnType::name`] writes it).
    pub fn parse(name: &str) -> std::result::Result<ColumnType, Invalid> {
        Ok(match name {
            "bytes" => ColumnType::Bytes,
            "str" => ColumnType::Str,
            "int64" => ColumnType::Int64,
            "float64" => ColumnType::Float64,
            "json" => ColumnType::Json,
            a if a.contains('[') => ColumnType::Array(ArraySpec::parse(a)?),
            other => {
                return Err(Invalid::from(format!(
                    "unknown column type {other:?} (bytes, str, int64, float64, json, or an array: DTYPE[DIMS] such as int32[?])"
                )))
            }
        })
    }

    /// Whether a value is stored as a `u64` length and that many bytes.
    pub fn is_variable(self) -> bool {
        !matches!(self, ColumnType::Int64 | ColumnType::Float64)
    }
}

impl Serialize for ColumnType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for ColumnType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ColumnType::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// One named, typed column.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Column {
    /// Column name, unique in the schema.
    pub name: String,
    /// Column type.
    #[serde(rename = "type")]
    pub ty: ColumnType,
    /// Whether a value may be null (`int64?`, `float64?`): stored as [`NULL_INT64`] or a NaN,
    /// delivered with a `<name>_valid` mask. Absent from the JSON when false, so a schema
    /// without nullable columns is the same bytes as before the field existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nullable: bool,
}

/// How a null is stored in a nullable `int64` column: the one value such a column cannot hold.
/// A nullable `float64` stores a null as a NaN (JSON has none, so no packed value is one).
pub const NULL_INT64: i64 = i64::MIN;

impl Column {
    /// The type as `--column` and [`Schema::describe`] write it: `int64?` when nullable.
    pub fn type_name(&self) -> String {
        let n = self.ty.name();
        if self.nullable {
            format!("{n}?")
        } else {
            n
        }
    }

    /// Whether `v` is this column's null.
    pub fn is_null(&self, v: &ValueRef<'_>) -> bool {
        self.nullable
            && match v {
                ValueRef::Int64(x) => *x == NULL_INT64,
                ValueRef::Float64(x) => x.is_nan(),
                _ => false,
            }
    }
}

/// Ordered list of columns. Its canonical JSON is stored in every shard and in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Schema {
    /// Columns in record order.
    pub columns: Vec<Column>,
}

/// Most columns a schema may have (a bound on header parsing work).
pub const COLUMNS_MAX: usize = 1024;
/// Longest column name in bytes.
pub const COLUMN_NAME_BYTES_MAX: usize = 256;

impl Schema {
    /// Builds and validates a schema from its columns.
    pub fn from_columns(columns: Vec<Column>) -> Result<Self> {
        let schema = Schema { columns };
        schema.validate().map_err(|r| Error::invalid("schema", r))?;
        Ok(schema)
    }

    /// Builds and validates a schema from `(name, type)` pairs.
    pub fn new<S: Into<String>>(cols: impl IntoIterator<Item = (S, ColumnType)>) -> Result<Self> {
        let schema = Schema {
            columns: cols
                .into_iter()
                .map(|(n, ty)| Column {
                    name: n.into(),
                    ty,
                    nullable: false,
                })
                .collect(),
        };
        schema.validate().map_err(|r| Error::invalid("schema", r))?;
        Ok(schema)
    }

    /// The schema of a columns sidecar: every column except the `bytes` ones, in order.
    /// `None` when there is no `bytes` column (the shard itself is as small) or nothing else.
    pub fn without_bytes(&self) -> Option<Schema> {
        let columns: Vec<Column> = self
            .columns
            .iter()
            .filter(|c| c.ty != ColumnType::Bytes)
            .cloned()
            .collect();
        if columns.is_empty() || columns.len() == self.columns.len() {
            return None;
        }
        Some(Schema { columns })
    }

    /// Checks names are non-empty, unique and bounded.
    pub fn validate(&self) -> std::result::Result<(), Invalid> {
        if self.columns.is_empty() {
            return Err(Invalid::from("a schema needs at least one column"));
        }
        if self.columns.len() > COLUMNS_MAX {
            return Err(Invalid::from(format!(
                "{} columns, more than the limit of {COLUMNS_MAX}",
                self.columns.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for c in &self.columns {
            if c.name.is_empty() || c.name.len() > COLUMN_NAME_BYTES_MAX {
                return Err(Invalid::from(format!(
                    "column name {:?} must be 1..={COLUMN_NAME_BYTES_MAX} bytes",
                    c.name
                )));
            }
            if !seen.insert(c.name.as_str()) {
                return Err(Invalid::from(format!("duplicate column name {:?}", c.name)));
            }
            if c.nullable && self.columns.iter().any(|o| o.name == format!("{}_valid", c.name)) {
                return Err(Invalid::from(format!(
                    "column {:?} is where nullable column {:?}'s mask goes",
                    format!("{}_valid", c.name),
                    c.name
                )));
            }
            if c.nullable && !matches!(c.ty, ColumnType::Int64 | ColumnType::Float64) {
                return Err(Invalid::from(format!(
                    "column {:?}: only int64 and float64 columns can be nullable (a json column holds null as it is)",
                    c.name
                )));
            }
        }
        Ok(())
    }

    /// Canonical JSON bytes: what shards store and hash.
    pub fn to_canonical_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("schema serialises")
    }

    /// Parses canonical JSON (as stored in a shard) and validates it.
    pub fn from_json(bytes: &[u8]) -> std::result::Result<Self, Invalid> {
        let s: Schema = serde_json::from_slice(bytes).map_err(|e| format!("schema JSON: {e}"))?;
        s.validate()?;
        Ok(s)
    }

    /// Index of the column called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name == name)
    }

    /// Short human form, e.g. `image:bytes, label:int64`.
    pub fn describe(&self) -> String {
        self.columns
            .iter()
            .map(|c| format!("{}:{}", c.name, c.type_name()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// An owned value, as given to a writer.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// For [`ColumnType::Bytes`].
    Bytes(Vec<u8>),
    /// For [`ColumnType::Str`].
    Str(String),
    /// For [`ColumnType::Int64`].
    Int64(i64),
    /// For [`ColumnType::Float64`].
    Float64(f64),
    /// For [`ColumnType::Json`]: JSON text.
    Json(String),
    /// For [`ColumnType::Array`].
    Array(Array),
}

impl Value {
    /// The column type this value fits.
    pub fn column_type(&self) -> ColumnType {
        match self {
            Value::Bytes(_) => ColumnType::Bytes,
            Value::Str(_) => ColumnType::Str,
            Value::Int64(_) => ColumnType::Int64,
            Value::Float64(_) => ColumnType::Float64,
            Value::Json(_) => ColumnType::Json,
            Value::Array(a) => ColumnType::Array(ArraySpec {
                dtype: Some(a.dtype),
                dims: super::array::Dims::Any,
            }),
        }
    }

    /// Borrowed view.
    pub fn as_ref(&self) -> ValueRef<'_> {
        match self {
            Value::Bytes(b) => ValueRef::Bytes(b),
            Value::Str(s) => ValueRef::Str(s),
            Value::Int64(v) => ValueRef::Int64(*v),
            Value::Float64(v) => ValueRef::Float64(*v),
            Value::Json(s) => ValueRef::Json(s),
            Value::Array(a) => ValueRef::Array(a.as_array_ref()),
        }
    }
}

/// A borrowed value, as read from a record without copying.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueRef<'a> {
    /// Bytes column.
    Bytes(&'a [u8]),
    /// Str column.
    Str(&'a str),
    /// Int64 column.
    Int64(i64),
    /// Float64 column.
    Float64(f64),
    /// Json column (text; parse with serde_json when needed).
    Json(&'a str),
    /// Array column, checked against its declaration.
    Array(ArrayRef<'a>),
}

impl ValueRef<'_> {
    /// Owned copy.
    pub fn to_owned_value(&self) -> Value {
        match *self {
            ValueRef::Bytes(b) => Value::Bytes(b.to_vec()),
            ValueRef::Str(s) => Value::Str(s.to_owned()),
            ValueRef::Int64(v) => Value::Int64(v),
            ValueRef::Float64(v) => Value::Float64(v),
            ValueRef::Json(s) => Value::Json(s.to_owned()),
            ValueRef::Array(a) => Value::Array(a.to_owned_array()),
        }
    }
}

/// Size in bytes of `values` once encoded as a record.
pub fn encoded_len(values: &[Value]) -> u64 {
    values
        .iter()
        .map(|v| match v {
            Value::Int64(_) | Value::Float64(_) => 8,
            Value::Bytes(b) => 8 + b.len() as u64,
            Value::Str(s) | Value::Json(s) => 8 + s.len() as u64,
            Value::Array(a) => 8 + a.encoded_len(),
        })
        .sum()
}

/// Appends the record encoding of `values` to `out`, checking them against `schema`.
/// `what` names the sample in errors (a path, `file:line`).
pub fn encode_record(schema: &Schema, values: &[Value], what: &str, out: &mut Vec<u8>) -> Result<()> {
    if values.len() != schema.columns.len() {
        return Err(Error::invalid(
            what,
            format!(
                "{} values for a schema of {} columns ({})",
                values.len(),
                schema.columns.len(),
                schema.describe()
            ),
        ));
    }
    for (col, v) in schema.columns.iter().zip(values) {
        if let (Value::Array(a), ColumnType::Array(spec)) = (v, col.ty) {
            spec.check(a.dtype, &a.shape)
                .map_err(|r| Error::invalid(what, format!("column {:?}: {r}", col.name)))?;
            continue;
        }
        if v.column_type() != col.ty {
            return Err(Error::invalid(
                what,
                format!(
                    "column {:?} is {}, value is {}",
                    col.name,
                    col.ty.name(),
                    v.column_type().name()
                ),
            ));
        }
        if let Value::Json(s) = v {
            serde_json::from_str::<serde::de::IgnoredAny>(s)
                .map_err(|e| Error::invalid(what, format!("column {:?} is not valid JSON: {e}", col.name)))?;
        }
    }
    out.reserve(encoded_len(values) as usize);
    for v in values {
        match v {
            Value::Int64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Float64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bytes(b) => put_var(out, b),
            Value::Str(s) | Value::Json(s) => put_var(out, s.as_bytes()),
            Value::Array(a) => {
                out.extend_from_slice(&a.encoded_len().to_le_bytes());
                a.encode(out);
            }
        }
    }
    Ok(())
}

fn put_var(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// Decodes one record. Every length is bounds-checked, text is checked to be UTF-8, and the
/// record must be consumed exactly. `at` names the sample in errors.
pub fn decode_record<'a>(schema: &Schema, rec: &'a [u8], at: &Location) -> Result<Vec<ValueRef<'a>>> {
    decode_record_at(schema, rec, || at.clone())
}

/// [`decode_record`], with the record's location made only for an error (a hot loop then
/// formats no name per record).
pub fn decode_record_at<'a>(schema: &Schema, rec: &'a [u8], at: impl Fn() -> Location) -> Result<Vec<ValueRef<'a>>> {
    let mut pos = 0usize;
    let mut out = Vec::with_capacity(schema.columns.len());
    let bad = |pos: usize, reason: String| Error::corrupt(at(), format!("record byte {pos}: {reason}"));
    for col in &schema.columns {
        let take8 = |pos: usize| -> Result<[u8; 8]> {
            rec.get(pos..pos + 8)
                .map(|s| s.try_into().expect("8 bytes"))
                .ok_or_else(|| {
                    bad(
                        pos,
                        format!("column {:?} runs past the record end ({} bytes)", col.name, rec.len()),
                    )
                })
        };
        match col.ty {
            ColumnType::Int64 => {
                out.push(ValueRef::Int64(i64::from_le_bytes(take8(pos)?)));
                pos += 8;
            }
            ColumnType::Float64 => {
                out.push(ValueRef::Float64(f64::from_le_bytes(take8(pos)?)));
                pos += 8;
            }
            ColumnType::Bytes | ColumnType::Str | ColumnType::Json | ColumnType::Array(_) => {
                let len = u64::from_le_bytes(take8(pos)?);
                pos += 8;
                let end = usize::try_from(len)
                    .ok()
                    .and_then(|l| pos.checked_add(l))
                    .filter(|&e| e <= rec.len())
                    .ok_or_else(|| {
                        bad(
                            pos,
                            format!(
                                "column {:?} length {len} runs past the record end ({} bytes)",
                                col.name,
                                rec.len()
                            ),
                        )
                    })?;
                let raw = &rec[pos..end];
                pos = end;
                out.push(match col.ty {
                    ColumnType::Bytes => ValueRef::Bytes(raw),
                    ColumnType::Array(spec) => ValueRef::Array(
                        ArrayRef::parse(raw, &spec).map_err(|r| bad(pos, format!("column {:?}: {r}", col.name)))?,
                    ),
                    ty => {
                        let s = std::str::from_utf8(raw)
                            .map_err(|e| bad(pos, format!("column {:?} is not UTF-8: {e}", col.name)))?;
                        if ty == ColumnType::Str {
                            ValueRef::Str(s)
                        } else {
                            ValueRef::Json(s)
                        }
                    }
                });
            }
        }
    }
    if pos != rec.len() {
        return Err(bad(
            pos,
            format!("{} trailing bytes after the last column", rec.len() - pos),
        ));
    }
    Ok(out)
}
