//! WebDataset: tar shards, samples grouped by key.

use super::ForeignColumn;
use crate::error::{Error, Location, Result};
use crate::format::array::ArraySpec;
use crate::format::npy::parse_npy;
use crate::format::{ColumnType, Schema, Value};

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

/// The columns of samples with these extensions: `__key__`, then one column per extension,
/// sorted: `any[*]` arrays for `.npy` members, `bytes` for the others.
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
        let ty = if e == NPY_EXT {
            ColumnType::Array(ArraySpec::parse("any[*]").expect("valid"))
        } else {
            ColumnType::Bytes
        };
        schema.push((e.clone(), ty));
    }
    Ok((cols, Schema::new(schema)?))
}

/// The extension whose members are read as arrays.
pub const NPY_EXT: &str = "npy";

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
        let bytes = &tar[r.clone()];
        if c.encoding == NPY_EXT {
            let a = parse_npy(bytes).map_err(|reason| {
                Error::corrupt(
                    at.clone(),
                    format!("sample {:?}: member {:?}: {reason}", s.key, c.encoding),
                )
            })?;
            out.push(Value::Array(a));
            continue;
        }
        out.push(Value::Bytes(bytes.to_vec()));
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
