//! A request checked before anything is fetched: a well-formed URL under an allowed prefix,
//! a manifest that opens (held, revalidated by age), a shard whose identity matches.

use super::{url_under, HeldDataset, Inner, Req};
use crate::error::Error;
use crate::wire::SHARD_MAX;
use crate::wire::URL_MAX;
use ramjet_engine::cache::ShardId;
use ramjet_engine::Dataset;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

impl Inner {
    /// Validates a request: a well-formed URL under an allowed prefix, a manifest that opens,
    /// a shard in it whose identity matches.
    pub(super) async fn resolve(
        &self,
        manifest_url: &str,
        shard: u32,
        checksum: u64,
        bytes: u64,
    ) -> Result<Req, Error> {
        let bad = |why: &str| Err(Error::Refused(format!("refused {manifest_url:?} shard {shard}: {why}")));
        if manifest_url.len() > URL_MAX || manifest_url.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return bad("malformed URL");
        }
        let Some((scheme, path)) = manifest_url.split_once("://") else {
            return bad("not a URL");
        };
        if !["s3", "gs", "az", "azure", "abfs", "file", "http", "https"].contains(&scheme) {
            return bad("unsupported scheme");
        }
        let names_dataset =
            manifest_url.ends_with(".json") || ramjet_engine::foreign::names_foreign_source(manifest_url);
        if path.split('/').any(|seg| seg == ".." || seg == ".") || !names_dataset {
            return bad("not a manifest path (path traversal, or neither .json nor a foreign source)");
        }
        if !self.cfg.allow_prefixes.is_empty() {
            // A local path is judged by where it really is: a symbolic link inside an allowed
            // folder must not serve what lies outside it.
            let real = match real_file_url(manifest_url) {
                Ok(u) => u,
                Err(why) => return bad(why.reason()),
            };
            let under = |p: &String| {
                let p = real_file_url(p).unwrap_or_else(|_| p.clone());
                url_under(&real, &p)
            };
            if !self.cfg.allow_prefixes.iter().any(under) {
                return bad("outside the allowed prefixes (symbolic links resolved)");
            }
        }
        let (mut ds, fresh) = self.dataset(manifest_url, false).await?;
        let matches = |ds: &Dataset| {
            let m = ds.manifest();
            (shard as usize) < m.shard_count()
                && m.shard_bytes_checksum(shard as usize)
                    .is_ok_and(|x| x == (bytes, checksum))
        };
        if !fresh && !matches(&ds) {
            // The requester may hold a newer manifest (re-packed under the same URL).
            ds = self.dataset(manifest_url, true).await?.0;
        }
        if shard as usize >= ds.manifest().shard_count() {
            return bad("no such shard in the manifest");
        }
        // A damaged block of the dataset's shard table: refused, naming the table.
        let info = ds
            .manifest()
            .shard(shard as usize)
            .map_err(|e| Error::Refused(format!("refused {manifest_url:?} shard {shard}: {e}")))?;
        let id = ShardId {
            checksum: info.checksum_u64(),
            bytes: info.bytes,
        };
        if id.checksum != checksum || id.bytes != bytes || bytes > SHARD_MAX {
            return bad("checksum or size does not match the manifest");
        }
        Ok(Req {
            ds,
            shard: shard as usize,
            id,
            via: None,
        })
    }

    /// The dataset of `url`: the one held, unless it is older than `manifest_revalidate_after`
    /// or `reload` asks (and it is at least a second old); else loaded now. Also whether it
    /// was loaded by this call.
    pub(super) async fn dataset(&self, url: &str, reload: bool) -> Result<(Arc<Dataset>, bool), Error> {
        let now = Instant::now();
        {
            let mut held = self.datasets.lock().expect("datasets lock");
            if let Some(h) = held.get_mut(url) {
                let age = now.duration_since(h.loaded);
                let stale = age >= self.cfg.manifest_revalidate_after || (reload && age >= Duration::from_secs(1));
                if !stale {
                    h.used = now;
                    return Ok((h.ds.clone(), false));
                }
            }
        }
        let (key, u, named) = (url.to_owned(), url.to_owned(), url.to_owned());
        let (flight, _) = self.opening.join_or_start(
            std::slice::from_ref(&key),
            key.clone(),
            || async move { Dataset::open(&u).await.map(Arc::new).map_err(Arc::new) },
            move |why| {
                Err(Arc::new(ramjet_engine::Error::invalid(
                    named.clone(),
                    format!("its open failed: {why}"),
                )))
            },
        );
        let d = tokio::time::timeout(Duration::from_secs(60), flight)
            .await
            .map_err(|_| {
                Error::Refused(format!(
                    "refused {url:?}: not open after 60 s (still opening: a foreign source being learned on this host goes on, and a later request gets it)"
                ))
            })?
            .map_err(|e| Error::Refused(format!("refused {url:?}: {e}")))?;
        let mut held = self.datasets.lock().expect("datasets lock");
        if !held.contains_key(url) && held.len() >= self.cfg.datasets_open_max.max(1) {
            // Requests in flight keep their own reference to an evicted dataset.
            if let Some(lru) = held.iter().min_by_key(|(_, h)| h.used).map(|(k, _)| k.clone()) {
                held.remove(&lru);
            }
        }
        held.insert(
            url.to_owned(),
            HeldDataset {
                ds: d.clone(),
                loaded: now,
                used: now,
            },
        );
        Ok((d, true))
    }

    /// Datasets held open now.
    pub(super) fn datasets_open(&self) -> usize {
        self.datasets.lock().expect("datasets lock").len()
    }
}

/// `url` with its path resolved when it is a `file://` URL (symbolic links followed, as
/// `realpath` does); any other URL as it is. A local path that cannot be resolved (missing) is
/// an error saying so.
fn real_file_url(url: &str) -> Result<String, ramjet_engine::Invalid> {
    let Some(path) = url.strip_prefix("file://") else {
        return Ok(url.to_owned());
    };
    let real = std::fs::canonicalize(path).map_err(|e| format!("cannot resolve {path}: {e}"))?;
    let real = real
        .to_str()
        .ok_or_else(|| format!("{} is not UTF-8", real.display()))?;
    Ok(format!("file://{real}"))
}
