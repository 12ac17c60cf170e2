//! `ramjet index`: a ramjet manifest over a foreign dataset's shards, written beside them
//! (`ramjet_engine::foreign::scan`). Like `pack`, the manifest goes up last, as
//! `manifests/<version>.json` and then `manifest.json`.

use std::time::{Duration, Instant};

use bytes::Bytes;

use ramjet_engine::foreign::ForeignSource;
use ramjet_engine::format::{Manifest, MANIFEST_NAME};
use ramjet_engine::{Error, Result, Store};

/// What `ramjet index` did.
#[derive(Debug)]
pub struct IndexReport {
    /// The manifest written.
    pub manifest: Manifest,
    /// Its URL.
    pub manifest_url: String,
    /// Bytes of foreign shards read.
    pub bytes_read: u64,
    /// Hashes from the foreign index that were checked (MDS `xxh64`, `xxh3_64`).
    pub foreign_hashes_checked: usize,
    /// Wall time.
    pub elapsed: Duration,
}

/// Writes `manifest.json` over the foreign dataset `src`, beside it; `progress` is called with
/// bytes read. `jpeg_restarts`: the shards it transcodes to hold their JPEGs with restart
/// markers every [`ramjet_engine::image::turbo::JPEG_RESTART_PX`] pixels
/// (`ForeignSpec::jpeg_restart_px`).
pub fn index(src: &str, jpeg_restarts: bool, progress: &(dyn Fn(u64) + Sync)) -> Result<IndexReport> {
    let t0 = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("tokio runtime", e))?;
    let source = ForeignSource::parse(src)?;
    let store = Store::open(&source.prefix)?;
    rt.block_on(async {
        let ix = ramjet_engine::foreign::index_into(
            src,
            &store,
            &store,
            Default::default(),
            jpeg_restarts.then_some(ramjet_engine::image::turbo::JPEG_RESTART_PX),
            progress,
        )
        .await?;
        let bytes = Bytes::from(ix.manifest.to_bytes());
        store
            .put(&format!("manifests/{}.json", ix.manifest.version), bytes.clone())
            .await?;
        store.put(MANIFEST_NAME, bytes).await?;
        Ok(IndexReport {
            manifest_url: store.url(MANIFEST_NAME),
            manifest: ix.manifest,
            bytes_read: ix.bytes_read,
            foreign_hashes_checked: ix.foreign_hashes_checked,
            elapsed: t0.elapsed(),
        })
    })
}
