//! The source chain for one shard or sample: the host daemon, else the disk cache, else the
//! origin (holding the host-wide download lock), each read verified; one flight per shard in
//! the process (`crate::singleflight`).

use super::*;

/// One sample with two ranged GETs: its index entry, then its record.
pub(super) async fn fetch_sample_ranged(shared: &Shared, id: SampleRef) -> Result<Bytes> {
    let src = &shared.sources[id.stream as usize];
    let info = &src.ds.manifest().shards[id.shard as usize];
    let store = src.ds.store();
    let url = store.url(&info.key);
    let at = Location::sample(&url, id.index as u64);
    let eo = crate::format::Header::entry_offset(id.index as u64);
    let eb = store.get_range(&info.key, eo..eo + INDEX_ENTRY_LEN).await?;
    let e = IndexEntry::parse(&eb);
    let data_offset = src.ds.data_offset(id.shard as usize);
    let end = e.offset.checked_add(e.len);
    // Saturating: a manifest may claim a shard smaller than its footer.
    if e.offset < data_offset || end.is_none_or(|x| x > info.bytes.saturating_sub(crate::format::FOOTER_LEN)) {
        return Err(Error::corrupt(
            at,
            format!("index entry points at [{}, +{}) outside the records", e.offset, e.len),
        ));
    }
    let rec = store.get_range(&info.key, e.offset..e.offset + e.len).await?;
    e.check_record(id.index as u64, &rec, &at)?;
    let m = &shared.metrics;
    Metrics::add(&m.origin_requests, 2);
    Metrics::add(&m.origin_bytes, INDEX_ENTRY_LEN + e.len);
    Metrics::add(&m.ranged_samples, 1);
    Ok(rec)
}

/// A whole shard from the origin (see [`Dataset::fetch_shard_parallel`]).
pub(super) async fn fetch_shard_origin(shared: &Shared, stream: usize, shard: usize) -> Result<Bytes> {
    let cfg = &shared.cfg;
    shared.sources[stream]
        .ds
        .fetch_shard_parallel(shard, cfg.range_bytes, cfg.ranges_in_flight_max, &shared.metrics)
        .await
}

/// A whole shard from the host daemon, verified here. `None` when the daemon failed or its
/// bytes did not verify: the caller then reads the shard itself.
pub(super) async fn fetch_shard_provider(
    shared: &Arc<Shared>,
    p: &Arc<dyn ShardProvider>,
    stream: usize,
    shard: usize,
) -> Option<Bytes> {
    let (sh, p) = (shared.clone(), p.clone());
    let calls = PROVIDER_CALLS
        .get(|| Ok(tokio::sync::Semaphore::new(crate::rt::BLOCKING_THREADS_MAX / 2)))
        .ok()?;
    let Ok(_call) = calls.acquire().await else {
        return None;
    };
    let r = tokio::task::spawn_blocking(move || {
        let src = &sh.sources[stream];
        let req = ShardRequest {
            manifest_url: src.ds.manifest_url(),
            shard: shard as u32,
            id: src.ids[shard],
        };
        let got = p.fetch(&req)?;
        if let Err(e) = src.ds.check_shard(shard, &got.bytes) {
            p.report_corrupt(&req);
            return Err(e);
        }
        Ok(got)
    })
    .await
    .unwrap_or_else(|e| Err(join_error("host-daemon call", e)));
    match r {
        Ok(got) => {
            let m = &shared.metrics;
            Metrics::add(&m.provider_shards[got.source.index()], 1);
            Metrics::add(&m.provider_bytes, got.bytes.len() as u64);
            Some(got.bytes)
        }
        Err(e) => {
            Metrics::add(&shared.metrics.provider_failures, 1);
            tracing::warn!(error = %e, "the host daemon did not deliver a sound shard; reading it directly");
            None
        }
    }
}

/// Whole-shard flights keyed by shard and source chain.
type ShardFlights = Flights<(ShardId, u64), Result<Bytes>>;

/// Whole-shard fetches in flight in this process (`crate::singleflight`), remade in a forked
/// child.
pub(super) static SHARD_FLIGHTS: crate::rt::PerProcess<Arc<ShardFlights>> = crate::rt::PerProcess::new();

/// A whole shard, fetched once in this process however many streams want it at once: the
/// first starts the flight ([`fetch_shard_once`]), the others join it.
pub(super) async fn fetch_shard(shared: Arc<Shared>, stream: usize, shard: usize) -> Result<Bytes> {
    let flights = SHARD_FLIGHTS.get(|| Ok(Arc::default()))?;
    let id = shared.sources[stream].ids[shard];
    let sh = shared.clone();
    let key = (id, shared.chain);
    let (flight, joined) = flights.join_or_start(
        &[key],
        key,
        move || fetch_shard_once(sh, stream, shard),
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

/// A whole shard: the host daemon, else the disk cache, else (holding the host-wide download
/// lock for it) the origin, then stored in the cache.
pub(super) async fn fetch_shard_once(shared: Arc<Shared>, stream: usize, shard: usize) -> Result<Bytes> {
    if let Some(p) = &shared.cfg.provider {
        if let Some(b) = fetch_shard_provider(&shared, p, stream, shard).await {
            return Ok(b);
        }
    }
    let Some(cache) = shared.cache.clone() else {
        Metrics::add(&shared.metrics.cache_misses, 1);
        return fetch_shard_origin(&shared, stream, shard).await;
    };
    let id = shared.sources[stream].ids[shard];
    let c = cache.clone();
    if let Some(b) = blocking(move || c.get(id)).await? {
        return Ok(b);
    }
    let lock = fetch_lock(&cache, id).await?;
    let c = cache.clone();
    if let Some(b) = blocking(move || c.get(id)).await? {
        return Ok(b);
    }
    Metrics::add(&shared.metrics.cache_misses, 1);
    let bytes = fetch_shard_origin(&shared, stream, shard).await?;
    // Writing (and fsyncing) the cache copy is off the delivery path; the download lock is
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
    let (c, b) = (cache.clone(), bytes.clone());
    let filler = shared.filler.as_ref().expect("a cache has a filler");
    filler.submit(Box::new(move || {
        if let Err(e) = c.insert(id, &b) {
            tracing::warn!(error = %e, "cache insert failed; the shard was served from memory");
        }
        drop(lock);
        drop(permit);
    }));
    Ok(bytes)
}

/// The shard's host-wide download lock, polled: the holder (this process or another) may be
/// minutes into a download, and a blocking-pool thread asleep in `flock` meanwhile would be
/// one fewer for the work that frees it (the pool is shared by the whole process).
pub(super) async fn fetch_lock(cache: &Cache, id: ShardId) -> Result<crate::cache::FetchGuard> {
    let mut pause = std::time::Duration::from_millis(2);
    loop {
        let c = cache.clone();
        if let Some(g) = blocking(move || c.try_fetch_lock(id)).await? {
            return Ok(g);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
}

/// Host-daemon calls in flight in this process: each holds a blocking-pool thread while the
/// daemon works, and an embedded daemon needs threads of the same pool to answer, so they may
/// take at most half of it. Per process: a forked child must not inherit permits held by
/// calls of its parent that it will never see finish (that hung DataLoader workers).
pub(super) static PROVIDER_CALLS: crate::rt::PerProcess<tokio::sync::Semaphore> = crate::rt::PerProcess::new();

pub(super) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(join_error("cache task", e)))
}

/// A blocking task that panicked, or never ran (the runtime stopped under it), as an error.
pub(super) fn join_error(what: &str, e: tokio::task::JoinError) -> Error {
    if e.is_panic() {
        Error::from_panic(what, &*e.into_panic())
    } else {
        Error::Internal {
            thread: what.to_string(),
            reason: "cancelled before it ran".into(),
        }
    }
}
