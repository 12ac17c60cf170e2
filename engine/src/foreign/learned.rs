//! A foreign dataset opened without `ramjet index`: the manifest learned on first read and
//! kept in the host's folder of learned manifests, shared by its processes.

use bytes::Bytes;
use serde_json::{Map, Value as Json};

use super::scan::index_into;
use crate::format::Manifest;
use crate::{Error, Result, Store};

/// Bumped when what a learned manifest holds changes: older ones are then learned again (2:
/// MDS `ndarray` columns and WebDataset `.npy` members became array columns).
const LEARNED_VERSION: u32 = 2;

/// Whether `url` names a foreign dataset itself rather than a ramjet manifest or prefix: an MDS
/// `index.json`, a tar or a brace pattern of tars, a shard-list `.txt`, or Parquet files (one,
/// a brace pattern, or a folder's `*.parquet`).
pub fn names_foreign_source(url: &str) -> bool {
    let u = url.trim_end_matches('/');
    let last = u.rsplit('/').next().unwrap_or(u);
    last == "index.json"
        || last.ends_with(".tar")
        || last.ends_with(".tar.gz")
        || last.ends_with(".tgz")
        || last.ends_with(".txt")
        || last.ends_with(".parquet")
}

/// The host's folder of learned manifests: `RAMJET_INDEX_DIR`, else `$XDG_CACHE_HOME/ramjet/index`,
/// else `~/.cache/ramjet/index`.
pub fn learned_dir() -> Result<std::path::PathBuf> {
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
            "unset, and there is no HOME to keep learned manifests under",
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
    /// The learned manifest's folder: its manifest and sample indexes.
    pub index: Store,
    /// The manifest learned.
    pub manifest: Manifest,
}

/// Opens the foreign dataset `url` names (see [`names_foreign_source`]) without a ramjet
/// manifest beside it. The first open on a host reads every shard once, as `ramjet index`
/// does, and keeps the manifest and sample indexes in a folder of [`learned_dir`] named by the
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
    } else if file == "*.parquet" {
        // Every Parquet file of the folder, by name and size: one added, removed or resized
        // is learned again.
        let (_, listed) = store.list_dir("").await?;
        let names = listed.iter().filter(|(n, _)| n.ends_with(".parquet"));
        Bytes::from(names.map(|(n, size)| format!("{n}\t{size}\n")).collect::<String>())
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
    let folder = learned_dir()?.join(format!("{:016x}", h.digest()));
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
            "a learned manifest that does not read ({e}); delete {} to learn it again",
            folder.display()
        ),
    })?;
    if m.foreign().is_none() || m.meta.get("learned_from").and_then(Json::as_str) != Some(canonical) {
        return Err(Error::Manifest {
            object: at,
            reason: format!(
                "this learned manifest is not {canonical}'s; delete {} to learn it again",
                folder.display()
            ),
        });
    }
    Ok(Some(m))
}
