//! A ramjet manifest over a foreign dataset's shards (MosaicML MDS or WebDataset tars), without
//! copying them: written beside them by `ramjet index`, or learned on first read by
//! [`crate::Dataset::open`] and kept in the host's folder of learned manifests (`crate::foreign::learned_dir`).
//!
//! Each shard is read once, checked (MDS: its own xxHash hashes from `index.json`; its sample
//! count), decompressed and transcoded to the ramjet shard a reader will make of it
//! (`crate::foreign`). The manifest records, per shard, the object's size and
//! xxh3-64 as stored and the transcoded shard's size, sample count and checksum; the
//! transcoded shard's index holds every sample's checksum. From then on every read is checked
//! as a ramjet shard's is. Whoever writes the manifest writes it last, after the sample indexes
//! it names.

use std::collections::BTreeSet;

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use serde_json::{Map, Value as Json};
use xxhash_rust::xxh3::xxh3_64;

use std::sync::Arc;

use parquet::file::metadata::ParquetMetaData;

use super::{
    self as foreign, mds, parquet_footer, parquet_rows, parquet_schema, sample_index_key, wds, ForeignFormat,
    ForeignObject, ForeignSpec, ParquetPart, SampleIndexRef,
};
use crate::error::Invalid;
use crate::format::{Checksum, Manifest, Schema, ShardInfo};
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
    /// WebDataset: the tars' keys, relative to `prefix`, in order; Parquet: the files' (or
    /// `*.parquet`: every one in the folder). MDS: from `index.json`.
    pub files: Vec<String>,
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
                files: Vec::new(), // read by `tars_of_list`
            });
        }
        let (dir, file) = split(src);
        if file.ends_with(".parquet") {
            if dir.contains('{') || dir.contains('*') || (file.contains('*') && file != "*.parquet") {
                return Err(Error::invalid(
                    src,
                    "Parquet files are named by one file, braces in the file name, or `*.parquet`",
                ));
            }
            let files = expand_braces(&file).map_err(|r| Error::invalid(src, r))?;
            return Ok(ForeignSource {
                format: ForeignFormat::Parquet,
                prefix: dir,
                files,
            });
        }
        if is_tar(&file) || file.contains('{') {
            if dir.contains('{') {
                return Err(Error::invalid(src, "braces are read in the file name only"));
            }
            let tars = expand_braces(&file).map_err(|r| Error::invalid(src, r))?;
            return Ok(ForeignSource {
                format: ForeignFormat::Wds,
                prefix: dir,
                files: tars,
            });
        }
        Ok(ForeignSource {
            format: ForeignFormat::Mds,
            prefix: src.to_owned(),
            files: Vec::new(),
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
    /// Parquet: the row group, its size and its file's footer.
    parquet: Option<RowGroupJob>,
}

/// A Parquet row group to index.
struct RowGroupJob {
    part: ParquetPart,
    bytes: u64,
    meta: Arc<ParquetMetaData>,
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
    let mut source = ForeignSource::parse(src)?;
    if source.format == ForeignFormat::Mds && store.size("index.json").await.is_err() {
        // A folder without an MDS index, of Parquet files (a Hugging Face split): all of them.
        let (_, files) = store.list_dir("").await?;
        if files.iter().any(|(n, _)| n.ends_with(".parquet")) {
            source.format = ForeignFormat::Parquet;
            source.files = vec!["*.parquet".into()];
        }
    }
    {
        let (spec, schema, jobs, meta) = match source.format {
            ForeignFormat::Mds | ForeignFormat::Lit => plan_mds(store, meta, jpeg_restart_px).await?,
            ForeignFormat::Wds => plan_wds(src, &source, store, meta, jpeg_restart_px).await?,
            ForeignFormat::Parquet => plan_parquet(&source, store, meta, jpeg_restart_px).await?,
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
                let stored = match (job.stored.clone(), &job.parquet) {
                    (Some(b), _) => b,
                    (None, Some(p)) => {
                        let at = p.part.offset;
                        store_r.get_range(&p.part.file, at..at + p.bytes).await?
                    }
                    (None, None) => store_r.get(&job.key).await?,
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
                        checksum: Checksum(sum),
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

/// What indexing a foreign dataset reads: its spec, its schema, the shards, the manifest's meta.
type Plan = (ForeignSpec, Schema, Vec<Job>, Map<String, Json>);

/// An MDS dataset's plan, from its `index.json`.
async fn plan_mds(store: &Store, meta: Map<String, Json>, jpeg_restart_px: Option<u32>) -> Result<Plan> {
    let url = store.url("index.json");
    let bytes = store.get("index.json").await?;
    let (ix, format) = match super::lit::as_mds_index(&bytes, &url)? {
        Some(ix) => (ix, ForeignFormat::Lit),
        None => (mds::Index::parse(&bytes, &url)?, ForeignFormat::Mds),
    };
    let (columns, schema) = ix.columns(&url)?;
    let mut meta = meta;
    meta.insert("foreign_index".into(), Json::from("index.json"));
    // Each column's MDS encoding as written (the schema folds jpeg, png, pil and bytes into
    // bytes): for a reader that decodes as MosaicML does (`ramjet.compat.mosaicml`).
    let encodings = columns.iter().map(|c| (c.name.clone(), Json::from(c.encoding.clone())));
    meta.insert("mds_encodings".into(), Json::Object(encodings.collect()));
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
                parquet: None,
            }
        })
        .collect::<Vec<_>>();
    let spec = ForeignSpec {
        format,
        columns,
        jpeg_restart_px,
    };
    Ok((spec, schema, jobs, meta))
}

/// A WebDataset's plan: its tars (listed in the URL, or in a list object), the columns from
/// the first tar's extensions.
async fn plan_wds(
    src: &str,
    source: &ForeignSource,
    store: &Store,
    meta: Map<String, Json>,
    jpeg_restart_px: Option<u32>,
) -> Result<Plan> {
    let tars = if source.files.is_empty() {
        let list = src.trim_end_matches('/').rsplit('/').next().unwrap_or(src).to_owned();
        tars_of_list(store, &list, &store.url(&list)).await?
    } else {
        source.files.clone()
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
            parquet: None,
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
    Ok((spec, schema, jobs, meta))
}

/// Indexes one shard: checks, decompresses and transcodes it. Returns its manifest entry, the
/// number of foreign hashes checked, and (for a plain shard) its sample index
/// (`crate::foreign::SampleIndexRef`).
fn index_one(
    job: &Job,
    stored: Bytes,
    spec: &ForeignSpec,
    schema: &Schema,
    url: &str,
) -> Result<(ShardInfo, usize, Option<Vec<u8>>)> {
    if let Some(p) = &job.parquet {
        return index_row_group(job, p, stored, spec, schema, url);
    }
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
            checksum: Checksum(built.checksum),
            columns: None,
            foreign: Some(ForeignObject {
                bytes: stored.len() as u64,
                checksum: Checksum(xxh3_64(&stored)),
                compression: job.compression.clone(),
                index: None,
                parquet: None,
            }),
        },
        checked,
        sample_index,
    ))
}

/// A Parquet dataset's plan: its files' footers (their schemas the same), one job a row group.
async fn plan_parquet(
    source: &ForeignSource,
    store: &Store,
    meta: Map<String, Json>,
    jpeg_restart_px: Option<u32>,
) -> Result<Plan> {
    let files = parquet_files(source, store).await?;
    let found: Vec<Result<(String, parquet_footer::Found, Arc<ParquetMetaData>)>> = stream::iter(files)
        .map(|f| async move {
            let found = parquet_footer::find(store, &f).await?;
            let meta = parquet_footer::decode(&found.bytes, &store.url(&f))?;
            Ok((f, found, meta))
        })
        .buffered(IN_FLIGHT)
        .collect()
        .await;
    let found = found.into_iter().collect::<Result<Vec<_>>>()?;
    let metas: Vec<&ParquetMetaData> = found.iter().map(|(_, _, m)| m.as_ref()).collect();
    let first = metas[0].file_metadata().schema_descr().root_schema();
    for (f, _, m) in &found {
        if m.file_metadata().schema_descr().root_schema() != first {
            return Err(Error::invalid(
                store.url(f),
                format!("its schema is not the first file's ({})", found[0].0),
            ));
        }
    }
    let (columns, schema) = parquet_schema::columns(&metas).map_err(|r| Error::invalid(store.url(&found[0].0), r))?;
    let mut jobs = Vec::new();
    for (f, at, m) in &found {
        for (r, rg) in m.row_groups().iter().enumerate() {
            if rg.num_rows() <= 0 {
                continue;
            }
            let key = format!("{f}#rg={r}");
            let (offset, bytes) = parquet_rows::row_group_span(rg)
                .map_err(|why| Error::corrupt(crate::Location::object(store.url(&key)), why))?;
            let part = ParquetPart {
                file: f.clone(),
                file_bytes: at.file_bytes,
                row_group: r as u32,
                offset,
                footer_offset: at.offset,
                footer_bytes: at.bytes.len() as u64,
                footer_checksum: Checksum(xxh3_64(&at.bytes)),
            };
            part.check(bytes)
                .map_err(|why| Error::corrupt(crate::Location::object(store.url(&key)), why))?;
            jobs.push(Job {
                key,
                compression: None,
                samples: Some(rg.num_rows() as u64),
                mds_file: None,
                mds_raw_bytes: None,
                stored: None,
                parquet: Some(RowGroupJob {
                    part,
                    bytes,
                    meta: m.clone(),
                }),
            });
        }
    }
    let spec = ForeignSpec {
        format: ForeignFormat::Parquet,
        columns,
        jpeg_restart_px,
    };
    Ok((spec, schema, jobs, meta))
}

/// The Parquet files a source names: as listed, or (`*.parquet`) every one in its folder, by
/// name.
async fn parquet_files(source: &ForeignSource, store: &Store) -> Result<Vec<String>> {
    let files = if source.files == ["*.parquet"] {
        let (_, listed) = store.list_dir("").await?;
        let mut names: Vec<String> = listed
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.ends_with(".parquet"))
            .collect();
        names.sort();
        names
    } else {
        source.files.clone()
    };
    if files.is_empty() {
        return Err(Error::invalid(store.url(""), "no .parquet files"));
    }
    Ok(files)
}

/// Indexes one Parquet row group: transcodes it against its file's footer.
fn index_row_group(
    job: &Job,
    p: &RowGroupJob,
    stored: Bytes,
    spec: &ForeignSpec,
    schema: &Schema,
    url: &str,
) -> Result<(ShardInfo, usize, Option<Vec<u8>>)> {
    if stored.len() as u64 != p.bytes {
        return Err(Error::Truncated {
            object: url.to_owned(),
            expected: p.bytes,
            actual: stored.len() as u64,
        });
    }
    let checksum = Checksum(xxh3_64(&stored));
    let built = parquet_rows::transcode_row_group(spec, schema, &p.meta, &p.part, stored, url)?;
    let info = ShardInfo {
        key: job.key.clone(),
        bytes: built.bytes.len() as u64,
        samples: built.samples,
        checksum: Checksum(built.checksum),
        columns: None,
        foreign: Some(ForeignObject {
            bytes: p.bytes,
            checksum,
            compression: None,
            index: None,
            parquet: Some(p.part.clone()),
        }),
    };
    Ok((info, 0, None))
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
            (s.format, s.prefix.as_str(), s.files.len()),
            (ForeignFormat::Wds, "s3://b/ds", 2)
        );
        let s = ForeignSource::parse("s3://b/mds/").unwrap();
        assert_eq!((s.format, s.prefix.as_str()), (ForeignFormat::Mds, "s3://b/mds"));
        let s = ForeignSource::parse("/data/list.txt").unwrap();
        assert_eq!((s.format, s.prefix.as_str()), (ForeignFormat::Wds, "/data"));
    }
}
