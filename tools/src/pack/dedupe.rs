//! `ramjet pack --dedupe KEY|content`: later duplicates dropped, the same whether one machine
//! packs or a thousand tasks do.
//!
//! Each sample's key (xxh3-64 of a column's value, or of the image bytes for `content`) is
//! computed where the sample is packed and kept with its group (a split pack writes them in
//! the group's part). After every group is packed, one pass in input order marks each sample
//! whose key an earlier sample had, and the manifest names the list of those samples
//! (`excluded/<checksum>.u64`: their global indices, ascending, u64 little-endian) in
//! `meta.dedupe`. The loader leaves them out of the order (`engine/src/stream/select.rs`), so
//! `len()`, every rank and every resume see the dataset without them; their bytes stay in the
//! shards, which are packed before the duplicates across groups are known.

use std::collections::HashSet;

use bytes::Bytes;
use serde_json::{json, Map, Value as Json};

use ramjet_engine::format::{ColumnType, Schema, Value};
use ramjet_engine::{Error, Result, Store};

/// What `--dedupe` compares: a column's values, or the image bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DedupeBy {
    /// A column's values.
    Column {
        /// Its index in the schema.
        index: usize,
        /// Its name.
        name: String,
    },
    /// The image bytes.
    Content {
        /// The bytes column's index in the schema.
        index: usize,
    },
}

impl DedupeBy {
    /// What `--dedupe by` means for `schema`: `content` is the image column (`image_column`,
    /// else the schema's only `bytes` column), anything else a column that is not an array.
    pub fn resolve(by: &str, schema: &Schema, image_column: Option<&str>) -> Result<DedupeBy> {
        let bad = |why: String| Err(Error::invalid("--dedupe", why));
        if by == "content" {
            let bytes: Vec<usize> = (0..schema.columns.len())
                .filter(|&i| schema.columns[i].ty == ColumnType::Bytes)
                .collect();
            let index = match image_column.and_then(|c| schema.index_of(c)) {
                Some(i) => i,
                None if bytes.len() == 1 => bytes[0],
                None => {
                    return bad(format!(
                        "content: the input has {} bytes columns ({}); name the image with --image-column",
                        bytes.len(),
                        schema.describe()
                    ))
                }
            };
            return Ok(DedupeBy::Content { index });
        }
        match schema.index_of(by) {
            None => bad(format!(
                "no column {by:?} (the columns are {}; or 'content' for the image bytes)",
                schema.describe()
            )),
            Some(i) if matches!(schema.columns[i].ty, ColumnType::Array(_)) => bad(format!(
                "column {by:?} is an array; dedupe by a scalar column or 'content'"
            )),
            Some(index) => Ok(DedupeBy::Column {
                index,
                name: by.to_owned(),
            }),
        }
    }

    /// The name `meta.dedupe.by` records.
    pub fn name(&self) -> &str {
        match self {
            DedupeBy::Column { name, .. } => name,
            DedupeBy::Content { .. } => "content",
        }
    }

    /// The key of the sample at input position `pos` whose values are `vals`. A null never
    /// matches another sample (its key is made unique by its position).
    pub fn key(&self, schema: &Schema, vals: &[Value], pos: u64) -> u64 {
        let index = match self {
            DedupeBy::Column { index, .. } | DedupeBy::Content { index } => *index,
        };
        let h = |b: &[u8]| xxhash_rust::xxh3::xxh3_64(b);
        let col = &schema.columns[index];
        match &vals[index] {
            Value::Int64(x) if col.nullable && *x == ramjet_engine::format::NULL_INT64 => null_key(pos),
            Value::Float64(x) if col.nullable && x.is_nan() => null_key(pos),
            Value::Int64(x) => h(&x.to_le_bytes()),
            Value::Float64(x) => h(&x.to_bits().to_le_bytes()),
            Value::Str(s) | Value::Json(s) => h(s.as_bytes()),
            Value::Bytes(b) => h(b),
            Value::Array(_) => unreachable!("refused by resolve"),
        }
    }
}

fn null_key(pos: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(b"\0null", pos)
}

/// The pass in input order: each group's keys (its samples in order) after `first` samples,
/// marking in `dropped` every sample whose key is already in `seen`.
#[derive(Default)]
pub struct Pass {
    seen: HashSet<u64>,
    samples: u64,
    /// Global indices of the samples dropped, ascending.
    pub dropped: Vec<u64>,
}

impl Pass {
    /// Takes one group's keys, which must be as many as its samples.
    pub fn group(&mut self, keys: &[u64], samples: u64, what: &str) -> Result<()> {
        if keys.len() as u64 != samples {
            return Err(Error::invalid(
                what,
                format!("{} dedupe keys for {samples} samples", keys.len()),
            ));
        }
        for (i, k) in keys.iter().enumerate() {
            if !self.seen.insert(*k) {
                self.dropped.push(self.samples + i as u64);
            }
        }
        self.samples += samples;
        Ok(())
    }

    /// Uploads the list of dropped samples (when any) and records it in `meta.dedupe`.
    pub fn finish(
        self,
        by: &str,
        store: &Store,
        rt: &tokio::runtime::Runtime,
        meta: &mut Map<String, Json>,
    ) -> Result<()> {
        let mut d = json!({"by": by, "dropped": self.dropped.len()});
        if !self.dropped.is_empty() {
            let bytes: Vec<u8> = self.dropped.iter().flat_map(|x| x.to_le_bytes()).collect();
            let sum = xxhash_rust::xxh3::xxh3_64(&bytes);
            let key = format!("excluded/{sum:016x}.u64");
            d["key"] = json!(key);
            d["bytes"] = json!(bytes.len());
            d["checksum"] = json!(format!("{sum:016x}"));
            rt.block_on(store.put(&key, Bytes::from(bytes)))?;
        }
        meta.insert("dedupe".into(), d);
        Ok(())
    }
}

/// Keys as a part stores them: 16 hex digits each, back to back.
pub fn keys_to_hex(keys: &[u64]) -> String {
    keys.iter().map(|k| format!("{k:016x}")).collect()
}

/// [`keys_to_hex`]'s inverse.
pub fn keys_from_hex(s: &str) -> std::result::Result<Vec<u64>, ramjet_engine::Invalid> {
    if s.len() % 16 != 0 || !s.is_ascii() {
        return Err("dedupe keys are not 16 hex digits each".into());
    }
    (0..s.len() / 16)
        .map(|i| {
            u64::from_str_radix(&s[i * 16..i * 16 + 16], 16)
                .map_err(|e| ramjet_engine::Invalid::from(format!("dedupe key {i}: {e}")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_duplicates_are_dropped_across_groups() {
        let mut p = Pass::default();
        p.group(&[1, 2, 1], 3, "g0").unwrap();
        p.group(&[3, 2, 4, 3], 4, "g1").unwrap();
        assert_eq!(p.dropped, [2, 4, 6]);
        assert!(p
            .group(&[1], 2, "g2")
            .unwrap_err()
            .to_string()
            .contains("1 dedupe keys for 2"));
        let k = [0u64, u64::MAX, 0x0123_4567_89ab_cdef];
        assert_eq!(keys_from_hex(&keys_to_hex(&k)).unwrap(), k);
        assert!(keys_from_hex("abc").is_err());
    }
}
