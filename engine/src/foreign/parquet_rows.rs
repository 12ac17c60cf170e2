//! One Parquet row group, as stored (its column chunks' bytes), as the ramjet shard it
//! transcodes to: decoded by the Apache Arrow project's `parquet` crate against the file's
//! footer (Snappy, Zstd, Gzip and LZ4 pages; a page's CRC-32 checked where the writer wrote
//! one), each row's fields read as their columns' [`Kind`]s.

use std::sync::Arc;

use bytes::{Buf, Bytes};
use parquet::file::metadata::{ParquetMetaData, RowGroupMetaData};
use parquet::file::properties::ReaderProperties;
use parquet::file::reader::{ChunkReader, Length, RowGroupReader};
use parquet::file::serialized_reader::SerializedRowGroupReader;
use parquet::record::{Field, Row};

use super::parquet_schema::Kind;
use super::{ForeignColumn, ForeignSpec, ParquetPart};
use crate::error::{Error, Invalid, Location, Result};
use crate::format::array::{Array, Dtype, Num};
use crate::format::{BuiltShard, Schema, ShardBuilder, Value, NULL_INT64};

/// Where row group `rg`'s column chunks lie in the file: from the first chunk's first page
/// (its dictionary page, if it has one) to the last chunk's end. Writers lay a row group's
/// chunks one after another, so this is what the row group holds.
pub fn row_group_span(rg: &RowGroupMetaData) -> std::result::Result<(u64, u64), Invalid> {
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for c in rg.columns() {
        let start = c.dictionary_page_offset().unwrap_or(c.data_page_offset());
        let (Ok(start), Ok(len)) = (u64::try_from(start), u64::try_from(c.compressed_size())) else {
            return Err(format!("column {} has a negative offset or size", c.column_path()).into());
        };
        let end = start.checked_add(len).ok_or("a column chunk's end overflows")?;
        lo = lo.min(start);
        hi = hi.max(end);
    }
    if rg.columns().is_empty() || hi <= lo {
        return Err("the row group has no column data".into());
    }
    Ok((lo, hi - lo))
}

/// A row group's bytes as the file the `parquet` crate reads: offsets are the file's, and
/// only the row group's span is there.
struct Span {
    offset: u64,
    data: Bytes,
}

impl Span {
    fn slice(&self, start: u64, len: usize) -> parquet::errors::Result<Bytes> {
        let at = start.checked_sub(self.offset).map(|a| a as usize);
        match at {
            Some(a) if a.checked_add(len).is_some_and(|e| e <= self.data.len()) => Ok(self.data.slice(a..a + len)),
            _ => Err(parquet::errors::ParquetError::EOF(format!(
                "[{start}, +{len}) is outside the row group's bytes [{}, +{})",
                self.offset,
                self.data.len()
            ))),
        }
    }
}

impl Length for Span {
    fn len(&self) -> u64 {
        self.offset + self.data.len() as u64
    }
}

impl ChunkReader for Span {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        let rest = self.len().saturating_sub(start) as usize;
        Ok(self.slice(start, rest)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.slice(start, length)
    }
}

/// The ramjet shard that row group `part` (its bytes `data`, checked by the caller against
/// the manifest) of a file whose footer is `meta` transcodes to. A fault names the row group
/// (`object`) and, where it is in one row, that row.
pub fn transcode_row_group(
    spec: &ForeignSpec,
    schema: &Schema,
    meta: &ParquetMetaData,
    part: &ParquetPart,
    data: Bytes,
    object: &str,
) -> Result<BuiltShard> {
    let at = Location::object(object);
    let bad = |r: String| Error::corrupt(at.clone(), r);
    let rg = meta
        .row_groups()
        .get(part.row_group as usize)
        .ok_or_else(|| bad(format!("the file's footer has no row group {}", part.row_group)))?;
    let reserve = data.len() + data.len() / 16;
    let reader = Arc::new(Span {
        offset: part.offset,
        data,
    });
    // The `parquet` crate's decoders are trusted with bytes whose checksum matched; a panic in
    // one still names this row group rather than taking the process down.
    let mut rows = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<Vec<Vec<Value>>> {
        let props = Arc::new(ReaderProperties::builder().build());
        let rgr = SerializedRowGroupReader::new(reader, rg, None, props).map_err(|e| bad(short(&e)))?;
        let mut rows = Vec::with_capacity(rg.num_rows().max(0) as usize);
        for row in rgr.get_row_iter(None).map_err(|e| bad(short(&e)))? {
            let row = row.map_err(|e| bad(format!("row {}: {}", rows.len(), short(&e))))?;
            let loc = Location::sample(object, rows.len() as u64);
            rows.push(row_values(&spec.columns, schema, &row, &loc)?);
        }
        Ok(rows)
    }))
    .map_err(|_| bad("the Parquet decoder failed on this row group".into()))??;
    if rows.len() as i64 != rg.num_rows() {
        return Err(bad(format!(
            "{} rows decoded; the footer says {}",
            rows.len(),
            rg.num_rows()
        )));
    }
    spec.restart_jpegs(&mut rows);
    let mut b = ShardBuilder::new(schema.clone());
    b.reserve(reserve);
    for (n, values) in rows.iter().enumerate() {
        b.push(values, &Location::sample(object, n as u64).to_string())?;
    }
    Ok(b.finish())
}

/// A `parquet` error's text, cut short (some quote whole values).
fn short(e: &parquet::errors::ParquetError) -> String {
    let mut s = e.to_string();
    if s.len() > 300 {
        let mut cut = 300;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

/// One row's values, in the columns' order.
fn row_values(columns: &[ForeignColumn], schema: &Schema, row: &Row, at: &Location) -> Result<Vec<Value>> {
    let fields = row.get_column_iter().map(|(_, f)| f).collect::<Vec<_>>();
    if fields.len() != columns.len() {
        return Err(Error::corrupt(
            at.clone(),
            format!("{} fields, the index says {}", fields.len(), columns.len()),
        ));
    }
    let mut out = Vec::with_capacity(columns.len());
    for ((c, f), col) in columns.iter().zip(fields).zip(&schema.columns) {
        let kind = Kind::parse(&c.encoding).ok_or_else(|| {
            Error::invalid(
                at.to_string(),
                format!("column {:?}: no Parquet kind {:?}", c.name, c.encoding),
            )
        })?;
        let v = value(kind, col.nullable, f)
            .map_err(|r| Error::corrupt(at.clone(), format!("column {:?}: {r}", c.name)))?;
        out.push(v);
    }
    Ok(out)
}

/// A field's value as a column of `kind` (`nullable`: an `int` or `float` null is stored as
/// the column's null).
fn value(kind: Kind, nullable: bool, f: &Field) -> std::result::Result<Value, Invalid> {
    let null = || Err(Invalid::from("a null, in a column that holds none"));
    Ok(match (kind, f) {
        (Kind::Int, Field::Null) if nullable => Value::Int64(NULL_INT64),
        (Kind::Float, Field::Null) if nullable => Value::Float64(f64::NAN),
        (Kind::StrOrNull, Field::Null) => Value::Json("null".into()),
        (_, Field::Null) => return null(),
        (Kind::Int, f) => {
            let v = int(f).ok_or_else(|| format!("{f} is not an integer"))?;
            if nullable && v == NULL_INT64 {
                return Err(format!("{v} is the value a null is stored as").into());
            }
            Value::Int64(v)
        }
        (Kind::Float, Field::Float16(x)) => Value::Float64(x.to_f64()),
        (Kind::Float, Field::Float(x)) => Value::Float64(*x as f64),
        (Kind::Float, Field::Double(x)) => Value::Float64(*x),
        (Kind::Str, Field::Str(s)) => Value::Str(s.clone()),
        (Kind::StrOrNull, Field::Str(s)) => Value::Json(serde_json::to_string(s).map_err(|e| e.to_string())?),
        (Kind::Json, Field::Str(s)) => {
            serde_json::from_str::<serde::de::IgnoredAny>(s).map_err(|e| format!("not one JSON value: {e}"))?;
            Value::Json(s.clone())
        }
        (Kind::Bytes, Field::Bytes(b)) => Value::Bytes(b.data().to_vec()),
        (Kind::Image, Field::Group(g)) => image_bytes(g)?,
        (Kind::List(d), Field::ListInternal(l)) => list(d, l.elements())?,
        (k, f) => return Err(format!("{f} is not a {} value", k.name()).into()),
    })
}

/// An integer field (booleans, dates, times and timestamps as stored) as an `i64`.
fn int(f: &Field) -> Option<i64> {
    Some(match *f {
        Field::Bool(b) => b as i64,
        Field::Byte(x) => x as i64,
        Field::Short(x) => x as i64,
        Field::Int(x) | Field::Date(x) | Field::TimeMillis(x) => x as i64,
        Field::Long(x) | Field::TimeMicros(x) | Field::TimestampMillis(x) | Field::TimestampMicros(x) => x,
        Field::UByte(x) => x as i64,
        Field::UShort(x) => x as i64,
        Field::UInt(x) => x as i64,
        Field::ULong(x) => i64::try_from(x).ok()?,
        _ => return None,
    })
}

/// Hugging Face's `{bytes, path}` struct: its bytes (an image kept only as a path names it).
fn image_bytes(g: &Row) -> std::result::Result<Value, Invalid> {
    let get = |name: &str| g.get_column_iter().find(|(n, _)| n.as_str() == name).map(|(_, f)| f);
    match (get("bytes"), get("path")) {
        (Some(Field::Bytes(b)), _) => Ok(Value::Bytes(b.data().to_vec())),
        (_, Some(Field::Str(p))) => Err(format!(
            "the image is only a path ({p:?}), not bytes in the file: embed it (datasets' `embed_external_files`) or pack it"
        ).into()),
        _ => Err("the image struct holds no bytes".into()),
    }
}

/// A list of numbers as a one-dimensional array of `dtype`.
fn list(dtype: Dtype, items: &[Field]) -> std::result::Result<Value, Invalid> {
    let mut data = Vec::with_capacity(items.len() * dtype.size());
    for (i, f) in items.iter().enumerate() {
        let x = match f {
            Field::Float16(x) => Num::F(x.to_f64()),
            Field::Float(x) => Num::F(*x as f64),
            Field::Double(x) => Num::F(*x),
            Field::ULong(x) => Num::U(*x),
            f => Num::I(int(f).ok_or_else(|| format!("element {i}: {f} is not a number"))?),
        };
        dtype.push(x, &mut data).map_err(|r| format!("element {i}: {r}"))?;
    }
    Ok(Value::Array(
        Array::new(dtype, vec![items.len() as u64], data).map_err(|r| r.to_string())?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nulls_are_stored_only_where_the_column_holds_them() {
        assert!(matches!(
            value(Kind::Int, true, &Field::Null),
            Ok(Value::Int64(NULL_INT64))
        ));
        assert!(value(Kind::Int, false, &Field::Null).unwrap_err().contains("null"));
        assert!(value(Kind::Int, true, &Field::Long(NULL_INT64)).is_err());
        assert!(matches!(value(Kind::StrOrNull, false, &Field::Null), Ok(Value::Json(s)) if s == "null"));
        assert!(
            matches!(value(Kind::StrOrNull, false, &Field::Str("a\"".into())), Ok(Value::Json(s)) if s == "\"a\\\"\"")
        );
        assert!(value(Kind::Int, false, &Field::ULong(u64::MAX)).is_err());
        assert!(value(Kind::Json, false, &Field::Str("{".into())).is_err());
    }

    #[test]
    fn a_list_of_numbers_is_an_array_and_a_null_element_is_refused() {
        let v = list(Dtype::F32, &[Field::Float(1.5), Field::Float(-2.0)]).unwrap();
        let Value::Array(a) = v else { panic!("not an array") };
        assert_eq!(a.as_array_ref().shape(), vec![2]);
        assert!(list(Dtype::F32, &[Field::Null]).unwrap_err().contains("element 0"));
        assert!(list(Dtype::U8, &[Field::Int(300)])
            .unwrap_err()
            .contains("out of range"));
    }

    #[test]
    fn a_read_outside_the_row_groups_bytes_is_an_error() {
        let s = Span {
            offset: 100,
            data: Bytes::from_static(b"abcdef"),
        };
        assert_eq!(&s.get_bytes(102, 3).unwrap()[..], b"cde");
        assert!(s.get_bytes(99, 2).is_err());
        assert!(s.get_bytes(104, 3).is_err());
        assert_eq!(s.len(), 106);
    }
}
