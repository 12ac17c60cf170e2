//! Disk I/O of the node-local cache: one trait, four implementations.
//!
//! - [`UringIo`]: io_uring, one ring per thread (thread-per-core: no lock is shared between
//!   rings), with a pool of registered (fixed) buffers that every read and write goes through,
//!   several operations in flight, and `O_DIRECT` where the filesystem allows it.
//! - [`PreadIo`]: plain `pread`/`pwrite`, the fallback where io_uring is unavailable.
//! - [`MapResident`]: wraps one of those; a file whose pages are all in the page cache is
//!   mapped and served in place (no copy), the others are read by the wrapped one.
//! - [`FaultyIo`]: wraps another and flips bytes or fails writes, for tests.
//!
//! [`detect`] picks io_uring when a ring can be created, else pread, and wraps it in
//! [`MapResident`]; `RAMJET_CACHE_IO=pread` or `=uring` forces one, `RAMJET_CACHE_MMAP=0`
//! turns the mapping off.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

/// Alignment of every cache buffer: O_DIRECT needs the logical block size; 4 KiB covers it.
pub const IO_ALIGN: usize = 4096;
/// Size of one registered buffer, and so of one I/O operation (also the unit the read path
/// hashes while it is hot in the CPU's cache).
pub const IO_CHUNK_BYTES: usize = 1 << 20;
/// Registered buffers per ring, and so operations in flight per thread.
pub const IO_CHUNKS_IN_FLIGHT: usize = 8;
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
    /// The process-wide pool.
    pub fn global() -> &'static BufPool {
        static POOL: std::sync::OnceLock<BufPool> = std::sync::OnceLock::new();
        POOL.get_or_init(|| BufPool {
            free: std::sync::Mutex::new(Vec::new()),
            retained: AtomicU64::new(0),
        })
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

/// A read-only shared mapping of a whole file: its page-cache pages, in place.
///
/// Cache files are immutable: written under `tmp/`, renamed into place, and only ever
/// unlinked, which leaves a mapping valid. A process outside ramjet that truncated a cache
/// file in place while it is mapped would make a read of the lost pages fault (SIGBUS); the
/// cache directory belongs to ramjet, as a database's files belong to the database.
pub struct MappedFile {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by this value; reads from any thread are sound.
unsafe impl Send for MappedFile {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for MappedFile {}

impl MappedFile {
    /// Maps the first `len` bytes of `f` when every one of their pages is in the page cache.
    /// `None` when some page is not (reading it into a buffer with queued I/O is then faster
    /// than faulting pages in one by one), or when `len` is 0. An error means the file cannot
    /// be mapped or checked here (a filesystem without mmap); the caller reads it instead.
    pub fn map_if_resident(f: &File, len: usize) -> io::Result<Option<MappedFile>> {
        if len == 0 {
            return Ok(None);
        }
        // SAFETY: a new read-only shared mapping of a descriptor we hold open; the kernel picks
        // the address, so no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let m = MappedFile { ptr, len };
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let mut resident = vec![0u8; len.div_ceil(page)];
        // SAFETY: `resident` has one byte per page of the mapping [ptr, ptr + len).
        if unsafe { libc::mincore(m.ptr, len, resident.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(resident.iter().all(|r| r & 1 == 1).then_some(m))
    }
}

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the mapping covers `len` readable bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map_if_resident`; no slice of it outlives
        // `self` (`Bytes` keeps the owner alive while any slice exists).
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

/// Serves files that are wholly in the page cache from a mapping of it, without a copy, and
/// reads the others with the wrapped implementation.
///
/// A warm shard read into a buffer moves every byte through memory twice (page cache to
/// buffer, then the buffer to whoever reads it); mapped, once, as `cat` does. Files not
/// resident still go through the wrapped queued reads (io_uring), which beat faulting pages
/// in one at a time. Writes go to the wrapped implementation.
pub struct MapResident {
    inner: Arc<dyn CacheIo>,
}

impl MapResident {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn CacheIo>) -> MapResident {
        MapResident { inner }
    }
}

impl CacheIo for MapResident {
    fn name(&self) -> &'static str {
        match self.inner.name() {
            "io_uring" => "io_uring (mmap when resident)",
            "io_uring+O_DIRECT" => "io_uring+O_DIRECT (mmap when resident)",
            "pread" => "pread (mmap when resident)",
            _ => "mmap when resident",
        }
    }
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let f = File::open(path)?;
        let len = f.metadata()?.len() as usize;
        // The mapping only saves a copy: where it fails, the file is read as without it.
        if let Ok(Some(m)) = MappedFile::map_if_resident(&f, len) {
            let h = hash_prefix(m.as_ref(), hash_skip_tail);
            return Ok((Bytes::from_owner(m), h));
        }
        self.inner.read_file(path, hash_skip_tail)
    }
    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        self.inner.write_file(path, data)
    }
}

/// Whole-file reads and writes for the cache.
pub trait CacheIo: Send + Sync {
    /// Name, for logs and benchmark output.
    fn name(&self) -> &'static str;
    /// Reads the whole file and, in the same pass (while each chunk is still in the CPU's
    /// cache), the xxh3-64 of its first `len - hash_skip_tail` bytes, when the file is at least
    /// that long.
    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)>;
    /// Creates `path` (which must not exist), writes `data`, and fsyncs it.
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
        f.write_all_at(data, 0)?;
        f.sync_all()
    }
}

/// One thread's ring and its registered buffers.
struct Ring {
    ring: io_uring::IoUring,
    bufs: Vec<AlignedBuf>,
}

impl Ring {
    fn new() -> io::Result<Ring> {
        let ring = io_uring::IoUring::new(IO_CHUNKS_IN_FLIGHT as u32 * 2)?;
        // Slots 0..IO_CHUNKS_IN_FLIGHT hold the bounce buffers (writes); slot DEST_SLOT is
        // re-pointed at each read's destination, so reads land in place with one copy.
        ring.submitter()
            .register_buffers_sparse(IO_CHUNKS_IN_FLIGHT as u32 + 1)?;
        let mut bufs: Vec<AlignedBuf> = (0..IO_CHUNKS_IN_FLIGHT)
            .map(|_| AlignedBuf::zeroed(IO_CHUNK_BYTES))
            .collect();
        let iovecs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.full_mut().as_mut_ptr().cast(),
                iov_len: IO_CHUNK_BYTES,
            })
            .collect();
        // SAFETY: the buffers live as long as the ring (both owned by this struct, and the
        // ring is dropped, unregistering them, before the buffers: fields drop in order).
        unsafe { ring.submitter().register_buffers_update(0, &iovecs, None)? };
        Ok(Ring { ring, bufs })
    }

    /// Empties the destination slot, releasing the kernel's reference to the memory it held.
    fn clear_dest(&mut self) -> io::Result<()> {
        let clear = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }];
        // SAFETY: an empty iovec registers no memory; it only drops the slot's old reference.
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(DEST_SLOT as u32, &clear, None)?
        };
        Ok(())
    }

    /// Runs `ops` chunked operations: `prep(i, buf_index, buf_ptr)` builds the entry for chunk
    /// `i`; `done(i, buf_index, result)` handles its completion. At most one operation per
    /// registered buffer is in flight, so a buffer is never reused before the kernel is done.
    fn run(
        &mut self,
        ops: usize,
        mut prep: impl FnMut(usize, u16, *mut u8) -> io_uring::squeue::Entry,
        mut done: impl FnMut(usize, &AlignedBuf, i32) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut next = 0usize;
        let mut in_flight = 0usize;
        let mut free: Vec<u16> = (0..self.bufs.len() as u16).collect();
        let mut owner = vec![usize::MAX; self.bufs.len()];
        let mut first_err: Option<io::Error> = None;
        while next < ops || in_flight > 0 {
            while next < ops && first_err.is_none() {
                let Some(b) = free.pop() else { break };
                let ptr = self.bufs[b as usize].full_mut().as_mut_ptr();
                let e = prep(next, b, ptr).user_data(b as u64);
                owner[b as usize] = next;
                // SAFETY: the entry points into registered buffer `b`, which stays alive and
                // untouched by us until its completion is reaped below.
                unsafe {
                    self.ring
                        .submission()
                        .push(&e)
                        .map_err(|_| io::Error::other("io_uring submission queue full"))?;
                }
                next += 1;
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            self.ring.submit_and_wait(1)?;
            let cqes: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (ud, res) in cqes {
                let b = ud as usize;
                in_flight -= 1;
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

thread_local! {
    static RING: RefCell<Option<Ring>> = const { RefCell::new(None) };
}

fn with_ring<T>(f: impl FnOnce(&mut Ring) -> io::Result<T>) -> io::Result<T> {
    RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Ring::new()?);
        }
        f(slot.as_mut().expect("ring just created"))
    })
}

/// io_uring with registered buffers; `direct` opens files with `O_DIRECT` when the
/// filesystem accepts it (falling back to buffered I/O per file when it does not).
#[derive(Debug)]
pub struct UringIo {
    direct: bool,
}

impl UringIo {
    /// An io_uring implementation, or the error that says why io_uring is unusable here.
    pub fn new(direct: bool) -> io::Result<UringIo> {
        with_ring(|_| Ok(()))?;
        Ok(UringIo { direct })
    }

    fn open(&self, path: &Path, write: bool) -> io::Result<(File, bool)> {
        let mut o = OpenOptions::new();
        if write {
            o.write(true).create_new(true);
        } else {
            o.read(true);
        }
        if self.direct {
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
        if self.direct {
            "io_uring+O_DIRECT"
        } else {
            "io_uring"
        }
    }

    fn read_file(&self, path: &Path, hash_skip_tail: usize) -> io::Result<(Bytes, Option<u64>)> {
        let (f, _direct) = self.open(path, false)?;
        let len = f.metadata()?.len() as usize;
        // SAFETY: every byte of [0, len) is written by the reads below, each checked to be
        // complete; on any error the buffer is dropped unread.
        let mut out = unsafe { BufPool::global().take(len) };
        let chunks = len.div_ceil(IO_CHUNK_BYTES);
        let fd = io_uring::types::Fd(f.as_raw_fd());
        let (dst, _, cap) = out.raw();
        let mut hasher = ChunkHasher::new(len, hash_skip_tail);
        with_ring(|ring| {
            let dest = [libc::iovec {
                iov_base: dst.cast(),
                iov_len: cap,
            }];
            // SAFETY: `out` outlives the registration: the slot is cleared below, before this
            // closure returns, and no operation is in flight after `run` returns.
            unsafe {
                ring.ring
                    .submitter()
                    .register_buffers_update(DEST_SLOT as u32, &dest, None)?
            };
            let r = ring.run(
                chunks,
                |i, _slot, _bounce| {
                    // O_DIRECT needs aligned lengths: read whole aligned chunks (they stay inside
                    // the aligned capacity); the kernel stops at end of file.
                    let off = i * IO_CHUNK_BYTES;
                    let want = (len - off).min(IO_CHUNK_BYTES).div_ceil(IO_ALIGN) * IO_ALIGN;
                    // SAFETY: off + want <= cap, inside the registered destination.
                    let p = unsafe { dst.add(off) };
                    io_uring::opcode::ReadFixed::new(fd, p, want as u32, DEST_SLOT)
                        .offset(off as u64)
                        .build()
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
            ring.clear_dest()?;
            r
        })?;
        Ok((out.into_bytes(), hasher.finish()))
    }

    fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let (f, direct) = self.open(path, true)?;
        let chunks = data.len().div_ceil(IO_CHUNK_BYTES);
        let fd = io_uring::types::Fd(f.as_raw_fd());
        with_ring(|ring| {
            // Buffered writes go straight from `data`, registered in the destination slot:
            // a copy into the bounce buffers first would read every byte once more. O_DIRECT
            // needs aligned lengths (the last chunk is padded), so it keeps the bounce buffers,
            // as do writes from memory the kernel will not register (read-only mappings).
            let dest = [libc::iovec {
                iov_base: data.as_ptr() as *mut libc::c_void,
                iov_len: data.len(),
            }];
            let in_place = !direct && !data.is_empty() && {
                // SAFETY: `data` outlives the registration: the slot is cleared below, before
                // this closure returns, and no operation is in flight after `run` returns. The
                // kernel only reads through it (writes to the file).
                unsafe {
                    ring.ring
                        .submitter()
                        .register_buffers_update(DEST_SLOT as u32, &dest, None)
                }
                .is_ok()
            };
            let r = ring.run(
                chunks,
                |i, b, ptr| {
                    let off = i * IO_CHUNK_BYTES;
                    let n = (data.len() - off).min(IO_CHUNK_BYTES);
                    if in_place {
                        let src = data[off..].as_ptr();
                        return io_uring::opcode::WriteFixed::new(fd, src, n as u32, DEST_SLOT)
                            .offset(off as u64)
                            .build();
                    }
                    // SAFETY: ptr is registered buffer `b` of IO_CHUNK_BYTES bytes, not in flight.
                    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, IO_CHUNK_BYTES) };
                    buf[..n].copy_from_slice(&data[off..off + n]);
                    // With O_DIRECT the length must be aligned: pad with zeros, truncate after.
                    let len = if direct {
                        buf[n..n.div_ceil(IO_ALIGN) * IO_ALIGN].fill(0);
                        n.div_ceil(IO_ALIGN) * IO_ALIGN
                    } else {
                        n
                    };
                    io_uring::opcode::WriteFixed::new(fd, ptr, len as u32, b)
                        .offset(off as u64)
                        .build()
                },
                |i, _buf, res| {
                    let got = res_to_io(res)?;
                    let want = (data.len() - i * IO_CHUNK_BYTES).min(IO_CHUNK_BYTES);
                    if got < want {
                        return Err(io::Error::new(
                            io::ErrorKind::WriteZero,
                            format!("short write at chunk {i}"),
                        ));
                    }
                    Ok(())
                },
            );
            if in_place {
                ring.clear_dest()?;
            }
            r
        })?;
        if direct {
            f.set_len(data.len() as u64)?;
        }
        f.sync_all()
    }
}

/// Picks the cache I/O: io_uring (O_DIRECT when `RAMJET_CACHE_DIRECT=1`) when a ring can be
/// created, else pread; `RAMJET_CACHE_IO=pread|uring` forces one. It is wrapped in
/// [`MapResident`] unless `RAMJET_CACHE_MMAP=0`.
pub fn detect() -> Arc<dyn CacheIo> {
    let io = detect_disk_io();
    if std::env::var("RAMJET_CACHE_MMAP").is_ok_and(|v| v == "0") {
        io
    } else {
        Arc::new(MapResident::new(io))
    }
}

fn detect_disk_io() -> Arc<dyn CacheIo> {
    let direct = std::env::var("RAMJET_CACHE_DIRECT").is_ok_and(|v| v == "1");
    match std::env::var("RAMJET_CACHE_IO").as_deref() {
        Ok("pread") => return Arc::new(PreadIo),
        Ok("uring") => {
            return Arc::new(UringIo::new(direct).expect("RAMJET_CACHE_IO=uring but io_uring is unavailable"))
        }
        _ => {}
    }
    match UringIo::new(direct) {
        Ok(u) => Arc::new(u),
        Err(e) => {
            tracing::info!(error = %e, "io_uring unavailable, cache falls back to pread");
            Arc::new(PreadIo)
        }
    }
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
        for direct in [false, true] {
            match UringIo::new(direct) {
                Ok(u) => suite(&u),
                Err(e) => println!("SKIPPED io_uring (direct={direct}): unavailable here: {e}"),
            }
        }
    }

    #[test]
    fn map_resident_suite() {
        suite(&MapResident::new(Arc::new(PreadIo)));
    }

    /// A resident file is served from the mapping; once its pages are dropped from the page
    /// cache, from the wrapped implementation (which here flips a byte, to tell them apart).
    #[test]
    fn map_resident_maps_resident_files_and_reads_the_others() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        let data: Vec<u8> = (0..3 * IO_CHUNK_BYTES + 5).map(|i| (i % 253) as u8).collect();
        PreadIo.write_file(&p, &data).unwrap();
        let faulty = Arc::new(FaultyIo::new(Arc::new(PreadIo)));
        faulty.faults.corrupt_reads.store(u64::MAX, Ordering::SeqCst);
        let io = MapResident::new(faulty.clone());
        let (got, h) = io.read_file(&p, 7).unwrap();
        assert_eq!(&got[..], &data[..], "a resident file was not served from the mapping");
        assert_eq!(h, hash_prefix(&data, 7));
        assert_eq!(faulty.faults.corrupt_reads.load(Ordering::SeqCst), u64::MAX);
        drop(got);
        let f = File::open(&p).unwrap();
        // SAFETY: advice on a descriptor we hold; no memory is involved.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if MappedFile::map_if_resident(&f, data.len()).unwrap().is_some() {
            println!("SKIPPED the non-resident half: the page cache kept the file");
            return;
        }
        let (got, h) = io.read_file(&p, 7).unwrap();
        assert_ne!(
            &got[..],
            &data[..],
            "a file not resident was not read by the wrapped io"
        );
        assert_eq!(h, hash_prefix(&got, 7));
    }
}
