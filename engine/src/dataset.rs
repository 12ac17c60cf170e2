//! A dataset as a whole: its manifest, its shards at the origin, and checks over all of them.

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};

use crate::error::{Error, Result};
use crate::foreign;
use crate::format::{
    verify_shard_bytes, ColumnType, Manifest, ShardExpect, ShardInfo, ShardView, TableReader, Value, MANIFEST_BYTES_MAX,
};
use crate::metrics::Metrics;
use crate::store::{DatasetUrl, Store};

/// The error for shard `bytes` shorter than the manifest's `info` says: a complete shard of its
/// own (the object was replaced by another, smaller one) is "not the manifest's"; anything
/// else is [`Error::Truncated`].
fn short_object(url: &str, bytes: &[u8], info: &ShardInfo) -> Error {
    match ShardView::parse(bytes, url) {
        Ok(v) => Error::corrupt(
            crate::Location::object(url),
            format!(
                "holds a complete shard of {} bytes and {} samples, not the manifest's ({} bytes, {} samples): the object was replaced",
                bytes.len(),
                v.samples(),
                info.bytes,
                info.samples
            ),
        ),
        Err(_) => Error::Truncated {
            object: url.to_owned(),
            expected: info.bytes,
            actual: bytes.len() as u64,
        },
    }
}

/// Claimed object sizes up to this are allocated without asking the object's real size first
/// (a larger claim costs one HEAD: [`Dataset::fetch_shard_parallel`]).
pub const SIZE_CLAIM_UNCHECKED_MAX: u64 = 256 << 20;

/// A dataset's shard table in its store, read a range at a time.
#[derive(Debug, Clone)]
struct StoreTable {
    store: Store,
    key: String,
}

impl StoreTable {
    async fn get(&self, range: std::ops::Range<u64>) -> Result<Bytes> {
        self.store.get_range(&self.key, range).await
    }
}

/// The table's head, already read (asynchronously, when the dataset was opened), and the rest of
/// the table read on demand.
#[derive(Debug)]
struct Prefetched {
    head: Bytes,
    rest: StoreTable,
}

impl TableReader for Prefetched {
    /// Blocks of the table are asked for from synchronous code (the order), which may run on a
    /// runtime worker, on a thread inside `block_on`, or outside any runtime: the read is run to
    /// completion on the process's runtime in each case (`block_in_place` on a worker, so the
    /// runtime keeps its thread count), or, from a single-threaded runtime, on a helper thread.
    fn read(&self, range: std::ops::Range<u64>) -> Result<Bytes> {
        if range.end <= self.head.len() as u64 {
            return Ok(self.head.slice(range.start as usize..range.end as usize));
        }
        if let Some(path) = self.rest.store.local_path(&self.rest.key) {
            // A local table: one positioned read, no runtime involved.
            use std::os::unix::fs::FileExt;
            let url = self.rest.store.url(&self.rest.key);
            let mut buf = vec![0u8; (range.end - range.start) as usize];
            let f = std::fs::File::open(&path).map_err(|e| Error::io(&url, e))?;
            f.read_exact_at(&mut buf, range.start).map_err(|e| Error::io(&url, e))?;
            return Ok(Bytes::from(buf));
        }
        let get = self.rest.get(range);
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(|| h.block_on(get))
            }
            Ok(_) => {
                let rt = crate::rt::handle()?;
                std::thread::scope(|s| s.spawn(|| rt.block_on(get)).join())
                    .unwrap_or_else(|_| Err(Error::invalid(&self.rest.key, "the shard table read panicked")))
            }
            Err(_) => crate::rt::handle()?.block_on(get),
        }
    }

    /// A local table is read a piece at a time into one buffer (a counts section of millions
    /// of shards is never held as read); a stored one in one request, cut.
    fn read_pieces(&self, range: std::ops::Range<u64>, piece: usize, f: &mut dyn FnMut(&[u8])) -> Result<()> {
        let Some(path) = self
            .rest
            .store
            .local_path(&self.rest.key)
            .filter(|_| range.end > self.head.len() as u64)
        else {
            let b = self.read(range)?;
            b.chunks(piece.max(1)).for_each(f);
            return Ok(());
        };
        use std::os::unix::fs::FileExt;
        let url = self.rest.store.url(&self.rest.key);
        let file = std::fs::File::open(&path).map_err(|e| Error::io(&url, e))?;
        let mut buf = vec![0u8; piece.max(1).min((range.end - range.start) as usize)];
        let mut at = range.start;
        while at < range.end {
            let n = buf.len().min((range.end - at) as usize);
            file.read_exact_at(&mut buf[..n], at).map_err(|e| Error::io(&url, e))?;
            f(&buf[..n]);
            at += n as u64;
        }
        Ok(())
    }
}

/// Checks a shard file (a shard or a columns sidecar) against its manifest entry: whole-file
/// checksum (footer and manifest) and size.
/// `hashed`: the checksum of the bytes before the footer, when the caller already has it.
fn check_listed(
    view: &ShardView<'_>,
    len: usize,
    what: &str,
    bytes: u64,
    expect: u64,
    url: &str,
    hashed: Option<u64>,
) -> Result<()> {
    let sum = view.check_checksum_hashed(hashed)?;
    if sum != expect || len as u64 != bytes {
        return Err(Error::corrupt(
            crate::Location::object(url),
            format!(
                "{what} is {len} bytes with checksum {sum:016x}; the manifest says {bytes} bytes with {expect:016x}"
            ),
        ));
    }
    Ok(())
}

/// The whole-shard checksum of a shard arriving in pieces, computed on the pieces that arrive
/// in order (each while still in the CPU's cache); [`InOrderHash::finish`] hashes the rest.
struct InOrderHash {
    hasher: crate::format::ShardHasher,
    /// Bytes hashed so far: `[0, next)`.
    next: usize,
    /// Bytes covered by the checksum (all but the footer); `None` for a shard too short to
    /// have one (its check fails on its structure).
    limit: Option<usize>,
}

impl InOrderHash {
    fn new(len: usize) -> Self {
        InOrderHash {
            hasher: Default::default(),
            next: 0,
            limit: len.checked_sub(crate::format::FOOTER_LEN as usize),
        }
    }

    /// One that hashes nothing (its `finish` is `None`).
    fn off() -> Self {
        InOrderHash {
            hasher: Default::default(),
            next: 0,
            limit: None,
        }
    }

    /// Bytes `b`, written at `at`.
    fn seen(&mut self, at: usize, b: &[u8]) {
        let Some(limit) = self.limit else { return };
        if at < self.next {
            // Rewritten (a range retried): start again; `finish` hashes what is left.
            *self = InOrderHash::new(limit + crate::format::FOOTER_LEN as usize);
        }
        if at == self.next && at < limit {
            let n = b.len().min(limit - at);
            self.hasher.update(&b[..n]);
            self.next += n;
        }
    }

    /// The checksum of `all`, the bytes every piece was written into.
    fn finish(mut self, all: &[u8]) -> Option<u64> {
        let limit = self.limit?;
        if all.len() != limit + crate::format::FOOTER_LEN as usize {
            return None;
        }
        self.hasher.update(&all[self.next..limit]);
        Some(self.hasher.digest())
    }
}

/// An opened dataset: a store prefix plus its parsed, validated manifest.
#[derive(Debug, Clone)]
pub struct Dataset {
    store: Store,
    manifest: Manifest,
    manifest_url: String,
    /// A foreign dataset opened without `ramjet index`: the folder of its learned manifest
    /// (`crate::foreign::open_learned`), where its sample indexes are.
    learned: Option<Store>,
}

/// One problem found by [`Dataset::verify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardProblem {
    /// Shard number in the manifest.
    pub shard: usize,
    /// Full URL of the shard object.
    pub url: String,
    /// Sample index inside the shard, when the problem is one sample.
    pub sample: Option<u64>,
    /// The sample's global index, when the problem is one sample.
    pub global_sample: Option<u64>,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for ShardProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {} ({})", self.shard, self.url)?;
        if let (Some(s), Some(g)) = (self.sample, self.global_sample) {
            write!(f, " sample {s} (global {g})")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// The result of [`Dataset::verify`].
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Shards checked.
    pub shards: usize,
    /// Shards with at least one problem.
    pub shards_bad: usize,
    /// Samples the manifest lists.
    pub samples: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Every problem, ordered by shard.
    pub problems: Vec<ShardProblem>,
}

impl VerifyReport {
    /// True when no problem was found.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl Dataset {
    /// Opens the dataset at `url` (a prefix, or a manifest `.json`), reading and validating
    /// its manifest.
    ///
    /// A foreign dataset named itself (an MDS `index.json`, a tar, a brace pattern of tars or
    /// a shard list), or an MDS folder without a ramjet manifest, is read in place through the
    /// index this host learned on first open (`crate::foreign::open_learned`).
    pub async fn open(url: &str) -> Result<Dataset> {
        if crate::foreign::names_foreign_source(url) {
            return Self::open_learned(url).await;
        }
        let loc = DatasetUrl::parse(url);
        let store = Store::open(&loc.prefix_url)?;
        Self::open_in(store, &loc.manifest_key).await
    }

    /// Opens a dataset that is about to be streamed: as [`Dataset::open`], and while the
    /// manifest is read, connections for the first batch's reads are opened
    /// ([`Store::preconnect`]).
    pub async fn open_to_stream(url: &str) -> Result<Dataset> {
        if crate::foreign::names_foreign_source(url) {
            return Self::open_learned(url).await;
        }
        let loc = DatasetUrl::parse(url);
        let store = Store::open(&loc.prefix_url)?;
        store.preconnect(&loc.manifest_key);
        Self::open_in(store, &loc.manifest_key).await
    }

    /// Opens the dataset whose manifest is `manifest_key` in `store`.
    pub async fn open_in(store: Store, manifest_key: &str) -> Result<Dataset> {
        // One name for one dataset: a plain path is named by its absolute `file://` URL.
        let manifest_url = store.canonical_url(manifest_key);
        // One request, not a HEAD then a GET: on a 20 ms link every round trip before the
        // first batch shows.
        let got = match store.get_at_most(manifest_key, MANIFEST_BYTES_MAX).await {
            Err(Error::NotFound { key }) if manifest_key == crate::format::MANIFEST_NAME => {
                // A MosaicML dataset without its ramjet index: read in place, learned.
                if store.size("index.json").await.is_ok() {
                    return Self::open_learned(&store.url("index.json")).await;
                }
                // A folder of Parquet files (a Hugging Face dataset's split): the same.
                if let Ok((_, files)) = store.list_dir("").await {
                    if files.iter().any(|(n, _)| n.ends_with(".parquet")) {
                        return Self::open_learned(&store.url("*.parquet")).await;
                    }
                    let has = |name: &str| files.iter().any(|(n, _)| n == name);
                    if has("state.json") && files.iter().any(|(n, _)| n.ends_with(".arrow")) {
                        return Err(Error::invalid(
                            store.url(""),
                            "a Hugging Face `save_to_disk` folder (Arrow IPC streams) is not read in place: \
                             write it as Parquet (`Dataset.to_parquet`), which ramjet reads in place",
                        ));
                    }
                }
                return Err(Error::NotFound { key });
            }
            other => other?,
        };
        let bytes = match got {
            Ok(b) => b,
            Err(size) => {
                return Err(Error::Manifest {
                    object: manifest_url,
                    reason: format!("{size} bytes exceeds the limit of {MANIFEST_BYTES_MAX}"),
                })
            }
        };
        let mut manifest = Manifest::parse(&bytes, &manifest_url)?;
        if let Some(t) = manifest.table_to_load().cloned() {
            // A large dataset's shards are listed in a binary table beside the manifest: its
            // head is read now, each block of records when first used.
            let reader = StoreTable {
                store: store.clone(),
                key: t.key.clone(),
            };
            let url = store.url(&t.key);
            let (head, size) = futures::future::try_join(
                reader.get(0..crate::format::shard_table_head_len(t.shards)),
                store.size(&t.key),
            )
            .await?;
            if size != t.bytes {
                return Err(Error::Manifest {
                    object: url,
                    reason: format!("{size} bytes, the manifest says {}", t.bytes),
                });
            }
            manifest.attach_table(std::sync::Arc::new(Prefetched { head, rest: reader }), &url)?;
        }
        Ok(Dataset {
            store,
            manifest,
            manifest_url,
            learned: None,
        })
    }

    async fn open_learned(url: &str) -> Result<Dataset> {
        let l = crate::foreign::open_learned(url).await?;
        Ok(Dataset {
            store: l.store,
            manifest: l.manifest,
            manifest_url: l.url,
            learned: Some(l.index),
        })
    }

    /// Where the sample indexes of a plain foreign shard are: beside the shards (`ramjet
    /// index`), or in this host's learned manifest.
    pub fn index_store(&self) -> &Store {
        self.learned.as_ref().unwrap_or(&self.store)
    }

    /// The folder of this host's learned manifest, for a foreign dataset opened without
    /// `ramjet index`.
    pub fn learned_index_url(&self) -> Option<String> {
        self.learned
            .as_ref()
            .map(|s| s.url("").trim_end_matches('/').to_owned())
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// URL of the manifest object.
    pub fn manifest_url(&self) -> &str {
        &self.manifest_url
    }

    /// The store the shards live in.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Downloads shard `i` whole and checks it (see [`Dataset::check_shard`]). Returns the
    /// bytes only when they are sound.
    pub async fn fetch_shard(&self, i: usize) -> Result<Bytes> {
        let info = self.manifest.shard(i)?;
        let stored = self.get_stored(&info).await?;
        let (bytes, hashed) = self.as_ramjet_shard(&info, stored).await?;
        self.check_shard_hashed(i, &bytes, hashed)?;
        Ok(bytes)
    }

    /// Shard `info`'s object as stored, read whole: the object at its key, or a Parquet row
    /// group's bytes in its file.
    async fn get_stored(&self, info: &ShardInfo) -> Result<Bytes> {
        match info
            .foreign
            .as_ref()
            .and_then(|f| f.parquet.as_ref().map(|p| (p, f.bytes)))
        {
            Some((p, n)) => self.store.get_range(&p.file, p.offset..p.offset + n).await,
            None => self.store.get(&info.key).await,
        }
    }

    /// A shard object as stored, as a ramjet shard: itself, or, for a foreign shard (MDS,
    /// WebDataset, a Parquet row group), the ramjet shard it transcodes to once its size and
    /// xxh3 are checked against the manifest (`crate::foreign`), with that shard's checksum.
    /// The result is for [`Dataset::check_shard`] to check, as any ramjet shard.
    pub async fn as_ramjet_shard(&self, info: &ShardInfo, stored: Bytes) -> Result<(Bytes, Option<u64>)> {
        let (Some(obj), Some(spec)) = (&info.foreign, self.manifest.foreign()) else {
            return Ok((stored, None));
        };
        let url = self.store.url(&info.key);
        foreign::check_object(&stored, obj, &url)?;
        if let Some(part) = &obj.parquet {
            let footer = foreign::parquet_footer::footer(&self.store, part).await?;
            let schema = &self.manifest.schema;
            let built = foreign::parquet_rows::transcode_row_group(spec, schema, &footer, part, stored, &url)?;
            return Ok((Bytes::from(built.bytes), Some(built.checksum)));
        }
        let plain;
        let data: &[u8] = match &obj.compression {
            Some(c) => {
                // The transcoded shard holds every byte of every value: the decompressed one
                // adds only its layout (MDS: a few bytes a sample and column, and the config;
                // a tar: at most 4 KiB of headers and padding a member, pax ones included).
                // That bounds what a damaged object may decompress to.
                let layout = info
                    .samples
                    .saturating_mul(self.manifest.schema.columns.len() as u64 * 4096);
                let max_out = info.bytes.saturating_add(layout).saturating_add(1 << 20);
                plain = foreign::decompress(&stored, Some(c), max_out, &url)?;
                &plain
            }
            None => &stored,
        };
        let transcode = || foreign::transcode(spec, &self.manifest.schema, data, &url);
        // Adding restart markers takes a few ms a JPEG, seconds a shard (on every core): a
        // runtime worker hands its other tasks on meanwhile.
        let built = match tokio::runtime::Handle::try_current() {
            Ok(h)
                if spec.jpeg_restart_px.is_some()
                    && h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread =>
            {
                tokio::task::block_in_place(transcode)?
            }
            _ => transcode()?,
        };
        let sum = built.checksum;
        Ok((Bytes::from(built.bytes), Some(sum)))
    }

    /// Downloads shard `i` as parallel ranged GETs of `range_bytes` (`in_flight` at once),
    /// assembled into one aligned buffer and checked. A shard that fails its check is fetched
    /// once more before the error is returned. Requests and bytes are counted in `metrics`.
    pub async fn fetch_shard_parallel(
        &self,
        i: usize,
        range_bytes: u64,
        in_flight: usize,
        metrics: &Metrics,
    ) -> Result<Bytes> {
        let info = &self.manifest.shard(i)?;
        // A foreign shard is fetched as stored, then transcoded (`as_ramjet_shard`).
        let stored_bytes = info.foreign.as_ref().map_or(info.bytes, |f| f.bytes);
        // A Parquet row group is read from its file, at its offset there.
        let (key, base) = info
            .foreign
            .as_ref()
            .map_or((info.key.as_str(), 0), |f| f.stored_at(&info.key));
        match info.foreign.as_ref().and_then(|f| f.parquet.as_ref()) {
            Some(p) => self.check_claimed_size(&p.file, p.file_bytes).await?,
            None => self.check_claimed_size(&info.key, stored_bytes).await?,
        }
        let part = range_bytes.max(1 << 16);
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Each range streams straight into its place in one pooled buffer: no part is
            // buffered on its own and copied again.
            // SAFETY: every range's bytes are written by `get_range_into`, which fails unless it
            // filled its whole slice; the ranges cover [0, bytes), so on success every byte was
            // written, and on failure the buffer is dropped unread.
            let buf = usize::try_from(stored_bytes)
                .ok()
                .and_then(|n| unsafe { crate::buf::BufPool::global().try_take(n) });
            let Some(mut buf) = buf else {
                return Err(Error::io(
                    self.store.url(&info.key),
                    std::io::Error::new(
                        std::io::ErrorKind::OutOfMemory,
                        format!("no memory for the shard's {stored_bytes} bytes"),
                    ),
                ));
            };
            // The checksum is computed as the bytes arrive, while they are in the CPU's cache,
            // as far as they arrive in order (all of a shard fetched as one range); the rest
            // is hashed when every range is in.
            // (A foreign object is hashed whole when it is checked: nothing to hash here.)
            let hash = std::sync::Mutex::new(if info.foreign.is_some() {
                InOrderHash::off()
            } else {
                InOrderHash::new(stored_bytes as usize)
            });
            let mut gets = Vec::new();
            for (n, dst) in buf.as_mut_slice().chunks_mut(part as usize).enumerate() {
                let at = (n as u64 * part) as usize;
                let hash = &hash;
                gets.push(self.store.get_range_into_seen(
                    key,
                    base + at as u64..base + (at + dst.len()) as u64,
                    dst,
                    move |off, b| hash.lock().expect("hash lock").seen(at + off, b),
                ));
            }
            let requests = gets.len() as u64;
            let got = futures::stream::iter(gets)
                .buffer_unordered(in_flight.max(1))
                .try_collect::<()>()
                .await;
            if let Err(e) = got {
                return Err(self.explain_short(info, e).await);
            }
            Metrics::add(&metrics.origin_requests, requests);
            Metrics::add(&metrics.origin_bytes, stored_bytes);
            let bytes = buf.into_bytes();
            let checked = if info.foreign.is_some() {
                match self.as_ramjet_shard(info, bytes).await {
                    Ok((b, sum)) => self.check_shard_hashed(i, &b, sum).map(|()| b),
                    Err(e) => Err(e),
                }
            } else {
                let sum = hash.into_inner().expect("hash lock").finish(&bytes);
                self.check_shard_hashed(i, &bytes, sum).map(|()| bytes)
            };
            match checked {
                Ok(bytes) => return Ok(bytes),
                Err(e) if attempt < 2 && e.is_data_error() => {
                    tracing::warn!(error = %e, "shard from origin failed verification; fetching again");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// `e` from a read of the ramjet shard `info`, named better when it says the object is
    /// shorter than the manifest's size: the object, read whole, is then either a torn shard
    /// ([`Error::Truncated`]) or another complete shard ("not the manifest's": replaced).
    /// Every path that reads a shard (whole or by ranges) names a replaced one the same way.
    pub(crate) async fn explain_short(&self, info: &ShardInfo, e: Error) -> Error {
        let short = matches!(&e, Error::Truncated { actual, .. } if *actual < info.bytes);
        if !short || info.foreign.is_some() {
            return e;
        }
        match self.store.get_at_most(&info.key, info.bytes).await {
            Ok(Ok(b)) => short_object(&self.store.url(&info.key), &b, info),
            _ => e,
        }
    }

    /// A claimed object size above [`SIZE_CLAIM_UNCHECKED_MAX`] is checked against the object
    /// itself (one HEAD) before a buffer that large is allocated: a manifest is a claim, and a
    /// re-hashed one can say 16 GiB for a 1 MB object. A size that differs is an error naming
    /// both sizes ("not the manifest's object"); a smaller claim is allocated as it is (the
    /// ranged GETs then find any difference).
    async fn check_claimed_size(&self, key: &str, claimed: u64) -> Result<()> {
        if claimed <= SIZE_CLAIM_UNCHECKED_MAX {
            return Ok(());
        }
        let real = self.store.size(key).await?;
        if real != claimed {
            return Err(Error::corrupt(
                crate::Location::object(self.store.url(key)),
                format!("the object is {real} bytes, the manifest says {claimed}: not the manifest's object"),
            ));
        }
        Ok(())
    }

    /// Checks shard `i`'s bytes against the manifest: size, structure, whole-shard checksum
    /// (footer and manifest) and schema.
    pub fn check_shard(&self, i: usize, bytes: &[u8]) -> Result<()> {
        self.check_shard_hashed(i, bytes, None)
    }

    /// [`Dataset::check_shard`], with the checksum of the bytes before the footer already
    /// computed (as they arrived) when `hashed` is given.
    fn check_shard_hashed(&self, i: usize, bytes: &[u8], hashed: Option<u64>) -> Result<()> {
        let info = &self.manifest.shard(i)?;
        let url = self.store.url(&info.key);
        if (bytes.len() as u64) < info.bytes {
            return Err(short_object(&url, bytes, info));
        }
        let view = ShardView::parse(bytes, &url)?;
        let expect = info.checksum_u64();
        check_listed(&view, bytes.len(), "shard", info.bytes, expect, &url, hashed)?;
        if view.samples() != info.samples {
            return Err(Error::corrupt(
                crate::Location::object(&url),
                format!(
                    "the shard holds {} samples; the manifest says {}",
                    view.samples(),
                    info.samples
                ),
            ));
        }
        if view.schema() != &self.manifest.schema {
            return Err(Error::SchemaMismatch {
                object: url.clone(),
                expected: self.manifest.schema.describe(),
                found: view.schema().describe(),
            });
        }
        Ok(())
    }

    /// Columns `names` of every sample of shard `i`, one vector per name, in sample order.
    /// They come from the shard's columns sidecar when it has one (labels and sizes without
    /// the images: a few KB instead of the shard), else from the whole shard. Both are
    /// verified: size, structure, checksum against the manifest, and every record's checksum.
    /// A `bytes` column is refused: it is what the sidecar leaves out.
    pub async fn shard_columns(&self, i: usize, names: &[String]) -> Result<Vec<Vec<Value>>> {
        let info = &self.manifest.shard(i)?;
        let mut pick = Vec::with_capacity(names.len());
        for n in names {
            match self.manifest.schema.columns.iter().find(|c| &c.name == n) {
                None => {
                    return Err(Error::invalid(
                        format!("column {n:?}"),
                        format!("the dataset's columns are {}", self.manifest.schema.describe()),
                    ))
                }
                Some(c) if c.ty == ColumnType::Bytes => {
                    return Err(Error::invalid(
                        format!("column {n:?}"),
                        "a bytes column is read per sample, not as a table",
                    ))
                }
                Some(_) => pick.push(n.as_str()),
            }
        }
        let (bytes, url) = match &info.columns {
            Some(c) => {
                let url = self.store.url(&c.key);
                let bytes = self.store.get(&c.key).await?;
                (bytes, url)
            }
            None => (self.fetch_shard(i).await?, self.store.url(&info.key)),
        };
        let view = ShardView::parse(&bytes, &url)?;
        if let Some(c) = &info.columns {
            let expect = c.checksum_u64();
            check_listed(&view, bytes.len(), "columns sidecar", c.bytes, expect, &url, None)?;
            let want = self.manifest.schema.without_bytes();
            if view.samples() != info.samples || Some(view.schema()) != want.as_ref() {
                return Err(Error::corrupt(
                    crate::Location::object(&url),
                    format!(
                        "columns sidecar holds {} samples of [{}]; the manifest's shard has {} samples of [{}]",
                        view.samples(),
                        view.schema().describe(),
                        info.samples,
                        want.map(|w| w.describe()).unwrap_or_default()
                    ),
                ));
            }
        }
        let idx: Vec<usize> = pick
            .iter()
            .map(|n| view.schema().index_of(n).expect("checked against the schema"))
            .collect();
        let mut out: Vec<Vec<Value>> = vec![Vec::with_capacity(info.samples as usize); idx.len()];
        for j in 0..view.samples() {
            let vals = view.sample(j)?;
            for (o, &k) in out.iter_mut().zip(&idx) {
                o.push(vals[k].to_owned_value());
            }
        }
        Ok(out)
    }

    /// Checks shard `i`'s columns sidecar on its own (see [`Dataset::shard_columns`]) and
    /// against the shard's own `bytes` (already read): the same values, sample by sample.
    async fn verify_sidecar(&self, i: usize, shard: &[u8], url: &str) -> Option<String> {
        let names: Vec<String> = self
            .manifest
            .schema
            .without_bytes()?
            .columns
            .into_iter()
            .map(|c| c.name)
            .collect();
        let side = match self.shard_columns(i, &names).await {
            Ok(s) => s,
            Err(e) => return Some(e.to_string()),
        };
        let view = ShardView::parse(shard, url).ok()?;
        let idx: Vec<usize> = names.iter().filter_map(|n| view.schema().index_of(n)).collect();
        for j in 0..view.samples() {
            let vals = view.sample(j).ok()?;
            for (col, &k) in side.iter().zip(&idx) {
                if col.get(j as usize) != Some(&vals[k].to_owned_value()) {
                    return Some(format!(
                        "columns sidecar disagrees with the shard at sample {j}, column {:?}",
                        view.schema().columns[k].name
                    ));
                }
            }
        }
        None
    }

    /// [`Dataset::shard_columns`] over every shard, `parallel` at once, concatenated in sample
    /// order.
    pub async fn columns(&self, names: &[String], parallel: usize) -> Result<Vec<Vec<Value>>> {
        let parts: Vec<Vec<Vec<Value>>> = stream::iter(0..self.manifest.shard_count())
            .map(|i| self.shard_columns(i, names))
            .buffered(parallel.max(1))
            .try_collect()
            .await?;
        let mut out: Vec<Vec<Value>> = vec![Vec::with_capacity(self.manifest.samples as usize); names.len()];
        for part in parts {
            for (o, p) in out.iter_mut().zip(part) {
                o.extend(p);
            }
        }
        Ok(out)
    }

    /// Checks a plain foreign shard's sample index (`crate::foreign::SampleIndexRef`)
    /// against the shard: its size and checksum, and for every sample, that its span of the
    /// object transcodes alone to the record the whole shard transcodes to. Returns each
    /// problem, with its sample where it is one sample's.
    async fn verify_sample_index(&self, info: &ShardInfo, stored: &[u8], rjs: &[u8]) -> Vec<(Option<u64>, String)> {
        let (Some(ix), Some(spec)) = (
            info.foreign.as_ref().and_then(|f| f.index.as_ref()),
            self.manifest.foreign(),
        ) else {
            return Vec::new();
        };
        let got = match self.index_store().get(&ix.key).await {
            Ok(b) => b,
            Err(e) => return vec![(None, e.to_string())],
        };
        let sum = xxhash_rust::xxh3::xxh3_64(&got);
        if got.len() as u64 != ix.bytes || ix.checksum != sum {
            return vec![(
                None,
                format!(
                    "the sample index of {}: {} bytes hashing to {sum:016x}; the manifest says {} bytes, {}",
                    info.key,
                    got.len(),
                    ix.bytes,
                    ix.checksum
                ),
            )];
        }
        let url = self.store.url(&info.key);
        let mut out = Vec::new();
        for (i, e) in got.chunks_exact(24).enumerate() {
            let e = crate::format::IndexEntry::parse(e);
            let at = crate::Location::sample(&url, i as u64);
            let whole =
                crate::format::IndexEntry::parse(&rjs[crate::format::Header::entry_offset(i as u64) as usize..][..24]);
            let alone = e
                .offset
                .checked_add(e.len)
                .filter(|&end| end <= stored.len() as u64)
                .ok_or_else(|| format!("its span [{}, +{}) is outside the object", e.offset, e.len))
                .and_then(|end| {
                    foreign::transcode_sample(
                        spec,
                        &self.manifest.schema,
                        &stored[e.offset as usize..end as usize],
                        &at,
                    )
                    .map_err(|err| err.to_string())
                });
            match alone {
                Ok(rec)
                    if crate::format::sample_checksum(i as u64, &rec) == e.checksum && e.checksum == whole.checksum => {
                }
                Ok(_) => out.push((
                    Some(i as u64),
                    "its span does not read as the sample the shard holds".to_owned(),
                )),
                Err(m) => out.push((Some(i as u64), m)),
            }
        }
        out
    }

    /// Byte offset of the first record in every shard of this dataset: the header, the index
    /// and the schema (which every shard shares with the manifest) come first.
    pub fn data_offset(&self, shard: usize) -> Result<u64> {
        Ok(crate::format::Header::entry_offset(self.manifest.shard_samples(shard)?)
            + self.manifest.schema.to_canonical_json().len() as u64)
    }

    /// Re-reads every shard and checks every checksum: shard sizes, whole-shard checksums,
    /// headers, schemas, sample counts and every sample's checksum and structure.
    /// `parallelism` shards are checked at once; `progress` is called with bytes read.
    pub async fn verify(&self, parallelism: usize, progress: impl Fn(u64) + Sync) -> VerifyReport {
        let progress = &progress;
        let table_url = self.manifest.table_ref().map(|t| self.store.url(&t.key));
        let table_url = &table_url;
        let mut results: Vec<(usize, Vec<ShardProblem>, u64)> = stream::iter(self.manifest.shards().enumerate())
            .map(|(i, info)| {
                let listed = info.and_then(|info| Ok((self.manifest.shard_start(i)?, info)));
                async move {
                    // A damaged block of the shard table: every shard it lists is unreadable.
                    let (start, info) = match listed {
                        Ok(x) => x,
                        Err(e) => {
                            let p = ShardProblem {
                                shard: i,
                                url: table_url.clone().unwrap_or_default(),
                                sample: None,
                                global_sample: None,
                                message: e.to_string(),
                            };
                            return (i, vec![p], 0);
                        }
                    };
                    let (probs, n) = self.verify_one(i, start, &info, progress).await;
                    (i, probs, n)
                }
            })
            .buffer_unordered(parallelism.max(1))
            .collect()
            .await;
        results.sort_by_key(|r| r.0);
        let mut report = VerifyReport {
            shards: self.manifest.shard_count(),
            samples: self.manifest.samples,
            ..Default::default()
        };
        for (_, probs, n) in results {
            report.bytes_read += n;
            if !probs.is_empty() {
                report.shards_bad += 1;
            }
            report.problems.extend(probs);
        }
        report
    }

    /// Verifies shard `i` (its first sample is `start` in the dataset): the stored object, the
    /// ramjet shard it is or transcodes to, a foreign shard's sample index, the sidecar. Returns
    /// its problems and the bytes read.
    async fn verify_one(
        &self,
        i: usize,
        start: u64,
        info: &ShardInfo,
        progress: &(impl Fn(u64) + Sync),
    ) -> (Vec<ShardProblem>, u64) {
        let url = self.store.url(&info.key);
        let problem = |sample: Option<u64>, message: String| ShardProblem {
            shard: i,
            url: url.clone(),
            sample,
            global_sample: sample.map(|s| start + s),
            message,
        };
        let stored = match self.get_stored(info).await {
            Ok(b) => b,
            Err(e) => return (vec![problem(None, e.to_string())], 0),
        };
        progress(stored.len() as u64);
        // A foreign shard is checked as stored, then as the ramjet shard it
        // transcodes to.
        let stored_copy = stored.clone();
        let bytes = match self.as_ramjet_shard(info, stored).await {
            Ok((b, _)) => b,
            Err(e) => {
                let sample = match &e {
                    Error::Corrupt { at, .. } => at.sample,
                    _ => None,
                };
                return (vec![problem(sample, e.to_string())], 0);
            }
        };
        let expect = ShardExpect {
            bytes: info.bytes,
            samples: info.samples,
            checksum: info.checksum_u64(),
            schema: &self.manifest.schema,
        };
        let n = bytes.len() as u64;
        // Hashing a 64 MiB shard is CPU work: keep it off the I/O threads.
        let (bytes2, url2, expect_schema) = (bytes.clone(), url.clone(), self.manifest.schema.clone());
        let found = tokio::task::spawn_blocking(move || {
            let e = ShardExpect {
                schema: &expect_schema,
                ..expect
            };
            verify_shard_bytes(&bytes2, &url2, &e)
        })
        .await
        .expect("verify task panicked");
        let mut probs: Vec<ShardProblem> = found.into_iter().map(|p| problem(p.sample, p.message)).collect();
        if let Some(ix) = info.foreign.as_ref().and_then(|f| f.index.as_ref()) {
            let ix_url = self.index_store().url(&ix.key);
            for (sample, p) in self.verify_sample_index(info, &stored_copy, &bytes).await {
                probs.push(ShardProblem {
                    url: ix_url.clone(),
                    ..problem(sample, p)
                });
            }
        }
        if let Some(c) = &info.columns {
            let side_url = self.store.url(&c.key);
            if let Some(p) = self.verify_sidecar(i, &bytes, &url).await {
                probs.push(ShardProblem {
                    url: side_url,
                    ..problem(None, p)
                });
            }
        }
        (probs, n)
    }
}

#[cfg(test)]
mod tests {
    use super::InOrderHash;
    use crate::format::{shard_checksum, FOOTER_LEN};

    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    /// Feeds `pieces` (start, end) of `all` in the order given, as the ranges would.
    fn run(all: &[u8], pieces: &[(usize, usize)]) -> Option<u64> {
        let mut h = InOrderHash::new(all.len());
        for &(a, b) in pieces {
            h.seen(a, &all[a..b]);
        }
        h.finish(all)
    }

    #[test]
    fn in_order_out_of_order_and_retried_pieces_give_the_shard_checksum() {
        let all = bytes(10_000);
        let want = Some(shard_checksum(&all[..all.len() - FOOTER_LEN as usize]));
        // In order, the last piece running into the footer.
        assert_eq!(run(&all, &[(0, 4000), (4000, 9000), (9000, 10_000)]), want);
        // Two ranges interleaved: the second's pieces arrive before the cursor reaches them.
        assert_eq!(
            run(&all, &[(0, 2000), (5000, 7000), (2000, 5000), (7000, 10_000)]),
            want
        );
        // The first range retried from its start after part of it was hashed.
        assert_eq!(run(&all, &[(0, 3000), (0, 3000), (3000, 10_000)]), want);
        // A later range retried.
        assert_eq!(
            run(&all, &[(0, 5000), (5000, 8000), (5000, 8000), (8000, 10_000)]),
            want
        );
        // Nothing arrived in order: all hashed at the end.
        assert_eq!(run(&all, &[(5000, 10_000)]), want);
        // A flipped byte in a piece hashed as it arrived changes the checksum.
        let mut other = all.clone();
        other[1_000] ^= 1;
        assert_ne!(run(&other, &[(0, 10_000)]), want);
    }

    #[test]
    fn a_shard_shorter_than_its_footer_has_no_checksum() {
        let all = bytes(10);
        assert_eq!(run(&all, &[(0, 10)]), None);
    }
}
