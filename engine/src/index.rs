//! A ramjet manifest over a foreign dataset's shards (MosaicML MDS or WebDataset tars), without
//! copying them: written beside them by `ramjet index`, or learned on first read by
//! [`crate::Dataset::open`] and kept in the host's index folder (`crate::dataset::index_dir`).
//!
//! Each shard is read once, checked (MDS: its own xxHash hashes from `index.json`; its sample
//! count), decompressed and transcoded to the ramjet shard a reader will make of it
//! (`crate::format::foreign`). The manifest records, per shard, the object's size and
//! xxh3-64 as stored and the transcoded shard's size, sample count and checksum; the
//! transcoded shard's index holds every sample's checksum. From then on every read is checked
//! as a ramjet shard's is. Whoever writes the manifest writes it last, after the sample indexes
//! it names.

use crate::error::Invalid;
use std::collections::BTreeSet;

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use serde_json::{Map, Value as Json};
use xxhash_rust::xxh3::xxh3_64;

use crate::format::foreign::{
    self, mds, sample_index_key, wds, ForeignFormat, ForeignObject, ForeignSpec, SampleIndexRef,
};
use crate::format::{Manifest, Schema, ShardInfo};
use crate::{Error, Result, Store};

/// Shards read at once.
const IN_FLIGHT: usize = 4;

/// What indexing a foreign dataset found.
#[derive(Debug)]
pub struct Indexed {
    /// The manifest over its shards (not yet written anywhere).
    pub manifest: Manifest,
    /// Bytes of foreign shards read.
    pub bytes_read: u64,
    /// Hashes from the foreign index that were checked (MDS `xxh64`, `xxh3_64`).
    pub foreign_hashes_checked: usize,
}

/// A foreign source: where its manifest goes, and its shards' keys relative to there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignSource {
    /// Its format.
    pub format: ForeignFormat,
    /// The dataset prefix (the MDS directory, or the folder of the tars).
    pub prefix: String,
    /// WebDataset: the tars' keys, relative to `prefix`, in order (MDS: from `index.json`).
    pub tars: Vec<String>,
}

/// Expands WebDataset's brace patterns: `{000..009}` (a zero-padded range) and `{a,b}`.
pub fn expand_braces(pattern: &str) -> std::result::Result<Vec<String>, Invalid> {
    let Some(open) = pattern.find('{') else {
        return Ok(vec![pattern.to_owned()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| c + open)
        .ok_or_else(|| format!("{pattern:?}: a '{{' without its '}}'"))?;
    let (head, body, tail) = (&pattern[..open], &pattern[open + 1..close], &pattern[close + 1..]);
    let items: Vec<String> = if let Some((a, b)) = body.split_once("..") {
        let (lo, hi) = (
            a.parse::<u64>()
                .map_err(|_| format!("{pattern:?}: {a:?} is not a number"))?,
            b.parse::<u64>()
                .map_err(|_| format!("{pattern:?}: {b:?} is not a number"))?,
        );
        if hi < lo || hi - lo > 10_000_000 {
            return Err(Invalid::from(format!(
                "{pattern:?}: the range {lo}..{hi} is empty or too long"
            )));
        }
        let width = a.len();
        (lo..=hi).map(|i| format!("{i:0width$}")).collect()
    } else {
        body.split(',').map(str::to_owned).collect()
    };
    let mut out = Vec::new();
    for it in items {
        for rest in expand_braces(tail)? {
            out.push(format!("{head}{it}{rest}"));
        }
    }
    Ok(out)
}

impl ForeignSource {
    /// Reads what `src` names: a folder or prefix holding an MDS `index.json`; a WebDataset
    /// brace pattern (`.../train-{000000..000099}.tar`) or one tar; or a shard-list file
    /// (`.txt`, one tar per line, relative to the list's folder).
    pub fn parse(src: &str) -> Result<ForeignSource> {
        let src = src.trim_end_matches('/');
        let is_tar = |s: &str| s.ends_with(".tar") || s.ends_with(".tar.gz") || s.ends_with(".tgz");
        let split = |s: &str| -> (String, String) {
            match s.rsplit_once('/') {
                Some((d, f)) => (d.to_owned(), f.to_owned()),
                None => (".".to_owned(), s.to_owned()),
            }
        };
        if src.ends_with(".txt") {
            let (prefix, _) = split(src);
            return Ok(ForeignSource {
                format: ForeignFormat::Wds,
                prefix,
                tars: Vec::new(), // read by `tars_of_list`
            });
        }
        let (dir, file) = split(src);
        if is_tar(&file) || file.contains('{') {
            if dir.contains('{') {
                return Err(Error::invalid(src, "braces are read in the file name only"));
            }
            let tars = expand_braces(&file).map_err(|r| Error::invalid(src, r))?;
            return Ok(ForeignSource {
                format: ForeignFormat::Wds,
                prefix: dir,
                tars,
            });
        }
        Ok(ForeignSource {
            format: ForeignFormat::Mds,
            prefix: src.to_owned(),
            tars: Vec::new(),
        })
    }
}

/// The tars a shard-list file names (one a line, `#` comments), as keys under its folder.
async fn tars_of_list(store: &Store, list_key: &str, list_url: &str) -> Result<Vec<String>> {
    let text = store.get(list_key).await?;
    let text = std::str::from_utf8(&text).map_err(|e| Error::invalid(list_url, format!("not UTF-8: {e}")))?;
    let tars: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    for t in &tars {
        crate::format::validate_key(t).map_err(|r| {
            Error::invalid(
                list_url,
                format!("{t:?}: {r} (list tars relative to the list's folder)"),
            )
        })?;
    }
    if tars.is_empty() {
        return Err(Error::invalid(list_url, "it lists no tars"));
    }
    Ok(tars)
}

/// One shard to index: its key as stored, its compression, and what its foreign index says.
struct Job {
    key: String,
    compression: Option<String>,
    samples: Option<u64>,
    mds_file: Option<mds::IndexFile>,
    /// MDS: the shard's size once decompressed.
    mds_raw_bytes: Option<u64>,
    /// The object, when it was read already (the first tar, for the columns).
    stored: Option<Bytes>,
}

/// Reads every shard of the foreign dataset `src` from `store` (the source's prefix, see
/// [`ForeignSource`]), checks and transcodes it, and writes each plain shard's sample index into
/// `out` (`ramjet-index/...`). Returns the manifest over them, for the caller to write where
/// the sample indexes are, with `meta` among its `meta`. `progress` is called with bytes read.
/// `jpeg_restart_px` (`ramjet index --jpeg-restarts`): the ramjet shards that the foreign ones
/// transcode to hold their JPEGs with restart markers ([`ForeignSpec::jpeg_restart_px`]).
pub async fn index_into(
    src: &str,
    store: &Store,
    out: &Store,
    meta: Map<String, Json>,
    jpeg_restart_px: Option<u32>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Indexed> {
    let source = ForeignSource::parse(src)?;
    {
        let (spec, schema, jobs, meta) = match source.format {
            ForeignFormat::Mds => {
                let url = store.url("index.json");
                let ix = mds::Index::parse(&store.get("index.json").await?, &url)?;
                let (columns, schema) = ix.columns(&url)?;
                let mut meta = meta;
                meta.insert("foreign_index".into(), Json::from("index.json"));
                let jobs = ix
                    .shards
                    .into_iter()
                    .map(|s| {
                        let raw_bytes = s.raw_data.bytes;
                        let (key, file) = match (s.compression.as_ref(), s.zip_data) {
                            (Some(_), Some(z)) => (z.basename.clone(), z),
                            _ => (s.raw_data.basename.clone(), s.raw_data),
                        };
                        Job {
                            key,
                            compression: s.compression.map(|c| c.split(':').next().unwrap_or(&c).to_owned()),
                            samples: Some(s.samples),
                            mds_file: Some(file),
                            mds_raw_bytes: Some(raw_bytes),
                            stored: None,
                        }
                    })
                    .collect::<Vec<_>>();
                let spec = ForeignSpec {
                    format: ForeignFormat::Mds,
                    columns,
                    jpeg_restart_px,
                };
                (spec, schema, jobs, meta)
            }
            ForeignFormat::Wds => {
                let tars = if source.tars.is_empty() {
                    let list = src.trim_end_matches('/').rsplit('/').next().unwrap_or(src).to_owned();
                    tars_of_list(store, &list, &store.url(&list)).await?
                } else {
                    source.tars.clone()
                };
                let mut jobs: Vec<Job> = tars
                    .iter()
                    .map(|t| Job {
                        key: t.clone(),
                        compression: (t.ends_with(".gz") || t.ends_with(".tgz")).then(|| "gz".to_owned()),
                        samples: None,
                        mds_file: None,
                        mds_raw_bytes: None,
                        stored: None,
                    })
                    .collect();
                // The columns are the first tar's extensions; every other sample must have the
                // same (a sample that differs is an error naming it).
                let first = &mut jobs[0];
                let url = store.url(&first.key);
                let stored = first.stored.insert(store.get(&first.key).await?);
                let data = foreign::decompress(
                    stored,
                    first.compression.as_deref(),
                    foreign::FOREIGN_SHARD_BYTES_MAX,
                    &url,
                )?;
                let samples = wds::samples(&data, &url)?;
                let exts: BTreeSet<String> = samples
                    .iter()
                    .flat_map(|s| s.members.iter().map(|(e, _)| e.clone()))
                    .collect();
                if exts.is_empty() {
                    return Err(Error::invalid(url, "the first tar holds no samples"));
                }
                let (columns, schema) = wds::columns(&exts)?;
                let spec = ForeignSpec {
                    format: ForeignFormat::Wds,
                    columns,
                    jpeg_restart_px,
                };
                (spec, schema, jobs, meta)
            }
        };
        // Keys a manifest may name (relative, inside the folder), checked before any read.
        for j in &jobs {
            crate::format::validate_key(&j.key)
                .map_err(|r| Error::invalid(store.url(&j.key), format!("as a shard key: {r}")))?;
        }
        let hashes = std::sync::atomic::AtomicUsize::new(0);
        let (spec_r, schema_r, store_r, out_r, hashes_r) = (&spec, &schema, store, out, &hashes);
        let results: Vec<Result<(ShardInfo, u64)>> = stream::iter(jobs.into_iter().enumerate())
            .map(|(n, job)| async move {
                let url = store_r.url(&job.key);
                let stored = match job.stored.clone() {
                    Some(b) => b,
                    None => store_r.get(&job.key).await?,
                };
                progress(stored.len() as u64);
                let (spec, schema) = (spec_r.clone(), schema_r.clone());
                let (mut info, checked, sample_index) =
                    tokio::task::spawn_blocking(move || index_one(&job, stored, &spec, &schema, &url))
                        .await
                        .map_err(|e| Error::Internal {
                            thread: "index".into(),
                            reason: e.to_string(),
                        })??;
                hashes_r.fetch_add(checked, std::sync::atomic::Ordering::Relaxed);
                // A plain shard's sample index goes up before the manifest that names it.
                if let (Some(ix), Some(f)) = (sample_index, info.foreign.as_mut()) {
                    let sum = xxh3_64(&ix);
                    let key = sample_index_key(n, sum);
                    let bytes = ix.len() as u64;
                    out_r.put(&key, Bytes::from(ix)).await?;
                    f.index = Some(SampleIndexRef {
                        key,
                        bytes,
                        checksum: format!("{sum:016x}"),
                    });
                }
                let read = info.foreign.as_ref().map_or(0, |f| f.bytes);
                Ok((info, read))
            })
            .buffered(IN_FLIGHT)
            .collect()
            .await;
        let mut shards = Vec::with_capacity(results.len());
        let mut bytes_read = 0;
        for r in results {
            let (info, n) = r?;
            bytes_read += n;
            // MDSWriter leaves an empty shard where one sample exceeds its size limit: it
            // holds nothing to read, so the manifest does not list it.
            if info.samples > 0 {
                shards.push(info);
            }
        }
        if shards.is_empty() {
            return Err(Error::invalid(src, "the dataset holds no samples"));
        }
        let manifest = Manifest::new_foreign(spec.format.name(), schema, meta, shards, spec);
        Ok(Indexed {
            manifest,
            bytes_read,
            foreign_hashes_checked: hashes.into_inner(),
        })
    }
}

/// Bumped when what a learned index holds changes: older ones are then learned again.
const LEARNED_VERSION: u32 = 1;

/// Whether `url` names a foreign dataset itself rather than a ramjet manifest or prefix: an MDS
/// `index.json`, a tar or a brace pattern of tars, or a shard-list `.txt`.
pub fn names_foreign_source(url: &str) -> bool {
    let u = url.trim_end_matches('/');
    let last = u.rsplit('/').next().unwrap_or(u);
    last == "index.json"
        || last.ends_with(".tar")
        || last.ends_with(".tar.gz")
        || last.ends_with(".tgz")
        || last.ends_with(".txt")
}

/// The host's folder of learned indexes: `RAMJET_INDEX_DIR`, else `$XDG_CACHE_HOME/ramjet/index`,
/// else `~/.cache/ramjet/index`.
pub fn index_dir() -> Result<std::path::PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
    };
    if let Some(d) = var("RAMJET_INDEX_DIR") {
        return Ok(d);
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return Ok(d.join("ramjet/index"));
    }
    var("HOME").map(|h| h.join(".cache/ramjet/index")).ok_or_else(|| {
        Error::invalid(
            "RAMJET_INDEX_DIR",
            "unset, and there is no HOME to keep learned indexes under",
        )
    })
}

/// A foreign dataset opened without `ramjet index`: its manifest, learned on this host.
#[derive(Debug)]
pub struct Learned {
    /// The source, as a URL (`s3://bucket/laion/train-{000..009}.tar`): how the dataset is
    /// named from then on, to the daemon and its peers too.
    pub url: String,
    /// Where its shards are.
    pub store: Store,
    /// The learned index's folder: its manifest and sample indexes.
    pub index: Store,
    /// The manifest learned.
    pub manifest: Manifest,
}

/// Opens the foreign dataset `url` names (see [`names_foreign_source`]) without a ramjet
/// manifest beside it. The first open on a host reads every shard once, as `ramjet index`
/// does, and keeps the manifest and sample indexes in a folder of [`index_dir`] named by the
/// source (its URL, and the bytes of its `index.json` or shard list, so that a rewritten list is
/// learned again); later opens read them from there. Processes of a host learning the same
/// source at once take turns (a file lock), so it is read once per host.
pub async fn open_learned(url: &str) -> Result<Learned> {
    let u = url.trim_end_matches('/');
    let (dir, file) = match u.rsplit_once('/') {
        Some((d, f)) if !d.is_empty() && !d.ends_with(':') => (d, f),
        _ => (".", u),
    };
    let store = Store::open(dir)?;
    let canonical = store.url(file);
    // What names the source: its URL, and for MDS or a list, the file saying which shards.
    let max = crate::format::MANIFEST_BYTES_MAX;
    let listing = if file == "index.json" || file.ends_with(".txt") {
        store
            .get_at_most(file, max)
            .await?
            .map_err(|size| Error::invalid(store.url(file), format!("{size} bytes exceeds the limit of {max}")))?
    } else {
        Bytes::new()
    };
    let src = if file == "index.json" { dir } else { u };
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&LEARNED_VERSION.to_le_bytes());
    h.update(canonical.as_bytes());
    // Not the S3 endpoint: a proxy or a host's gateway in front of the same bucket is the same
    // source. One URL naming other bytes elsewhere is found by the objects' checksums.
    h.update(&[0]);
    h.update(&listing);
    let folder = index_dir()?.join(format!("{:016x}", h.digest()));
    std::fs::create_dir_all(&folder).map_err(|e| Error::io(folder.display().to_string(), e))?;
    let index = Store::open(
        folder
            .to_str()
            .ok_or_else(|| Error::invalid(folder.display().to_string(), "not UTF-8"))?,
    )?;
    // Learned already; else learned by another process of this host while this one waited for
    // the lock; else learned by this one, holding the lock.
    let mut lock = None;
    loop {
        if let Some(manifest) = read_learned(&folder, &canonical)? {
            return Ok(Learned {
                url: canonical,
                store,
                index,
                manifest,
            });
        }
        if lock.is_some() {
            break;
        }
        let lock_path = folder.join(".learning");
        lock = Some(
            tokio::task::spawn_blocking(move || crate::cache::lock::FileLock::acquire(&lock_path, true, true, true))
                .await
                .map_err(|e| Error::Internal {
                    thread: "index lock".into(),
                    reason: e.to_string(),
                })?
                .map_err(|e| Error::io(folder.join(".learning").display().to_string(), e))?,
        );
    }
    let t0 = std::time::Instant::now();
    let read = std::sync::atomic::AtomicU64::new(0);
    let shown = std::sync::Mutex::new(t0);
    let progress = |n: u64| {
        let total = read.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
        let mut last = shown.lock().expect("progress lock");
        if last.elapsed() >= std::time::Duration::from_secs(2) {
            *last = std::time::Instant::now();
            eprintln!(
                "ramjet: learning {canonical} (once on this host; `ramjet index` writes it beside the data): {:.0} MiB read",
                total as f64 / (1 << 20) as f64
            );
        }
    };
    let meta = Map::from_iter([("learned_from".to_owned(), Json::from(canonical.clone()))]);
    let ix = index_into(src, &store, &index, meta, None, &progress).await?;
    index
        .put(crate::format::MANIFEST_NAME, Bytes::from(ix.manifest.to_bytes()))
        .await?;
    eprintln!(
        "ramjet: learned {canonical}: {} shards, {} samples, {:.0} MiB read in {:.1} s; kept in {}",
        ix.manifest.shard_count(),
        ix.manifest.samples,
        ix.bytes_read as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64(),
        folder.display()
    );
    Ok(Learned {
        url: canonical,
        store,
        index,
        manifest: ix.manifest,
    })
}

/// The manifest learned earlier into `folder` for `canonical`, if there is one. One that does
/// not parse, or names another source, is an error naming it (delete the folder to learn
/// again), never silently used.
fn read_learned(folder: &std::path::Path, canonical: &str) -> Result<Option<Manifest>> {
    let path = folder.join(crate::format::MANIFEST_NAME);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path.display().to_string(), e)),
    };
    let at = path.display().to_string();
    let m = Manifest::parse(&bytes, &at).map_err(|e| Error::Manifest {
        object: at.clone(),
        reason: format!(
            "a learned index that does not read ({e}); delete {} to learn it again",
            folder.display()
        ),
    })?;
    if m.foreign.is_none() || m.meta.get("learned_from").and_then(Json::as_str) != Some(canonical) {
        return Err(Error::Manifest {
            object: at,
            reason: format!(
                "this learned index is not {canonical}'s; delete {} to learn it again",
                folder.display()
            ),
        });
    }
    Ok(Some(m))
}

/// Indexes one shard: checks, decompresses and transcodes it. Returns its manifest entry, the
/// number of foreign hashes checked, and (for a plain shard) its sample index
/// (`crate::format::foreign::SampleIndexRef`).
fn index_one(
    job: &Job,
    stored: Bytes,
    spec: &ForeignSpec,
    schema: &Schema,
    url: &str,
) -> Result<(ShardInfo, usize, Option<Vec<u8>>)> {
    let mut checked = 0;
    if let Some(f) = &job.mds_file {
        if stored.len() as u64 != f.bytes {
            return Err(Error::Truncated {
                object: url.to_owned(),
                expected: f.bytes,
                actual: stored.len() as u64,
            });
        }
        checked += mds::check_hashes(f, &stored, url)?;
    }
    // MDS says how large the shard is once decompressed; a tar may be up to the limit.
    let max_out = job.mds_raw_bytes.unwrap_or(foreign::FOREIGN_SHARD_BYTES_MAX);
    let data = foreign::decompress(&stored, job.compression.as_deref(), max_out, url)?;
    let (built, spans) = foreign::transcode_with_spans(spec, schema, &data, url)?;
    // For a plain shard: each sample's span in the object and its record's checksum (the
    // transcoded shard's index entry holds it, at byte 16 of 24).
    let sample_index = job.compression.is_none().then(|| {
        let mut ix = Vec::with_capacity(spans.len() * 24);
        for (i, span) in spans.iter().enumerate() {
            let e = crate::format::Header::entry_offset(i as u64) as usize;
            ix.extend_from_slice(&span.start.to_le_bytes());
            ix.extend_from_slice(&(span.end - span.start).to_le_bytes());
            ix.extend_from_slice(&built.bytes[e + 16..e + 24]);
        }
        ix
    });
    if let Some(n) = job.samples {
        if n != built.samples {
            return Err(Error::corrupt(
                crate::Location::object(url),
                format!("the shard holds {} samples; index.json says {n}", built.samples),
            ));
        }
    }
    Ok((
        ShardInfo {
            key: job.key.clone(),
            bytes: built.bytes.len() as u64,
            samples: built.samples,
            checksum: format!("{:016x}", built.checksum),
            columns: None,
            foreign: Some(ForeignObject {
                bytes: stored.len() as u64,
                checksum: format!("{:016x}", xxh3_64(&stored)),
                compression: job.compression.clone(),
                index: None,
            }),
        },
        checked,
        sample_index,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn braces_expand_like_webdataset() {
        assert_eq!(
            expand_braces("s-{008..011}.tar").unwrap(),
            ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
        );
        assert_eq!(
            expand_braces("{a,b}-{0..1}.tar").unwrap(),
            ["a-0.tar", "a-1.tar", "b-0.tar", "b-1.tar"]
        );
        assert!(expand_braces("x-{1..").is_err());
    }

    #[test]
    fn sources_are_told_apart_by_their_name() {
        let s = ForeignSource::parse("s3://b/ds/train-{0..1}.tar").unwrap();
        assert_eq!(
            (s.format, s.prefix.as_str(), s.tars.len()),
            (ForeignFormat::Wds, "s3://b/ds", 2)
        );
        let s = ForeignSource::parse("s3://b/mds/").unwrap();
        assert_eq!((s.format, s.prefix.as_str()), (ForeignFormat::Mds, "s3://b/mds"));
        let s = ForeignSource::parse("/data/list.txt").unwrap();
        assert_eq!((s.format, s.prefix.as_str()), (ForeignFormat::Wds, "/data"));
    }
}
