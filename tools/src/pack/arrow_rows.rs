//! A Hugging Face `datasets` folder written by `Dataset.save_to_disk`: `state.json` names its
//! Arrow IPC stream files (`data-00000-of-00001.arrow`, ...) in order, read with the Apache Arrow
//! project's `arrow-ipc` (docs/dependencies.md). ramjet does not read these in place (they have
//! no footer to range-read by); `ramjet pack` reads them whole, a file at a time.
//!
//! Columns map as Parquet's do (docs/format.md, "Parquet"): integers, booleans, dates and
//! timestamps as `int64`, floats as `float64`, strings as `str` (`json` when some are null),
//! binary as `bytes`, Hugging Face's image struct `{bytes, path}` as `bytes`, lists of numbers
//! as `DTYPE[?]` arrays; int and float columns holding a null become nullable. Anything else is
//! refused naming the column.

use std::io::Cursor;

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array as _, ArrayRef, RecordBatch};
use arrow_ipc::reader::StreamReader;
use arrow_schema::{DataType, Schema as ArrowSchema};
use serde_json::Value as Json;

use ramjet_engine::format::array::{Array, Dtype, Num};
use ramjet_engine::format::{Column, ColumnType, Schema, Value, NULL_INT64};
use ramjet_engine::{Error, Invalid, Result};

use super::Source;

/// How one top-level Arrow field becomes a ramjet column's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Float,
    Str,
    StrOrNull,
    Bytes,
    Image,
    List(Dtype),
}

/// One Arrow file of the dataset, as first read.
#[derive(Debug, Clone)]
pub struct ArrowFile {
    /// Its name in the folder.
    pub name: String,
    /// Rows in it.
    pub rows: u64,
    /// Its size.
    pub bytes: u64,
    /// xxh3-64 of its bytes: a file changed after the first read is refused.
    pub checksum: u64,
}

/// A saved dataset, opened: its files and their columns.
pub struct ArrowInput {
    /// Its files, in `state.json`'s order.
    pub files: Vec<ArrowFile>,
    /// The ramjet columns.
    pub schema: Schema,
    kinds: Vec<Kind>,
    arrow: ArrowSchema,
}

/// The Arrow IPC streams in `bytes` (`name` in errors): the schema and every batch.
fn batches(bytes: &[u8], name: &str) -> Result<(ArrowSchema, Vec<RecordBatch>)> {
    let bad = |e: arrow_schema::ArrowError| Error::invalid(name, format!("not an Arrow IPC stream: {e}"));
    let r = StreamReader::try_new(Cursor::new(bytes), None).map_err(bad)?;
    let schema = r.schema().as_ref().clone();
    let got = r.collect::<std::result::Result<Vec<_>, _>>().map_err(bad)?;
    Ok((schema, got))
}

impl ArrowInput {
    /// Opens a `save_to_disk` folder: reads `state.json` and each file it names once (its rows,
    /// checksum and nulls). A `DatasetDict` (several splits) is refused naming them.
    pub fn open(src: &Source, rt: &tokio::runtime::Runtime) -> Result<ArrowInput> {
        if let Some(d) = src.read_opt(rt, "dataset_dict.json")? {
            let splits = serde_json::from_slice::<Json>(&d)
                .ok()
                .and_then(|j| j.get("splits").cloned());
            return Err(Error::invalid(
                &src.display,
                format!(
                    "a DatasetDict saved with save_to_disk: pack one split's folder (its splits: {})",
                    splits.map_or("see dataset_dict.json".into(), |s| s.to_string())
                ),
            ));
        }
        let state_name = src.name("state.json");
        let state: Json = serde_json::from_slice(&src.read(rt, "state.json")?)
            .map_err(|e| Error::invalid(&state_name, format!("not JSON: {e}")))?;
        let names: Vec<String> = state
            .get("_data_files")
            .and_then(Json::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.get("filename").and_then(Json::as_str).map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        if names.is_empty() || names.iter().any(|n| n.contains('/') || n.contains("..")) {
            return Err(Error::invalid(
                &state_name,
                "its _data_files name no Arrow files in this folder",
            ));
        }
        let (mut files, mut first, mut nulls) = (Vec::new(), None::<ArrowSchema>, Vec::new());
        for n in names {
            let bytes = src.read(rt, &n)?;
            let name = src.name(&n);
            let (schema, got) = batches(&bytes, &name)?;
            match &first {
                Some(f) if f.fields() != schema.fields() => {
                    return Err(Error::invalid(name, "its columns differ from the first file's"))
                }
                Some(_) => {}
                None => {
                    nulls = vec![false; schema.fields().len()];
                    first = Some(schema);
                }
            }
            for b in &got {
                for (i, c) in b.columns().iter().enumerate() {
                    nulls[i] |= c.null_count() > 0;
                }
            }
            files.push(ArrowFile {
                name: n,
                rows: got.iter().map(|b| b.num_rows() as u64).sum(),
                bytes: bytes.len() as u64,
                checksum: xxhash_rust::xxh3::xxh3_64(&bytes),
            });
        }
        let arrow = first.expect("at least one file");
        let (mut cols, mut kinds) = (Vec::new(), Vec::new());
        for (f, &null) in arrow.fields().iter().zip(&nulls) {
            let kind = kind_of(f.data_type()).map_err(|why| {
                Error::invalid(
                    &src.display,
                    format!("column {:?} ({}): {why}", f.name(), f.data_type()),
                )
            })?;
            let ty = match kind {
                Kind::Int => ColumnType::Int64,
                Kind::Float => ColumnType::Float64,
                Kind::Str => ColumnType::Str,
                Kind::StrOrNull => ColumnType::Json,
                Kind::Bytes | Kind::Image => ColumnType::Bytes,
                Kind::List(d) => ColumnType::Array(
                    ramjet_engine::format::array::ArraySpec::parse(&format!("{}[?]", d.name())).expect("a 1-D array"),
                ),
            };
            let kind = if kind == Kind::Str && null {
                Kind::StrOrNull
            } else {
                kind
            };
            let ty = if kind == Kind::StrOrNull { ColumnType::Json } else { ty };
            cols.push(Column {
                name: f.name().clone(),
                ty,
                nullable: null && matches!(kind, Kind::Int | Kind::Float),
            });
            kinds.push(kind);
        }
        Ok(ArrowInput {
            files,
            schema: Schema::from_columns(cols)?,
            kinds,
            arrow,
        })
    }

    /// The names of the columns holding image files (Hugging Face's image struct).
    pub fn image_columns(&self) -> Vec<String> {
        self.schema
            .columns
            .iter()
            .zip(&self.kinds)
            .filter(|(_, k)| **k == Kind::Image)
            .map(|(c, _)| c.name.clone())
            .collect()
    }

    /// Rows `rows` of file `f`, each as values or an error naming it: the file is read again
    /// and must be the one first read (size and checksum).
    pub fn rows(
        &self,
        src: &Source,
        rt: &tokio::runtime::Runtime,
        f: usize,
        rows: std::ops::Range<u64>,
    ) -> Result<Vec<Result<Vec<Value>>>> {
        let file = &self.files[f];
        let name = src.name(&file.name);
        let bytes = src.read(rt, &file.name)?;
        let sum = xxhash_rust::xxh3::xxh3_64(&bytes);
        if bytes.len() as u64 != file.bytes || sum != file.checksum {
            return Err(Error::invalid(
                name,
                format!(
                    "changed since it was first read ({} bytes, xxh3 {:016x}; now {} bytes, {sum:016x})",
                    file.bytes,
                    file.checksum,
                    bytes.len()
                ),
            ));
        }
        let (schema, got) = batches(&bytes, &name)?;
        if schema.fields() != self.arrow.fields() {
            return Err(Error::invalid(name, "its columns differ from the first file's"));
        }
        let mut out = Vec::with_capacity((rows.end - rows.start) as usize);
        let mut at = 0u64;
        for b in &got {
            let n = b.num_rows() as u64;
            for r in rows.start.max(at)..rows.end.min(at + n) {
                let i = (r - at) as usize;
                let vals = b
                    .columns()
                    .iter()
                    .zip(&self.kinds)
                    .zip(&self.schema.columns)
                    .map(|((a, &k), c)| {
                        value(k, c.nullable, a, i).map_err(|why| {
                            Error::invalid(format!("{name} row {r}"), format!("column {:?}: {why}", c.name))
                        })
                    })
                    .collect();
                out.push(vals);
            }
            at += n;
        }
        Ok(out)
    }
}

/// The dtype of a primitive number type.
fn dtype_of(t: &DataType) -> Option<Dtype> {
    Some(match t {
        DataType::Int8 => Dtype::I8,
        DataType::Int16 => Dtype::I16,
        DataType::Int32 => Dtype::I32,
        DataType::Int64 => Dtype::I64,
        DataType::UInt8 => Dtype::U8,
        DataType::UInt16 => Dtype::U16,
        DataType::UInt32 => Dtype::U32,
        DataType::UInt64 => Dtype::U64,
        DataType::Float16 => Dtype::F16,
        DataType::Float32 => Dtype::F32,
        DataType::Float64 => Dtype::F64,
        _ => return None,
    })
}

/// How a field of type `t` is read, or why not.
fn kind_of(t: &DataType) -> std::result::Result<Kind, Invalid> {
    use DataType as D;
    Ok(match t {
        D::Boolean
        | D::Int8
        | D::Int16
        | D::Int32
        | D::Int64
        | D::UInt8
        | D::UInt16
        | D::UInt32
        | D::UInt64
        | D::Date32
        | D::Date64
        | D::Timestamp(..)
        | D::Time32(_)
        | D::Time64(_)
        | D::Duration(_) => Kind::Int,
        D::Float16 | D::Float32 | D::Float64 => Kind::Float,
        D::Utf8 | D::LargeUtf8 => Kind::Str,
        D::Binary | D::LargeBinary | D::FixedSizeBinary(_) => Kind::Bytes,
        D::Struct(fields) => {
            let names: Vec<&str> = fields.iter().map(|f| f.name().as_str()).collect();
            let bytes = fields.iter().find(|f| f.name() == "bytes");
            match bytes.map(|f| f.data_type()) {
                Some(D::Binary | D::LargeBinary) if names.len() == 2 && names.contains(&"path") => Kind::Image,
                _ => return Err("a struct other than Hugging Face's image {bytes, path} is not read".into()),
            }
        }
        D::List(f) | D::LargeList(f) | D::FixedSizeList(f, _) => match dtype_of(f.data_type()) {
            Some(d) => Kind::List(d),
            None => return Err("only lists of numbers are read (as arrays)".into()),
        },
        other => return Err(format!("{other} is not read").into()),
    })
}

/// Row `i` of array `a` as a value of `kind` (`nullable`: an int or float null is stored as the
/// column's null).
fn value(kind: Kind, nullable: bool, a: &ArrayRef, i: usize) -> std::result::Result<Value, Invalid> {
    if a.is_null(i) {
        return match kind {
            Kind::Int if nullable => Ok(Value::Int64(NULL_INT64)),
            Kind::Float if nullable => Ok(Value::Float64(f64::NAN)),
            Kind::StrOrNull => Ok(Value::Json("null".into())),
            Kind::Image => Err("a null image".into()),
            _ => Err("a null, in a column that holds none".into()),
        };
    }
    Ok(match kind {
        Kind::Int => {
            let v = int_at(a, i)?;
            if nullable && v == NULL_INT64 {
                return Err(format!("{v} is the value a null is stored as").into());
            }
            Value::Int64(v)
        }
        Kind::Float => Value::Float64(match num_at(a, i)? {
            Num::F(f) => f,
            Num::I(v) => v as f64,
            Num::U(v) => v as f64,
        }),
        Kind::Str => Value::Str(str_at(a, i)?.to_owned()),
        Kind::StrOrNull => Value::Json(Json::from(str_at(a, i)?).to_string()),
        Kind::Bytes => Value::Bytes(bytes_at(a, i)?.to_vec()),
        Kind::Image => {
            let s = a.as_struct();
            let b = s.column_by_name("bytes").ok_or("no bytes field")?;
            if b.is_null(i) {
                return Err(
                    "an image that is only a path (no bytes): load it with its bytes before save_to_disk".into(),
                );
            }
            Value::Bytes(bytes_at(b, i)?.to_vec())
        }
        Kind::List(d) => {
            let items = match a.data_type() {
                DataType::List(_) => a.as_list::<i32>().value(i),
                DataType::LargeList(_) => a.as_list::<i64>().value(i),
                DataType::FixedSizeList(..) => a.as_fixed_size_list().value(i),
                other => return Err(format!("{other} is not a list").into()),
            };
            let mut data = Vec::with_capacity(items.len() * d.size());
            for j in 0..items.len() {
                if items.is_null(j) {
                    return Err(format!("element {j} of the list is null").into());
                }
                d.push(num_at(&items, j)?, &mut data).map_err(|e| e.to_string())?;
            }
            Value::Array(Array::new(d, vec![items.len() as u64], data).map_err(|e| e.to_string())?)
        }
    })
}

/// An integer-like value (booleans, dates, times as their stored integers).
fn int_at(a: &ArrayRef, i: usize) -> std::result::Result<i64, Invalid> {
    use DataType as D;
    Ok(match a.data_type() {
        D::Boolean => a.as_boolean().value(i) as i64,
        D::Date32 => a.as_primitive::<Date32Type>().value(i) as i64,
        D::Date64 => a.as_primitive::<Date64Type>().value(i),
        D::Timestamp(u, _) => match u {
            arrow_schema::TimeUnit::Second => a.as_primitive::<TimestampSecondType>().value(i),
            arrow_schema::TimeUnit::Millisecond => a.as_primitive::<TimestampMillisecondType>().value(i),
            arrow_schema::TimeUnit::Microsecond => a.as_primitive::<TimestampMicrosecondType>().value(i),
            arrow_schema::TimeUnit::Nanosecond => a.as_primitive::<TimestampNanosecondType>().value(i),
        },
        D::Time32(arrow_schema::TimeUnit::Second) => a.as_primitive::<Time32SecondType>().value(i) as i64,
        D::Time32(_) => a.as_primitive::<Time32MillisecondType>().value(i) as i64,
        D::Time64(arrow_schema::TimeUnit::Microsecond) => a.as_primitive::<Time64MicrosecondType>().value(i),
        D::Time64(_) => a.as_primitive::<Time64NanosecondType>().value(i),
        D::Duration(u) => match u {
            arrow_schema::TimeUnit::Second => a.as_primitive::<DurationSecondType>().value(i),
            arrow_schema::TimeUnit::Millisecond => a.as_primitive::<DurationMillisecondType>().value(i),
            arrow_schema::TimeUnit::Microsecond => a.as_primitive::<DurationMicrosecondType>().value(i),
            arrow_schema::TimeUnit::Nanosecond => a.as_primitive::<DurationNanosecondType>().value(i),
        },
        _ => match num_at(a, i)? {
            Num::I(v) => v,
            Num::U(v) => i64::try_from(v).map_err(|_| format!("{v} does not fit int64"))?,
            Num::F(f) => return Err(format!("{f} is not an integer").into()),
        },
    })
}

/// A number of a primitive number array.
fn num_at(a: &ArrayRef, i: usize) -> std::result::Result<Num, Invalid> {
    use DataType as D;
    Ok(match a.data_type() {
        D::Int8 => Num::I(a.as_primitive::<Int8Type>().value(i) as i64),
        D::Int16 => Num::I(a.as_primitive::<Int16Type>().value(i) as i64),
        D::Int32 => Num::I(a.as_primitive::<Int32Type>().value(i) as i64),
        D::Int64 => Num::I(a.as_primitive::<Int64Type>().value(i)),
        D::UInt8 => Num::U(a.as_primitive::<UInt8Type>().value(i) as u64),
        D::UInt16 => Num::U(a.as_primitive::<UInt16Type>().value(i) as u64),
        D::UInt32 => Num::U(a.as_primitive::<UInt32Type>().value(i) as u64),
        D::UInt64 => Num::U(a.as_primitive::<UInt64Type>().value(i)),
        D::Float16 => Num::F(a.as_primitive::<Float16Type>().value(i).to_f64()),
        D::Float32 => Num::F(a.as_primitive::<Float32Type>().value(i) as f64),
        D::Float64 => Num::F(a.as_primitive::<Float64Type>().value(i)),
        other => return Err(format!("{other} is not a number").into()),
    })
}

fn str_at(a: &ArrayRef, i: usize) -> std::result::Result<&str, Invalid> {
    Ok(match a.data_type() {
        DataType::Utf8 => a.as_string::<i32>().value(i),
        DataType::LargeUtf8 => a.as_string::<i64>().value(i),
        other => return Err(format!("{other} is not a string").into()),
    })
}

fn bytes_at(a: &ArrayRef, i: usize) -> std::result::Result<&[u8], Invalid> {
    Ok(match a.data_type() {
        DataType::Binary => a.as_binary::<i32>().value(i),
        DataType::LargeBinary => a.as_binary::<i64>().value(i),
        DataType::FixedSizeBinary(_) => a.as_fixed_size_binary().value(i),
        other => return Err(format!("{other} is not binary").into()),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{BinaryArray, Int32Array, ListArray, StringArray, StructArray};
    use arrow_schema::{Field, Fields};

    use super::*;

    fn image_struct(bytes: Vec<Option<&[u8]>>) -> ArrayRef {
        let n = bytes.len();
        let fields = Fields::from(vec![
            Field::new("bytes", DataType::Binary, true),
            Field::new("path", DataType::Utf8, true),
        ]);
        let cols: Vec<ArrayRef> = vec![
            Arc::new(BinaryArray::from_opt_vec(bytes)),
            Arc::new(StringArray::from(vec![Some("a.jpg"); n])),
        ];
        Arc::new(StructArray::new(fields, cols, None))
    }

    #[test]
    fn hugging_faces_image_struct_is_bytes_and_other_structs_and_lists_are_refused() {
        let img = image_struct(vec![Some(b"\xff\xd8x"), None]);
        assert_eq!(kind_of(img.data_type()).unwrap(), Kind::Image);
        assert!(matches!(value(Kind::Image, false, &img, 0), Ok(Value::Bytes(b)) if b == b"\xff\xd8x"));
        assert!(value(Kind::Image, false, &img, 1).unwrap_err().contains("only a path"));
        let other = DataType::Struct(Fields::from(vec![Field::new("x", DataType::Int32, true)]));
        assert!(kind_of(&other).unwrap_err().contains("struct"));
        let strings = DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)));
        assert!(kind_of(&strings).unwrap_err().contains("lists of numbers"));
        let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        assert!(kind_of(&dict).unwrap_err().contains("not read"));
    }

    #[test]
    fn nulls_are_stored_only_where_the_column_holds_them_and_lists_become_arrays() {
        let ints: ArrayRef = Arc::new(Int32Array::from(vec![Some(7), None]));
        assert!(matches!(value(Kind::Int, true, &ints, 0), Ok(Value::Int64(7))));
        assert!(matches!(value(Kind::Int, true, &ints, 1), Ok(Value::Int64(NULL_INT64))));
        assert!(value(Kind::Int, false, &ints, 1).unwrap_err().contains("null"));
        let s: ArrayRef = Arc::new(StringArray::from(vec![Some("a\"b"), None]));
        assert!(matches!(value(Kind::StrOrNull, false, &s, 0), Ok(Value::Json(j)) if j == r#""a\"b""#));
        assert!(matches!(value(Kind::StrOrNull, false, &s, 1), Ok(Value::Json(j)) if j == "null"));
        let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(vec![
            Some(vec![Some(1), Some(-2)]),
            Some(vec![Some(3), None]),
        ]));
        assert_eq!(kind_of(lists.data_type()).unwrap(), Kind::List(Dtype::I32));
        let Ok(Value::Array(a)) = value(Kind::List(Dtype::I32), false, &lists, 0) else {
            panic!("a list of ints is an array")
        };
        assert_eq!(a.shape, vec![2]);
        assert_eq!(a.data, [1i32.to_le_bytes(), (-2i32).to_le_bytes()].concat());
        assert!(value(Kind::List(Dtype::I32), false, &lists, 1)
            .unwrap_err()
            .contains("element 1"));
    }
}
