//! A stream's steps of the fetch chain, for one shard or sample. A whole shard goes through
//! the fetch chain (`crate::chain`, shared with the host daemon) with the stream's steps: the
//! host daemon, else the disk cache, else the origin (holding the host-wide download lock),
//! each read verified; one flight per shard in the process (`crate::singleflight`). Single samples are
//! read from a cached shard or with ranged GETs (merged per shard when read together).

use super::shared::{CachedReader, Shared, Source, INSERT_PERMIT_BYTES};
use crate::cache::ShardId;
use crate::chain::{blocking, Outcome, ShardAt, Step, Upstream, UpstreamFetch};
use crate::error::Error;
use crate::error::Location;
use crate::error::Result;
use crate::format::IndexEntry;
use crate::format::ShardReader;
use crate::format::INDEX_ENTRY_LEN;
use crate::metrics::Metrics;
use crate::order::SampleRef;
use crate::provider::FetchedFrom;
use crate::provider::ShardProvider;
use crate::provider::ShardRequest;
use crate::singleflight::Flights;
use crate::stall::WaitOn;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Arc;

/// Samples read one by one, together: from the disk cache where their shard is there (one
/// blocking task; each shard opened once), the rest with ranged GETs merged per shard
/// ([`fetch_samples_ranged`]), all at once.
/// Returns the records in the order of `ids`, and how many came from the origin.
pub(super) async fn read_samples(shared: &Arc<Shared>, ids: &[SampleRef]) -> (Vec<Result<Bytes>>, u64) {
    let cached: Vec<Option<Bytes>> = match shared.cache.clone() {
        Some(cache) => {
            let (sh, want) = (shared.clone(), ids.to_vec());
            blocking("cache task", move || {
                // Read in shard and index order (near one another in each file), each shard
                // opened once; the results go back to their places.
                let mut order: Vec<usize> = (0..want.len()).collect();
                order.sort_unstable_by_key(|&k| want[k]);
                let mut open: HashMap<(u32, u32), Option<OpenCached>> = HashMap::new();
                let mut out: Vec<Option<Bytes>> = vec![None; want.len()];
                let mut damaged = Vec::new();
                for k in order {
                    let id = want[k];
                    let r = open.entry((id.source, id.shard)).or_insert_with(|| {
                        let sid = sh.sources[id.source as usize].id(id.shard as usize).ok()?;
                        let shard = cache.shard(sid).ok()??;
                        let reader = shard.records().ok()?;
                        let index = shard_index(&sh, (id.source, id.shard), &reader);
                        Some((Arc::new((shard, reader)), index))
                    });
                    let Some((reader, index)) = r.as_ref() else {
                        continue;
                    };
                    let rec = match index {
                        Some(ix) => reader.1.read_record_indexed(ix, id.index as u64),
                        None => reader.1.read_record(id.index as u64),
                    };
                    match rec {
                        Ok(rec) => {
                            Metrics::add(&sh.metrics.cache_bytes, rec.len() as u64);
                            out[k] = Some(Bytes::from(rec));
                        }
                        // A damaged record is read from the origin instead, and the damaged
                        // copy is removed (the next epoch's warming fetches it again).
                        Err(Error::Corrupt { .. }) => damaged.push(((id.source, id.shard), reader.clone())),
                        Err(_) => {}
                    }
                }
                damaged.dedup_by_key(|d| d.0);
                for (key, reader) in damaged {
                    // The held index may be what is damaged: it is read again with the copy.
                    if let Some(held) = &sh.indexes {
                        held.lock().expect("not poisoned").remove(&key);
                    }
                    cache.remove_copy(&reader.0);
                }
                Ok(out)
            })
            .await
            .unwrap_or_else(|_| vec![None; ids.len()])
        }
        None => vec![None; ids.len()],
    };
    let remote: Vec<SampleRef> = ids
        .iter()
        .zip(&cached)
        .filter(|(_, c)| c.is_none())
        .map(|(id, _)| *id)
        .collect();
    let mut got = fetch_samples_ranged(shared, &remote).await.into_iter();
    let records = cached
        .into_iter()
        .map(|c| match c {
            Some(rec) => Ok(rec),
            None => got.next().expect("one result per sample not cached"),
        })
        .collect();
    (records, remote.len() as u64)
}

/// A cached shard open for reading samples one by one: its reader and its held index (if any).
type OpenCached = (CachedReader, Option<Arc<Vec<u8>>>);

/// The held index of a cached shard read one sample at a time, read whole the first time (one
/// read, the shard's every entry), when the stream holds indexes (`index_bytes_max`).
fn shard_index(sh: &Shared, key: (u32, u32), reader: &ShardReader<std::fs::File>) -> Option<Arc<Vec<u8>>> {
    let held = sh.indexes.as_ref()?;
    if let Some(ix) = held.lock().expect("not poisoned").get(&key) {
        return Some(ix.clone());
    }
    // Read without the lock: another batch may read the same index meanwhile (once, rarely).
    let ix = Arc::new(reader.read_index().ok()?);
    held.lock().expect("not poisoned").insert(key, ix.clone());
    Some(ix)
}

/// Index entries this close together (in entries) are read with one ranged GET.
const ENTRY_GAP_MAX: u64 = 2048;
/// Records this close together (in bytes) are read with one ranged GET; the gap is read and
/// thrown away, which costs less than a request.
const RECORD_GAP_BYTES_MAX: u64 = 64 << 10;
/// The longest ranged GET of several records.
const RECORD_RUN_BYTES_MAX: u64 = 8 << 20;

/// Each sample's record (or why it could not be read), by its index in the shard.
type Records = HashMap<u64, Result<Bytes>>;

/// Records read with one ranged GET: the byte range, and each record's sample and entry.
type RecordRun = (std::ops::Range<u64>, Vec<(u64, IndexEntry)>);

/// Samples read from the origin with ranged GETs, their requests merged: per shard, one GET
/// for each cluster of index entries, then one for each run of records lying close together
/// (a sequential or block-shuffled order reads a batch with two requests instead of two per
/// sample). Every record is checked against its index entry. Where a merged GET fails, each of
/// its samples is read again on its own, so every error names its sample.
async fn fetch_samples_ranged(shared: &Arc<Shared>, ids: &[SampleRef]) -> Vec<Result<Bytes>> {
    let mut by_shard: HashMap<(u32, u32), Vec<usize>> = HashMap::new();
    for (slot, id) in ids.iter().enumerate() {
        by_shard.entry((id.source, id.shard)).or_default().push(slot);
    }
    let groups = by_shard.into_values().map(|slots| fetch_from_shard(shared, ids, slots));
    let mut out: Vec<Option<Result<Bytes>>> = (0..ids.len()).map(|_| None).collect();
    for group in futures::future::join_all(groups).await {
        for (slot, r) in group {
            out[slot] = Some(r);
        }
    }
    out.into_iter().map(|r| r.expect("every sample read")).collect()
}

/// The samples `slots` of `ids`, all of one shard (see [`fetch_samples_ranged`]).
async fn fetch_from_shard(shared: &Arc<Shared>, ids: &[SampleRef], slots: Vec<usize>) -> Vec<(usize, Result<Bytes>)> {
    let first = ids[slots[0]];
    let src = &shared.sources[first.source as usize];
    let info = match src.ds.manifest().shard(first.shard as usize) {
        Ok(info) => info,
        Err(e) => return slots.into_iter().map(|s| (s, Err(e.clone()))).collect(),
    };
    let Some(layout) = Ranged::of(&info, &src.ds) else {
        // A compressed foreign shard has no sample index to read ranges by: it comes whole
        // (once, through the fetch chain, then from the cache), and its records are sliced out.
        let indices: Vec<u64> = slots.iter().map(|&s| ids[s].index as u64).collect();
        let got = records_of_whole_shard(shared, first.source, first.shard, &indices).await;
        return slots.into_iter().zip(got).collect();
    };
    let layout = &layout;
    let info = &info;
    let store = src.ds.store();
    let m = &shared.metrics;
    let counted_get = |entries: bool, range: &std::ops::Range<u64>| {
        let (store, key) = if entries {
            (layout.entry_store, layout.entry_key)
        } else {
            (store, info.key.as_str())
        };
        merged_get(store, key, range.clone(), m)
    };
    let clusters = entry_clusters(slots.iter().map(|&s| ids[s].index as u64).collect());
    // Nothing of the shard is trusted before it is tied to the manifest: a ramjet shard's
    // footer checked while its entries are read, a foreign shard's whole sample index first.
    let key = (first.source, first.shard);
    let held = match layout.foreign_bytes {
        None => None,
        Some(_) => match vouch(shared, key, info, layout).await {
            Ok(held) => held,
            Err(e) => return slots.into_iter().map(|s| (s, Err(e.clone()))).collect(),
        },
    };
    let entry_gets = clusters.iter().map(|c| {
        let held = held.clone();
        async move {
            let (lo, hi) = (c[0], c[c.len() - 1]);
            let range = layout.entry_at(lo)..layout.entry_at(hi) + INDEX_ENTRY_LEN;
            let b = match held {
                Some(ix) => ix.slice(range.start as usize..range.end as usize),
                None => counted_get(true, &range).await?,
            };
            Some(
                c.iter()
                    .map(|&i| {
                        let o = ((i - lo) * INDEX_ENTRY_LEN) as usize;
                        (i, IndexEntry::parse(&b[o..o + INDEX_ENTRY_LEN as usize]))
                    })
                    .collect::<Vec<_>>(),
            )
        }
    });
    let (vouched, got) = futures::join!(
        async {
            match held {
                Some(_) => Ok(None),
                None => vouch(shared, key, info, layout).await,
            }
        },
        futures::future::join_all(entry_gets)
    );
    if let Err(e) = vouched {
        return slots.into_iter().map(|s| (s, Err(e.clone()))).collect();
    }
    let mut entries: HashMap<u64, IndexEntry> = HashMap::new();
    for got in got.into_iter().flatten() {
        entries.extend(got);
    }
    // Records, by runs of entries that checked out, in file order.
    let (sound, mut results) = check_entries(layout, src, first.shard as usize, &entries);
    let runs = record_runs(sound);
    let url = store.url(&info.key);
    let record_gets = runs.iter().map(|(span, r)| {
        let url = &url;
        async move {
            let start = span.start;
            let b = counted_get(false, span).await?;
            Some(
                r.iter()
                    .map(|(i, e)| {
                        let rec = b.slice((e.offset - start) as usize..(e.offset - start + e.len) as usize);
                        (*i, layout.record(src, *i, e, rec, &Location::sample(url, *i)))
                    })
                    .collect::<Vec<_>>(),
            )
        }
    });
    for got in futures::future::join_all(record_gets).await.into_iter().flatten() {
        results.extend(got);
    }
    deliver(shared, ids, slots, results).await
}

/// One merged ranged GET, counted; `None` when it failed (its samples are read again alone).
async fn merged_get(store: &crate::Store, key: &str, range: std::ops::Range<u64>, m: &Metrics) -> Option<Bytes> {
    let got = store.get_range(key, range).await;
    Metrics::add(&m.origin_requests, 1);
    let b = got
        .inspect_err(|e| tracing::debug!(error = %e, "a merged ranged read failed; its samples are read alone"))
        .ok()?;
    Metrics::add(&m.origin_bytes, b.len() as u64);
    Some(b)
}

/// The samples' index entries in clusters read with one ranged GET each: sorted, each sample
/// once, a new cluster past [`ENTRY_GAP_MAX`] entries.
fn entry_clusters(mut indices: Vec<u64>) -> Vec<Vec<u64>> {
    indices.sort_unstable();
    indices.dedup();
    let mut clusters: Vec<Vec<u64>> = Vec::new();
    for i in indices {
        match clusters.last_mut() {
            Some(c) if i - c[c.len() - 1] <= ENTRY_GAP_MAX => c.push(i),
            _ => clusters.push(vec![i]),
        }
    }
    clusters
}

/// The entries that check out against the shard's layout, and an error for each that does not.
fn check_entries(
    layout: &Ranged<'_>,
    src: &Source,
    shard: usize,
    entries: &HashMap<u64, IndexEntry>,
) -> (Vec<(u64, IndexEntry)>, Records) {
    let mut refused: Records = HashMap::new();
    let mut sound: Vec<(u64, IndexEntry)> = Vec::new();
    for (&i, e) in entries {
        match layout.check_entry(src, shard, i, e) {
            Ok(()) => sound.push((i, *e)),
            Err(err) => {
                refused.insert(i, Err(err));
            }
        }
    }
    (sound, refused)
}

/// Records (by their checked entries) in runs read with one ranged GET each: in file order,
/// a new run past a gap of [`RECORD_GAP_BYTES_MAX`] or a run of [`RECORD_RUN_BYTES_MAX`].
fn record_runs(mut sound: Vec<(u64, IndexEntry)>) -> Vec<RecordRun> {
    sound.sort_by_key(|(_, e)| e.offset);
    let mut runs: Vec<RecordRun> = Vec::new();
    for (i, e) in sound {
        let end = e.offset + e.len;
        match runs.last_mut() {
            Some((span, r))
                if e.offset >= span.end
                    && e.offset - span.end <= RECORD_GAP_BYTES_MAX
                    && end - span.start <= RECORD_RUN_BYTES_MAX =>
            {
                span.end = end;
                r.push((i, e));
            }
            _ => runs.push((e.offset..end, vec![(i, e)])),
        }
    }
    runs
}

/// Each slot's record from `results`; what a merged GET did not deliver is read on its own
/// (its own error, its own retries). A sample wanted twice gets the same record twice.
async fn deliver(
    shared: &Arc<Shared>,
    ids: &[SampleRef],
    slots: Vec<usize>,
    mut results: HashMap<u64, Result<Bytes>>,
) -> Vec<(usize, Result<Bytes>)> {
    let mut out = Vec::with_capacity(slots.len());
    let mut again = Vec::new();
    for slot in slots {
        let i = ids[slot].index as u64;
        match results.get(&i) {
            Some(Ok(rec)) => out.push((slot, Ok(rec.clone()))),
            Some(Err(_)) => {
                let err = results.remove(&i).expect("present").unwrap_err();
                out.push((slot, Err(err)));
            }
            _ => again.push(slot),
        }
    }
    let retried = futures::future::join_all(again.iter().map(|&slot| fetch_sample_ranged(shared, ids[slot])));
    out.extend(again.iter().copied().zip(retried.await));
    out
}

/// Where a shard's samples are read from one at a time: a ramjet shard's own index and
/// records, or a plain foreign shard's sample index and its object
/// (`crate::foreign`).
pub(super) struct Ranged<'a> {
    /// The store and object holding the index entries.
    entry_store: &'a crate::Store,
    entry_key: &'a str,
    /// The foreign object's size, for a foreign shard.
    foreign_bytes: Option<u64>,
}

impl<'a> Ranged<'a> {
    /// How `info`'s samples are read alone; `None` for a foreign shard without a sample index
    /// (a compressed one), which is read whole.
    fn of(info: &'a crate::format::ShardInfo, ds: &'a crate::Dataset) -> Option<Ranged<'a>> {
        match &info.foreign {
            None => Some(Ranged {
                entry_store: ds.store(),
                entry_key: &info.key,
                foreign_bytes: None,
            }),
            Some(f) => f.index.as_ref().map(|ix| Ranged {
                entry_store: ds.index_store(),
                entry_key: &ix.key,
                foreign_bytes: Some(f.bytes),
            }),
        }
    }

    /// Where sample `i`'s entry is.
    fn entry_at(&self, i: u64) -> u64 {
        match self.foreign_bytes {
            None => crate::format::Header::entry_offset(i),
            Some(_) => crate::foreign::ranged::entry_offset(i),
        }
    }

    /// Checks that an entry points inside the object's samples.
    fn check_entry(&self, src: &Source, shard: usize, index: u64, e: &IndexEntry) -> Result<()> {
        match self.foreign_bytes {
            None => check_entry(src, shard, index, e),
            Some(bytes) => crate::foreign::ranged::check_entry(e, bytes, &src.shard_url(shard), index),
        }
    }

    /// Sample `i`'s record from the bytes its entry points at, checked against the entry.
    fn record(&self, src: &Source, i: u64, e: &IndexEntry, raw: Bytes, at: &Location) -> Result<Bytes> {
        if self.foreign_bytes.is_none() {
            return e.check_record(i, &raw, at).map(|()| raw);
        }
        let m = src.ds.manifest();
        let spec = m.foreign().expect("a foreign shard's manifest has its spec");
        crate::foreign::ranged::record(spec, &m.schema, i, e, &raw, at)
    }
}

/// Checks that sample `index`'s entry points inside shard `shard`'s records.
fn check_entry(src: &Source, shard: usize, index: u64, e: &IndexEntry) -> Result<()> {
    let (bytes, _) = src.ds.manifest().shard_bytes_checksum(shard)?;
    let data_offset = src.ds.data_offset(shard)?;
    let end = e.offset.checked_add(e.len);
    // Saturating: a manifest may claim a shard smaller than its footer.
    if e.offset < data_offset || end.is_none_or(|x| x > bytes.saturating_sub(crate::format::FOOTER_LEN)) {
        return Err(Error::corrupt(
            Location::sample(src.shard_url(shard), index),
            format!("index entry points at [{}, +{}) outside the records", e.offset, e.len),
        ));
    }
    Ok(())
}

/// One sample with two ranged GETs: its index entry, then its record (counted as an origin
/// read; the caller counts it as a ranged sample when it delivers it).
pub(super) async fn fetch_sample_ranged(shared: &Arc<Shared>, id: SampleRef) -> Result<Bytes> {
    let src = &shared.sources[id.source as usize];
    let info = &src.ds.manifest().shard(id.shard as usize)?;
    let Some(layout) = Ranged::of(info, &src.ds) else {
        let mut got = records_of_whole_shard(shared, id.source, id.shard, &[id.index as u64]).await;
        return got.pop().expect("one record asked, one given");
    };
    let store = src.ds.store();
    let url = store.url(&info.key);
    let at = Location::sample(&url, id.index as u64);
    let eo = layout.entry_at(id.index as u64);
    let key = (id.source, id.shard);
    let (held, eb) = match layout.foreign_bytes {
        // A foreign shard's entries come from its sample index, read whole and checked.
        Some(_) => {
            let ix = vouch(shared, key, info, &layout)
                .await?
                .expect("a foreign shard's index is held");
            let eb = ix.slice(eo as usize..(eo + INDEX_ENTRY_LEN) as usize);
            (Some(()), eb)
        }
        None => {
            let (v, eb) = futures::join!(
                vouch(shared, key, info, &layout),
                layout.entry_store.get_range(layout.entry_key, eo..eo + INDEX_ENTRY_LEN)
            );
            v?;
            (None, eb?)
        }
    };
    let e = IndexEntry::parse(&eb);
    layout.check_entry(src, id.shard as usize, id.index as u64, &e)?;
    let raw = store.get_range(&info.key, e.offset..e.offset + e.len).await?;
    let rec = layout.record(src, id.index as u64, &e, raw, &at)?;
    let m = &shared.metrics;
    let entry_gets = if held.is_some() { 0 } else { 1 };
    Metrics::add(&m.origin_requests, 1 + entry_gets);
    Metrics::add(&m.origin_bytes, INDEX_ENTRY_LEN * entry_gets + e.len);
    Ok(rec)
}

/// Shards whose samples may be read one at a time from the origin, tied to the manifest by
/// [`vouch`]: for a ramjet shard nothing (its footer checked out), for a foreign shard its
/// sample index, read whole and checked. Bounded: past [`VOUCHED_SHARDS_MAX`] shards or
/// [`VOUCHED_INDEX_BYTES_MAX`] bytes of indexes it starts again (a shard is then checked again:
/// one small read).
#[derive(Default)]
pub(super) struct Vouched {
    shards: HashMap<(u32, u32), Option<Bytes>>,
    index_bytes: u64,
}

/// Shards remembered as vouched for.
const VOUCHED_SHARDS_MAX: usize = 1 << 16;
/// Bytes of foreign sample indexes held.
const VOUCHED_INDEX_BYTES_MAX: u64 = 64 << 20;

/// Ties shard `key`'s samples read one at a time from the origin to the manifest, once per
/// shard and source, before any of its index entries is trusted. A sample's own checksum lives
/// in its shard's index, which travels with the shard: a shard swapped at the origin for
/// another valid one (of this dataset or another) would pass its own per-sample checks.
/// - A ramjet shard's footer (its last 16 bytes) must hold the manifest's checksum of the
///   shard and the footer magic: another shard, a rewritten or truncated object, or a manifest
///   whose checksum is wrong fails here, naming the shard. Its header (read at the same time)
///   must pass its own checksum and agree with the manifest, so a damaged header fails at the
///   shard's first sample on every path, not only once the whole shard arrives. The footer's checksum covers every
///   byte of the shard, index included, so the entries read next belong to the shard the
///   manifest lists (a forged index with a matching footer is not an accident this guards
///   against: XXH3 is no cryptographic hash).
/// - A foreign shard's sample index (ramjet's `.rjx`, 24 bytes a sample) is read whole and
///   must have the manifest's size and XXH3-64; it is held and the entries come from it. The
///   records it points at are transcoded and checked against its per-sample checksums, so a
///   swapped foreign object fails there, naming the sample.
///
/// Returns the held sample index of a foreign shard.
pub(super) async fn vouch(
    shared: &Arc<Shared>,
    key: (u32, u32),
    info: &crate::format::ShardInfo,
    layout: &Ranged<'_>,
) -> Result<Option<Bytes>> {
    if let Some(v) = shared.vouched.lock().expect("not poisoned").shards.get(&key) {
        return Ok(v.clone());
    }
    let src = &shared.sources[key.0 as usize];
    let m = &shared.metrics;
    let held = match &info.foreign {
        None => {
            let url = src.shard_url(key.1 as usize);
            let (bytes, want) = src.ds.manifest().shard_bytes_checksum(key.1 as usize)?;
            let footer = crate::format::FOOTER_LEN;
            if bytes < crate::format::HEADER_LEN + footer {
                return Err(Error::corrupt(
                    Location::object(&url),
                    format!("the manifest lists it as {bytes} bytes, less than a header and footer"),
                ));
            }
            let head = crate::format::HEADER_LEN;
            let store = src.ds.store();
            let (hb, fb) = futures::join!(
                store.get_range(&info.key, 0..head),
                store.get_range(&info.key, bytes - footer..bytes)
            );
            Metrics::add(&m.origin_requests, 2);
            Metrics::add(&m.origin_bytes, head + footer);
            // The footer first: a shorter or longer object, or another shard, is named as such
            // rather than by whatever its header happens to hold.
            let fb = match fb {
                Ok(b) => b,
                // A footer past the object's end: a torn shard, or another one in its place.
                Err(e) => return Err(src.ds.explain_short(info, e).await),
            };
            crate::format::check_footer(&fb, want, &url)?;
            let header = crate::format::Header::parse(&hb?, &url)?;
            let data_offset = src.ds.data_offset(key.1 as usize)?;
            if header.samples != info.samples || header.data_offset != data_offset {
                return Err(Error::corrupt(
                    Location::object(&url),
                    format!(
                        "its header says {} samples with records from byte {}; the manifest, {} from byte {data_offset}",
                        header.samples, header.data_offset, info.samples
                    ),
                ));
            }
            None
        }
        Some(f) => {
            let ix = f.index.as_ref().expect("a shard read by ranges has a sample index");
            let url = layout.entry_store.url(&ix.key);
            let b = if ix.bytes == 0 {
                Bytes::new()
            } else {
                layout.entry_store.get_range(&ix.key, 0..ix.bytes).await?
            };
            Metrics::add(&m.origin_requests, 1);
            Metrics::add(&m.origin_bytes, ix.bytes);
            let samples = src.ds.manifest().shard(key.1 as usize)?.samples;
            crate::foreign::ranged::check_sample_index(&b, samples, ix, &src.shard_url(key.1 as usize), &url)?;
            Some(b)
        }
    };
    let mut v = shared.vouched.lock().expect("not poisoned");
    let n = held.as_ref().map_or(0, |b| b.len() as u64);
    if v.shards.len() >= VOUCHED_SHARDS_MAX || v.index_bytes + n > VOUCHED_INDEX_BYTES_MAX {
        *v = Vouched::default();
    }
    if v.shards.insert(key, held.clone()).is_none() {
        v.index_bytes += n;
    }
    Ok(held)
}

/// Records `indices` of a shard with no index to read one sample by at the origin (a
/// compressed foreign shard, `crate::foreign`): the shard whole, through the source
/// chain, its view parsed once, each record sliced out of its verified bytes.
async fn records_of_whole_shard(shared: &Arc<Shared>, source: u32, shard: u32, indices: &[u64]) -> Vec<Result<Bytes>> {
    let url = shared.sources[source as usize].shard_url(shard as usize);
    let sliced = |bytes: Bytes| -> Result<Vec<Result<Bytes>>> {
        let view = crate::format::ShardView::parse(&bytes, &url)?;
        Ok(indices
            .iter()
            .map(|&i| view.record(i).map(|r| bytes.slice_ref(r)))
            .collect())
    };
    match fetch_shard(shared.clone(), source as usize, shard as usize)
        .await
        .and_then(sliced)
    {
        Ok(records) => records,
        Err(e) => indices.iter().map(|_| Err(e.clone())).collect(),
    }
}

/// The host daemon as the first step of a stream's fetch chain (`crate::chain`). It is
/// called on a blocking thread, at most half the blocking pool at once.
struct HostDaemon<'a> {
    shared: &'a Arc<Shared>,
    provider: &'a Arc<dyn ShardProvider>,
    source: usize,
}

/// The request's `split` and `reader` for shard `shard` of source `source`.
fn split_fields(sh: &Shared, source: usize, shard: usize) -> (bool, Option<u32>) {
    match sh.split_via(source, shard) {
        None => (false, None),
        Some(super::split::SplitVia::Owner) => (true, None),
        Some(super::split::SplitVia::Reader(n)) => (true, Some(n)),
    }
}

impl HostDaemon<'_> {
    fn request<'r>(&'r self, at: &ShardAt<'r>) -> ShardRequest<'r> {
        let (split, reader) = split_fields(self.shared, self.source, at.shard);
        ShardRequest {
            manifest_url: at.ds.manifest_url(),
            shard: at.shard as u32,
            id: at.id,
            keep: self.shared.keeps_share(),
            split,
            reader,
            job: &self.shared.job,
        }
    }
}

impl Upstream for HostDaemon<'_> {
    fn fetch<'a>(&'a self, at: &'a ShardAt<'a>) -> UpstreamFetch<'a> {
        Box::pin(async move {
            let calls = PROVIDER_CALLS.get(|| Ok(tokio::sync::Semaphore::new(crate::rt::BLOCKING_THREADS_MAX / 2)))?;
            let _call = calls
                .acquire()
                .await
                .map_err(|_| Error::invalid("host daemon", "call permits closed"))?;
            let (sh, p, source, shard) = (self.shared.clone(), self.provider.clone(), self.source, at.shard);
            let got = blocking("host-daemon call", move || {
                let src = &sh.sources[source];
                let (split, reader) = split_fields(&sh, source, shard);
                p.fetch(&ShardRequest {
                    manifest_url: src.ds.manifest_url(),
                    shard: shard as u32,
                    id: src.id(shard)?,
                    keep: sh.keeps_share(),
                    split,
                    reader,
                    job: &sh.job,
                })
            })
            .await?;
            Ok((got.bytes, got.from))
        })
    }

    fn outcome(&self, at: &ShardAt<'_>, outcome: Outcome) {
        let m = &self.shared.metrics;
        match outcome {
            Outcome::Delivered(from) => {
                Metrics::add(&m.provider_shards[from.index()], 1);
                Metrics::add(&m.provider_bytes, at.id.bytes);
            }
            Outcome::Corrupt(e) => {
                self.provider.report_corrupt(&self.request(at));
                Metrics::add(&m.provider_failures, 1);
                tracing::warn!(error = %e, "the host daemon delivered a corrupt shard; reading it directly");
            }
            Outcome::Failed(e) => {
                Metrics::add(&m.provider_failures, 1);
                tracing::warn!(error = %e, "the host daemon did not deliver the shard; reading it directly");
            }
        }
    }
}

/// Whole-shard flights keyed by shard, fetch chain and the dataset's manifest: a flight that
/// reads another dataset's copy of the same content (equally addressed) never answers this
/// one, so a damaged copy at the other's origin fails only the other.
type ShardFlights = Flights<(ShardId, u64), Result<(Bytes, WaitOn)>>;

/// Whole-shard fetches in flight in this process (`crate::singleflight`), remade in a forked
/// child.
pub(super) static SHARD_FLIGHTS: crate::rt::PerProcess<Arc<ShardFlights>> = crate::rt::PerProcess::new();

/// A whole shard, fetched once in this process however many streams want it at once: the
/// first starts the flight ([`fetch_shard_once`]), the others join it.
pub(super) async fn fetch_shard(shared: Arc<Shared>, source: usize, shard: usize) -> Result<Bytes> {
    Ok(fetch_shard_from(shared, source, shard).await?.0)
}

/// [`fetch_shard`], and the stage it came from (for the consumer's wait: `crate::stall`).
pub(super) async fn fetch_shard_from(shared: Arc<Shared>, source: usize, shard: usize) -> Result<(Bytes, WaitOn)> {
    let flights = SHARD_FLIGHTS.get(|| Ok(Arc::default()))?;
    let id = shared.sources[source].id(shard)?;
    let sh = shared.clone();
    let origin = shared.sources[source].ds.manifest_url();
    let key = (
        id,
        xxhash_rust::xxh3::xxh3_64_with_seed(origin.as_bytes(), shared.chain),
    );
    let (flight, joined) = flights.join_or_start(
        &[key],
        key,
        move || fetch_shard_once(sh, source, shard),
        |why| {
            Err(Error::Internal {
                thread: "shard fetch".into(),
                reason: why,
            })
        },
    );
    if joined {
        Metrics::add(&shared.metrics.shards_coalesced, 1);
    }
    flight.await
}

/// A whole shard through the stream's fetch chain (`crate::chain`): the host daemon, else
/// the disk cache, else (holding the host-wide download lock for it) the origin, then stored
/// in the cache.
pub(super) async fn fetch_shard_once(shared: Arc<Shared>, source: usize, shard: usize) -> Result<(Bytes, WaitOn)> {
    let src = &shared.sources[source];
    let at = ShardAt {
        ds: &src.ds,
        shard,
        id: src.id(shard)?,
        range_bytes: match src.ds.store().origin() {
            Some(o) if !shared.cfg.range_pinned => o.range_bytes(shared.cfg.range_bytes),
            _ => shared.cfg.range_bytes,
        },
        ranges_in_flight: shared.cfg.ranges_in_flight_max,
    };
    let daemon = shared.cfg.provider.as_ref().map(|provider| HostDaemon {
        shared: &shared,
        provider,
        source,
    });
    let mut steps = Vec::with_capacity(4);
    if let Some(d) = &daemon {
        steps.push(Step::Upstream(d));
    }
    if let Some(c) = &shared.cache {
        steps.extend([Step::Cache(c), Step::CacheLocked(c)]);
    }
    steps.push(Step::Origin);
    let got = crate::chain::fetch(&steps, &at, &shared.metrics).await?;
    let via_daemon = got.via_upstream;
    let from = WaitOn::of(got.from, via_daemon);
    let (Some(cache), Some(lock)) = (shared.cache.clone(), got.lock) else {
        return Ok((got.bytes, from));
    };
    if got.from != FetchedFrom::Origin {
        return Ok((got.bytes, from));
    }
    let (id, bytes) = (at.id, got.bytes);
    // Writing the cache copy is off the delivery path; the download lock is
    // held until the copy is in place, so other processes on the host wait for it instead of
    // fetching again. Copies queue behind a disk slower than the link, holding at most
    // `prefetch_bytes_max` of delivered shards, and `INSERTS_IN_FLIGHT_MAX` are written at
    // once. The budget is taken before the shard is delivered, so a copy is never lost to
    // cancellation: either the shard was not delivered, or its copy runs to completion (`Drop`
    // waits for it). The copies are written at low CPU priority (see `Filler`).
    let need = (bytes.len() as u64 / INSERT_PERMIT_BYTES + 1).min(shared.insert_permits as u64) as u32;
    let permit = shared
        .inserts
        .clone()
        .acquire_many_owned(need)
        .await
        .expect("semaphore open");
    let b = bytes.clone();
    let filler = shared.filler.as_ref().expect("a cache has a filler");
    filler.submit(Box::new(move || {
        if let Err(e) = cache.insert(id, &b) {
            tracing::warn!(error = %e, "cache insert failed; the shard was served from memory");
        }
        drop(lock);
        drop(permit);
    }));
    Ok((bytes, from))
}

/// Host-daemon calls in flight in this process: each holds a blocking-pool thread while the
/// daemon works, and an embedded daemon needs threads of the same pool to answer, so they may
/// take at most half of it. Per process: a forked child must not inherit permits held by
/// calls of its parent that it will never see finish (that hung DataLoader workers).
pub(super) static PROVIDER_CALLS: crate::rt::PerProcess<tokio::sync::Semaphore> = crate::rt::PerProcess::new();
