//! Reading a plain (uncompressed) foreign shard's samples one at a time from the origin: where
//! a sample's entry is in the shard's sample index (ramjet's `.rjx`, written by `ramjet index`),
//! the checks that tie the index to the manifest and an entry to the object, and a record
//! transcoded to ramjet's form and checked against the checksum the index holds. The stream's
//! ranged reads (`crate::stream`) call these and know nothing else of foreign formats.

use bytes::Bytes;

use super::{transcode_sample, ForeignSpec, SampleIndexRef, SAMPLE_INDEX_ENTRY_LEN};
use crate::error::{Error, Location, Result};
use crate::format::{sample_checksum, IndexEntry, Schema};

/// Where sample `i`'s entry is in its shard's sample index.
pub fn entry_offset(i: u64) -> u64 {
    i * SAMPLE_INDEX_ENTRY_LEN
}

/// Checks that sample `index`'s entry points inside the foreign object (`object_bytes` long);
/// `shard_url` names the shard in the error.
pub fn check_entry(e: &IndexEntry, object_bytes: u64, shard_url: &str, index: u64) -> Result<()> {
    if e.offset.checked_add(e.len).is_some_and(|end| end <= object_bytes) {
        return Ok(());
    }
    Err(Error::corrupt(
        Location::sample(shard_url, index),
        format!(
            "its sample index points at [{}, +{}), outside the {object_bytes}-byte object",
            e.offset, e.len
        ),
    ))
}

/// Sample `i`'s ramjet record from its bytes in the foreign object (`raw`, where its entry `e`
/// points): transcoded with the dataset's `spec`, and checked against the checksum the sample
/// index holds, so an object changed since it was indexed fails here, naming the sample.
pub fn record(spec: &ForeignSpec, schema: &Schema, i: u64, e: &IndexEntry, raw: &[u8], at: &Location) -> Result<Bytes> {
    let rec = transcode_sample(spec, schema, raw, at)?;
    if sample_checksum(i, &rec) != e.checksum {
        return Err(Error::corrupt(
            at.clone(),
            "the sample does not match its checksum in the sample index (the object changed since it was indexed)",
        ));
    }
    Ok(Bytes::from(rec))
}

/// Checks a shard's sample index as read (`b`, from `index_url`) against the manifest: one
/// entry per sample of the shard (`samples`), and the size and XXH3-64 the manifest lists.
pub fn check_sample_index(b: &[u8], samples: u64, ix: &SampleIndexRef, shard_url: &str, index_url: &str) -> Result<()> {
    let sum = xxhash_rust::xxh3::xxh3_64(b);
    if b.len() as u64 == samples * SAMPLE_INDEX_ENTRY_LEN && sum == ix.checksum.get() {
        return Ok(());
    }
    Err(Error::corrupt(
        Location::object(index_url),
        format!(
            "the sample index of {shard_url} ({} bytes, XXH3-64 {sum:016x}) is not the one the manifest lists \
             ({} bytes for {samples} samples, {})",
            b.len(),
            ix.bytes,
            ix.checksum
        ),
    ))
}
