//! NumPy's `.npy` files as arrays: what `ramjet pack` reads from `.npy`/`.npz` inputs and
//! WebDataset `.npy` members are.
//!
//! A file is `\x93NUMPY`, a version (1, 2 or 3), the header's length (`u16` for version 1,
//! `u32` after), a Python dict literal `{'descr': '<i4', 'fortran_order': False, 'shape':
//! (3, 4), }`, then the elements. Big-endian elements are swapped to little-endian and a
//! Fortran-order array is reordered row-major, so the result is always ramjet's layout.
//! Object arrays (`|O`, pickles) and structured dtypes are refused.

use super::array::{elements, Array, Dtype, RANK_MAX};
use crate::error::Invalid;

/// The first bytes of every `.npy` file.
pub const NPY_MAGIC: &[u8] = b"\x93NUMPY";
/// The longest header read (NumPy writes a few hundred bytes).
const HEADER_MAX: usize = 1 << 16;

/// Parses a whole `.npy` file into an array.
pub fn parse_npy(b: &[u8]) -> Result<Array, Invalid> {
    if !b.starts_with(NPY_MAGIC) || b.len() < 10 {
        return Err(Invalid::from("not a .npy file (no \\x93NUMPY magic)"));
    }
    let major = b[6];
    let (len, start) = match major {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 => {
            let h = b.get(8..12).ok_or("a .npy header cut short")?;
            (u32::from_le_bytes(h.try_into().expect("4 bytes")) as usize, 12)
        }
        v => return Err(Invalid::from(format!(".npy version {v} is not known"))),
    };
    if len > HEADER_MAX {
        return Err(Invalid::from(format!("a .npy header of {len} bytes")));
    }
    let header = b
        .get(start..start + len)
        .ok_or("a .npy header runs past the file's end")?;
    let header = std::str::from_utf8(header).map_err(|_| "a .npy header that is not text")?;
    let descr = dict_value(header, "descr").ok_or("a .npy header without 'descr'")?;
    let fortran = dict_value(header, "fortran_order").ok_or("a .npy header without 'fortran_order'")?;
    let shape = dict_value(header, "shape").ok_or("a .npy header without 'shape'")?;
    let descr = descr.trim().trim_matches(|c| c == '\'' || c == '"');
    let (big, dtype) = parse_descr(descr)?;
    let fortran = match fortran.trim() {
        "True" => true,
        "False" => false,
        f => return Err(Invalid::from(format!(".npy fortran_order {f:?}"))),
    };
    let shape = parse_shape(shape)?;
    let n = elements(&shape)?;
    let size = dtype.size();
    let want = n.checked_mul(size as u64).ok_or("a .npy shape too large")?;
    let data = &b[start + len..];
    if data.len() as u64 != want {
        return Err(Invalid::from(format!(
            ".npy of {} shape {shape:?} holds {} element bytes, {want} expected",
            dtype.name(),
            data.len()
        )));
    }
    let mut out = data.to_vec();
    if big && size > 1 {
        out.chunks_mut(size).for_each(<[u8]>::reverse);
    }
    if fortran && shape.len() > 1 {
        out = fortran_to_c(&out, &shape, size);
    }
    Array::new(dtype, shape, out)
}

/// `(big-endian, dtype)` of a NumPy type string such as `<f4`, `|u1`, `>i8`.
fn parse_descr(d: &str) -> Result<(bool, Dtype), Invalid> {
    // The byte order is the first character, whatever it is (a header is any UTF-8 text: a
    // split at byte 1 panicked inside a multi-byte character, found by tests/tests/fuzz_stable.rs).
    let mut chars = d.chars();
    let (order, code) = (chars.next(), chars.as_str());
    let big = match order {
        Some('<' | '|' | '=') => false,
        Some('>') => true,
        _ => return Err(Invalid::from(format!(".npy dtype {d:?} is not a plain number type"))),
    };
    let dtype = match code {
        "i1" | "b" => Dtype::I8,
        "i2" => Dtype::I16,
        "i4" => Dtype::I32,
        "i8" => Dtype::I64,
        "u1" | "B" => Dtype::U8,
        "u2" => Dtype::U16,
        "u4" => Dtype::U32,
        "u8" => Dtype::U64,
        "f2" => Dtype::F16,
        "f4" => Dtype::F32,
        "f8" => Dtype::F64,
        _ => {
            return Err(Invalid::from(format!(
            ".npy dtype {d:?} is not read (ints, uints and float16/32/64 are; objects and structured dtypes are not)"
        )))
        }
    };
    Ok((big, dtype))
}

/// The text of `key`'s value in a Python dict literal (up to the next top-level comma).
fn dict_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    let rest = rest.trim_start().strip_prefix(':')?;
    let mut depth = 0i32;
    for (i, c) in rest.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' | '}' if depth == 0 => return Some(&rest[..i]),
            _ => {}
        }
    }
    None
}

/// `(3, 4)`, `(5,)`, `()` as axes.
fn parse_shape(s: &str) -> Result<Vec<u64>, Invalid> {
    let inner = s
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| Invalid::from(format!(".npy shape {s:?} is not a tuple")))?;
    let shape: Vec<u64> = inner
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.trim_end_matches('L').parse::<u64>())
        .collect::<Result<_, _>>()
        .map_err(|_| Invalid::from(format!(".npy shape {s:?}")))?;
    if shape.len() > RANK_MAX {
        return Err(Invalid::from(format!(
            ".npy of {} axes, more than {RANK_MAX}",
            shape.len()
        )));
    }
    Ok(shape)
}

/// Column-major elements reordered row-major.
fn fortran_to_c(data: &[u8], shape: &[u64], size: usize) -> Vec<u8> {
    let rank = shape.len();
    // Fortran strides, in elements: the first axis varies fastest.
    let mut fstride = vec![1usize; rank];
    for a in 1..rank {
        fstride[a] = fstride[a - 1] * shape[a - 1] as usize;
    }
    let mut out = Vec::with_capacity(data.len());
    let mut idx = vec![0usize; rank];
    for _ in 0..data.len() / size {
        let src: usize = idx.iter().zip(&fstride).map(|(i, s)| i * s).sum();
        out.extend_from_slice(&data[src * size..(src + 1) * size]);
        // Next row-major index: the last axis varies fastest.
        for a in (0..rank).rev() {
            idx[a] += 1;
            if idx[a] < shape[a] as usize {
                break;
            }
            idx[a] = 0;
        }
    }
    out
}

/// The bytes of member `name` (`emb` or `emb.npy`) of a NumPy `.npz` file (a zip: stored or
/// deflated members, ZIP64 sizes as NumPy writes them), read through its central directory.
pub fn npz_member(zip: &[u8], name: &str) -> Result<Vec<u8>, Invalid> {
    let want = if name.ends_with(".npy") {
        name.to_owned()
    } else {
        format!("{name}.npy")
    };
    let mut found = Vec::new();
    for m in npz_members(zip)? {
        if m.name == want {
            return m.read(zip);
        }
        found.push(m.name.trim_end_matches(".npy").to_owned());
    }
    Err(Invalid::from(format!(
        "no array {name:?} in the .npz (it holds {found:?})"
    )))
}

/// One member of a zip, from its central directory entry.
struct ZipMember {
    name: String,
    method: u16,
    crc: u32,
    packed: u64,
    size: u64,
    local: u64,
}

fn le16(b: &[u8], at: usize) -> Result<u16, Invalid> {
    b.get(at..at + 2)
        .map(|x| u16::from_le_bytes([x[0], x[1]]))
        .ok_or_else(|| Invalid::from("a .npz cut short"))
}

fn le32(b: &[u8], at: usize) -> Result<u32, Invalid> {
    b.get(at..at + 4)
        .map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")))
        .ok_or_else(|| Invalid::from("a .npz cut short"))
}

fn le64(b: &[u8], at: usize) -> Result<u64, Invalid> {
    b.get(at..at + 8)
        .map(|x| u64::from_le_bytes(x.try_into().expect("8 bytes")))
        .ok_or_else(|| Invalid::from("a .npz cut short"))
}

/// The members listed by a zip's central directory.
fn npz_members(zip: &[u8]) -> Result<Vec<ZipMember>, Invalid> {
    const EOCD: u32 = 0x0605_4b50;
    const CDIR: u32 = 0x0201_4b50;
    let lowest = zip.len().saturating_sub(22 + 65_535);
    let eocd = (lowest..zip.len().saturating_sub(21))
        .rev()
        .find(|&i| le32(zip, i).ok() == Some(EOCD))
        .ok_or("not a .npz (no zip end record)")?;
    let count = le16(zip, eocd + 10)? as usize;
    let mut at = le32(zip, eocd + 16)? as usize;
    let mut out = Vec::with_capacity(count.min(4096));
    for _ in 0..count {
        if le32(zip, at)? != CDIR {
            return Err(Invalid::from("a .npz whose zip directory is damaged"));
        }
        let method = le16(zip, at + 10)?;
        let crc = le32(zip, at + 16)?;
        let (mut packed, mut size) = (le32(zip, at + 20)? as u64, le32(zip, at + 24)? as u64);
        let (n, e, c) = (
            le16(zip, at + 28)? as usize,
            le16(zip, at + 30)? as usize,
            le16(zip, at + 32)? as usize,
        );
        let mut local = le32(zip, at + 42)? as u64;
        let name = zip.get(at + 46..at + 46 + n).ok_or("a .npz cut short")?;
        let name = String::from_utf8_lossy(name).into_owned();
        // ZIP64: the sizes and offset that read 0xFFFFFFFF follow in the extra field 0x0001.
        let extra = zip.get(at + 46 + n..at + 46 + n + e).ok_or("a .npz cut short")?;
        let mut x = 0;
        while x + 4 <= extra.len() {
            let (id, len) = (le16(extra, x)?, le16(extra, x + 2)? as usize);
            if id == 1 {
                let mut f = x + 4;
                for v in [&mut size, &mut packed, &mut local] {
                    if *v == u32::MAX as u64 {
                        *v = le64(extra, f)?;
                        f += 8;
                    }
                }
            }
            x += 4 + len;
        }
        out.push(ZipMember {
            name,
            method,
            crc,
            packed,
            size,
            local,
        });
        at += 46 + n + e + c;
    }
    Ok(out)
}

impl ZipMember {
    /// The member's bytes, inflated when deflated.
    fn read(&self, zip: &[u8]) -> Result<Vec<u8>, Invalid> {
        const LOCAL: u32 = 0x0403_4b50;
        let at = usize::try_from(self.local).map_err(|_| "a .npz member offset too large")?;
        if le32(zip, at)? != LOCAL {
            return Err(Invalid::from(format!(
                "the .npz member {:?} has no local header",
                self.name
            )));
        }
        let start = at + 30 + le16(zip, at + 26)? as usize + le16(zip, at + 28)? as usize;
        let data = usize::try_from(self.packed)
            .ok()
            .and_then(|p| zip.get(start..start.checked_add(p)?))
            .ok_or_else(|| Invalid::from(format!("the .npz member {:?} runs past the file's end", self.name)))?;
        let out = match self.method {
            0 => data.to_vec(),
            8 => {
                use std::io::Read;
                let cap = usize::try_from(self.size).unwrap_or(0).min(1 << 30);
                let mut out = Vec::with_capacity(cap);
                flate2::read::DeflateDecoder::new(data)
                    .take(self.size)
                    .read_to_end(&mut out)
                    .map_err(|e| Invalid::from(format!("the .npz member {:?} does not inflate: {e}", self.name)))?;
                out
            }
            m => {
                return Err(Invalid::from(format!(
                    "the .npz member {:?} uses zip method {m} (stored and deflated are read)",
                    self.name
                )))
            }
        };
        if out.len() as u64 != self.size {
            return Err(Invalid::from(format!(
                "the .npz member {:?} holds {} bytes, its directory says {}",
                self.name,
                out.len(),
                self.size
            )));
        }
        let mut crc = flate2::Crc::new();
        crc.update(&out);
        if crc.sum() != self.crc {
            return Err(Invalid::from(format!(
                "the .npz member {:?} fails its CRC-32 ({:08x}, its directory says {:08x}): the file is damaged",
                self.name,
                crc.sum(),
                self.crc
            )));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(descr: &str, fortran: bool, shape: &str, data: &[u8]) -> Vec<u8> {
        let mut h = format!(
            "{{'descr': '{descr}', 'fortran_order': {}, 'shape': {shape}, }}",
            if fortran { "True" } else { "False" }
        );
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut b = NPY_MAGIC.to_vec();
        b.extend_from_slice(&[1, 0]);
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(data);
        b
    }

    #[test]
    fn npy_files_read_in_every_layout() {
        let a = parse_npy(&npy(
            "<i4",
            false,
            "(2, 3)",
            &(0..6i32).flat_map(i32::to_le_bytes).collect::<Vec<_>>(),
        ))
        .unwrap();
        assert_eq!((a.dtype, a.shape.clone()), (Dtype::I32, vec![2, 3]));
        assert_eq!(Dtype::I32.get(&a.data, 5), crate::format::array::Num::I(5));
        // Big-endian, swapped.
        let a = parse_npy(&npy(">u2", false, "(2,)", &[0, 1, 1, 0])).unwrap();
        assert_eq!(a.data, vec![1, 0, 0, 1]);
        // Fortran order [[0, 1, 2], [3, 4, 5]] is stored 0 3 1 4 2 5.
        let f: Vec<u8> = [0u8, 3, 1, 4, 2, 5].to_vec();
        let a = parse_npy(&npy("|u1", true, "(2, 3)", &f)).unwrap();
        assert_eq!(a.data, vec![0, 1, 2, 3, 4, 5]);
        // A scalar.
        let a = parse_npy(&npy("<f8", false, "()", &1.5f64.to_le_bytes())).unwrap();
        assert_eq!((a.shape.len(), a.data.len()), (0, 8));
    }

    #[test]
    fn bad_npy_files_say_why() {
        for (b, why) in [
            (b"not npy at all".to_vec(), "magic"),
            (npy("|O", false, "(1,)", &[0; 8]), "not read"),
            (npy("<i4", false, "(2,)", &[0; 7]), "element bytes"),
            (npy("<i4", false, "[2]", &[0; 8]), "not a tuple"),
            // A byte-order character of more than one byte (once a panic: a split at byte 1).
            (npy("\u{7b4}91", false, "(1,)", &[0; 8]), "not a plain number type"),
            (npy("", false, "(1,)", &[0; 8]), "not a plain number type"),
            (
                npy("<i4", false, "(99999999999, 99999999999, 99999999999)", &[0; 8]),
                "element",
            ),
        ] {
            let e = parse_npy(&b).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
        // Every truncation is an error, never a panic.
        let good = npy("<i2", false, "(3,)", &[1, 0, 2, 0, 3, 0]);
        for n in 0..good.len() {
            assert!(parse_npy(&good[..n]).is_err(), "cut at {n}");
        }
    }
}
