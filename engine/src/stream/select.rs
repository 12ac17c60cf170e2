//! The samples of a source the order deals: all of them, less the duplicates its pack dropped
//! (`meta.dedupe`, a list of samples the manifest names), and of those, the ones a filter keeps
//! ([`crate::filter`]), found by reading every shard's columns sidecar once (a few KB a shard).
//! Either is held as a selection ([`Selected`]: 8 bytes a shard, a bit a sample of a shard with
//! drops). A filtered source's version gains the filter's hash, so a state saved under one
//! filter does not resume under another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::{StreamExt, TryStreamExt};

use crate::dataset::Dataset;
use crate::error::{Error, Result};
use crate::filter::Filter;
use crate::order::{KeptBits, Selected, ShardCounts};

/// Shards whose columns are read at once.
const PARALLEL: usize = 16;

/// Selections computed in this process, by manifest URL, version and filter: a stream and
/// `len()` of the same dataset read the columns once.
type Memo = Mutex<HashMap<(String, String, String), (Arc<dyn ShardCounts>, u64)>>;

fn memo() -> &'static Memo {
    static M: std::sync::OnceLock<Memo> = std::sync::OnceLock::new();
    M.get_or_init(Default::default)
}

/// Most selections the memo holds (each a bit per sample of its shards with drops).
const MEMO_MAX: usize = 8;

/// Parses a stream's filter, naming it in the error.
pub fn parse_filter(text: &str) -> Result<Filter> {
    Filter::parse(text).map_err(|r| Error::invalid(format!("filter {text:?}"), r))
}

/// `ds`'s counts as the order deals them, and its version as the order keys it: the manifest's
/// own without a filter; with one, the kept samples and `<version>+filter.<hash>`.
pub(super) async fn source_counts(ds: &Dataset, filter: Option<&str>) -> Result<(Arc<dyn ShardCounts>, String)> {
    let m = ds.manifest();
    let deduped = m.meta.get("dedupe").and_then(|d| d.get("key")).is_some();
    let f = filter.map(parse_filter).transpose()?;
    let version = match &f {
        None => m.version.clone(),
        Some(f) => format!(
            "{}+filter.{:016x}",
            m.version,
            xxhash_rust::xxh3::xxh3_64(f.text().as_bytes())
        ),
    };
    if f.is_none() && !deduped {
        return Ok((m.shard_counts(), version));
    }
    let text = f.as_ref().map_or(String::new(), |f| f.text().to_owned());
    let key = (ds.manifest_url().to_owned(), m.version.clone(), text);
    if let Some((c, _)) = memo().lock().expect("memo").get(&key) {
        return Ok((c.clone(), version));
    }
    let checked = match &f {
        None => None,
        Some(f) => Some((
            f,
            f.check(&m.schema)
                .map_err(|r| Error::invalid(format!("filter {:?} on {}", f.text(), ds.manifest_url()), r))?,
        )),
    };
    let dropped = excluded(ds).await?;
    let sel = select(ds, checked, &dropped).await?;
    let dropped = sel.dropped();
    let counts = sel.into_counts();
    let mut g = memo().lock().expect("memo");
    if g.len() >= MEMO_MAX {
        g.clear();
    }
    g.insert(key, (counts.clone(), dropped));
    Ok((counts, version))
}

/// The samples the pack's dedupe dropped (`meta.dedupe`): their global indices, ascending, from
/// the object the manifest names, checked against its size, checksum and the dataset.
async fn excluded(ds: &Dataset) -> Result<Vec<u64>> {
    let m = ds.manifest();
    let Some(d) = m.meta.get("dedupe") else {
        return Ok(Vec::new());
    };
    let Some(key) = d.get("key").and_then(|k| k.as_str()) else {
        return Ok(Vec::new());
    };
    let url = ds.store().url(key);
    let bad = |why: String| Error::corrupt(crate::Location::object(&url), why);
    let bytes = ds.store().get(key).await?;
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes);
    let want = (
        d.get("bytes").and_then(|b| b.as_u64()),
        d.get("checksum").and_then(|c| c.as_str()),
    );
    if want != (Some(bytes.len() as u64), Some(format!("{sum:016x}").as_str())) {
        return Err(bad(format!(
            "{} bytes hashing to {sum:016x}; the manifest's meta.dedupe says {:?} bytes, {:?}",
            bytes.len(),
            want.0,
            want.1
        )));
    }
    let list: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    if list.windows(2).any(|w| w[0] >= w[1]) || list.last().is_some_and(|&x| x >= m.samples) {
        return Err(bad(format!(
            "the dropped samples are not ascending indices below the dataset's {} samples",
            m.samples
        )));
    }
    Ok(list)
}

/// Reads every shard's filter columns (with a filter) and keeps the rows it keeps, less the
/// samples in `dropped` (global indices, ascending), logging progress every few seconds.
async fn select(ds: &Dataset, f: Option<(&Filter, Vec<bool>)>, dropped: &[u64]) -> Result<Selected> {
    let (n, t0) = (ds.manifest().shard_count(), Instant::now());
    let names = f.as_ref().map_or(Vec::new(), |(f, _)| f.columns().to_vec());
    let text = f.as_ref().map_or("(none)", |(f, _)| f.text());
    let nullable = f.as_ref().map_or(&[][..], |(_, n)| &n[..]);
    let mut last = Instant::now();
    let mut done = 0usize;
    let mut samples = Vec::with_capacity(n);
    let mut kept = Vec::with_capacity(n);
    let mut s = futures::stream::iter(0..n)
        .map(|i| {
            let names = &names;
            let f = f.as_ref().map(|(f, _)| *f);
            async move {
                let rows = ds.manifest().shard(i)?.samples;
                let start = ds.manifest().shard_start(i)?;
                let mut bits = match f {
                    None => KeptBits::all(rows),
                    Some(f) => {
                        let cols = ds.shard_columns(i, names).await?;
                        let mut bits = KeptBits::none(rows);
                        let mut row: Vec<&crate::format::Value> = Vec::with_capacity(cols.len());
                        for r in 0..rows as usize {
                            row.clear();
                            row.extend(cols.iter().map(|c| &c[r]));
                            if f.keeps(&row, nullable) {
                                bits.keep(r as u64);
                            }
                        }
                        bits
                    }
                };
                let lo = dropped.partition_point(|&x| x < start);
                for &g in dropped[lo..].iter().take_while(|&&x| x < start + rows) {
                    bits.drop_sample(g - start);
                }
                Ok::<_, Error>((rows, bits))
            }
        })
        .buffered(PARALLEL);
    while let Some((rows, bits)) = s.try_next().await? {
        samples.push(rows);
        kept.push(Some(bits));
        done += 1;
        if last.elapsed().as_secs() >= 3 {
            last = Instant::now();
            tracing::info!(
                "selecting (filter {text:?}, {} deduped) on {}: {done}/{n} shards ({:.0} s)",
                dropped.len(),
                ds.manifest_url(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    let sel = Selected::new(&samples, kept);
    tracing::info!(
        "selecting (filter {text:?}, {} deduped) on {}: keeps {} of {} samples ({n} shards, {:.1} s)",
        dropped.len(),
        ds.manifest_url(),
        sel.total(),
        sel.total() + sel.dropped(),
        t0.elapsed().as_secs_f64()
    );
    Ok(sel)
}
