//! Disk I/O of the node-local cache: one trait, three implementations.
//!
//! - [`UringIo`]: io_uring on the process's I/O core: N threads (`RAMJET_IO_THREADS`, default
//!   the cores), each owning one ring with registered (fixed) buffers; a request is routed to a
//!   ring by its file (so by shard), or to a less loaded ring when that one is busy, through
//!   that thread's own queue, with no lock shared between rings. A ring runs one file at a time
//!   with up to [`IO_CHUNKS_IN_FLIGHT`] chunks in flight and reaps every completion that is
//!   ready at each wake; several files go to several rings at once. Buffered reads and writes
//!   go straight between the page cache and the caller's memory; O_DIRECT (where the
//!   filesystem allows it) reads into a registered destination and writes from the
//!   registered bounce buffers.
//! - [`PreadIo`]: plain `pread`/`pwrite`, the fallback where io_uring is unavailable.
//! - [`FaultyIo`]: wraps another and flips bytes or fails writes, for tests.
//!
//! [`detect`] picks io_uring when a ring can be created, else pread; `RAMJET_CACHE_IO=pread`
//! or `=uring` forces one.
//!
//! Every read lands in a buffer this process owns and is hashed there. Cache files are never
//! mapped: another process that truncates or rewrites one can then make a read fail its
//! checksum (and be fetched again), but never raise SIGBUS in a trainer or change bytes after
//! they were verified (`docs/cache.md`, "Trust model").

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;

/// Alignment of every cache buffer: O_DIRECT needs the logical block size; 4 KiB covers it.
pub const IO_ALIGN: usize = 4096;
/// Size of one registered buffer, and so of one I/O operation (also the unit the read path
/// hashes while it is hot in the CPU's cache).
pub const IO_CHUNK_BYTES: usize = 1 << 20;
/// Registered buffers per ring, and so operations in flight per thread.
pub const IO_CHUNKS_IN_FLIGHT: usize = 8;
/// Kernel io-wq workers of a cache writer's ring (see [`own_ring_on_this_thread`]).
pub const WRITER_IO_WORKERS_MAX: usize = 2;
/// The registered-buffer slot that points at the current read's destination.
const DEST_SLOT: u16 = IO_CHUNKS_IN_FLIGHT as u16;

/// A heap buffer aligned to [`IO_ALIGN`]. Converts into [`Bytes`] without copying.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through `as_ref`, like a Vec<u8>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes, capacity rounded up to [`IO_ALIGN`].
    pub fn zeroed(len: usize) -> AlignedBuf {
        let cap = len.div_ceil(IO_ALIGN).max(1) * IO_ALIGN;
        let layout = Layout::from_size_align(cap, IO_ALIGN).expect("valid layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {cap} bytes failed");
        AlignedBuf { ptr, len, cap }
    }

    /// A buffer of `len` bytes whose contents are not initialised.
    ///
    /// # Safety
    /// The caller must write all of `[0, len)` before the buffer is read through `as_ref`,
    /// `as_mut` or `into_bytes`, or drop it unread.
    pub unsafe fn uninit(len: usize) -> AlignedBuf {
        let cap = len.div_ceil(IO_ALIGN).max(1) * IO_ALIGN;
        let layout = Layout::from_size_align(cap, IO_ALIGN).expect("valid layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null(), "allocation of {cap} bytes failed");
        AlignedBuf { ptr, len, cap }
    }

    /// The whole capacity, for I/O that works in aligned units.
    fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap bytes and uniquely borrowed through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.cap) }
    }

    /// Sets the logical length (at most the capacity).
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.cap);
        self.len = len;
    }

    /// Into shared bytes, without copying.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len <= cap initialised (zeroed or written) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len <= cap bytes, uniquely borrowed through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(self.cap, IO_ALIGN).expect("layout")) }
    }
}

/// Bytes of idle buffers the process-wide pool keeps for reuse.
pub const POOL_RETAINED_BYTES_MAX: u64 = 768 << 20;

/// A process-wide pool of large aligned buffers. A fresh 64 MiB buffer costs a page fault per
/// 4 KiB page on first touch (here: slower than the read itself); a reused one is already
/// mapped. A buffer returns to the pool when the last `Bytes` slice of it is dropped.
pub struct BufPool {
    free: std::sync::Mutex<Vec<AlignedBuf>>,
    retained: AtomicU64,
}

impl BufPool {
    /// The process-wide pool (a forked child makes its own: its lock may have been held by a
    /// parent thread at the fork).
    pub fn global() -> &'static BufPool {
        static POOL: crate::rt::PerProcess<BufPool> = crate::rt::PerProcess::new();
        POOL.get(|| {
            Ok(BufPool {
                free: std::sync::Mutex::new(Vec::new()),
                retained: AtomicU64::new(0),
            })
        })
        .expect("making a pool cannot fail")
    }

    /// A buffer of `len` bytes whose contents are unspecified (old data or uninitialised).
    ///
    /// # Safety
    /// As [`AlignedBuf::uninit`]: write all of `[0, len)` before reading it.
    pub unsafe fn take(&'static self, len: usize) -> PooledBuf {
        let reused = {
            let mut free = self.free.lock().expect("pool lock");
            // Smallest free buffer that fits without wasting more than half of it.
            let pick = free
                .iter()
                .enumerate()
                .filter(|(_, b)| b.cap >= len && b.cap / 2 <= len.max(IO_ALIGN))
                .min_by_key(|(_, b)| b.cap)
                .map(|(i, _)| i);
            pick.map(|i| free.swap_remove(i))
        };
        let buf = match reused {
            Some(mut b) => {
                self.retained.fetch_sub(b.cap as u64, Ordering::Relaxed);
                b.len = len;
                b
            }
            // SAFETY: forwarded to our caller.
            None => unsafe { AlignedBuf::uninit(len) },
        };
        PooledBuf {
            buf: Some(buf),
            pool: self,
        }
    }

    fn give_back(&self, b: AlignedBuf) {
        if self.retained.load(Ordering::Relaxed) + b.cap as u64 <= POOL_RETAINED_BYTES_MAX {
            self.retained.fetch_add(b.cap as u64, Ordering::Relaxed);
            self.free.lock().expect("pool lock").push(b);
        }
    }
}

/// A buffer on loan from a [`BufPool`]; it goes back to the pool on drop.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: &'static BufPool,
}

impl PooledBuf {
    /// The buffer's bytes, for filling.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut().expect("present until drop").as_mut()
    }

    fn raw(&mut self) -> (*mut u8, usize, usize) {
        let b = self.buf.as_mut().expect("present until drop");
        (b.ptr, b.len, b.cap)
    }

    /// Into shared bytes, without copying.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_ref().expect("present until drop").as_ref()
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

/// Hashes a file's chunks in order as their reads complete (completions may come out of order).
struct ChunkHasher {
    hasher: Option<crate::format::ShardHasher>,
    limit: usize,
    next: usize,
    ready: Vec<bool>,
}

impl ChunkHasher {
    fn new(len: usize, skip_tail: usize) -> Self {
        ChunkHasher {
            hasher: (len >= skip_tail).then(crate::format::ShardHasher::default),
            limit: len.saturating_sub(skip_tail),
            next: 0,
            ready: vec![false; len.div_ceil(IO_CHUNK_BYTES)],
        }
    }

    /// Chunk `i` is complete: hash every chunk now contiguous from the start. `bytes(range)`
    /// gives the bytes of a range of completed chunks (and is only asked for such ranges).
    fn done<'a>(&mut self, i: usize, bytes: impl Fn(std::ops::Range<usize>) -> &'a [u8]) {
        self.ready[i] = true;
        while self.next < self.ready.len() && self.ready[self.next] {
            if let Some(h) = self.hasher.as_mut() {
                let start = (self.next * IO_CHUNK_BYTES).min(self.limit);
                let end = ((self.next + 1) * IO_CHUNK_BYTES).min(self.limit);
                h.update(bytes(start..end));
            }
            self.next += 1;
        }
    }

    fn finish(self) -> Option<u64> {
        self.hasher.map(|h| h.digest())
    }
}

/// xxh3-64 of the first `len - skip_tail` bytes, when there are at least `skip_tail`.
fn hash_prefix(b: &[u8], skip_tail: usize) -> Option<u64> {
    (b.len() >= skip_tail).then(|| crate::format::shard_checksum(&b[..b.len() - skip_tail]))
}

/// Whole-file reads and writes for the cache.
pub trait CacheIo: Send + Sync {
    /// Name, for logs and benchmark output.
    fn name(&self) -> &'static str;
    /// Reads the whole file and, in the same pass (while each chunk is still in the CPU's
    /// cache), the xxh3-64 of its first `len - hash_skip_tail` bytes, when the file is at least
    /// that long.
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)>;
    /// Creates `path` (which must not exist) and writes `data`. No fsync: a cache file torn by
    /// a power loss fails the hash every read checks, and is fetched again (`docs/cache.md`).
    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()>;
}

/// `pread`/`pwrite`, buffered through the page cache.
#[derive(Debug, Default)]
pub struct PreadIo;

impl CacheIo for PreadIo {
    fn name(&self) -> &'static str {
        "pread"
    }
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let f = File::open(path)?;
        let len = f.metadata()?.len() as usize;
        // SAFETY: read_exact_at fills all of [0, len) or fails, and the buffer is dropped unread.
        let mut buf = unsafe { BufPool::global().take(len) };
        let mut h = ChunkHasher::new(len, hash_skip_tail);
        let dst = buf.as_mut_slice();
        let mut off = 0;
        while off < len {
            let n = (len - off).min(IO_CHUNK_BYTES);
            f.read_exact_at(&mut dst[off..off + n], off as u64)?;
            h.done(off / IO_CHUNK_BYTES, |r| &dst[r]);
            off += n;
        }
        Ok((buf.into_bytes(), h.finish()))
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let f = OpenOptions::new().write(true).create_new(true).open(path)?;
        f.write_all_at(data, 0)
    }
}

/// Faults injected at the ring level, for the tests of its failure paths.
#[derive(Debug, Default)]
struct RingFaults {
    /// Fail this many waits with EINTR before calling the kernel.
    eintr_waits: u32,
    /// Once this many operations are in flight, fail the next wait with this errno (once).
    fail_wait_in_flight: Option<(usize, i32)>,
    /// Report the submission queue full this many times.
    sq_full: u32,
    /// Fail every buffer registration with ENOMEM (as RLIMIT_MEMLOCK does for non-root users).
    register_enomem: bool,
    /// Run every call at full depth from its first operation, as for a file not in the page
    /// cache (so tests on page-cached files get several operations in flight).
    full_depth: bool,
}

/// Attempts to drain operations still in flight after a failed wait before the ring is given
/// up (leaked with every buffer the kernel may write into).
const DRAIN_ATTEMPTS_MAX: u32 = 100;

/// One thread's ring and its buffers.
///
/// Invariant: no method returns while an operation it submitted is in flight, unless it marks
/// the ring `stuck`; a stuck ring is leaked with its buffers (and the caller leaks its
/// destination), so the kernel never writes into memory that was freed or reused.
struct Ring {
    ring: io_uring::IoUring,
    bufs: Vec<AlignedBuf>,
    /// Whether the bounce buffers are registered (else operations use plain Read and Write).
    registered: bool,
    /// Operations submitted and not yet reaped.
    in_flight: usize,
    /// Operations could not be drained: the ring and its buffers must never be freed.
    stuck: bool,
    faults: RingFaults,
}

impl Ring {
    fn new() -> io::Result<Ring> {
        Self::with_faults(RingFaults::default())
    }

    /// A cache writer's ring: the kernel runs its buffered writes on at most
    /// [`WRITER_IO_WORKERS_MAX`] io-wq workers (one file is written at a time, at low priority).
    fn for_writer() -> io::Result<Ring> {
        let r = Self::new()?;
        let mut workers = [WRITER_IO_WORKERS_MAX as u32, 1];
        let _ = r.ring.submitter().register_iowq_max_workers(&mut workers);
        Ok(r)
    }

    fn with_faults(faults: RingFaults) -> io::Result<Ring> {
        let ring = io_uring::IoUring::new(IO_CHUNKS_IN_FLIGHT as u32 * 2)?;
        // Buffered file I/O the kernel cannot finish inline goes to its io-wq workers (kernel
        // threads named `iou-wrk-*` in this process): at most one per operation in flight, so
        // the process's thread count stays bounded. Older kernels refuse; their default applies.
        let mut workers = [IO_CHUNKS_IN_FLIGHT as u32, 1];
        let _ = ring.submitter().register_iowq_max_workers(&mut workers);
        let mut bufs: Vec<AlignedBuf> = (0..IO_CHUNKS_IN_FLIGHT)
            .map(|_| AlignedBuf::zeroed(IO_CHUNK_BYTES))
            .collect();
        let mut r = Ring {
            ring,
            bufs: Vec::new(),
            registered: false,
            in_flight: 0,
            stuck: false,
            faults,
        };
        // Slots 0..IO_CHUNKS_IN_FLIGHT hold the bounce buffers (writes); slot DEST_SLOT is
        // re-pointed at each read's destination, so reads land in place with one copy.
        // Registration pins memory against RLIMIT_MEMLOCK; where that is refused (ENOMEM for
        // a non-root user with a small limit), the ring runs unregistered operations instead.
        let iovecs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.full_mut().as_mut_ptr().cast(),
                iov_len: IO_CHUNK_BYTES,
            })
            .collect();
        let reg = if r.faults.register_enomem {
            Err(io::Error::from_raw_os_error(libc::ENOMEM))
        } else {
            r.ring
                .submitter()
                .register_buffers_sparse(IO_CHUNKS_IN_FLIGHT as u32 + 1)
                // SAFETY: the buffers live as long as the ring (both owned by this struct; the
                // ring is dropped, unregistering them, before the buffers: fields drop in order).
                .and_then(|()| unsafe { r.ring.submitter().register_buffers_update(0, &iovecs, None) })
        };
        match reg {
            Ok(()) => r.registered = true,
            Err(e) => {
                tracing::info!(error = %e, "io_uring buffer registration refused; using unregistered I/O");
                let _ = r.ring.submitter().unregister_buffers();
            }
        }
        r.bufs = bufs;
        Ok(r)
    }

    /// Points the destination slot at `[ptr, ptr + len)`. False when refused (the caller then
    /// uses unregistered operations).
    ///
    /// # Safety
    /// The memory must stay valid until `clear_dest` has run, and no operation may use the slot
    /// after that.
    unsafe fn register_dest(&mut self, ptr: *mut u8, len: usize) -> bool {
        if !self.registered || self.faults.register_enomem || len == 0 {
            return false;
        }
        let dest = [libc::iovec {
            iov_base: ptr.cast(),
            iov_len: len,
        }];
        // SAFETY: forwarded to our caller.
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(DEST_SLOT as u32, &dest, None)
        }
        .is_ok()
    }

    /// Empties the destination slot, releasing the kernel's reference to the memory it held.
    /// A failure marks the ring stuck: its slot may still name memory about to be freed.
    fn clear_dest(&mut self) {
        let clear = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }];
        // SAFETY: an empty iovec registers no memory; it only drops the slot's old reference.
        let r = unsafe {
            self.ring
                .submitter()
                .register_buffers_update(DEST_SLOT as u32, &clear, None)
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, "io_uring: clearing the destination slot failed; ring retired");
            self.stuck = true;
        }
    }

    /// Pushes one entry, flushing the queue to the kernel once if it is full.
    ///
    /// # Safety
    /// As `SubmissionQueue::push`: the entry's buffers must stay valid until it completes.
    unsafe fn push(&mut self, e: &io_uring::squeue::Entry) -> io::Result<()> {
        for attempt in 0..2 {
            let injected = attempt == 0 && self.faults.sq_full > 0;
            if injected {
                self.faults.sq_full -= 1;
            }
            // SAFETY: forwarded to our caller.
            if !injected && unsafe { self.ring.submission().push(e) }.is_ok() {
                return Ok(());
            }
            if attempt == 0 {
                // The queue is full of entries the kernel has not taken yet: hand them over.
                loop {
                    match self.ring.submit() {
                        Ok(_) => break,
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(_) => break,
                    }
                }
            }
        }
        Err(io::Error::other("io_uring submission queue full"))
    }

    /// Submits what is queued and waits for at least one completion; EINTR is retried.
    fn wait(&mut self) -> io::Result<()> {
        loop {
            let r = if self.faults.eintr_waits > 0 {
                self.faults.eintr_waits -= 1;
                Err(io::Error::from_raw_os_error(libc::EINTR))
            } else if let Some((_, errno)) = self.faults.fail_wait_in_flight.filter(|(n, _)| self.in_flight >= *n) {
                // Hand the queued operations to the kernel first, so they really are in flight
                // when the failure is reported.
                let _ = self.ring.submit();
                self.faults.fail_wait_in_flight = None;
                Err(io::Error::from_raw_os_error(errno))
            } else {
                self.ring.submit_and_wait(1).map(|_| ())
            };
            match r {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                other => return other,
            }
        }
    }

    /// Reaps every available completion: `(buffer index, result)`.
    fn reap(&mut self) -> Vec<(usize, i32)> {
        let cqes: Vec<(usize, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        self.in_flight = self.in_flight.saturating_sub(cqes.len());
        cqes
    }

    /// After a failed wait: waits until nothing is in flight, or marks the ring stuck.
    fn drain(&mut self) {
        let mut attempts = 0;
        while self.in_flight > 0 {
            match self.wait() {
                Ok(()) => {
                    self.reap();
                }
                Err(e) => {
                    attempts += 1;
                    if attempts >= DRAIN_ATTEMPTS_MAX {
                        tracing::error!(error = %e, in_flight = self.in_flight, "io_uring: operations cannot be drained; ring and buffers retired");
                        self.stuck = true;
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    /// Runs `ops` chunked operations: `prep(i, buf_index, buf_ptr, registered)` builds the entry
    /// for chunk `i`; `done(i, buf_index, result)` handles its completion. At most one operation
    /// per bounce buffer is in flight, so a buffer is never reused before the kernel is done,
    /// and nothing is in flight when this returns (or the ring is marked stuck).
    ///
    /// Depth adapts to where the data is. A call starts with one operation in flight: a
    /// buffered read of a page-cached file completes while it is being submitted, and its chunk
    /// is then handed to `done` (which hashes it) while it is still in the core's L2 cache;
    /// eight chunks submitted at once were hashed after the first had left it, at a third of
    /// the speed (docs/dependencies.md, `twox-hash`). The first operation that does not
    /// complete on submission (the disk, O_DIRECT) raises the depth to every bounce buffer for
    /// the rest of the call.
    fn run(
        &mut self,
        ops: usize,
        mut prep: impl FnMut(usize, u16, *mut u8, bool) -> io_uring::squeue::Entry,
        mut done: impl FnMut(usize, &AlignedBuf, i32) -> io::Result<()>,
    ) -> io::Result<()> {
        assert_eq!(self.in_flight, 0, "io_uring: a previous call left operations in flight");
        // Completions nobody waits for would be taken for this call's: there must be none.
        let stale = self.reap();
        assert!(stale.is_empty(), "io_uring: {} stale completions", stale.len());
        let mut next = 0usize;
        let mut free: Vec<u16> = (0..self.bufs.len() as u16).collect();
        let mut owner = vec![usize::MAX; self.bufs.len()];
        let mut first_err: Option<io::Error> = None;
        let full = self.bufs.len();
        let mut depth = if self.faults.full_depth { full } else { 1 };
        while (next < ops && first_err.is_none()) || self.in_flight > 0 {
            while next < ops && first_err.is_none() && self.in_flight < depth {
                let Some(b) = free.pop() else { break };
                let ptr = self.bufs[b as usize].full_mut().as_mut_ptr();
                let e = prep(next, b, ptr, self.registered).user_data(b as u64);
                // SAFETY: the entry points into bounce buffer `b` (or the caller's destination),
                // which stays alive and untouched by us until its completion is reaped below.
                match unsafe { self.push(&e) } {
                    Ok(()) => {
                        owner[b as usize] = next;
                        next += 1;
                        self.in_flight += 1;
                    }
                    Err(err) => {
                        free.push(b);
                        if self.in_flight == 0 {
                            first_err = Some(err);
                        }
                        break;
                    }
                }
            }
            if self.in_flight == 0 {
                break;
            }
            if depth < full && first_err.is_none() {
                // Hand the queue over without waiting: an operation served from the page cache
                // completes in this call. A failure here is seen again by the wait below.
                let _ = self.ring.submit();
                if self.ring.completion().is_empty() {
                    depth = full;
                    continue;
                }
            }
            if let Err(e) = self.wait() {
                // Nothing may be returned (or freed) while the kernel still owns buffers.
                first_err.get_or_insert(e);
                self.drain();
                break;
            }
            for (b, res) in self.reap() {
                free.push(b as u16);
                if first_err.is_none() {
                    if let Err(e) = done(owner[b], &self.bufs[b], res) {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A job for an I/O core thread: it runs on that thread's ring slot.
type RingJob = ScopedRingJob<'static>;

/// A job that may borrow its caller's stack (see [`with_ring_on`]).
type ScopedRingJob<'a> = Box<dyn FnOnce(&mut Option<Ring>) + Send + 'a>;

/// The process's I/O core: `RAMJET_IO_THREADS` threads (default: the cores), named
/// `ramjet-io-N`, each owning one ring and its registered buffers. A request goes to the ring
/// its key (the cache file) hashes to, through that thread's own queue, so no lock is shared
/// between rings and one file's chunks are always on one ring.
struct IoCore {
    lanes: Vec<Lane>,
}

/// One I/O thread's queue, and how many jobs are queued on it or running there.
struct Lane {
    queue: std::sync::mpsc::Sender<RingJob>,
    load: AtomicUsize,
}

impl IoCore {
    /// The lane for a request keyed `key`: the one its key names, unless that one is busy and
    /// another is less loaded (then the least loaded, the first of equals). One file's request
    /// is one job, so its chunks always share one ring; routing by key alone left a warm epoch
    /// of 6 shards on 2 rings split 4:2 about half the time, one core idle while the other
    /// read (docs/benchmarks.md, "Engine core"). Reading the loads takes no lock.
    fn lane(&self, key: u64) -> &Lane {
        let home = &self.lanes[(key % self.lanes.len() as u64) as usize];
        if home.load.load(Ordering::Relaxed) == 0 {
            return home;
        }
        self.lanes
            .iter()
            .min_by_key(|l| l.load.load(Ordering::Relaxed))
            .filter(|l| l.load.load(Ordering::Relaxed) < home.load.load(Ordering::Relaxed))
            .unwrap_or(home)
    }
}

static CORE: crate::rt::PerProcess<IoCore> = crate::rt::PerProcess::new();

/// Threads of the I/O core.
pub fn io_threads() -> usize {
    std::env::var("RAMJET_IO_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(crate::rt::cores)
}

impl IoCore {
    fn new(threads: usize) -> crate::Result<IoCore> {
        let mut lanes = Vec::with_capacity(threads);
        for i in 0..threads {
            let (tx, rx) = std::sync::mpsc::channel::<RingJob>();
            std::thread::Builder::new()
                .name(format!("ramjet-io-{i}"))
                .spawn(move || {
                    let mut slot: Option<Ring> = None;
                    while let Ok(job) = rx.recv() {
                        job(&mut slot);
                    }
                })
                .map_err(|e| crate::Error::io("I/O core thread", e))?;
            lanes.push(Lane {
                queue: tx,
                load: AtomicUsize::new(0),
            });
        }
        Ok(IoCore { lanes })
    }
}

/// Lets a closure that borrows the caller's stack cross to an I/O thread.
struct OnRing<F>(F);
// SAFETY: the closure runs on the I/O thread while the thread that made it is blocked in
// `with_ring` waiting for it, so nothing it captures is ever used by two threads at once; the
// closures given to `with_ring` capture raw pointers into buffers the caller keeps alive, and
// no thread-affine value (such as a lock guard).
unsafe impl<F> Send for OnRing<F> {}

/// Runs `f` on the ring of the I/O core thread that `key` routes to (the ring is made on first
/// use; a ring left stuck is leaked, never dropped, and the next request there makes a fresh
/// one). The caller waits for `f`, which may borrow its stack.
fn with_ring<T: Send>(key: u64, f: impl FnOnce(&mut Ring) -> io::Result<T>) -> io::Result<T> {
    let core = CORE.get(|| IoCore::new(io_threads())).map_err(io::Error::other)?;
    with_ring_on(core, key, f)
}

/// [`with_ring`] on a given core (the process's, or a test's own).
fn with_ring_on<T: Send>(core: &IoCore, key: u64, f: impl FnOnce(&mut Ring) -> io::Result<T>) -> io::Result<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<std::thread::Result<io::Result<T>>>(1);
    let f = OnRing(f);
    let job = move |slot: &mut Option<Ring>| {
        let f = f;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_in_slot(slot, Ring::new, f.0)));
        let _ = tx.send(r);
    };
    let job: ScopedRingJob<'_> = Box::new(job);
    // SAFETY: only the lifetime is erased. This function does not return before the job has
    // run to its end and sent its result (a panic inside is caught and sent too), or was
    // dropped without running (the receive below then fails); either way nothing it borrows
    // is used after this function returns.
    let job: RingJob = unsafe { std::mem::transmute::<ScopedRingJob<'_>, RingJob>(job) };
    let lane = core.lane(key);
    lane.load.fetch_add(1, Ordering::Relaxed);
    let sent = lane.queue.send(job).is_ok();
    if !sent {
        lane.load.fetch_sub(1, Ordering::Relaxed);
        return Err(io::Error::other("the I/O core thread has ended"));
    }
    let got = rx.recv();
    lane.load.fetch_sub(1, Ordering::Relaxed);
    match got {
        Ok(Ok(r)) => r,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(io::Error::other("the I/O core thread has ended")),
    }
}

/// Runs `f` on the ring in `slot`, made on first use; a ring left stuck is leaked, never
/// dropped, and the next call makes a fresh one.
fn run_in_slot<T>(
    slot: &mut Option<Ring>,
    make: fn() -> io::Result<Ring>,
    f: impl FnOnce(&mut Ring) -> io::Result<T>,
) -> io::Result<T> {
    if slot.is_none() {
        *slot = Some(make()?);
    }
    let ring = slot.as_mut().expect("ring just created");
    let r = f(ring);
    if ring.stuck {
        std::mem::forget(slot.take());
    }
    r
}

thread_local! {
    /// The ring of a thread that owns one: the cache writers (see [`own_ring_on_this_thread`]).
    /// `None` on every other thread, whose requests go to the I/O core.
    /// Boxed: a thread-local's inline size counts against the static TLS block that the Python
    /// extension must get from glibc when it is loaded (it uses mimalloc's initial-exec TLS),
    /// which is small and shared with every library loaded before it (torch's among them).
    static OWN_RING: std::cell::RefCell<Option<Box<Option<Ring>>>> = const { std::cell::RefCell::new(None) };
}

/// Makes this thread run its own cache I/O on a ring of its own instead of the I/O core's.
/// For the cache writers (`cache::Filler`), which run at a low CPU priority: the kernel's
/// io_uring workers for their buffered writes are made from the thread that owns the ring and
/// take its priority, so a cache copy never takes a core from the read path. On an I/O core
/// thread (nice 0) those workers ran at normal priority.
pub fn own_ring_on_this_thread() {
    OWN_RING.with(|r| {
        let mut r = r.borrow_mut();
        if r.is_none() {
            *r = Some(Box::new(None));
        }
    });
}

/// The route of a cache file: a hash of its path (which names the shard).
fn route(path: &Path) -> u64 {
    xxhash_rust::xxh3::xxh3_64(path.as_os_str().as_encoded_bytes())
}

/// io_uring with registered buffers; `direct` opens files with `O_DIRECT` when the
/// filesystem accepts it (falling back to buffered I/O per file when it does not).
pub struct UringIo {
    /// Reads open files with O_DIRECT (where the filesystem allows).
    direct: bool,
    /// Cache fills (writes) open files with O_DIRECT (where the filesystem allows).
    fill_direct: bool,
    /// A core of its own (tests of faulted rings); `None`: the process's.
    core: Option<IoCore>,
}

impl std::fmt::Debug for UringIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringIo")
            .field("direct", &self.direct)
            .field("fill_direct", &self.fill_direct)
            .finish()
    }
}

impl UringIo {
    /// An io_uring implementation, or the error that says why io_uring is unusable here.
    /// `direct`: reads and writes open files with O_DIRECT where the filesystem allows.
    pub fn new(direct: bool) -> io::Result<UringIo> {
        with_ring(0, |_| Ok(()))?;
        Ok(UringIo {
            direct,
            fill_direct: direct,
            core: None,
        })
    }

    /// Whether cache fills (writes) bypass the page cache with O_DIRECT, whatever reads do.
    pub fn with_direct_fills(mut self, on: bool) -> UringIo {
        self.fill_direct = on;
        self
    }

    fn on_ring<T: Send>(&self, path: &Path, f: impl FnOnce(&mut Ring) -> io::Result<T>) -> io::Result<T> {
        match &self.core {
            Some(c) => with_ring_on(c, route(path), f),
            None => {
                let mut f = Some(f);
                let own = OWN_RING.with(|r| {
                    let mut r = r.borrow_mut();
                    r.as_mut()
                        .map(|slot| run_in_slot(slot, Ring::for_writer, f.take().expect("runs once")))
                });
                match own {
                    Some(r) => r,
                    None => with_ring(route(path), f.take().expect("not run")),
                }
            }
        }
    }

    fn open(&self, path: &Path, write: bool) -> io::Result<(File, bool)> {
        let mut o = OpenOptions::new();
        if write {
            o.write(true).create_new(true);
        } else {
            o.read(true);
        }
        if (write && self.fill_direct) || (!write && self.direct) {
            let mut od = o.clone();
            od.custom_flags(libc::O_DIRECT);
            match od.open(path) {
                Ok(f) => return Ok((f, true)),
                // tmpfs and some others refuse O_DIRECT with EINVAL.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
        }
        Ok((o.open(path)?, false))
    }
}

fn res_to_io(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

impl CacheIo for UringIo {
    fn name(&self) -> &'static str {
        match (self.direct, self.fill_direct) {
            (true, _) => "io_uring+O_DIRECT",
            (false, true) => "io_uring, O_DIRECT fills",
            (false, false) => "io_uring",
        }
    }

    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let (f, direct) = self.open(path, false)?;
        let len = f.metadata()?.len() as usize;
        // SAFETY: every byte of [0, len) is written by the reads below, each checked to be
        // complete; on any error the buffer is dropped unread (or leaked, if the ring is stuck).
        let mut out = unsafe { BufPool::global().take(len) };
        let chunks = len.div_ceil(IO_CHUNK_BYTES);
        let fd = io_uring::types::Fd(f.as_raw_fd());
        let (dst, _, cap) = out.raw();
        let mut hasher = ChunkHasher::new(len, hash_skip_tail);
        let mut leak_out = false;
        let r = self.on_ring(path, |ring| {
            // SAFETY: `out` outlives the registration: the slot is cleared below, before this
            // closure returns, and no operation is in flight after `run` returns (or the ring is
            // stuck, and then `out` is leaked).
            // Only O_DIRECT gains from a registered destination (the kernel pins each page once
            // instead of once per operation). A buffered read is a copy out of the page cache,
            // and registering the destination would pin every page of it for nothing: measured
            // at 0.76x the speed of unregistered reads on warm files (docs/benchmarks.md).
            let fixed = direct && unsafe { ring.register_dest(dst, cap) };
            let r = ring.run(
                chunks,
                |i, _slot, _bounce, _registered| {
                    // O_DIRECT needs aligned lengths: read whole aligned chunks (they stay inside
                    // the aligned capacity); the kernel stops at end of file.
                    let off = i * IO_CHUNK_BYTES;
                    let want = (len - off).min(IO_CHUNK_BYTES).div_ceil(IO_ALIGN) * IO_ALIGN;
                    // SAFETY: off + want <= cap, inside the destination.
                    let p = unsafe { dst.add(off) };
                    if fixed {
                        io_uring::opcode::ReadFixed::new(fd, p, want as u32, DEST_SLOT)
                            .offset(off as u64)
                            .build()
                    } else {
                        io_uring::opcode::Read::new(fd, p, want as u32)
                            .offset(off as u64)
                            .build()
                    }
                },
                |i, _buf, res| {
                    let got = res_to_io(res)?;
                    let want = (len - i * IO_CHUNK_BYTES).min(IO_CHUNK_BYTES);
                    if got < want {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("short read at chunk {i}"),
                        ));
                    }
                    hasher.done(i, |r| {
                        // SAFETY: the hasher asks only for ranges of completed chunks: they are
                        // initialised and no read in flight overlaps them.
                        unsafe { std::slice::from_raw_parts(dst.add(r.start), r.end - r.start) }
                    });
                    Ok(())
                },
            );
            if fixed {
                ring.clear_dest();
            }
            leak_out = ring.stuck;
            r
        });
        if leak_out {
            // The kernel may still write into it: never free or reuse it.
            std::mem::forget(out);
            return Err(r.err().unwrap_or_else(|| io::Error::other("io_uring ring retired")));
        }
        r?;
        Ok((out.into_bytes(), hasher.finish()))
    }

    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let (f, direct) = self.open(path, true)?;
        // With O_DIRECT only whole aligned blocks go through the ring; an unaligned tail is
        // written buffered after. Padding the tail to a block and truncating after would leave
        // the file, for a moment, up to a block longer than its data, over the cache's budget.
        let ring_end = if direct {
            data.len() / IO_ALIGN * IO_ALIGN
        } else {
            data.len()
        };
        let chunks = ring_end.div_ceil(IO_CHUNK_BYTES);
        let fd = io_uring::types::Fd(f.as_raw_fd());
        // Writes go straight from `data`: a copy into the bounce buffers would read every
        // byte once more (and registering `data` would only pin its pages first). Buffered,
        // the kernel copies it into the page cache; with O_DIRECT the device reads it where it
        // is, which needs an aligned address: a pooled buffer's chunks are aligned, and other
        // data goes through the bounce buffers.
        let aligned = data.as_ptr() as usize % IO_ALIGN == 0;
        self.on_ring(path, |ring| {
            let r = ring.run(
                chunks,
                |i, b, ptr, registered| {
                    let off = i * IO_CHUNK_BYTES;
                    let n = (ring_end - off).min(IO_CHUNK_BYTES);
                    if !direct || aligned {
                        let src = data[off..].as_ptr();
                        return io_uring::opcode::Write::new(fd, src, n as u32)
                            .offset(off as u64)
                            .build();
                    }
                    // SAFETY: ptr is bounce buffer `b` of IO_CHUNK_BYTES bytes, not in flight.
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, IO_CHUNK_BYTES) };
                    buf[..n].copy_from_slice(&data[off..off + n]);
                    if registered {
                        io_uring::opcode::WriteFixed::new(fd, ptr, n as u32, b)
                            .offset(off as u64)
                            .build()
                    } else {
                        io_uring::opcode::Write::new(fd, ptr, n as u32)
                            .offset(off as u64)
                            .build()
                    }
                },
                |i, _buf, res| {
                    let got = res_to_io(res)?;
                    let want = (ring_end - i * IO_CHUNK_BYTES).min(IO_CHUNK_BYTES);
                    if got < want {
                        return Err(io::Error::new(
                            io::ErrorKind::WriteZero,
                            format!("short write at chunk {i}"),
                        ));
                    }
                    Ok(())
                },
            );
            if ring.stuck {
                // `data` is borrowed and cannot be leaked here; a stuck ring only arises when the
                // kernel refuses to report completions, and the process is then told loudly.
                tracing::error!(path = %path.display(), "io_uring ring retired during a cache write");
            }
            r
        })?;
        if ring_end < data.len() {
            // SAFETY: fcntl on a descriptor this function owns (F_GETFL/F_SETFL take no pointer).
            let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
            if flags < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: as above; clearing O_DIRECT makes the tail's write a buffered one.
            if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
                return Err(io::Error::last_os_error());
            }
            std::os::unix::fs::FileExt::write_all_at(&f, &data[ring_end..], ring_end as u64)?;
        }
        Ok(())
    }
}

/// Picks the cache I/O: io_uring (O_DIRECT when `RAMJET_CACHE_DIRECT=1`) when a ring can be
/// created, else pread; `RAMJET_CACHE_IO=pread|uring` forces one. Another value, or `uring`
/// where no ring can be made, is an error naming the variable (never a panic).
pub fn detect() -> crate::Result<Arc<dyn CacheIo>> {
    detect_disk_io()
}

/// Whether the environment says io_uring must work here (`RAMJET_EXPECT_IO_URING=1`, which CI
/// sets): then the io_uring test suites fail instead of skipping where a ring cannot be made.
pub fn uring_expected() -> bool {
    std::env::var("RAMJET_EXPECT_IO_URING").is_ok_and(|v| v == "1")
}

fn detect_disk_io() -> crate::Result<Arc<dyn CacheIo>> {
    let direct = std::env::var("RAMJET_CACHE_DIRECT").is_ok_and(|v| v == "1");
    // Cache fills bypass the page cache unless told otherwise: a shard is written once and
    // read again only an epoch later, and the copy into the page cache (plus its writeback)
    // cost a cold epoch more CPU than hashing it (docs/benchmarks.md).
    let fill_direct = direct || std::env::var("RAMJET_CACHE_FILL").as_deref() != Ok("buffered");
    choose_io(std::env::var("RAMJET_CACHE_IO").ok().as_deref(), direct, fill_direct)
}

/// The cache I/O for a `RAMJET_CACHE_IO` value (`None`: unset).
fn choose_io(forced: Option<&str>, direct: bool, fill_direct: bool) -> crate::Result<Arc<dyn CacheIo>> {
    match forced {
        Some("pread") => return Ok(Arc::new(PreadIo)),
        Some("uring") => {
            return match UringIo::new(direct) {
                Ok(u) => Ok(Arc::new(u.with_direct_fills(fill_direct))),
                Err(e) => Err(crate::Error::invalid(
                    "RAMJET_CACHE_IO=uring",
                    format!("io_uring is unavailable here ({e}); unset it or set pread"),
                )),
            }
        }
        Some(v) => {
            return Err(crate::Error::invalid(
                format!("RAMJET_CACHE_IO={v:?}"),
                "must be pread or uring (or unset: io_uring where it works, else pread)",
            ))
        }
        None => {}
    }
    Ok(match UringIo::new(direct) {
        Ok(u) => Arc::new(u.with_direct_fills(fill_direct)),
        Err(e) => {
            tracing::info!(error = %e, "io_uring unavailable, cache falls back to pread");
            Arc::new(PreadIo)
        }
    })
}

/// Faults to inject.
#[derive(Debug, Default)]
pub struct Faults {
    /// Flip a byte in the middle of the next this-many reads.
    pub corrupt_reads: AtomicU64,
    /// Fail the next this-many writes with ENOSPC ("no space left on device").
    pub enospc_writes: AtomicU64,
}

/// A [`CacheIo`] that injects [`Faults`] into another.
pub struct FaultyIo {
    inner: Arc<dyn CacheIo>,
    /// The faults still to inject.
    pub faults: Arc<Faults>,
}

impl FaultyIo {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn CacheIo>) -> FaultyIo {
        FaultyIo {
            inner,
            faults: Arc::default(),
        }
    }
}

fn take(a: &AtomicU64) -> bool {
    a.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

impl CacheIo for FaultyIo {
    fn name(&self) -> &'static str {
        "faulty"
    }
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let (b, _) = self.inner.read_file(path, hash_skip_tail)?;
        let mut v = b.to_vec();
        if take(&self.faults.corrupt_reads) && !v.is_empty() {
            let mid = v.len() / 2;
            v[mid] ^= 0x40;
        }
        // Hash what is returned, so an injected flip is seen by the checksum as a real one would be.
        let h = hash_prefix(&v, hash_skip_tail);
        Ok((Bytes::from(v), h))
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        if take(&self.faults.enospc_writes) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        self.inner.write_file(path, data)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_bad_cache_io_setting_is_an_error_naming_the_variable_not_a_panic() {
        let e = super::choose_io(Some("fast"), false, true).err().expect("refused");
        let m = e.to_string();
        assert!(
            m.contains("RAMJET_CACHE_IO=\"fast\"") && m.contains("pread or uring"),
            "{m}"
        );
        assert_eq!(super::choose_io(Some("pread"), false, true).unwrap().name(), "pread");
        assert!(super::choose_io(None, false, true).is_ok());
    }

    use super::*;

    /// One suite, run against every implementation available here.
    fn suite(io: &dyn CacheIo) {
        let d = tempfile::tempdir().unwrap();
        for len in [0usize, 1, 4095, 4096, IO_CHUNK_BYTES + 17, 9 * IO_CHUNK_BYTES + 5] {
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let p = d.path().join(format!("f{len}"));
            io.write_file(&p, &data).unwrap();
            assert_eq!(
                std::fs::metadata(&p).unwrap().len() as usize,
                len,
                "{} len {len}",
                io.name()
            );
            let (got, h) = io.read_file(&p, 3).unwrap();
            assert_eq!(&got[..], &data[..], "{} len {len}", io.name());
            let want = (len >= 3).then(|| xxhash_rust::xxh3::xxh3_64(&data[..len - 3]));
            assert_eq!(h, want, "{} len {len}: fused hash", io.name());
            // From an aligned buffer, as a shard fetched into a pooled one is written: with
            // O_DIRECT every whole block goes from it in place, and an unaligned tail is written
            // buffered (never padded: the file must not outgrow its data, even for a moment).
            let mut aligned = AlignedBuf::zeroed(len);
            aligned.as_mut().copy_from_slice(&data);
            let p = d.path().join(format!("a{len}"));
            io.write_file(&p, aligned.as_ref()).unwrap();
            assert_eq!(
                std::fs::read(&p).unwrap(),
                data,
                "{} len {len}, aligned source",
                io.name()
            );
        }
        assert!(
            io.write_file(&d.path().join("f1"), b"x").is_err(),
            "write_file must not overwrite"
        );
    }

    #[test]
    fn pread_suite() {
        suite(&PreadIo);
    }

    #[test]
    fn uring_suite() {
        // Buffered, O_DIRECT, and the default: O_DIRECT fills with buffered reads.
        for (direct, fills) in [(false, false), (true, true), (false, true)] {
            match UringIo::new(direct) {
                Ok(u) => suite(&u.with_direct_fills(fills)),
                Err(e) if uring_expected() => {
                    panic!("io_uring expected (RAMJET_EXPECT_IO_URING=1) but unavailable: {e}")
                }
                Err(e) => println!("SKIPPED io_uring (direct={direct}): unavailable here: {e}"),
            }
        }
    }

    /// Replaces this thread's ring with one carrying `faults`; `None` (with the reason printed)
    /// where io_uring is unavailable and not expected.
    fn ring_with(faults: RingFaults) -> Option<UringIo> {
        let core = IoCore::new(1).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        core.lanes[0]
            .queue
            .send(Box::new(move |slot: &mut Option<Ring>| {
                let r = Ring::with_faults(faults).map(|r| *slot = Some(r));
                tx.send(r).unwrap();
            }))
            .unwrap();
        match rx.recv().unwrap() {
            Ok(()) => Some(UringIo {
                direct: false,
                fill_direct: false,
                core: Some(core),
            }),
            Err(e) if uring_expected() => panic!("io_uring expected (RAMJET_EXPECT_IO_URING=1) but unavailable: {e}"),
            Err(e) => {
                println!("SKIPPED io_uring ring test: unavailable here: {e}");
                None
            }
        }
    }

    /// Reads a field of the test core's ring.
    fn ring_field<T: Send>(io: &UringIo, f: impl FnOnce(&Ring) -> T) -> T {
        with_ring_on(io.core.as_ref().unwrap(), 0, |r| Ok(f(r))).unwrap()
    }

    fn ring_in_flight(io: &UringIo) -> usize {
        ring_field(io, |r| r.in_flight)
    }

    fn data_file(d: &Path, name: &str, len: usize) -> (std::path::PathBuf, Vec<u8>) {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let p = d.join(name);
        std::fs::write(&p, &data).unwrap();
        (p, data)
    }

    /// Regression: a wait interrupted by a signal (EINTR) failed the whole read.
    #[test]
    fn uring_wait_interrupted_by_a_signal_is_retried() {
        let Some(io) = ring_with(RingFaults {
            eintr_waits: 5,
            ..Default::default()
        }) else {
            return;
        };
        let d = tempfile::tempdir().unwrap();
        let (p, data) = data_file(d.path(), "f", 5 * IO_CHUNK_BYTES + 3);
        let (got, _) = io.read_file(&p, 0).unwrap();
        assert_eq!(&got[..], &data[..]);
        assert_eq!(ring_field(&io, |r| r.faults.eintr_waits), 0, "faults not exercised");
    }

    /// Regression: a failed `submit_and_wait` returned with reads in flight; the buffer went
    /// back to the pool while the kernel could still write into it, and the late completions
    /// were taken for the next call's.
    #[test]
    fn uring_failed_wait_returns_only_after_draining_in_flight_reads() {
        let Some(io) = ring_with(RingFaults {
            fail_wait_in_flight: Some((4, libc::EBUSY)),
            full_depth: true,
            ..Default::default()
        }) else {
            return;
        };
        let d = tempfile::tempdir().unwrap();
        let (p, _) = data_file(d.path(), "a", 9 * IO_CHUNK_BYTES);
        let e = io
            .read_file(&p, 0)
            .expect_err("the injected wait failure must fail the read");
        assert_eq!(e.raw_os_error(), Some(libc::EBUSY));
        assert_eq!(ring_in_flight(&io), 0, "returned with operations in flight");
        // The same ring serves the next read correctly: no stale completion is mistaken for it.
        let (q, data) = data_file(d.path(), "b", 3 * IO_CHUNK_BYTES + 11);
        let (got, h) = io.read_file(&q, 5).unwrap();
        assert_eq!(&got[..], &data[..]);
        assert_eq!(h, hash_prefix(&data, 5));
    }

    /// Regression: a full submission queue failed the read instead of flushing it.
    #[test]
    fn uring_full_submission_queue_is_flushed_not_fatal() {
        let Some(io) = ring_with(RingFaults {
            sq_full: 3,
            ..Default::default()
        }) else {
            return;
        };
        let d = tempfile::tempdir().unwrap();
        let (p, data) = data_file(d.path(), "f", 4 * IO_CHUNK_BYTES + 1);
        let (got, _) = io.read_file(&p, 0).unwrap();
        assert_eq!(&got[..], &data[..]);
        io.write_file(&d.path().join("w"), &data).unwrap();
        assert_eq!(std::fs::read(d.path().join("w")).unwrap(), data);
        assert_eq!(ring_in_flight(&io), 0);
    }

    /// Regression: buffer registration refused (ENOMEM under RLIMIT_MEMLOCK for non-root users)
    /// failed every read; the ring now runs unregistered reads and writes.
    #[test]
    fn uring_registration_refused_by_memlock_falls_back_to_unregistered_io() {
        let Some(io) = ring_with(RingFaults {
            register_enomem: true,
            ..Default::default()
        }) else {
            return;
        };
        assert!(!ring_field(&io, |r| r.registered));
        suite(&io);
    }
}
