//! The node-local shard cache: one directory shared by every process on the host.
//!
//! Layout under the cache directory:
//!
//! ```text
//! lock                       flock held while admitting (budget accounting and eviction)
//! shards/<xxh3>-<bytes>.rjs  complete, verified shards, named by content
//! tmp/<name>.<pid>.<n>       shards being written (never read; removed if their writer died)
//! fetch/<name>.lock          flock held by the one process downloading that shard
//! ```
//!
//! Guarantees:
//! - **Bounded.** The bytes under `shards/` and `tmp/` never exceed `limit_bytes`: room is made
//!   and the temp file written while holding the admission lock, so every admission sees every
//!   other's bytes.
//! - **Crash-safe.** A shard is written to `tmp/` and renamed into `shards/`, so a killed
//!   process leaves a complete file or a temp file; temp files of dead processes are removed
//!   when a cache is opened. Nothing is fsynced: a file torn by a power loss fails the hash
//!   of its next read (below) and is fetched again.
//! - **Self-healing layout.** A directory of the layout that disappears under a running process
//!   (someone deleted the cache) is made again by the next operation that needs it, with one
//!   warning; the shards that were in it are misses and fetched again.
//! - **Verified.** Every read hashes the whole shard and compares it with the checksum in its
//!   name; a mismatch deletes the file and reports a miss, so a damaged shard is re-fetched and
//!   never served.
//! - **LRU, with a stable resident subset.** Eviction takes the least recently used shard not
//!   in use (readers hold a shared flock). When the dataset is larger than the budget, plain
//!   LRU evicts every shard before its next use and the hit rate falls to zero. So a recently
//!   used shard is evicted only for a shard of higher *priority* (a fixed hash of its checksum):
//!   over epochs the cache settles on the same highest-priority subset and the hit rate stays
//!   near budget / dataset. Shards unused for `stale_after_secs` are evicted in plain LRU order.
//!
//! The design keeps ownership in one place (`Cache`), so the host daemon can own it later and
//! serve other processes without changing the on-disk contract.

pub mod lock;

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, Result};
use crate::format::FOOTER_LEN;
use crate::io::{self, CacheIo};
use crate::metrics::Metrics;
use lock::FileLock;

/// Cache settings.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct CacheConfig {
    /// The cache directory.
    pub dir: PathBuf,
    /// Byte budget of `shards/` plus `tmp/`.
    pub limit_bytes: u64,
    /// A shard unused this long is evicted in plain LRU order.
    #[serde(default = "stale_after_secs")]
    pub stale_after_secs: u64,
}

fn stale_after_secs() -> u64 {
    600
}

impl CacheConfig {
    /// A cache at `dir` holding at most `limit_bytes`.
    pub fn new(dir: impl Into<PathBuf>, limit_bytes: u64) -> Self {
        Self {
            dir: dir.into(),
            limit_bytes,
            stale_after_secs: stale_after_secs(),
        }
    }
}

/// A shard's identity in the cache: its content checksum and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardId {
    /// Whole-shard xxh3-64.
    pub checksum: u64,
    /// Size in bytes.
    pub bytes: u64,
}

impl ShardId {
    /// File name in `shards/`.
    pub fn file_name(&self) -> String {
        format!("{:016x}-{}.rjs", self.checksum, self.bytes)
    }

    fn parse(name: &str) -> Option<ShardId> {
        let stem = name.strip_suffix(".rjs")?;
        let (c, b) = stem.split_once('-')?;
        Some(ShardId {
            checksum: u64::from_str_radix(c, 16).ok()?,
            bytes: b.parse().ok()?,
        })
    }

    /// Admission priority: a fixed pseudo-random rank, the same on every host and run.
    pub fn priority(&self) -> u64 {
        xxh3_64(&self.checksum.to_le_bytes())
    }
}

/// The cache. Cheap to clone; every clone shares the I/O and metrics.
#[derive(Clone)]
pub struct Cache {
    cfg: CacheConfig,
    io: Arc<dyn CacheIo>,
    metrics: Arc<Metrics>,
    tmp_seq: Arc<AtomicU64>,
}

/// The host-wide download lock of one shard (see [`Cache::fetch_lock`]); released on drop.
pub struct FetchGuard(#[allow(dead_code)] FileLock);

impl Cache {
    /// Opens (creating) the cache directory and removes temp files of dead writers.
    pub fn open(cfg: CacheConfig, io: Arc<dyn CacheIo>, metrics: Arc<Metrics>) -> Result<Cache> {
        make_layout(&cfg.dir)?;
        let c = Cache {
            cfg,
            io,
            metrics,
            tmp_seq: Arc::new(AtomicU64::new(0)),
        };
        let _g = c.admission_lock()?;
        c.remove_dead_temps()?;
        Ok(c)
    }

    /// Settings.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Name of the I/O implementation in use.
    pub fn io_name(&self) -> &'static str {
        self.io.name()
    }

    /// Path of a cached shard (whether or not it is present).
    pub fn path_of(&self, id: ShardId) -> PathBuf {
        self.cfg.dir.join("shards").join(id.file_name())
    }

    /// Runs `op`; when it fails with "not found", makes the layout again if a directory of it
    /// is gone and runs `op` again, up to [`HEAL_TRIES`] times (see the module docs,
    /// "Self-healing layout"). The layout found whole is tried again too: another thread may
    /// have made it again between this one's failure and its look (regression: that thread's
    /// error reached the consumer as a lost epoch).
    fn healing<T>(&self, op: impl Fn() -> std::io::Result<T>) -> std::io::Result<T> {
        let mut tries = 0;
        loop {
            match op() {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < HEAL_TRIES => {
                    tries += 1;
                    let missing = ["shards", "tmp", "fetch"]
                        .iter()
                        .any(|d| !self.cfg.dir.join(d).is_dir());
                    if missing {
                        tracing::warn!(dir = %self.cfg.dir.display(), "the cache directory disappeared; made again (its shards are fetched again)");
                        make_layout(&self.cfg.dir).map_err(|e| std::io::Error::other(e.to_string()))?;
                    }
                }
                r => return r,
            }
        }
    }

    fn admission_lock(&self) -> Result<FileLock> {
        let p = self.cfg.dir.join("lock");
        self.healing(|| FileLock::acquire(&p, true, true, true))
            .map_err(|e| Error::io(p.display(), e))?
            .ok_or_else(|| Error::io(p.display(), std::io::Error::other("lock not granted")))
    }

    /// Holds the download lock of one shard, so one process on the host fetches it while the
    /// others wait and then read it from the cache.
    pub fn fetch_lock(&self, id: ShardId) -> Result<FetchGuard> {
        let p = self.cfg.dir.join("fetch").join(format!("{}.lock", id.file_name()));
        self.healing(|| FileLock::acquire(&p, true, true, true))
            .map_err(|e| Error::io(p.display(), e))?
            .map(FetchGuard)
            .ok_or_else(|| Error::io(p.display(), std::io::Error::other("lock not granted")))
    }

    /// [`Cache::fetch_lock`] without waiting: `None` while another holder has it (an async
    /// caller polls, so a runtime thread never sleeps in `flock`).
    pub fn try_fetch_lock(&self, id: ShardId) -> Result<Option<FetchGuard>> {
        let p = self.cfg.dir.join("fetch").join(format!("{}.lock", id.file_name()));
        Ok(self
            .healing(|| FileLock::acquire(&p, true, false, true))
            .map_err(|e| Error::io(p.display(), e))?
            .map(FetchGuard))
    }

    fn remove_dead_temps(&self) -> Result<()> {
        let d = self.cfg.dir.join("tmp");
        for e in fs::read_dir(&d).map_err(|e| Error::io(d.display(), e))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name.rsplit('.').nth(1).and_then(|p| p.parse::<i32>().ok());
            // SAFETY: kill with signal 0 only checks whether the process exists.
            let alive = pid.is_some_and(|p| unsafe { libc::kill(p, 0) } == 0);
            if !alive {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(())
    }

    /// The one way to hold a cached shard: open, of the right size, marked used, and pinned
    /// against eviction (a shared lock on its file; eviction takes an exclusive one) until the
    /// handle is dropped. `Ok(None)` on a miss; a file of the wrong size is deleted, counted
    /// and reported as a miss. Every read through the handle is verified (see
    /// [`CachedShard`]).
    pub fn shard(&self, id: ShardId) -> Result<Option<CachedShard>> {
        let path = self.path_of(id);
        let pin = match FileLock::acquire(&path, false, true, false) {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path.display(), e)),
        };
        let len = pin.file().metadata().map_err(|e| Error::io(path.display(), e))?.len();
        if len != id.bytes {
            tracing::warn!(path = %path.display(), "cached shard has the wrong size: deleted, will re-fetch");
            Metrics::add(&self.metrics.cache_corrupt, 1);
            let _ = fs::remove_file(&path);
            return Ok(None);
        }
        let _ = pin.file().set_modified(SystemTime::now());
        Ok(Some(CachedShard {
            pin,
            path,
            id,
            io: self.io.clone(),
            metrics: self.metrics.clone(),
        }))
    }

    /// A cached shard's bytes, verified whole ([`Cache::shard`] then [`CachedShard::bytes`]).
    /// `Ok(None)` on a miss; a corrupt or truncated copy is deleted, counted, and reported as
    /// a miss, never returned.
    pub fn get(&self, id: ShardId) -> Result<Option<Bytes>> {
        match self.shard(id)? {
            Some(s) => s.bytes(),
            None => Ok(None),
        }
    }

    /// Deletes a cached shard a reader found corrupt, so it is fetched again.
    pub fn remove(&self, id: ShardId) {
        delete_corrupt(&self.path_of(id), &self.metrics);
    }

    /// Deletes the copy `shard` has open, which a reader found corrupt, so it is fetched again;
    /// unless the file at its path is another copy by now (a sound one fetched since by a
    /// reader of the whole shard, which must not be deleted).
    pub fn remove_copy(&self, shard: &CachedShard) {
        shard.discard();
    }

    /// Whether a shard is present (not verified).
    pub fn contains(&self, id: ShardId) -> bool {
        self.path_of(id).exists()
    }

    /// Bytes under `shards/` and `tmp/`.
    pub fn usage(&self) -> Result<u64> {
        Ok(self.entries()?.iter().map(|e| e.bytes).sum::<u64>() + self.temp_bytes()?)
    }

    fn temp_bytes(&self) -> Result<u64> {
        let d = self.cfg.dir.join("tmp");
        let mut n = 0;
        for e in self
            .healing(|| fs::read_dir(&d))
            .map_err(|e| Error::io(d.display(), e))?
            .flatten()
        {
            n += e.metadata().map(|m| m.len()).unwrap_or(0);
        }
        Ok(n)
    }

    fn entries(&self) -> Result<Vec<Entry>> {
        let d = self.cfg.dir.join("shards");
        let mut out = Vec::new();
        for e in self
            .healing(|| fs::read_dir(&d))
            .map_err(|e| Error::io(d.display(), e))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let (Some(id), Ok(m)) = (ShardId::parse(&name), e.metadata()) else {
                continue;
            };
            out.push(Entry {
                id,
                bytes: m.len(),
                used: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                path: e.path(),
            });
        }
        Ok(out)
    }

    /// Stores a verified shard. Returns whether it was admitted; a full disk or a budget full
    /// of in-use or higher-priority shards means "not admitted", and the caller streams the
    /// shard from memory instead. Nothing partial is ever visible under `shards/`.
    pub fn insert(&self, id: ShardId, data: &Bytes) -> Result<bool> {
        assert_eq!(
            data.len() as u64,
            id.bytes,
            "insert of a shard whose size does not match its id"
        );
        let dest = self.path_of(id);
        if dest.exists() {
            return Ok(true);
        }
        if id.bytes > self.cfg.limit_bytes {
            Metrics::add(&self.metrics.cache_rejects, 1);
            return Ok(false);
        }
        let tmp = self.cfg.dir.join("tmp").join(format!(
            "{}.{}.{}",
            id.file_name(),
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        {
            let _g = self.admission_lock()?;
            if !self.make_room(id)? {
                Metrics::add(&self.metrics.cache_rejects, 1);
                return Ok(false);
            }
            // Written and moved into place under the admission lock: no other process admits a
            // shard until this one's bytes are on disk and counted by every later scan. The
            // rename too: a scan reads `shards/` then `tmp/`, and a rename between the two
            // would hide the shard from both (a test with four processes admitting at once saw
            // the budget overshot by half a shard that way).
            if let Err(e) = self.healing(|| self.io.write_file(&tmp, data.clone())) {
                let _ = fs::remove_file(&tmp);
                Metrics::add(&self.metrics.cache_rejects, 1);
                tracing::warn!(path = %tmp.display(), error = %e, "cache write failed; shard not cached");
                return Ok(false);
            }
            if let Err(e) = self.healing(|| fs::rename(&tmp, &dest)) {
                // The cache is a copy: a shard it cannot keep is read from memory all the same.
                let _ = fs::remove_file(&tmp);
                Metrics::add(&self.metrics.cache_rejects, 1);
                tracing::warn!(path = %dest.display(), error = %e, "cache rename failed; shard not cached");
                return Ok(false);
            }
        }
        Metrics::add(&self.metrics.cache_inserts, 1);
        Ok(true)
    }

    /// Evicts until `id` fits, or returns false (evicting nothing) if it cannot.
    fn make_room(&self, id: ShardId) -> Result<bool> {
        let mut entries = self.entries()?;
        let used: u64 = entries.iter().map(|e| e.bytes).sum::<u64>() + self.temp_bytes()?;
        let limit = self.cfg.limit_bytes;
        if used + id.bytes <= limit {
            return Ok(true);
        }
        entries.sort_by_key(|e| e.used);
        let stale_before = SystemTime::now() - Duration::from_secs(self.cfg.stale_after_secs);
        let mut need = used + id.bytes - limit;
        let mut victims = Vec::new();
        for e in entries {
            if need == 0 {
                break;
            }
            if e.used > stale_before && e.id.priority() >= id.priority() {
                continue;
            }
            // A reader holds a shared lock: in use, not evictable.
            if let Ok(Some(lock)) = FileLock::acquire(&e.path, true, false, false) {
                need = need.saturating_sub(e.bytes);
                victims.push((e, lock));
            }
        }
        if need > 0 {
            return Ok(false);
        }
        for (e, _lock) in victims {
            if fs::remove_file(&e.path).is_ok() {
                Metrics::add(&self.metrics.cache_evictions, 1);
            }
        }
        Ok(true)
    }
}

/// A cached shard held open and pinned against eviction (see [`Cache::shard`]). Its bytes
/// are verified on every path out: [`CachedShard::bytes`] hashes the whole file as it reads;
/// [`CachedShard::records`] checks each record against its own checksum; a process that
/// receives [`CachedShard::file`] (the host daemon's fd passing) verifies the whole shard
/// and reports a bad copy with [`Cache::remove`].
pub struct CachedShard {
    pin: FileLock,
    path: PathBuf,
    id: ShardId,
    io: Arc<dyn CacheIo>,
    metrics: Arc<Metrics>,
}

/// Times [`Cache::healing`] runs an operation again after "not found".
const HEAL_TRIES: usize = 3;

/// Makes the cache's layout under `dir` (what is there already is kept).
fn make_layout(dir: &Path) -> Result<()> {
    for sub in ["shards", "tmp", "fetch"] {
        let d = dir.join(sub);
        fs::create_dir_all(&d).map_err(|e| Error::io(d.display(), e))?;
    }
    Ok(())
}

/// Deletes the corrupt copy at `path`; whoever's delete succeeds counts it and warns, naming
/// the file (every way a corrupt copy leaves the cache goes through here).
fn delete_corrupt(path: &Path, metrics: &Metrics) {
    if fs::remove_file(path).is_ok() {
        Metrics::add(&metrics.cache_corrupt, 1);
        tracing::warn!(path = %path.display(), "cached shard failed its checksum: deleted, will re-fetch");
    }
}

impl CachedShard {
    /// Deletes this copy, which a reader found corrupt, then counts it and warns naming the
    /// file, once: unless the file at its path is another copy by now (a sound one fetched
    /// since, which must not be deleted), or another reader of the same copy deleted it first.
    fn discard(&self) {
        use std::os::unix::fs::MetadataExt;
        let (Ok(open), Ok(now)) = (self.file().metadata(), fs::metadata(&self.path)) else {
            return;
        };
        if (open.dev(), open.ino()) == (now.dev(), now.ino()) {
            delete_corrupt(&self.path, &self.metrics);
        }
    }

    /// The open file (pinned while this handle lives).
    pub fn file(&self) -> &File {
        self.pin.file()
    }

    /// The file opened afresh, to hand whole to a reader that verifies it (the host daemon
    /// passing the descriptor to a loader, or sending the file to a peer): counted as a hit.
    ///
    /// A fresh open file description, never a copy of the pinned one: the pin's shared lock
    /// belongs to its description, so a copy handed to a loader (or inherited by a worker the
    /// loader forks) would hold the lock, and keep the shard from eviction, for as long as any
    /// copy lives. The fresh file is checked to be the pinned one (same device and inode).
    pub fn hand_out(&self) -> Result<File> {
        let f = self.reopen()?;
        Metrics::add(&self.metrics.cache_hits, 1);
        Metrics::add(&self.metrics.cache_bytes, self.id.bytes);
        Ok(f)
    }

    /// The pinned file opened again (a new open file description, without the pin's lock).
    fn reopen(&self) -> Result<File> {
        use std::os::unix::fs::MetadataExt;
        let err = |e: std::io::Error| Error::io(self.path.display(), e);
        let f = File::open(&self.path).map_err(err)?;
        let (a, b) = (f.metadata().map_err(err)?, self.pin.file().metadata().map_err(err)?);
        if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
            return Err(err(std::io::Error::other(
                "the cached file was replaced while pinned (a corrupt copy deleted and fetched again)",
            )));
        }
        Ok(f)
    }

    /// The whole shard, hashed as it is read (through the I/O core). `Ok(None)` when it fails
    /// its checksum or was truncated: the copy is then deleted and counted as corrupt.
    pub fn bytes(&self) -> Result<Option<Bytes>> {
        let (bytes, hash) = match self.io.read_file(&self.path, FOOTER_LEN as usize) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(self.path.display(), e)),
        };
        if bytes.len() as u64 != self.id.bytes || hash != Some(self.id.checksum) {
            self.discard();
            return Ok(None);
        }
        Metrics::add(&self.metrics.cache_hits, 1);
        Metrics::add(&self.metrics.cache_bytes, bytes.len() as u64);
        Ok(Some(bytes))
    }

    /// A reader of single records, each checked against its own checksum (random access and
    /// global shuffle read two ranges of the file per sample, not the whole shard).
    /// The copy must have the size and, in its footer, the checksum of the shard it is cached
    /// as: a file of another shard put in its place is refused, deleted and counted as corrupt.
    pub fn records(&self) -> Result<crate::format::ShardReader<File>> {
        let f = self.reopen()?;
        let name = self.path.display().to_string();
        crate::format::ShardReader::open_expecting(f, &name, self.id.bytes, self.id.checksum).inspect_err(|e| {
            if e.is_data_error() {
                self.discard();
            }
        })
    }
}

/// Nice value of the cache-filling threads: a tenth of a normal thread's CPU share when the
/// cores are contended (19, the lowest, could starve the copies for minutes on a busy host).
const FILL_NICE: libc::c_int = 10;

/// Threads that write cache copies at a low CPU priority (nice 10), so filling the cache
/// never takes a core from fetching, verifying and delivering samples: where the cores are
/// busy, the copies wait for idle time (the consumer's compute, or the end of the epoch).
/// Jobs run in submission order across the threads; the threads end when the filler is
/// dropped and the queue is drained.
pub struct Filler {
    tx: std::sync::Mutex<std::sync::mpsc::Sender<FillJob>>,
}

/// One background cache write.
pub type FillJob = Box<dyn FnOnce() + Send>;

/// Writer threads of the process's filler.
pub const FILL_THREADS: usize = 2;

static FILLER: crate::rt::PerProcess<Filler> = crate::rt::PerProcess::new();

impl Filler {
    /// The process's filler ([`FILL_THREADS`] threads), shared by every stream.
    pub fn process() -> Result<&'static Filler> {
        FILLER.get(|| Filler::new(FILL_THREADS).map_err(|e| Error::io("cache filler thread", e)))
    }

    /// A filler with `threads` writer threads.
    pub fn new(threads: usize) -> std::io::Result<Filler> {
        let (tx, rx) = std::sync::mpsc::channel::<FillJob>();
        let rx = Arc::new(std::sync::Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("ramjet-cache-fill-{i}"))
                .spawn(move || {
                    // SAFETY: setpriority on the calling thread (on Linux, PRIO_PROCESS with
                    // who = 0 names the calling thread); no memory is involved. Raising one's
                    // own nice value needs no privilege; a failure only leaves the priority as is.
                    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, FILL_NICE) };
                    // Its writes run on a ring of its own, so the kernel's workers for them
                    // share this thread's low priority (see `io::own_ring_on_this_thread`).
                    io::own_ring_on_this_thread();
                    loop {
                        let job = rx.lock().expect("filler queue lock").recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                })?;
        }
        Ok(Filler {
            tx: std::sync::Mutex::new(tx),
        })
    }

    /// Queues a write.
    pub fn submit(&self, job: FillJob) {
        // The threads live as long as the sender, so the send cannot fail.
        let _ = self.tx.lock().expect("filler lock").send(job);
    }
}

struct Entry {
    id: ShardId,
    bytes: u64,
    used: SystemTime,
    path: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{ColumnType, Schema, ShardBuilder, Value};
    use std::os::unix::process::ExitStatusExt;
    use std::path::Path;

    fn shard(tag: u8, n: usize) -> (ShardId, Bytes) {
        let mut b = ShardBuilder::new(Schema::new([("x", ColumnType::Bytes)]).unwrap());
        for i in 0..n {
            b.push(&[Value::Bytes(vec![tag; 1000 + i])], "t").unwrap();
        }
        let s = b.finish();
        (
            ShardId {
                checksum: s.checksum,
                bytes: s.bytes.len() as u64,
            },
            Bytes::from(s.bytes),
        )
    }

    fn cache(dir: &Path, limit: u64, io: Arc<dyn CacheIo>) -> Cache {
        Cache::open(CacheConfig::new(dir, limit), io, Arc::default()).unwrap()
    }

    /// Regression: a thread whose lock file's folder vanished found the layout already made
    /// again by another thread, and gave up with "not found" (a lost epoch in the loader).
    /// It now tries again; a directory that keeps vanishing still ends in the error.
    #[test]
    fn an_operation_that_lost_the_race_to_heal_the_layout_is_tried_again() {
        let d = tempfile::tempdir().unwrap();
        let c = cache(d.path(), 1 << 20, Arc::new(io::PreadIo));
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let gone = || std::io::Error::from(std::io::ErrorKind::NotFound);
        // The layout is whole when this thread looks (another made it again): one retry.
        let r = c.healing(|| match calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => Err(gone()),
            n => Ok(n),
        });
        assert_eq!(r.unwrap(), 1);
        // Gone and made again, each time: a bounded number of tries, then the error.
        calls.store(0, std::sync::atomic::Ordering::Relaxed);
        let r: std::io::Result<()> = c.healing(|| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = fs::remove_dir_all(d.path().join("fetch"));
            Err(gone())
        });
        assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::NotFound);
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), HEAL_TRIES + 1);
    }

    /// Every I/O path available here; io_uring is skipped, saying so, where the kernel refuses it.
    fn all_io() -> Vec<Arc<dyn CacheIo>> {
        let mut v: Vec<Arc<dyn CacheIo>> = vec![Arc::new(io::PreadIo)];
        match io::UringIo::new(false) {
            Ok(u) => v.push(Arc::new(u)),
            Err(e) if io::uring_expected() => {
                panic!("io_uring expected (RAMJET_EXPECT_IO_URING=1) but unavailable: {e}")
            }
            Err(e) => println!("SKIPPED io_uring cache path: unavailable here: {e}"),
        }
        v
    }

    /// Regression: deleting the cache directory under a running loader failed its reads with
    /// an i/o error on `fetch/<shard>.lock` (reported as an origin error), and a daemon whose
    /// cache directory was deleted never cached again. The next operation makes the layout again.
    #[test]
    fn a_cache_directory_deleted_under_a_running_cache_is_made_again() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("cache");
        let c = cache(&root, 1 << 20, Arc::new(io::PreadIo));
        let (id, data) = shard(7, 4);
        assert!(c.insert(id, &data).unwrap());
        fs::remove_dir_all(&root).unwrap();
        assert!(c.get(id).unwrap().is_none(), "its shards are misses");
        let _lock = c.fetch_lock(id).unwrap();
        assert!(c.try_fetch_lock(shard(8, 2).0).unwrap().is_some());
        assert!(c.insert(id, &data).unwrap(), "admitted again");
        assert_eq!(&c.get(id).unwrap().unwrap()[..], &data[..]);
        fs::remove_dir_all(root.join("shards")).unwrap();
        assert_eq!(c.usage().unwrap(), 0);
        assert!(root.join("shards").is_dir());
    }

    #[test]
    fn round_trip_and_corruption_is_a_miss() {
        for io in all_io() {
            round_trip_and_corruption_is_a_miss_with(io);
        }
    }

    fn round_trip_and_corruption_is_a_miss_with(io: Arc<dyn CacheIo>) {
        let d = tempfile::tempdir().unwrap();
        let c = cache(d.path(), 1 << 20, io);
        let (id, data) = shard(1, 10);
        assert!(c.get(id).unwrap().is_none());
        assert!(c.insert(id, &data).unwrap());
        assert_eq!(&c.get(id).unwrap().unwrap()[..], &data[..]);
        // Flip a byte in the real file.
        let p = c.path_of(id);
        let mut b = fs::read(&p).unwrap();
        b[500] ^= 1;
        fs::write(&p, b).unwrap();
        assert!(c.get(id).unwrap().is_none(), "a corrupt shard was served");
        assert!(!p.exists(), "the corrupt file was not removed");
        assert_eq!(c.metrics.cache_corrupt.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn budget_holds_and_admission_prefers_a_stable_subset() {
        for io in all_io() {
            budget_holds_with(io);
        }
    }

    fn budget_holds_with(io: Arc<dyn CacheIo>) {
        let d = tempfile::tempdir().unwrap();
        let shards: Vec<_> = (0..12u8).map(|t| shard(t, 20)).collect();
        let size = shards[0].0.bytes;
        let c = cache(d.path(), size * 4 + size / 2, io);
        // Three passes over 12 shards with room for 4: after the first pass the resident set
        // must stop changing (no thrash), and usage never exceeds the budget.
        let mut resident_after = Vec::new();
        for _pass in 0..3 {
            for (id, data) in &shards {
                if c.get(*id).unwrap().is_none() {
                    c.insert(*id, data).unwrap();
                }
                assert!(c.usage().unwrap() <= c.config().limit_bytes);
            }
            let mut r: Vec<u64> = c.entries().unwrap().iter().map(|e| e.id.checksum).collect();
            r.sort();
            resident_after.push(r);
        }
        assert_eq!(resident_after[1], resident_after[2], "resident set still churning");
        assert_eq!(resident_after[2].len(), 4);
        // The resident ones are the 4 highest-priority shards.
        let mut by_prio: Vec<&(ShardId, Bytes)> = shards.iter().collect();
        by_prio.sort_by_key(|(id, _)| std::cmp::Reverse(id.priority()));
        let mut top: Vec<u64> = by_prio[..4].iter().map(|(id, _)| id.checksum).collect();
        top.sort();
        assert_eq!(resident_after[2], top);
    }

    #[test]
    fn a_full_disk_is_not_admitted_and_leaves_nothing_partial() {
        for io in all_io() {
            full_disk_with(io);
        }
    }

    fn full_disk_with(inner: Arc<dyn CacheIo>) {
        let d = tempfile::tempdir().unwrap();
        let faulty = Arc::new(io::FaultyIo::new(inner));
        faulty.faults.enospc_writes.store(1, Ordering::SeqCst);
        let c = cache(d.path(), 1 << 20, faulty);
        let (id, data) = shard(3, 5);
        assert!(!c.insert(id, &data).unwrap());
        assert!(!c.contains(id));
        assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
        assert!(c.insert(id, &data).unwrap(), "the next write succeeds");
    }

    #[test]
    fn temps_of_dead_writers_are_removed_on_open() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("tmp")).unwrap();
        // PID 0x7ffffffe is never a live process.
        let dead = d.path().join("tmp/abc-10.rjs.2147483646.0");
        fs::write(&dead, b"partial").unwrap();
        cache(d.path(), 1 << 20, io::detect().unwrap());
        assert!(!dead.exists());
    }

    /// Waits up to `secs` for one byte on `fd`; `None` on timeout.
    fn read_byte_within(fd: libc::c_int, secs: i32) -> Option<u8> {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut p, 1, secs * 1000) } != 1 {
            return None;
        }
        let mut b = [0u8; 1];
        // SAFETY: reads at most one byte into `b`.
        (unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) } == 1).then_some(b[0])
    }

    /// Regression: `flock` belongs to the open file description, which `fork` shares. A worker
    /// forked while the admission and fetch locks were held kept them for its whole life: its
    /// own `Cache::open` waited forever, and so did the parent's next insert.
    #[test]
    fn cache_locks_leak_into_forked_workers() {
        let d = tempfile::tempdir().unwrap();
        let c = cache(d.path(), 1 << 20, Arc::new(io::PreadIo));
        let (id, data) = shard(7, 5);
        let (id2, data2) = shard(8, 5);
        let adm = c.admission_lock().unwrap();
        let fetch = c.fetch_lock(id).unwrap();
        let mut fds = [0; 2];
        // SAFETY: a pipe into a two-element array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only runs the cache calls below and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // The child, forked while its parent holds both locks: it must wait only for the
            // parent (which lets go below), never on locks it inherited.
            let ok = (|| -> Result<()> {
                let c2 = Cache::open(
                    CacheConfig::new(d.path(), 1 << 20),
                    Arc::new(io::PreadIo),
                    Arc::default(),
                )?;
                let _g = c2.fetch_lock(id)?;
                c2.insert(id2, &data2)?;
                Ok(())
            })()
            .is_ok();
            // SAFETY: writes one byte to the pipe, then waits to be killed without unwinding.
            unsafe {
                libc::write(fds[1], [ok as u8].as_ptr().cast(), 1);
                libc::sleep(30);
                libc::_exit(0);
            }
        }
        drop(adm);
        drop(fetch);
        let child = read_byte_within(fds[0], 20);
        // The child is alive and holds nothing now: the parent takes both locks at once.
        let adm_free = FileLock::acquire(&d.path().join("lock"), true, false, true)
            .unwrap()
            .is_some();
        let fetch_free = {
            let p = d.path().join("fetch").join(format!("{}.lock", id.file_name()));
            FileLock::acquire(&p, true, false, true).unwrap().is_some()
        };
        // Only when the lock is free: with the bug, this insert would wait forever.
        let inserted = adm_free && c.insert(id, &data).unwrap();
        // SAFETY: ends and reaps our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        assert_eq!(
            child,
            Some(1),
            "the forked child could not open the cache and take a lock"
        );
        assert!(adm_free, "the forked child still holds the admission lock");
        assert!(fetch_free, "the forked child still holds the fetch lock");
        assert!(
            inserted && c.contains(id2),
            "the child's insert or the parent's did not land"
        );
    }

    /// What a child process of the tests below does, chosen by `RAMJET_CACHE_CHILD`: the test
    /// binary re-runs itself with this test selected (never run otherwise: it fails when the
    /// variable is missing).
    #[test]
    #[ignore = "a child process of the multi-process cache tests, which start it themselves"]
    fn cache_child_process() {
        let what = std::env::var("RAMJET_CACHE_CHILD").expect("only run by the multi-process cache tests");
        let dir = PathBuf::from(std::env::var("RAMJET_CACHE_DIR").unwrap());
        let limit: u64 = std::env::var("RAMJET_CACHE_LIMIT").unwrap().parse().unwrap();
        let c = cache(&dir, limit, io::detect().unwrap());
        match what.split_once(':') {
            // Admits its own 15 shards, three passes, checking the budget after each insert.
            Some(("admit", k)) => {
                let k: u8 = k.parse().unwrap();
                let shards: Vec<_> = (0..15u8).map(|i| shard(k * 16 + i, 20)).collect();
                for _ in 0..3 {
                    for (id, data) in &shards {
                        if c.get(*id).unwrap().is_none() {
                            c.insert(*id, data).unwrap();
                        }
                        // Read under the admission lock: a scan while another process
                        // admits could see the shard it evicts and the one it writes both.
                        let u = {
                            let _g = c.admission_lock().unwrap();
                            c.usage().unwrap()
                        };
                        assert!(u <= limit, "process {k}: usage {u} over the budget {limit}");
                    }
                }
            }
            // Writes large shards one after another until it is killed.
            Some(("write", _)) => {
                let data = Bytes::from(vec![7u8; 16 << 20]);
                for k in 0..20 {
                    let id = ShardId {
                        checksum: 0xdead_0000 + k,
                        bytes: data.len() as u64,
                    };
                    c.insert(id, &data).unwrap();
                }
            }
            _ => panic!("unknown child {what}"),
        }
    }

    fn child(what: &str, dir: &Path, limit: u64) -> std::process::Child {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cache::tests::cache_child_process",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("RAMJET_CACHE_CHILD", what)
            .env("RAMJET_CACHE_DIR", dir)
            .env("RAMJET_CACHE_LIMIT", limit.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Bytes on disk under `shards/` then `tmp/` (in that order: a rename from `tmp/` to
    /// `shards/` between the two reads is missed, never counted twice).
    fn on_disk(dir: &Path) -> u64 {
        ["shards", "tmp"]
            .iter()
            .flat_map(|s| fs::read_dir(dir.join(s)).into_iter().flatten().flatten())
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum()
    }

    /// Four processes admit shards into one cache at once (each its own 15, room for 5): the
    /// bytes on disk, sampled by this process all along (between admissions), never exceed
    /// the budget, and each process saw its own usage within it after every insert.
    #[test]
    fn the_budget_holds_with_several_processes_admitting_at_once() {
        let d = tempfile::tempdir().unwrap();
        let size = shard(0, 20).0.bytes;
        let limit = size * 5 + size / 2;
        cache(d.path(), limit, io::detect().unwrap());
        let kids: Vec<_> = (1..=4).map(|k| child(&format!("admit:{k}"), d.path(), limit)).collect();
        let mut kids: Vec<_> = kids.into_iter().map(Some).collect();
        let (mut samples, mut most) = (0u64, 0u64);
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        let mut outs = Vec::new();
        let sampler = cache(d.path(), limit, io::detect().unwrap());
        while kids.iter().any(Option::is_some) {
            // Sampled under the admission lock, as the admitting processes see it: a scan while
            // one admits could count the shard it evicts and the one it writes both.
            let u = {
                let _g = sampler.admission_lock().unwrap();
                on_disk(d.path())
            };
            samples += 1;
            most = most.max(u);
            assert!(u <= limit, "{u} bytes on disk, over the budget {limit}");
            for k in kids.iter_mut() {
                if let Some(c) = k {
                    if c.try_wait().unwrap().is_some() {
                        outs.push(k.take().unwrap().wait_with_output().unwrap());
                    }
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the admitting processes did not finish in 120 s"
            );
        }
        for o in &outs {
            assert!(
                o.status.success(),
                "a child failed:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        assert!(samples > 10, "sampled {samples} times");
        assert!(most > limit / 2, "the cache filled ({most} of {limit} bytes at most)");
        assert!(on_disk(d.path()) <= limit);
    }

    /// A writer SIGKILLed in the middle of an insert leaves nothing partial under `shards/`
    /// and no lock held; its temp file is counted in the budget until the next open removes
    /// it; the shard it was writing is then admitted whole.
    #[test]
    fn a_writer_killed_mid_insert_leaves_nothing_partial_and_no_lock() {
        let limit = 1u64 << 30;
        for attempt in 0..10 {
            let d = tempfile::tempdir().unwrap();
            cache(d.path(), limit, io::detect().unwrap());
            let mut w = child("write:0", d.path(), limit);
            let tmp = d.path().join("tmp");
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            let caught = loop {
                let partial = fs::read_dir(&tmp)
                    .unwrap()
                    .flatten()
                    .find(|e| e.metadata().is_ok_and(|m| m.len() > 0 && m.len() < 16 << 20));
                if let Some(p) = partial {
                    w.kill().unwrap();
                    break Some(p.file_name().to_string_lossy().into_owned());
                }
                if w.try_wait().unwrap().is_some() || std::time::Instant::now() > deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_micros(200));
            };
            let status = w.wait().unwrap();
            let Some(name) = caught else { continue };
            let left: Vec<_> = fs::read_dir(&tmp).unwrap().flatten().map(|e| e.file_name()).collect();
            if left.is_empty() {
                // The kill landed just after the rename: try again.
                continue;
            }
            assert!(status.signal().is_some(), "the writer was killed, attempt {attempt}");
            // Under shards/: whole shards only.
            for e in fs::read_dir(d.path().join("shards")).unwrap().flatten() {
                assert_eq!(e.metadata().unwrap().len(), 16 << 20, "{:?} is partial", e.path());
            }
            // The dead writer's temp file counts against the budget until an open removes it.
            let c = Cache::open(CacheConfig::new(d.path(), limit), io::detect().unwrap(), Arc::default()).unwrap();
            assert_eq!(
                fs::read_dir(&tmp).unwrap().count(),
                0,
                "{name} of the dead writer was left"
            );
            // No lock is left held: the shard it was writing is admitted, whole.
            let being_written: u64 = u64::from_str_radix(name.split('-').next().unwrap(), 16).unwrap();
            let id = ShardId {
                checksum: being_written,
                bytes: 16 << 20,
            };
            assert!(!c.contains(id), "{name}: a partial shard became visible");
            assert!(c.insert(id, &Bytes::from(vec![7u8; 16 << 20])).unwrap());
            assert_eq!(fs::metadata(c.path_of(id)).unwrap().len(), 16 << 20);
            assert_eq!(c.usage().unwrap(), on_disk(d.path()));
            return;
        }
        panic!("no kill landed in the middle of an insert in 10 attempts");
    }
}
