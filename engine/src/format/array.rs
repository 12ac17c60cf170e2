//! Typed array columns: the element types, the declared shape, and one sample's encoding.
//!
//! A column's type is written `DTYPE[DIMS]`: `int32[?]` (one axis of any length: a token
//! array), `float32[768]` (fixed), `float32[?,4]` (boxes), `uint8[*]` (any rank and shape).
//! `int32[]` is read as `int32[?]`. `any[*]` (only from foreign datasets whose arrays state
//! their own element type per sample, MDS `ndarray` and WebDataset `.npy`) takes any dtype.
//!
//! Every value carries its own dtype and shape, so a record is self-describing and checked
//! against the column's declaration on read: `u8` dtype code, `u8` rank, 6 zero bytes, `rank`
//! `u64` little-endian dimensions, then the elements, little-endian, row-major. See
//! `docs/format.md`.

use crate::error::Invalid;

/// Most axes an array may have (NumPy's limit is 64; MosaicML's 63).
pub const RANK_MAX: usize = 32;
/// Bytes before an array value's dimensions.
pub const ARRAY_HEAD: usize = 8;

/// An element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// int8.
    I8,
    /// int16.
    I16,
    /// int32.
    I32,
    /// int64.
    I64,
    /// uint8.
    U8,
    /// uint16.
    U16,
    /// uint32.
    U32,
    /// uint64.
    U64,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// float32.
    F32,
    /// float64.
    F64,
}

/// Every dtype, in code order (a value's dtype byte is its index here).
pub const DTYPES: [Dtype; 12] = [
    Dtype::I8,
    Dtype::I16,
    Dtype::I32,
    Dtype::I64,
    Dtype::U8,
    Dtype::U16,
    Dtype::U32,
    Dtype::U64,
    Dtype::F16,
    Dtype::Bf16,
    Dtype::F32,
    Dtype::F64,
];

impl Dtype {
    /// Name in type strings, NumPy's and torch's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::I8 => "int8",
            Dtype::I16 => "int16",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
            Dtype::U8 => "uint8",
            Dtype::U16 => "uint16",
            Dtype::U32 => "uint32",
            Dtype::U64 => "uint64",
            Dtype::F16 => "float16",
            Dtype::Bf16 => "bfloat16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
        }
    }

    /// The dtype called `name` (also NumPy's short forms `f4`, `i8`, ...).
    pub fn parse(name: &str) -> Option<Dtype> {
        let n = match name {
            "f2" | "half" => "float16",
            "f4" | "float" => "float32",
            "f8" | "double" => "float64",
            "i1" => "int8",
            "i2" => "int16",
            "i4" => "int32",
            "i8" => "int64",
            "u1" => "uint8",
            "u2" => "uint16",
            "u4" => "uint32",
            "u8" => "uint64",
            other => other,
        };
        DTYPES.iter().copied().find(|d| d.name() == n)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::I8 | Dtype::U8 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    /// The code stored in each value.
    pub fn code(self) -> u8 {
        DTYPES.iter().position(|&d| d == self).expect("listed") as u8
    }

    /// The dtype of a stored code.
    pub fn from_code(code: u8) -> Option<Dtype> {
        DTYPES.get(code as usize).copied()
    }

    /// Whether the elements are integers.
    pub fn is_int(self) -> bool {
        !matches!(self, Dtype::F16 | Dtype::Bf16 | Dtype::F32 | Dtype::F64)
    }

    /// Appends `x` as one element, little-endian. Integers must be whole and in range; a
    /// float is rounded to the nearest value of a narrower float type.
    pub fn push(self, x: Num, out: &mut Vec<u8>) -> Result<(), Invalid> {
        let int = |lo: i128, hi: i128| -> Result<i128, Invalid> {
            let v = match x {
                Num::I(v) => v as i128,
                Num::U(v) => v as i128,
                Num::F(f) if f.fract() == 0.0 && f.is_finite() => f as i128,
                Num::F(f) => return Err(Invalid::from(format!("{f} is not an integer ({})", self.name()))),
            };
            if v < lo || v > hi {
                return Err(Invalid::from(format!("{v} is out of range for {}", self.name())));
            }
            Ok(v)
        };
        let f = || match x {
            Num::I(v) => v as f64,
            Num::U(v) => v as f64,
            Num::F(f) => f,
        };
        match self {
            Dtype::I8 => out.extend_from_slice(&(int(i8::MIN as i128, i8::MAX as i128)? as i8).to_le_bytes()),
            Dtype::I16 => out.extend_from_slice(&(int(i16::MIN as i128, i16::MAX as i128)? as i16).to_le_bytes()),
            Dtype::I32 => out.extend_from_slice(&(int(i32::MIN as i128, i32::MAX as i128)? as i32).to_le_bytes()),
            Dtype::I64 => out.extend_from_slice(&(int(i64::MIN as i128, i64::MAX as i128)? as i64).to_le_bytes()),
            Dtype::U8 => out.push(int(0, u8::MAX as i128)? as u8),
            Dtype::U16 => out.extend_from_slice(&(int(0, u16::MAX as i128)? as u16).to_le_bytes()),
            Dtype::U32 => out.extend_from_slice(&(int(0, u32::MAX as i128)? as u32).to_le_bytes()),
            Dtype::U64 => out.extend_from_slice(&(int(0, u64::MAX as i128)? as u64).to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&half::f16::from_f64(f()).to_le_bytes()),
            Dtype::Bf16 => out.extend_from_slice(&half::bf16::from_f64(f()).to_le_bytes()),
            Dtype::F32 => out.extend_from_slice(&(f() as f32).to_le_bytes()),
            Dtype::F64 => out.extend_from_slice(&f().to_le_bytes()),
        }
        Ok(())
    }

    /// Element `i` of `data` (little-endian elements of this dtype) as a number.
    pub fn get(self, data: &[u8], i: usize) -> Num {
        let b = &data[i * self.size()..(i + 1) * self.size()];
        let a = |n: usize| -> [u8; 8] {
            let mut x = [0u8; 8];
            x[..n].copy_from_slice(&b[..n]);
            x
        };
        match self {
            Dtype::I8 => Num::I(b[0] as i8 as i64),
            Dtype::I16 => Num::I(i16::from_le_bytes([b[0], b[1]]) as i64),
            Dtype::I32 => Num::I(i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64),
            Dtype::I64 => Num::I(i64::from_le_bytes(a(8))),
            Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 => Num::U(u64::from_le_bytes(a(self.size()))),
            Dtype::F16 => Num::F(half::f16::from_le_bytes([b[0], b[1]]).to_f64()),
            Dtype::Bf16 => Num::F(half::bf16::from_le_bytes([b[0], b[1]]).to_f64()),
            Dtype::F32 => Num::F(f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64),
            Dtype::F64 => Num::F(f64::from_le_bytes(a(8))),
        }
    }
}

/// A number on its way into or out of an array.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Num {
    /// Signed integer.
    I(i64),
    /// Unsigned integer.
    U(u64),
    /// Float.
    F(f64),
}

/// Most axes a column may declare (a value of a `[*]` column may have up to [`RANK_MAX`]).
pub const DECLARED_RANK_MAX: usize = 8;
/// A declared axis that is free (`?`).
pub const FREE: u32 = u32::MAX;

/// A column's declared shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dims {
    /// Any rank, any dimensions (`[*]`).
    Any,
    /// This rank; each axis fixed, or [`FREE`] (written `?`).
    Rank {
        /// Number of axes.
        rank: u8,
        /// The first `rank` entries are the axes.
        dims: [u32; DECLARED_RANK_MAX],
    },
}

impl Dims {
    /// Axis `i` of a declared rank: its length, `None` when free.
    pub fn axis(dims: &[u32; DECLARED_RANK_MAX], i: usize) -> Option<u64> {
        (dims[i] != FREE).then_some(dims[i] as u64)
    }
}

/// An array column's declaration: element type (`None`: any, per value) and shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArraySpec {
    /// Element type; `None` is `any` (each value states its own).
    pub dtype: Option<Dtype>,
    /// Shape.
    pub dims: Dims,
}

impl ArraySpec {
    /// Parses `DTYPE[DIMS]` (see the module documentation).
    pub fn parse(text: &str) -> Result<ArraySpec, Invalid> {
        let bad = |why: &str| {
            Invalid::from(format!(
                "array type {text:?}: {why} (write DTYPE[DIMS], e.g. int32[?], float32[768], float32[?,4], uint8[*])"
            ))
        };
        let (dt, rest) = text.split_once('[').ok_or_else(|| bad("no '['"))?;
        let inner = rest.strip_suffix(']').ok_or_else(|| bad("no closing ']'"))?;
        let dtype = match dt.trim() {
            "any" => None,
            d => Some(Dtype::parse(d).ok_or_else(|| bad(&format!("unknown dtype {d:?}")))?),
        };
        let inner = inner.trim();
        let dims = if inner == "*" {
            Dims::Any
        } else if inner.is_empty() {
            Dims::Rank {
                rank: 1,
                dims: [FREE; DECLARED_RANK_MAX],
            }
        } else {
            let parts: Vec<&str> = inner.split(',').map(str::trim).collect();
            if parts.len() > DECLARED_RANK_MAX {
                return Err(bad(&format!(
                    "more than {DECLARED_RANK_MAX} axes (declare [*] for more)"
                )));
            }
            let mut dims = [FREE; DECLARED_RANK_MAX];
            for (i, p) in parts.iter().enumerate() {
                dims[i] = match *p {
                    "?" => FREE,
                    n => n
                        .parse::<u32>()
                        .ok()
                        .filter(|&x| x != FREE)
                        .ok_or_else(|| bad(&format!("axis {i} is {n:?}, not a length below 2^32 - 1 or '?'")))?,
                };
            }
            Dims::Rank {
                rank: parts.len() as u8,
                dims,
            }
        };
        Ok(ArraySpec { dtype, dims })
    }

    /// Canonical text: `int32[?]`, `float32[?,4]`, `any[*]`.
    pub fn text(&self) -> String {
        let dt = self.dtype.map_or("any", Dtype::name);
        let dims = match self.dims {
            Dims::Any => "*".to_owned(),
            Dims::Rank { rank, dims } => (0..rank as usize)
                .map(|i| Dims::axis(&dims, i).map_or("?".to_owned(), |n| n.to_string()))
                .collect::<Vec<_>>()
                .join(","),
        };
        format!("{dt}[{dims}]")
    }

    /// The fixed shape, when every axis is fixed.
    pub fn fixed_shape(&self) -> Option<Vec<u64>> {
        match self.dims {
            Dims::Any => None,
            Dims::Rank { rank, dims } => (0..rank as usize).map(|i| Dims::axis(&dims, i)).collect(),
        }
    }

    /// Checks a value's dtype and shape against this declaration.
    pub fn check(&self, dtype: Dtype, shape: &[u64]) -> Result<(), Invalid> {
        if let Some(d) = self.dtype {
            if d != dtype {
                return Err(Invalid::from(format!(
                    "the value is {}, the column {}",
                    dtype.name(),
                    self.text()
                )));
            }
        }
        if let Dims::Rank { rank, dims } = self.dims {
            let fits = shape.len() == rank as usize
                && shape
                    .iter()
                    .enumerate()
                    .all(|(i, &s)| Dims::axis(&dims, i).is_none_or(|d| d == s));
            if !fits {
                return Err(Invalid::from(format!(
                    "the value's shape is {shape:?}, the column {}",
                    self.text()
                )));
            }
        }
        if shape.len() > RANK_MAX {
            return Err(Invalid::from(format!("{} axes, more than {RANK_MAX}", shape.len())));
        }
        Ok(())
    }
}

/// Number of elements of `shape`, or why it overflows.
pub fn elements(shape: &[u64]) -> Result<u64, Invalid> {
    shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Invalid::from(format!("shape {shape:?} has more elements than fit 64 bits")))
}

/// An owned array value.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    /// Element type.
    pub dtype: Dtype,
    /// Axes.
    pub shape: Vec<u64>,
    /// Elements, little-endian, row-major: `elements(shape) * dtype.size()` bytes.
    pub data: Vec<u8>,
}

impl Array {
    /// An array, checked: `data` holds exactly the elements of `shape`.
    pub fn new(dtype: Dtype, shape: Vec<u64>, data: Vec<u8>) -> Result<Array, Invalid> {
        let want = elements(&shape)?.checked_mul(dtype.size() as u64);
        if want != Some(data.len() as u64) {
            return Err(Invalid::from(format!(
                "{} bytes for a {} array of shape {shape:?} ({} bytes expected)",
                data.len(),
                dtype.name(),
                want.map_or("too many".to_owned(), |w| w.to_string())
            )));
        }
        if shape.len() > RANK_MAX {
            return Err(Invalid::from(format!("{} axes, more than {RANK_MAX}", shape.len())));
        }
        Ok(Array { dtype, shape, data })
    }

    /// Encoded length (without the record's `u64` length prefix).
    pub fn encoded_len(&self) -> u64 {
        (ARRAY_HEAD + 8 * self.shape.len() + self.data.len()) as u64
    }

    /// Appends the encoding (without the length prefix).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.dtype.code());
        out.push(self.shape.len() as u8);
        out.extend_from_slice(&[0u8; ARRAY_HEAD - 2]);
        for d in &self.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&self.data);
    }
}

/// A borrowed array value: read from a record, or lent by an owned [`Array`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArrayRef<'a> {
    /// Element type.
    pub dtype: Dtype,
    /// The dimensions.
    dims: DimsRef<'a>,
    /// The elements.
    pub data: &'a [u8],
}

/// Where an [`ArrayRef`]'s dimensions are.
#[derive(Debug, Clone, Copy, PartialEq)]
enum DimsRef<'a> {
    /// As stored: `u64` little-endian each.
    Le(&'a [u8]),
    /// An owned array's.
    Slice(&'a [u64]),
}

impl Array {
    /// Borrowed view.
    pub fn as_array_ref(&self) -> ArrayRef<'_> {
        ArrayRef {
            dtype: self.dtype,
            dims: DimsRef::Slice(&self.shape),
            data: &self.data,
        }
    }
}

impl<'a> ArrayRef<'a> {
    /// Parses an encoded value and checks it against `spec`.
    pub fn parse(b: &'a [u8], spec: &ArraySpec) -> Result<ArrayRef<'a>, Invalid> {
        if b.len() < ARRAY_HEAD {
            return Err(Invalid::from(format!(
                "an array value of {} bytes has no header",
                b.len()
            )));
        }
        let dtype = Dtype::from_code(b[0]).ok_or_else(|| Invalid::from(format!("unknown dtype code {}", b[0])))?;
        let rank = b[1] as usize;
        if rank > RANK_MAX || b[2..ARRAY_HEAD].iter().any(|&x| x != 0) {
            return Err(Invalid::from(format!("bad array header {:?}", &b[..ARRAY_HEAD])));
        }
        let dims_end = ARRAY_HEAD + 8 * rank;
        let dims = b
            .get(ARRAY_HEAD..dims_end)
            .ok_or_else(|| Invalid::from(format!("an array value of {} bytes ends in its shape", b.len())))?;
        let a = ArrayRef {
            dtype,
            dims: DimsRef::Le(dims),
            data: &b[dims_end..],
        };
        let shape = a.shape();
        let want = elements(&shape)?.checked_mul(dtype.size() as u64);
        if want != Some(a.data.len() as u64) {
            return Err(Invalid::from(format!(
                "{} element bytes for a {} array of shape {shape:?}",
                a.data.len(),
                dtype.name()
            )));
        }
        spec.check(dtype, &shape)?;
        Ok(a)
    }

    /// Number of axes.
    pub fn rank(&self) -> usize {
        match self.dims {
            DimsRef::Le(b) => b.len() / 8,
            DimsRef::Slice(s) => s.len(),
        }
    }

    /// Axis `i`.
    pub fn dim(&self, i: usize) -> u64 {
        match self.dims {
            DimsRef::Le(b) => u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes")),
            DimsRef::Slice(s) => s[i],
        }
    }

    /// The shape.
    pub fn shape(&self) -> Vec<u64> {
        (0..self.rank()).map(|i| self.dim(i)).collect()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Owned copy.
    pub fn to_owned_array(&self) -> Array {
        Array {
            dtype: self.dtype,
            shape: self.shape(),
            data: self.data.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_strings_round_trip_and_bad_ones_say_why() {
        for t in [
            "int32[?]",
            "float32[768]",
            "float32[?,4]",
            "uint8[*]",
            "any[*]",
            "bfloat16[2,3,4]",
        ] {
            assert_eq!(ArraySpec::parse(t).unwrap().text(), t);
        }
        assert_eq!(ArraySpec::parse("int32[]").unwrap().text(), "int32[?]");
        assert_eq!(ArraySpec::parse("f4[3]").unwrap().text(), "float32[3]");
        for (t, why) in [
            ("int32", "no '['"),
            ("int33[?]", "unknown dtype"),
            ("int32[x]", "axis 0"),
            ("int32[?", "closing"),
        ] {
            let e = ArraySpec::parse(t).unwrap_err().to_string();
            assert!(e.contains(why), "{t}: {e}");
        }
    }

    #[test]
    fn values_are_checked_against_their_column() {
        let spec = ArraySpec::parse("float32[?,2]").unwrap();
        let a = Array::new(Dtype::F32, vec![3, 2], vec![0; 24]).unwrap();
        let mut b = Vec::new();
        a.encode(&mut b);
        assert_eq!(b.len() as u64, a.encoded_len());
        let r = ArrayRef::parse(&b, &spec).unwrap();
        assert_eq!((r.shape(), r.len()), (vec![3, 2], 6));
        assert_eq!(r.to_owned_array(), a);
        let e = ArrayRef::parse(&b, &ArraySpec::parse("float32[?,3]").unwrap()).unwrap_err();
        assert!(e.to_string().contains("shape is [3, 2]"), "{e}");
        let e = ArrayRef::parse(&b, &ArraySpec::parse("int32[*]").unwrap()).unwrap_err();
        assert!(e.to_string().contains("float32"), "{e}");
        // A lying shape or a cut value is refused.
        let mut lie = b.clone();
        lie[ARRAY_HEAD] = 4;
        assert!(ArrayRef::parse(&lie, &spec).is_err());
        assert!(ArrayRef::parse(&b[..b.len() - 1], &spec).is_err());
        assert!(ArrayRef::parse(&b[..5], &spec).is_err());
        let mut huge = b.clone();
        huge[ARRAY_HEAD..ARRAY_HEAD + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(ArrayRef::parse(&huge, &spec).is_err());
        assert!(Array::new(Dtype::I32, vec![2], vec![0; 7]).is_err());
    }

    #[test]
    fn numbers_are_range_checked_and_rounded_to_their_dtype() {
        let mut out = Vec::new();
        Dtype::U8.push(Num::I(255), &mut out).unwrap();
        assert!(Dtype::U8.push(Num::I(256), &mut out).is_err());
        assert!(Dtype::I8.push(Num::I(-129), &mut out).is_err());
        assert!(Dtype::I32.push(Num::F(1.5), &mut out).is_err());
        Dtype::I32.push(Num::F(7.0), &mut out).unwrap();
        Dtype::U64.push(Num::U(u64::MAX), &mut out).unwrap();
        Dtype::Bf16.push(Num::F(1.0), &mut out).unwrap();
        Dtype::F16.push(Num::F(0.5), &mut out).unwrap();
        assert_eq!(Dtype::U8.get(&out, 0), Num::U(255));
        assert_eq!(Dtype::I32.get(&out[1..], 0), Num::I(7));
        assert_eq!(Dtype::U64.get(&out[5..], 0), Num::U(u64::MAX));
        assert_eq!(Dtype::Bf16.get(&out[13..], 0), Num::F(1.0));
        assert_eq!(Dtype::F16.get(&out[15..], 0), Num::F(0.5));
    }
}
