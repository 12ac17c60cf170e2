//! Origin access over `object_store`: URL parsing, retries with backoff, ranged and
//! multipart transfers, and conversion of backend errors into [`Error`].
//!
//! Retries live here, in one place. The backend client is configured with no retries of its
//! own, so every attempt is counted and the whole retry window is bounded by
//! [`RetryPolicy::window_ms`].

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig, WriteMultipart,
};

use crate::error::{Error, Result};

/// How failed origin requests are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub attempts_max: u32,
    /// Wait before the first retry; it doubles on each retry.
    pub backoff_initial_ms: u64,
    /// Longest wait between two attempts.
    pub backoff_max_ms: u64,
    /// No new attempt starts later than this after the first one.
    pub window_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts_max: 8,
            backoff_initial_ms: 100,
            backoff_max_ms: 5_000,
            window_ms: 30_000,
        }
    }
}

/// Origin client settings. Environment variables override the defaults (see
/// [`StoreConfig::from_env`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreConfig {
    /// Retry policy.
    pub retry: RetryPolicy,
    /// Whole-request timeout.
    pub request_timeout_ms: u64,
    /// TCP connect timeout.
    pub connect_timeout_ms: u64,
    /// Objects at least this large are uploaded with multipart upload.
    pub multipart_threshold_bytes: u64,
    /// Part size of a multipart upload.
    pub multipart_part_bytes: u64,
    /// Parts of one upload in flight at once.
    pub multipart_parts_in_flight_max: usize,
    /// Connections a stream opens to the origin while it reads the manifest, so that its
    /// first batch's parallel ranged reads find them ready ([`Store::preconnect`]). 0: none.
    pub preconnect: usize,
    /// Ranged reads of at most this many bytes are hedged: when one has not completed after
    /// [`StoreConfig::hedge_after_min_ms`] or twice the origin's recent latency, whichever is
    /// longer, a second identical request starts and the first to succeed is kept (see
    /// [`Store::get_range`]). 0: never.
    pub hedge_max_bytes: u64,
    /// The shortest wait before a hedged read's second request.
    pub hedge_after_min_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            retry: RetryPolicy::default(),
            request_timeout_ms: 60_000,
            connect_timeout_ms: 5_000,
            multipart_threshold_bytes: 16 << 20,
            multipart_part_bytes: 8 << 20,
            multipart_parts_in_flight_max: 4,
            preconnect: 8,
            hedge_max_bytes: 1 << 20,
            hedge_after_min_ms: 20,
        }
    }
}

impl StoreConfig {
    /// Defaults, overridden by `RAMJET_RETRY_ATTEMPTS`, `RAMJET_RETRY_BACKOFF_MS`,
    /// `RAMJET_RETRY_WINDOW_MS`, `RAMJET_REQUEST_TIMEOUT_MS`, `RAMJET_CONNECT_TIMEOUT_MS`,
    /// `RAMJET_MULTIPART_THRESHOLD_BYTES`, `RAMJET_MULTIPART_PART_BYTES`,
    /// `RAMJET_PRECONNECT`, `RAMJET_HEDGE_BYTES` and `RAMJET_HEDGE_AFTER_MS`.
    pub fn from_env() -> Self {
        let mut c = Self::default();
        let num = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(v) = num("RAMJET_RETRY_ATTEMPTS") {
            c.retry.attempts_max = v.clamp(1, 1000) as u32;
        }
        if let Some(v) = num("RAMJET_RETRY_BACKOFF_MS") {
            c.retry.backoff_initial_ms = v;
        }
        if let Some(v) = num("RAMJET_RETRY_WINDOW_MS") {
            c.retry.window_ms = v;
        }
        if let Some(v) = num("RAMJET_REQUEST_TIMEOUT_MS") {
            c.request_timeout_ms = v.max(1);
        }
        if let Some(v) = num("RAMJET_CONNECT_TIMEOUT_MS") {
            c.connect_timeout_ms = v.max(1);
        }
        if let Some(v) = num("RAMJET_MULTIPART_THRESHOLD_BYTES") {
            c.multipart_threshold_bytes = v;
        }
        if let Some(v) = num("RAMJET_MULTIPART_PART_BYTES") {
            // S3 refuses parts under 5 MiB (the last part excepted).
            c.multipart_part_bytes = v.max(5 << 20);
        }
        if let Some(v) = num("RAMJET_PRECONNECT") {
            c.preconnect = v.min(64) as usize;
        }
        if let Some(v) = num("RAMJET_HEDGE_BYTES") {
            c.hedge_max_bytes = v;
        }
        if let Some(v) = num("RAMJET_HEDGE_AFTER_MS") {
            c.hedge_after_min_ms = v.max(1);
        }
        c
    }
}

/// An object store rooted at a URL prefix. Keys are relative to that prefix.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    prefix: Path,
    base_url: String,
    config: StoreConfig,
    /// The origin's recent latency and hedge counts, shared by every store on the same client.
    pace: Arc<Pace>,
    /// The directory a `file://` store's prefix lives in.
    local: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("url", &self.base_url).finish()
    }
}

/// A dataset location: where its store prefix is and which object is its manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatasetUrl {
    /// URL of the dataset prefix ("folder").
    pub prefix_url: String,
    /// Manifest key relative to the prefix.
    pub manifest_key: String,
}

impl DatasetUrl {
    /// `…/dir` means `…/dir/manifest.json`; a URL ending in `.json` names the manifest itself.
    pub fn parse(url: &str) -> DatasetUrl {
        let trimmed = url.trim_end_matches('/');
        if trimmed.ends_with(".json") {
            if let Some((dir, name)) = trimmed.rsplit_once('/') {
                let dir = if dir.ends_with(':') || dir.is_empty() {
                    // "s3://x.json" has no folder part; keep the scheme intact.
                    format!("{dir}/")
                } else {
                    dir.to_owned()
                };
                return DatasetUrl {
                    prefix_url: dir,
                    manifest_key: name.to_owned(),
                };
            }
            return DatasetUrl {
                prefix_url: ".".into(),
                manifest_key: trimmed.to_owned(),
            };
        }
        DatasetUrl {
            prefix_url: trimmed.to_owned(),
            manifest_key: crate::format::MANIFEST_NAME.into(),
        }
    }
}

/// Installs the process-wide TLS crypto provider once (ring; no C toolchain needed).
/// Installs rustls' process-wide crypto provider, once. Called at first use, and early by
/// embedders that fork (the Python module calls it at import): a `Once` first run in one
/// thread while another forks is inherited half-done by the child, whose first S3 client then
/// waits on it forever.
pub fn ensure_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An Err means another part of the process installed one first, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl Store {
    /// Opens the store for a URL prefix: `s3://bucket/prefix`, `gs://…`, `az://container/…`,
    /// `file:///path`, a plain local path, or `memory://` (a fresh in-process store).
    ///
    /// S3 reads `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` (default
    /// `us-east-1`), `AWS_ENDPOINT_URL` and the other `AWS_*` variables object_store knows.
    /// Plain-HTTP endpoints are allowed, for local servers.
    pub fn open(url: &str) -> Result<Store> {
        Self::open_with(url, StoreConfig::from_env())
    }

    /// [`Store::open`] with explicit settings.
    pub fn open_with(url: &str, config: StoreConfig) -> Result<Store> {
        ensure_crypto_provider();
        let bad = |reason: String| Error::InvalidUrl {
            url: url.to_owned(),
            reason,
        };
        let retry = RetryConfig {
            backoff: BackoffConfig::default(),
            max_retries: 0,
            retry_timeout: Duration::from_millis(config.retry.window_ms.max(1)),
        };
        let client = ClientOptions::new()
            .with_timeout(Duration::from_millis(config.request_timeout_ms))
            .with_connect_timeout(Duration::from_millis(config.connect_timeout_ms));
        let (scheme, rest) = match url.split_once("://") {
            Some((s, r)) => (s, r),
            None => ("file", url),
        };
        let split_bucket = |rest: &str| -> Result<(String, String)> {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(bad("no bucket or container name".into()));
            }
            Ok((bucket.to_owned(), prefix.trim_matches('/').to_owned()))
        };
        let mut local = None;
        let ((inner, pace), prefix): ((Arc<dyn ObjectStore>, Arc<Pace>), String) = match scheme {
            "s3" | "s3a" => {
                let (bucket, prefix) = split_bucket(rest)?;
                let client = shared_client(scheme, &bucket, &config, || {
                    let mut b = object_store::aws::AmazonS3Builder::from_env()
                        .with_bucket_name(&bucket)
                        .with_retry(retry)
                        .with_client_options(client.with_allow_http(true));
                    if std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err() {
                        b = b.with_region("us-east-1");
                    }
                    Ok(Arc::new(b.build().map_err(|e| bad(e.to_string()))?))
                })?;
                (client, prefix)
            }
            "gs" => {
                let (bucket, prefix) = split_bucket(rest)?;
                let client = shared_client(scheme, &bucket, &config, || {
                    let b = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                        .with_bucket_name(&bucket)
                        .with_retry(retry)
                        .with_client_options(client);
                    Ok(Arc::new(b.build().map_err(|e| bad(e.to_string()))?))
                })?;
                (client, prefix)
            }
            "az" | "azure" | "abfs" | "abfss" => {
                let (container, prefix) = split_bucket(rest)?;
                let client = shared_client(scheme, &container, &config, || {
                    let b = object_store::azure::MicrosoftAzureBuilder::from_env()
                        .with_container_name(&container)
                        .with_retry(retry)
                        .with_client_options(client);
                    Ok(Arc::new(b.build().map_err(|e| bad(e.to_string()))?))
                })?;
                (client, prefix)
            }
            "memory" => (
                (Arc::new(object_store::memory::InMemory::new()), Arc::default()),
                rest.trim_matches('/').to_owned(),
            ),
            "file" => {
                let path = std::path::Path::new(if rest.is_empty() { "." } else { rest });
                let canon = path
                    .canonicalize()
                    .map_err(|_| Error::NotFound { key: url.to_owned() })?;
                if !canon.is_dir() {
                    return Err(bad(format!("{} is not a directory", canon.display())));
                }
                let fs =
                    object_store::local::LocalFileSystem::new_with_prefix(&canon).map_err(|e| bad(e.to_string()))?;
                local = Some(canon);
                ((Arc::new(fs), Arc::default()), String::new())
            }
            other => {
                return Err(bad(format!(
                    "unsupported scheme {other:?} (use s3, gs, az, file or a path)"
                )))
            }
        };
        Ok(Store {
            inner,
            prefix: Path::from(prefix),
            base_url: normalize_base(url),
            config,
            pace,
            local,
        })
    }

    /// Wraps an existing object store (tests use this with in-memory or fault-injecting stores).
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, base_url: &str, config: StoreConfig) -> Store {
        Store {
            inner,
            prefix: Path::default(),
            base_url: normalize_base(base_url),
            config,
            pace: Arc::default(),
            local: None,
        }
    }

    /// The same store rooted one level deeper.
    pub fn child(&self, sub: &str) -> Store {
        let sub = sub.trim_matches('/');
        let mut s = self.clone();
        s.prefix = self.path(sub);
        s.base_url = self.url(sub);
        s
    }

    /// The file behind `key` in a `file://` store (`None` for other stores).
    pub fn local_path(&self, key: &str) -> Option<std::path::PathBuf> {
        let mut p = self.local.clone()?;
        for seg in self.path(key).parts() {
            p.push(seg.as_ref());
        }
        Some(p)
    }

    /// The settings in force.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// `key`'s URL as the host daemon and its peers name it: [`Store::url`], except that a
    /// store opened by a plain local path gives a `file://` URL of the absolute path. A path
    /// and its `file://` URL are then one dataset to the daemon (which takes URLs only).
    pub fn canonical_url(&self, key: &str) -> String {
        let url = self.url(key);
        if url.contains("://") {
            return url;
        }
        match std::path::absolute(&url) {
            Ok(p) => format!("file://{}", p.display()),
            Err(_) => url,
        }
    }

    /// Full URL of `key`, used in every message about it.
    pub fn url(&self, key: &str) -> String {
        if self.base_url.ends_with('/') {
            format!("{}{key}", self.base_url)
        } else {
            format!("{}/{key}", self.base_url)
        }
    }

    fn path(&self, key: &str) -> Path {
        let mut p = self.prefix.clone();
        for seg in key.split('/').filter(|s| !s.is_empty()) {
            p = p.clone().join(seg);
        }
        p
    }

    /// Runs `op` under the retry policy. Permanent errors (not found, denied, bad request)
    /// return at once; transient ones (5xx, timeouts, refused connections) are retried.
    async fn retrying<T, F, Fut>(&self, key: &str, mut op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = object_store::Result<T>>,
    {
        let mut retry = Retrying::new(self.config.retry);
        loop {
            let ticket = self.origin_start(false).await;
            let r = op().await;
            finish(ticket, r.as_ref().map(|_| 0));
            match r {
                Ok(v) => {
                    // Each origin request's latency, retries included (RAMJET_LOG=trace).
                    let (ms, attempts) = (retry.start.elapsed().as_secs_f64() * 1e3, retry.attempt + 1);
                    tracing::trace!(object = %self.url(key), ms, attempts, "origin request");
                    return Ok(v);
                }
                Err(e) => self.after_failure(key, &mut retry, e).await?,
            }
        }
    }

    /// After a failed attempt: waits out the backoff and returns `Ok` to try again, or returns
    /// the error to give up with (a permanent error, or the attempts or the window spent).
    async fn after_failure(&self, key: &str, r: &mut Retrying, e: object_store::Error) -> Result<()> {
        let p = self.config.retry;
        r.attempt += 1;
        let transient = is_transient(&e);
        let out_of_time = r.start.elapsed() + r.backoff > Duration::from_millis(p.window_ms);
        if !transient || r.attempt >= p.attempts_max || out_of_time {
            return Err(self.convert(key, e, r.attempt));
        }
        tracing::debug!(object = %self.url(key), attempt = r.attempt, error = %e, "retrying origin request");
        tokio::time::sleep(r.backoff).await;
        r.backoff = (r.backoff * 2).min(Duration::from_millis(p.backoff_max_ms));
        Ok(())
    }

    fn convert(&self, key: &str, e: object_store::Error, attempts: u32) -> Error {
        let url = self.url(key);
        if range_past_end(&e) {
            // The object is shorter than a read of it needs: the caller
            // ([`Store::truncated_or`]) names the sizes.
            return Error::Truncated {
                object: url,
                expected: 0,
                actual: 0,
            };
        }
        match e {
            object_store::Error::NotFound { .. } => Error::NotFound { key: url },
            object_store::Error::PermissionDenied { source, .. }
            | object_store::Error::Unauthenticated { source, .. } => Error::Auth {
                object: url,
                reason: source.to_string(),
            },
            other => Error::Origin {
                object: url,
                attempts,
                reason: error_chain(&other),
            },
        }
    }

    /// Whole object.
    pub async fn get(&self, key: &str) -> Result<Bytes> {
        let path = self.path(key);
        let _bulk = self.pace.bulk();
        self.retrying(key, || async { self.inner.get(&path).await?.bytes().await })
            .await
    }

    /// Starts [`StoreConfig::preconnect`] HEAD requests of `key` in the background and returns
    /// at once. Each opens a connection, which then waits in the client's pool: the first
    /// batch's reads, a few at once per shard, find them ready instead of paying a TCP (and
    /// TLS) handshake each, a round trip apiece on a 20 ms link. Nothing for local files, or
    /// outside a tokio runtime. Their results are not looked at: a failing origin shows on
    /// the requests that matter.
    pub fn preconnect(&self, key: &str) {
        if self.local.is_some() || self.config.preconnect == 0 {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let path = self.path(key);
        for _ in 0..self.config.preconnect {
            let (inner, path) = (self.inner.clone(), path.clone());
            rt.spawn(async move {
                let _ = inner.head(&path).await;
            });
        }
    }

    /// Whole object in one request, refused unread when it is larger than `max` bytes (its size
    /// comes from the response's headers, before the body): `Ok(Err(size))`.
    pub async fn get_at_most(&self, key: &str, max: u64) -> Result<std::result::Result<Bytes, u64>> {
        let path = self.path(key);
        tracing::trace!(object = %self.url(key), "GET starts");
        let t0 = Instant::now();
        let r = self
            .retrying(key, || async {
                let r = self.inner.get(&path).await?;
                if r.meta.size > max {
                    return Ok(Err(r.meta.size));
                }
                Ok(Ok(r.bytes().await?))
            })
            .await?;
        if matches!(&r, Ok(b) if b.len() as u64 <= self.config.hedge_max_bytes) {
            // A first estimate for the hedged reads that follow (a new connection's handshake
            // included: an overestimate, which the next small reads bring down).
            self.pace.observe(t0.elapsed());
        }
        Ok(r)
    }

    /// Bytes `range` of an object. A range past the end is an error naming the object.
    ///
    /// A range of at most [`StoreConfig::hedge_max_bytes`] is hedged. When its request has not
    /// completed after twice the origin's recent latency for such reads (at least
    /// [`StoreConfig::hedge_after_min_ms`]), a second identical request starts, on another
    /// pooled connection, and whichever succeeds first is kept; the other is dropped. A lost
    /// segment at the tail of a small answer otherwise costs TCP's retransmission timeout
    /// (200 ms at least on Linux), ten times a 20 ms round trip: the first batch's reads on a
    /// lossy link. Never while a whole object downloads on the same client (every read is then
    /// slow, and a second request would only add load), at most one extra request per read,
    /// and on one client no more hedges than 8 plus one in ten of its small reads. A hedged
    /// read fails only when both of its requests fail.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        let end = range.end;
        let got = self.get_range_unsized(key, range).await;
        self.truncated_or(key, end, got).await
    }

    /// A read that failed because the object ends before `end` (an origin's 416, a local file's
    /// invalid range) becomes [`Error::Truncated`] with the object's actual size (one HEAD), at
    /// once: that is no transient fault, and retrying it only delays the error.
    async fn truncated_or<T>(&self, key: &str, end: u64, got: Result<T>) -> Result<T> {
        match got {
            Err(Error::Truncated {
                object,
                expected: 0,
                actual: 0,
            }) => {
                let actual = self.size(key).await?;
                Err(Error::Truncated {
                    object,
                    expected: end,
                    actual,
                })
            }
            other => other,
        }
    }

    async fn get_range_unsized(&self, key: &str, range: Range<u64>) -> Result<Bytes> {
        let path = self.path(key);
        let want = range.end - range.start;
        tracing::trace!(object = %self.url(key), ?range, "ranged GET starts");
        let once = || async {
            let t0 = Instant::now();
            let r = self.retrying(key, || self.inner.get_range(&path, range.clone())).await;
            (r, t0.elapsed())
        };
        let b = if self.local.is_some() || want > self.config.hedge_max_bytes {
            once().await.0?
        } else {
            let after = self.pace.hedge_after(self.config.hedge_after_min_ms);
            Pace::add(&self.pace.reads, 1);
            let first = once();
            tokio::pin!(first);
            let on_time = tokio::select! {
                out = &mut first => Some(out),
                _ = tokio::time::sleep(after) => None,
            };
            let (r, took) = match on_time {
                Some(out) => out,
                // While whole objects download on this client the link is busy with them: every
                // read is slow, and a second request would add load, not cut a tail.
                None if self.pace.busy() || !self.pace.may_hedge() => first.await,
                None => {
                    tracing::debug!(object = %self.url(key), ?range, after_ms = after.as_millis() as u64,
                        "a small ranged read runs late: hedged with a second request");
                    let second = once();
                    tokio::pin!(second);
                    // The first success wins; a failure waits for the other request.
                    tokio::select! {
                        (r, took) = &mut first => match r {
                            Ok(b) => (Ok(b), took),
                            Err(_) => self.pace.second(second.await),
                        },
                        out = &mut second => match out.0 {
                            Ok(_) => self.pace.second(out),
                            Err(_) => first.await,
                        },
                    }
                }
            };
            if r.is_ok() {
                self.pace.observe(took);
            }
            r?
        };
        if b.len() as u64 != want {
            return Err(Error::Truncated {
                object: self.url(key),
                expected: range.end,
                actual: range.start + b.len() as u64,
            });
        }
        Ok(b)
    }

    /// Waits for a request's start with the origin's control, if this store has one
    /// ([`crate::tune::Origin`]): bulk requests also take a place in flight.
    async fn origin_start(&self, bulk: bool) -> Option<crate::tune::Ticket> {
        match &self.pace.origin {
            Some(o) => Some(o.start(bulk).await),
            None => None,
        }
    }

    /// This store's origin control (`None` for local and in-memory stores, or with
    /// `RAMJET_ORIGIN_TUNE=off`): the stream's metrics show its state, and its range rule
    /// sizes whole-shard reads.
    pub fn origin(&self) -> Option<Arc<crate::tune::Origin>> {
        self.pace.origin.clone()
    }

    /// Ranged reads hedged so far by stores on this store's client, and how many of them the
    /// second request won ([`Store::get_range`]).
    pub fn hedges(&self) -> (u64, u64) {
        let g = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        (g(&self.pace.hedged), g(&self.pace.hedges_won))
    }

    /// Bytes `range` of an object, written into `dst` (exactly as long as the range) as they
    /// arrive, with no buffer in between. Retried like every request; a retry rewrites `dst`
    /// from its start. A short or long answer is an error naming the object, and on any error
    /// `dst` holds no defined content.
    pub async fn get_range_into(&self, key: &str, range: Range<u64>, dst: &mut [u8]) -> Result<()> {
        self.get_range_into_seen(key, range, dst, |_, _| {}).await
    }

    /// [`Store::get_range_into`], calling `seen(offset, bytes)` with each piece just written
    /// (its offset in `dst`), while it is still in the CPU's cache. A retry starts again from
    /// offset 0.
    pub async fn get_range_into_seen(
        &self,
        key: &str,
        range: Range<u64>,
        dst: &mut [u8],
        seen: impl FnMut(usize, &[u8]) + Send,
    ) -> Result<()> {
        let end = range.end;
        let got = self.get_range_into_unsized(key, range, dst, seen).await;
        self.truncated_or(key, end, got).await
    }

    async fn get_range_into_unsized(
        &self,
        key: &str,
        range: Range<u64>,
        dst: &mut [u8],
        mut seen: impl FnMut(usize, &[u8]) + Send,
    ) -> Result<()> {
        assert_eq!(
            dst.len() as u64,
            range.end - range.start,
            "destination of the wrong size"
        );
        let _bulk = self.pace.bulk();
        let path = self.path(key);
        tracing::trace!(object = %self.url(key), ?range, "ranged GET starts");
        let mut retry = Retrying::new(self.config.retry);
        loop {
            let ticket = self.origin_start(true).await;
            let mut first = None;
            let mut seen_first = |off: usize, b: &[u8]| {
                first.get_or_insert_with(Instant::now);
                seen(off, b)
            };
            let r = read_stream_into(self.inner.as_ref(), &path, range.clone(), dst, &mut seen_first).await;
            if let (Some(t), Some(at)) = (ticket.as_ref(), first) {
                t.first_byte_at(at);
            }
            finish(ticket, r.as_ref().map(|n| *n as u64));
            match r {
                Ok(n) if n == dst.len() => return Ok(()),
                Ok(n) if n < dst.len() => {
                    return Err(Error::Truncated {
                        object: self.url(key),
                        expected: range.end,
                        actual: range.start + n as u64,
                    })
                }
                Ok(n) => {
                    return Err(Error::corrupt(
                        crate::Location::object(self.url(key)),
                        format!("asked for {} bytes at {}, the origin sent {n}", dst.len(), range.start),
                    ))
                }
                Err(e) => self.after_failure(key, &mut retry, e).await?,
            }
        }
    }

    /// Size of an object.
    pub async fn size(&self, key: &str) -> Result<u64> {
        let path = self.path(key);
        Ok(self.retrying(key, || self.inner.head(&path)).await?.size)
    }

    /// Writes an object whole. Large objects go up as a multipart upload with
    /// [`StoreConfig::multipart_parts_in_flight_max`] parts in flight; the object becomes
    /// visible only when the upload completes.
    pub async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        let path = self.path(key);
        if (data.len() as u64) < self.config.multipart_threshold_bytes
            || self.base_url.starts_with("file")
            || !self.base_url.contains("://")
        {
            let payload = PutPayload::from_bytes(data);
            self.retrying(key, || self.inner.put(&path, payload.clone())).await?;
            return Ok(());
        }
        // A failed multipart upload is restarted whole: parts are not resumable across attempts.
        self.retrying(key, || async {
            let upload = self.inner.put_multipart(&path).await?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, self.config.multipart_part_bytes as usize);
            let part = self.config.multipart_part_bytes as usize;
            let mut off = 0;
            while off < data.len() {
                w.wait_for_capacity(self.config.multipart_parts_in_flight_max).await?;
                let end = (off + part).min(data.len());
                w.put(data.slice(off..end));
                off = end;
            }
            w.finish().await
        })
        .await?;
        Ok(())
    }

    /// The objects under folder `under` (relative to this store; `""` for all), after key
    /// `after` when given, a page at a time, in the store's own listing order: UTF-8 byte order
    /// of the keys on S3, folder by folder on SeaweedFS (whichever it is, `after` resumes it).
    /// Keys come back relative to this store. A transient failure mid-listing is retried under
    /// the retry policy from the last key received, so nothing is listed twice or lost.
    pub fn list(&self, under: &str, after: Option<&str>) -> Listing {
        Listing {
            store: self.clone(),
            under: self.path(under),
            last: after.map(|a| self.path(a)),
            inner: None,
            retry: Retrying::new(self.config.retry),
            done: false,
        }
    }

    /// The folders (common prefixes) and objects directly under folder `under`, each sorted by
    /// name, as names relative to `under`; objects with their sizes. For the few top-level
    /// entries of a layout (an image folder's classes), not for a large flat folder.
    pub async fn list_dir(&self, under: &str) -> Result<(Vec<String>, Vec<(String, u64)>)> {
        let path = self.path(under);
        let r = self
            .retrying(under, || self.inner.list_with_delimiter(Some(&path)))
            .await?;
        let name = |p: &Path| p.filename().unwrap_or_default().to_owned();
        let mut dirs: Vec<String> = r.common_prefixes.iter().map(name).collect();
        let mut files: Vec<(String, u64)> = r.objects.iter().map(|o| (name(&o.location), o.size)).collect();
        dirs.sort();
        files.sort();
        Ok((dirs, files))
    }

    /// A key relative to this store, for a path the client returned.
    fn relative(&self, p: &Path) -> String {
        let full = p.as_ref();
        let pre = self.prefix.as_ref();
        if pre.is_empty() {
            return full.to_owned();
        }
        full.strip_prefix(pre)
            .map(|r| r.trim_start_matches('/').to_owned())
            .unwrap_or_else(|| full.to_owned())
    }

    /// Deletes an object (tests and tools use this).
    pub async fn delete(&self, key: &str) -> Result<()> {
        let path = self.path(key);
        self.retrying(key, || self.inner.delete(&path)).await
    }
}

/// A URL without trailing slashes, except that a bare `scheme://` root keeps its own.
fn normalize_base(url: &str) -> String {
    let t = url.trim_end_matches('/');
    if t.ends_with(':') {
        format!("{t}//")
    } else {
        t.to_owned()
    }
}

/// Cloud clients kept by the process, at most this many.
const SHARED_CLIENTS_MAX: usize = 32;

/// The process's client for one bucket, built on first use and then shared by every store
/// opened on it with the same settings and the same credentials in the environment. Building
/// one (TLS set-up, a new connection pool) cost 10-16 ms here, most of a warm stream's start;
/// a shared one also keeps its pooled connections.
fn shared_client(
    scheme: &str,
    bucket: &str,
    config: &StoreConfig,
    build: impl FnOnce() -> Result<Arc<dyn ObjectStore>>,
) -> Result<(Arc<dyn ObjectStore>, Arc<Pace>)> {
    type Client = (Arc<dyn ObjectStore>, Arc<Pace>);
    type Clients = std::sync::Mutex<std::collections::HashMap<String, Client>>;
    // Per process: a forked child must not wait on a lock a parent thread held at the fork.
    static CLIENTS: crate::rt::PerProcess<Clients> = crate::rt::PerProcess::new();
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| ["AWS_", "GOOGLE_", "AZURE_"].iter().any(|p| k.starts_with(p)))
        .collect();
    env.sort();
    // The process id is part of the key: a forked child (a DataLoader worker) must not use
    // its parent's client, whose pooled connections and tasks belong to the parent.
    let key = format!(
        "{}\0{scheme}\0{bucket}\0{}\0{}\0{}\0{env:?}",
        std::process::id(),
        config.request_timeout_ms,
        config.connect_timeout_ms,
        config.retry.window_ms
    );
    let clients = CLIENTS.get(|| Ok(Default::default()))?;
    if let Some(c) = clients.lock().expect("client cache lock").get(&key) {
        return Ok(c.clone());
    }
    let origin = crate::tune::Origin::from_env();
    if let Some(o) = &origin {
        crate::tune::Origin::register(&format!("{scheme}://{bucket}"), o);
    }
    let pace = Pace {
        origin,
        ..Default::default()
    };
    let c = (build()?, Arc::new(pace));
    let mut map = clients.lock().expect("client cache lock");
    if map.len() >= SHARED_CLIENTS_MAX {
        map.clear();
    }
    Ok(map.entry(key).or_insert(c).clone())
}

/// How fast an origin has answered small reads lately, for [`Store::get_range`]'s hedge.
#[derive(Debug, Default)]
struct Pace {
    /// Recent latency of a small read, microseconds (0: none seen yet). It falls at once to a
    /// faster read and rises by a sixteenth of the gap on a slower one: close to the floor a
    /// healthy request reaches, not dragged up by the slow reads the hedge is for.
    latency_us: std::sync::atomic::AtomicU64,
    /// Small reads started (each may be hedged).
    reads: std::sync::atomic::AtomicU64,
    /// Reads hedged.
    hedged: std::sync::atomic::AtomicU64,
    /// Hedged reads the second request won.
    hedges_won: std::sync::atomic::AtomicU64,
    /// Whole-object and large reads in flight ([`Store::get`], [`Store::get_range_into`]).
    bulk: std::sync::atomic::AtomicU64,
    /// The origin's request control ([`crate::tune::Origin`]; remote stores only, unless
    /// `RAMJET_ORIGIN_TUNE=off`).
    origin: Option<Arc<crate::tune::Origin>>,
}

/// One bulk read in flight, counted in [`Pace`] until dropped.
struct Bulk<'a>(&'a Pace);

impl Drop for Bulk<'_> {
    fn drop(&mut self) {
        self.0.bulk.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Pace {
    /// Used before any read was timed: a first read waits this long for its hedge.
    const UNKNOWN: Duration = Duration::from_millis(200);
    /// No hedge waits longer than this.
    const AFTER_MAX: Duration = Duration::from_secs(2);
    /// Hedges allowed before any read was counted: a first batch's reads, all at once.
    const HEDGES_FREE: u64 = 8;
    /// Beyond those, at most one read in this many is hedged: on a link that is slow for every
    /// read (saturated by whole-shard downloads), hedging each would add load, not cut a tail.
    const HEDGE_ONE_IN: u64 = 10;

    fn add(a: &std::sync::atomic::AtomicU64, n: u64) {
        a.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    fn observe(&self, took: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let t = (took.as_micros() as u64).max(1);
        // Lost updates between racing readers only blur an estimate.
        let old = self.latency_us.load(Relaxed);
        let new = if old == 0 || t <= old { t } else { old + (t - old) / 16 };
        self.latency_us.store(new, Relaxed);
    }

    /// Takes a hedge from the budget: `false` when the hedges so far already reach
    /// [`Pace::HEDGES_FREE`] plus one in [`Pace::HEDGE_ONE_IN`] of the reads.
    fn may_hedge(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let allowed = Self::HEDGES_FREE + self.reads.load(Relaxed) / Self::HEDGE_ONE_IN;
        self.hedged
            .fetch_update(Relaxed, Relaxed, |h| (h < allowed).then_some(h + 1))
            .is_ok()
    }

    /// Counts a bulk read until the guard is dropped.
    fn bulk(&self) -> Bulk<'_> {
        Self::add(&self.bulk, 1);
        Bulk(self)
    }

    /// Whether bulk reads are in flight.
    fn busy(&self) -> bool {
        self.bulk.load(std::sync::atomic::Ordering::Relaxed) > 0
    }

    /// A hedged read's outcome when its second request gave it, counted when it succeeded.
    fn second<T>(&self, out: (Result<T>, Duration)) -> (Result<T>, Duration) {
        if out.0.is_ok() {
            Self::add(&self.hedges_won, 1);
        }
        out
    }

    /// How long a small read runs before it is hedged.
    fn hedge_after(&self, min_ms: u64) -> Duration {
        let us = self.latency_us.load(std::sync::atomic::Ordering::Relaxed);
        let after = if us == 0 {
            Self::UNKNOWN
        } else {
            Duration::from_micros(us * 2)
        };
        after.clamp(
            Duration::from_millis(min_ms),
            Self::AFTER_MAX.max(Duration::from_millis(min_ms)),
        )
    }
}

/// The state of one request's retries.
/// A listing in progress ([`Store::list`]).
pub struct Listing {
    store: Store,
    under: Path,
    /// The last key received (or the starting point): a retry resumes after it.
    last: Option<Path>,
    inner: Option<futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>>,
    retry: Retrying,
    /// The listing ended (a finished stream must not be polled again).
    done: bool,
}

impl std::fmt::Debug for Listing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listing")
            .field("store", &self.store.base_url)
            .field("under", &self.under)
            .field("last", &self.last)
            .finish()
    }
}

impl Listing {
    /// The next object: its key (relative to the store) and size; `None` at the end.
    pub async fn next(&mut self) -> Option<Result<(String, u64)>> {
        use futures::StreamExt;
        if self.done {
            return None;
        }
        loop {
            let inner = self.inner.get_or_insert_with(|| {
                let under = (!self.under.as_ref().is_empty()).then_some(&self.under);
                match &self.last {
                    Some(after) => self.store.inner.list_with_offset(under, after),
                    None => self.store.inner.list(under),
                }
            });
            match inner.next().await {
                None => {
                    self.done = true;
                    return None;
                }
                Some(Ok(meta)) => {
                    self.retry = Retrying::new(self.store.config.retry);
                    let key = self.store.relative(&meta.location);
                    self.last = Some(meta.location);
                    return Some(Ok((key, meta.size)));
                }
                Some(Err(e)) => {
                    self.inner = None;
                    let what = self.store.relative(&self.under);
                    if let Err(e) = self.store.after_failure(&what, &mut self.retry, e).await {
                        return Some(Err(e));
                    }
                }
            }
        }
    }
}

struct Retrying {
    start: Instant,
    backoff: Duration,
    attempt: u32,
}

impl Retrying {
    fn new(p: RetryPolicy) -> Retrying {
        Retrying {
            start: Instant::now(),
            backoff: Duration::from_millis(p.backoff_initial_ms),
            attempt: 0,
        }
    }
}

/// One ranged GET, its body copied into `dst` chunk by chunk as it arrives. Returns the bytes
/// the origin sent (only the first `dst.len()` are kept).
async fn read_stream_into(
    store: &dyn ObjectStore,
    path: &Path,
    range: Range<u64>,
    dst: &mut [u8],
    seen: &mut (impl FnMut(usize, &[u8]) + Send),
) -> object_store::Result<usize> {
    use futures::StreamExt;
    let opts = object_store::GetOptions {
        range: Some(range.into()),
        ..Default::default()
    };
    let got = store.get_opts(path, opts).await?;
    // A local file's body, as object_store streams it, is 8 KiB reads each on a blocking-pool
    // task: a task switch per 8 KiB, the main cost of reading a warm local dataset. Read it
    // straight into `dst` instead, in large positional reads, on this worker (the runtime moves
    // its other tasks away meanwhile).
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        if let object_store::GetResultPayload::File(file, file_path) = got.payload {
            let start = got.range.start;
            let len = (got.range.end - got.range.start) as usize;
            return tokio::task::block_in_place(|| read_file_into(&file, &file_path, start, len, dst, seen));
        }
    }
    let mut body = got.into_stream();
    let mut n = 0usize;
    while let Some(chunk) = body.next().await {
        let chunk = chunk?;
        if let Some(d) = dst.get_mut(n..n + chunk.len()) {
            d.copy_from_slice(&chunk);
            seen(n, d);
        }
        n += chunk.len();
    }
    Ok(n)
}

/// [`read_stream_into`] for a local file: `len` bytes at `start`, read into `dst` (the bytes
/// past `dst`'s end only counted), 4 MiB at a time.
fn read_file_into(
    file: &std::fs::File,
    file_path: &std::path::Path,
    start: u64,
    len: usize,
    dst: &mut [u8],
    seen: &mut (impl FnMut(usize, &[u8]) + Send),
) -> object_store::Result<usize> {
    use std::os::unix::fs::FileExt;
    const PIECE: usize = 4 << 20;
    let io = |e: std::io::Error| object_store::Error::Generic {
        store: "LocalFileSystem",
        source: format!("reading {}: {e}", file_path.display()).into(),
    };
    let keep = len.min(dst.len());
    let mut n = 0usize;
    while n < keep {
        let piece = &mut dst[n..keep.min(n + PIECE)];
        let got = file.read_at(piece, start + n as u64).map_err(io)?;
        if got == 0 {
            return Ok(n); // the file ended early: the caller names the short read
        }
        seen(n, &piece[..got]);
        n += got;
    }
    // The origin sent more than `dst` holds: counted, as a stream's surplus is.
    Ok(n.max(len))
}

/// Whether an object_store error says a ranged read started or ended past the object's end:
/// an origin's `416 Range Not Satisfiable`, or the local store's invalid range.
fn range_past_end(e: &object_store::Error) -> bool {
    let msg = error_chain(e);
    msg.contains("Requested range was invalid")
        || msg.contains("Wanted range starting at")
        || msg.contains("status code: 416")
        || msg.contains("InvalidRange")
}

/// Reports how an attempt ended to the origin's control: its bytes, a throttle, or another
/// failure.
fn finish(ticket: Option<crate::tune::Ticket>, r: std::result::Result<u64, &object_store::Error>) {
    if let Some(t) = ticket {
        t.finish(r.map_err(is_throttle));
    }
}

/// Whether an origin said to slow down: HTTP 503 (S3's SlowDown) or 429 (Too Many Requests).
fn is_throttle(e: &object_store::Error) -> bool {
    let msg = error_chain(e);
    msg.contains("status code: 503")
        || msg.contains("status code: 429")
        || msg.contains("SlowDown")
        || msg.contains("Too Many Requests")
}

/// Whether an object_store error is worth retrying.
fn is_transient(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    if range_past_end(e) {
        return false;
    }
    match e {
        E::NotFound { .. }
        | E::PermissionDenied { .. }
        | E::Unauthenticated { .. }
        | E::InvalidPath { .. }
        | E::NotSupported { .. }
        | E::NotImplemented { .. }
        | E::Precondition { .. }
        | E::NotModified { .. }
        | E::AlreadyExists { .. }
        | E::UnknownConfigurationKey { .. } => false,
        other => {
            // A client error (4xx other than 408/429) will not change on retry. The status is
            // only exposed in the message ("... status code: 400 Bad Request ...").
            let msg = error_chain(other);
            if let Some(i) = msg.find("status code: ") {
                if let Ok(c) = msg[i + 13..].chars().take(3).collect::<String>().parse::<u16>() {
                    return !(400..500).contains(&c) || c == 408 || c == 429;
                }
            }
            true
        }
    }
}

/// `e` and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pace_follows_fast_reads_at_once_slow_ones_slowly_and_budgets_hedges() {
        let ms = Duration::from_millis;
        let p = Pace::default();
        assert_eq!(p.hedge_after(20), Pace::UNKNOWN, "nothing timed yet");
        p.observe(ms(45));
        assert_eq!(p.hedge_after(20), ms(90));
        p.observe(ms(25));
        assert_eq!(p.hedge_after(20), ms(50), "a faster read counts at once");
        p.observe(ms(185));
        assert_eq!(p.hedge_after(20), ms(70), "a slower one by a sixteenth of the gap");
        p.observe(Duration::from_micros(500));
        assert_eq!(p.hedge_after(20), ms(20), "never under the floor");
        p.observe(Duration::from_secs(60));
        assert_eq!(p.hedge_after(20), Pace::AFTER_MAX, "never over the cap");
        for _ in 0..Pace::HEDGES_FREE {
            assert!(p.may_hedge());
        }
        assert!(!p.may_hedge(), "the free hedges are spent");
        for _ in 0..Pace::HEDGE_ONE_IN {
            Pace::add(&p.reads, 1);
        }
        assert!(p.may_hedge(), "one more after ten reads");
        assert!(!p.may_hedge());
        assert!(!p.busy());
        let (a, b) = (p.bulk(), p.bulk());
        assert!(p.busy());
        drop(a);
        assert!(p.busy(), "one bulk read still in flight");
        drop(b);
        assert!(!p.busy());
    }

    #[test]
    fn dataset_url_forms() {
        assert_eq!(
            DatasetUrl::parse("s3://b/p/"),
            DatasetUrl {
                prefix_url: "s3://b/p".into(),
                manifest_key: "manifest.json".into()
            }
        );
        assert_eq!(
            DatasetUrl::parse("s3://b/p/manifests/abc.json"),
            DatasetUrl {
                prefix_url: "s3://b/p/manifests".into(),
                manifest_key: "abc.json".into()
            }
        );
        assert_eq!(DatasetUrl::parse("/data/ds").prefix_url, "/data/ds");
    }

    #[test]
    fn unknown_scheme_is_refused_with_the_url() {
        let e = Store::open("ftp://x/y").unwrap_err().to_string();
        assert!(e.contains("ftp://x/y") && e.contains("unsupported scheme"), "{e}");
    }

    #[tokio::test]
    async fn memory_store_round_trip_and_missing_key() {
        let s = Store::open("memory://").unwrap();
        s.put("a/b.bin", Bytes::from_static(b"hello")).await.unwrap();
        assert_eq!(&s.get("a/b.bin").await.unwrap()[..], b"hello");
        assert_eq!(&s.get_range("a/b.bin", 1..3).await.unwrap()[..], b"el");
        assert_eq!(s.size("a/b.bin").await.unwrap(), 5);
        // Bounded whole-object reads: the size comes with the answer, the body is not read.
        assert_eq!(&s.get_at_most("a/b.bin", 5).await.unwrap().unwrap()[..], b"hello");
        assert_eq!(s.get_at_most("a/b.bin", 4).await.unwrap().unwrap_err(), 5);
        assert!(matches!(s.get_at_most("nope", 9).await, Err(Error::NotFound { .. })));
        let e = s.get("nope").await.unwrap_err();
        assert!(
            matches!(e, Error::NotFound { ref key } if key == "memory://nope"),
            "{e}"
        );
    }
}
