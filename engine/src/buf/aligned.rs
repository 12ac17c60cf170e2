//! Aligned buffers for disk I/O, and the process-wide pool that reuses them.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

/// Alignment of every cache buffer: O_DIRECT needs the logical block size; 4 KiB covers it.
pub const IO_ALIGN: usize = 4096;

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
        // SAFETY: forwarded to our caller.
        unsafe { Self::try_uninit(len) }.unwrap_or_else(|| panic!("allocation of {len} bytes failed"))
    }

    /// [`AlignedBuf::uninit`], or `None` when the memory cannot be had (a size past the
    /// address space, or an allocator that says no: an address-space limit, a cgroup): a size
    /// that comes from outside (a manifest's claim) must fail as an error, never abort.
    ///
    /// # Safety
    /// As [`AlignedBuf::uninit`].
    pub unsafe fn try_uninit(len: usize) -> Option<AlignedBuf> {
        let cap = len.div_ceil(IO_ALIGN).max(1).checked_mul(IO_ALIGN)?;
        let layout = Layout::from_size_align(cap, IO_ALIGN).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        (!ptr.is_null()).then_some(AlignedBuf { ptr, len, cap })
    }

    /// The whole capacity, for I/O that works in aligned units.
    pub(crate) fn full_mut(&mut self) -> &mut [u8] {
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
        // SAFETY: forwarded to our caller.
        unsafe { self.try_take(len) }.unwrap_or_else(|| panic!("allocation of {len} bytes failed"))
    }

    /// [`BufPool::take`], or `None` when a new buffer's memory cannot be had.
    ///
    /// # Safety
    /// As [`AlignedBuf::uninit`]: write all of `[0, len)` before reading it.
    pub unsafe fn try_take(&'static self, len: usize) -> Option<PooledBuf> {
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
            None => unsafe { AlignedBuf::try_uninit(len) }?,
        };
        Some(PooledBuf {
            buf: Some(buf),
            pool: self,
        })
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

    pub(crate) fn raw(&mut self) -> (*mut u8, usize, usize) {
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
