//! A foreign shard as the ramjet shard it transcodes to: the one entry point from a foreign
//! object's bytes to verified ramjet records (with JPEG restarts, when the spec asks).

use super::{mds, wds, ForeignFormat, ForeignObject, ForeignSpec};
use crate::error::{Error, Location, Result};
use crate::format::{BuiltShard, Schema, ShardBuilder, Value};

/// The first bytes of every JPEG file: SOI, then the next marker's `FF`.
const JPEG_SOI: [u8; 3] = [0xFF, 0xD8, 0xFF];

impl ForeignSpec {
    /// With [`ForeignSpec::jpeg_restart_px`], the JPEG values of each sample's `values`
    /// transcoded with restart markers, on every core (a JPEG takes a few ms); otherwise
    /// nothing. The result does not depend on the number of cores.
    pub(super) fn restart_jpegs(&self, samples: &mut [Vec<Value>]) {
        let Some(px) = self.jpeg_restart_px else {
            return;
        };
        let cols: Vec<usize> = (self.columns.iter().enumerate())
            .filter(|(_, c)| self.may_hold_jpeg(c))
            .map(|(i, _)| i)
            .collect();
        if cols.is_empty() || samples.is_empty() {
            return;
        }
        let one = |values: &mut Vec<Value>| {
            for &c in &cols {
                match values.get_mut(c) {
                    Some(Value::Bytes(b)) if b.starts_with(&JPEG_SOI) => {
                        *b = crate::image::turbo::with_restarts_or_given(std::mem::take(b), px);
                    }
                    _ => {}
                }
            }
        };
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(samples.len());
        if threads <= 1 {
            samples.iter_mut().for_each(one);
            return;
        }
        let per = samples.len().div_ceil(threads);
        std::thread::scope(|s| {
            for part in samples.chunks_mut(per) {
                s.spawn(|| part.iter_mut().for_each(one));
            }
        });
    }
}

/// Checks a foreign object's bytes as stored against its manifest entry: size, then xxh3-64.
pub fn check_object(bytes: &[u8], obj: &ForeignObject, object: &str) -> Result<()> {
    if bytes.len() as u64 != obj.bytes {
        return Err(Error::Truncated {
            object: object.to_owned(),
            expected: obj.bytes,
            actual: bytes.len() as u64,
        });
    }
    // XXH3-64 as twox-hash computes it (AVX2 picked at run time; the same value as xxh3_64).
    let sum = twox_hash::XxHash3_64::oneshot(bytes);
    if sum != obj.checksum_u64() {
        return Err(Error::corrupt(
            Location::object(object),
            format!(
                "the object hashes to {sum:016x}, its index says {} (it changed since it was indexed: run `ramjet index` again, or delete the learned manifest `ramjet inspect` names)",
                obj.checksum
            ),
        ));
    }
    Ok(())
}

/// The ramjet shard that a foreign shard's (decompressed) bytes transcode to: every sample,
/// in order, as a ramjet record of `schema`. Every structural fault names the shard `object`
/// and, where it is in one sample, that sample.
pub fn transcode(spec: &ForeignSpec, schema: &Schema, data: &[u8], object: &str) -> Result<BuiltShard> {
    Ok(transcode_with_spans(spec, schema, data, object)?.0)
}

/// [`transcode`], with where each sample lies in `data` (what a sample index records).
pub fn transcode_with_spans(
    spec: &ForeignSpec,
    schema: &Schema,
    data: &[u8],
    object: &str,
) -> Result<(BuiltShard, Vec<std::ops::Range<u64>>)> {
    let mut b = ShardBuilder::new(schema.clone());
    b.reserve(data.len() + data.len() / 16);
    let mut spans = Vec::new();
    // With restart markers to add, the shard's samples are gathered first and their JPEGs
    // transcoded on every core; otherwise each goes into the shard as it is read.
    let gather = spec.jpeg_restart_px.is_some();
    let (mut held, mut whats): (Vec<Vec<Value>>, Vec<String>) = (Vec::new(), Vec::new());
    let mut put = |values: Vec<Value>, what: String| -> Result<()> {
        if gather {
            held.push(values);
            whats.push(what);
            Ok(())
        } else {
            b.push(&values, &what)
        }
    };
    match spec.format {
        ForeignFormat::Mds | ForeignFormat::Lit => {
            let shard = mds::MdsShard::parse(data, object)?;
            for i in 0..shard.samples() {
                let values = mds::sample_values(&spec.columns, shard.sample(i)?, &Location::sample(object, i))?;
                put(values, format!("{object} sample {i}"))?;
                spans.push(shard.span(i));
            }
        }
        ForeignFormat::Parquet => {
            return Err(Error::invalid(
                object,
                "a Parquet row group is transcoded with its file's footer (foreign::parquet_rows)",
            ))
        }
        ForeignFormat::Wds => {
            let samples = wds::samples(data, object)?;
            for (i, s) in samples.iter().enumerate() {
                let values = wds::sample_values(&spec.columns, s, data, &Location::sample(object, i as u64))?;
                put(values, format!("{object} sample {i} ({})", s.key))?;
                spans.push(s.span.start as u64..s.span.end as u64);
            }
        }
    }
    spec.restart_jpegs(&mut held);
    for (values, what) in held.iter().zip(&whats) {
        b.push(values, what)?;
    }
    Ok((b.finish(), spans))
}

/// One sample, read alone from its span of a plain foreign object (by its sample index), as
/// the ramjet record it transcodes to. The caller checks the record against the index's
/// checksum.
pub fn transcode_sample(spec: &ForeignSpec, schema: &Schema, raw: &[u8], at: &Location) -> Result<Vec<u8>> {
    let mut values = match spec.format {
        ForeignFormat::Mds | ForeignFormat::Lit => mds::sample_values(&spec.columns, raw, at)?,
        ForeignFormat::Wds => {
            let s = wds::sample_in(raw, at)?;
            wds::sample_values(&spec.columns, &s, raw, at)?
        }
        ForeignFormat::Parquet => {
            return Err(Error::invalid(
                at.to_string(),
                "a Parquet row is read with its row group, not alone",
            ))
        }
    };
    spec.restart_jpegs(std::slice::from_mut(&mut values));
    let mut rec = Vec::new();
    crate::format::encode_record(schema, &values, &at.to_string(), &mut rec)?;
    Ok(rec)
}
