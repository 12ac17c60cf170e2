//! A Parquet file's schema as ramjet columns: each top-level field, by its physical and
//! converted type, is read as one [`Kind`] (`docs/format.md`, "Parquet"), and anything else is
//! refused naming the field.

use parquet::basic::{ConvertedType, LogicalType, Repetition, Type as Physical};
use parquet::file::metadata::ParquetMetaData;
use parquet::schema::types::Type;

use super::ForeignColumn;
use crate::error::Invalid;
use crate::format::array::{ArraySpec, Dtype};
use crate::format::{Column, ColumnType, Schema};

/// How one top-level Parquet field becomes a ramjet column's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Booleans, integers of every width and sign, dates, times and timestamps (their
    /// stored integers): `int64`.
    Int,
    /// Half, single and double floats: `float64`.
    Float,
    /// UTF-8 strings (and enums): `str`.
    Str,
    /// UTF-8 strings, some null: `json`, each value a JSON string or `null`.
    StrOrNull,
    /// JSON documents: `json`.
    Json,
    /// Binary and fixed-size binary values: `bytes`.
    Bytes,
    /// Hugging Face's image (and audio) struct, `{bytes, path}`: its `bytes`, as `bytes`.
    Image,
    /// A list of numbers: a one-dimensional array of this dtype.
    List(Dtype),
}

impl Kind {
    /// The name in a manifest's foreign column ([`ForeignColumn::encoding`]).
    pub fn name(self) -> String {
        match self {
            Kind::Int => "int".into(),
            Kind::Float => "float".into(),
            Kind::Str => "str".into(),
            Kind::StrOrNull => "str-or-null".into(),
            Kind::Json => "json".into(),
            Kind::Bytes => "bytes".into(),
            Kind::Image => "image".into(),
            Kind::List(d) => format!("list:{}", d.name()),
        }
    }

    /// The kind called `name` ([`Kind::name`]).
    pub fn parse(name: &str) -> Option<Kind> {
        Some(match name {
            "int" => Kind::Int,
            "float" => Kind::Float,
            "str" => Kind::Str,
            "str-or-null" => Kind::StrOrNull,
            "json" => Kind::Json,
            "bytes" => Kind::Bytes,
            "image" => Kind::Image,
            other => Kind::List(Dtype::parse(other.strip_prefix("list:")?)?),
        })
    }

    /// The ramjet column type its values are.
    fn column_type(self) -> ColumnType {
        match self {
            Kind::Int => ColumnType::Int64,
            Kind::Float => ColumnType::Float64,
            Kind::Str => ColumnType::Str,
            Kind::StrOrNull | Kind::Json => ColumnType::Json,
            Kind::Bytes | Kind::Image => ColumnType::Bytes,
            Kind::List(d) => ColumnType::Array(ArraySpec::parse(&format!("{}[?]", d.name())).expect("a 1-D array")),
        }
    }
}

/// The kind a primitive field of this physical and converted type is read as, or why not.
fn primitive_kind(t: &Type) -> Result<Kind, Invalid> {
    let info = t.get_basic_info();
    let float16 = matches!(info.logical_type_ref(), Some(LogicalType::Float16));
    Ok(match (t.get_physical_type(), info.converted_type()) {
        (_, ConvertedType::DECIMAL) => return Err("decimals are not read (cast them to float64 or int64)".into()),
        (Physical::INT96, _) => return Err("INT96 timestamps are not read (write timestamps as INT64)".into()),
        (Physical::BOOLEAN | Physical::INT32 | Physical::INT64, _) => Kind::Int,
        (Physical::FLOAT | Physical::DOUBLE, _) => Kind::Float,
        (Physical::FIXED_LEN_BYTE_ARRAY, _) if float16 => Kind::Float,
        (Physical::BYTE_ARRAY, ConvertedType::UTF8 | ConvertedType::ENUM) => Kind::Str,
        (Physical::BYTE_ARRAY, ConvertedType::JSON) => Kind::Json,
        (Physical::BYTE_ARRAY | Physical::FIXED_LEN_BYTE_ARRAY, ConvertedType::NONE | ConvertedType::BSON) => {
            Kind::Bytes
        }
        (p, c) => return Err(format!("{p} values of converted type {c} are not read").into()),
    })
}

/// The dtype of a list's numeric element, or why it is not one.
fn element_dtype(t: &Type) -> Result<Dtype, Invalid> {
    if !t.is_primitive() {
        return Err("a list of lists or structs is not read (a list of numbers is)".into());
    }
    let info = t.get_basic_info();
    if matches!(info.logical_type_ref(), Some(LogicalType::Float16)) {
        return Ok(Dtype::F16);
    }
    Ok(match (t.get_physical_type(), info.converted_type()) {
        (Physical::BOOLEAN, _) => Dtype::U8,
        (Physical::INT32, ConvertedType::INT_8) => Dtype::I8,
        (Physical::INT32, ConvertedType::INT_16) => Dtype::I16,
        (Physical::INT32, ConvertedType::UINT_8) => Dtype::U8,
        (Physical::INT32, ConvertedType::UINT_16) => Dtype::U16,
        (Physical::INT32, ConvertedType::UINT_32) => Dtype::U32,
        (Physical::INT32, ConvertedType::NONE | ConvertedType::INT_32 | ConvertedType::DATE) => Dtype::I32,
        (Physical::INT64, ConvertedType::UINT_64) => Dtype::U64,
        (Physical::INT64, c) if c != ConvertedType::DECIMAL => Dtype::I64,
        (Physical::FLOAT, _) => Dtype::F32,
        (Physical::DOUBLE, _) => Dtype::F64,
        (p, c) => return Err(format!("a list of {p} ({c}) is not a list of numbers").into()),
    })
}

/// The kind a top-level field is read as, and whether it may hold nulls by its repetition.
fn field_kind(t: &Type) -> Result<Kind, Invalid> {
    let info = t.get_basic_info();
    if info.repetition() == Repetition::REPEATED {
        // A repeated field outside a LIST group (the legacy two-level list).
        return Ok(Kind::List(element_dtype(t)?));
    }
    if t.is_primitive() {
        return primitive_kind(t);
    }
    let fields = t.get_fields();
    let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
    if info.converted_type() == ConvertedType::LIST || matches!(info.logical_type_ref(), Some(LogicalType::List)) {
        let [rep] = fields else {
            return Err("a LIST group with more than one child".into());
        };
        // Three levels (`list.element`), or two (the repeated field is the element).
        let element = match rep.is_group() {
            true if rep.get_fields().len() == 1 => &rep.get_fields()[0],
            true => return Err("a list of structs is not read (a list of numbers is)".into()),
            false => rep,
        };
        return Ok(Kind::List(element_dtype(element)?));
    }
    if names.len() == 2 && names.contains(&"bytes") && names.contains(&"path") {
        let bytes = fields.iter().find(|f| f.name() == "bytes").expect("named above");
        if bytes.is_primitive() && bytes.get_physical_type() == Physical::BYTE_ARRAY {
            return Ok(Kind::Image);
        }
    }
    Err(format!(
        "a struct ({}) is not read (Hugging Face's image struct, {{bytes, path}}, is)",
        names.join(", ")
    )
    .into())
}

/// Whether the field may hold a null in some row group of `files`: it is not required, and a
/// column chunk under it counts nulls (or does not say).
fn holds_nulls(root: usize, files: &[&ParquetMetaData]) -> bool {
    files.iter().any(|m| {
        let schema = m.file_metadata().schema_descr();
        m.row_groups().iter().any(|rg| {
            rg.columns().iter().enumerate().any(|(leaf, c)| {
                schema.get_column_root_idx(leaf) == root
                    && c.statistics().is_none_or(|s| s.null_count_opt().is_none_or(|n| n > 0))
            })
        })
    })
}

/// The columns of a Parquet dataset whose files' footers are `files` (the first one's schema,
/// which the caller checks every file shares): each top-level field's kind, and the ramjet
/// schema (an `int` or `float` field that holds a null is nullable; a `str` one is read as
/// `str-or-null`). A field that is not read is an error naming it.
pub fn columns(files: &[&ParquetMetaData]) -> Result<(Vec<ForeignColumn>, Schema), Invalid> {
    let first = files.first().ok_or("no Parquet files")?;
    let root = first.file_metadata().schema_descr().root_schema();
    let (mut foreign, mut cols) = (Vec::new(), Vec::new());
    for (i, f) in root.get_fields().iter().enumerate() {
        let mut kind = field_kind(f).map_err(|r| format!("field {:?}: {r}", f.name()))?;
        let nulls = f.is_optional() && holds_nulls(i, files);
        if kind == Kind::Str && nulls {
            kind = Kind::StrOrNull;
        }
        foreign.push(ForeignColumn {
            name: f.name().to_owned(),
            encoding: kind.name(),
            size: None,
        });
        cols.push(Column {
            name: f.name().to_owned(),
            ty: kind.column_type(),
            nullable: nulls && matches!(kind, Kind::Int | Kind::Float),
        });
    }
    let schema = Schema::from_columns(cols).map_err(|e| e.to_string())?;
    Ok((foreign, schema))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_by_name() {
        for k in [
            Kind::Int,
            Kind::Float,
            Kind::Str,
            Kind::StrOrNull,
            Kind::Json,
            Kind::Bytes,
            Kind::Image,
            Kind::List(Dtype::F32),
        ] {
            assert_eq!(Kind::parse(&k.name()), Some(k));
        }
        assert_eq!(Kind::parse("list:complex64"), None);
    }

    #[test]
    fn fields_read_by_type_and_the_rest_are_refused() {
        let parse = |text: &str| parquet::schema::parser::parse_message_type(text).unwrap();
        let t = parse(
            "message m { required int32 a (INT_8); optional binary s (UTF8); optional binary b;
             optional group img { optional binary bytes; optional binary path (UTF8); }
             optional group v (LIST) { repeated group list { optional float element; } }
             optional fixed_len_byte_array(16) d (DECIMAL(30, 2)); optional int96 t; }",
        );
        let kinds: Vec<Result<Kind, Invalid>> = t.get_fields().iter().map(|f| field_kind(f)).collect();
        assert_eq!(kinds[0], Ok(Kind::Int));
        assert_eq!(kinds[1], Ok(Kind::Str));
        assert_eq!(kinds[2], Ok(Kind::Bytes));
        assert_eq!(kinds[3], Ok(Kind::Image));
        assert_eq!(kinds[4], Ok(Kind::List(Dtype::F32)));
        assert!(kinds[5].as_ref().unwrap_err().contains("decimals"));
        assert!(kinds[6].as_ref().unwrap_err().contains("INT96"));
        let s = parse("message m { optional group s { optional int32 x; } }");
        assert!(field_kind(&s.get_fields()[0]).unwrap_err().contains("struct (x)"));
    }
}
