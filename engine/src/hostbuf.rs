//! Host buffers for batches: 64-byte aligned, reused through a bounded pool.
//!
//! A batch's image tensor lives in one [`HostBuf`]. When the last reference to it goes (the
//! training loop dropped the tensor), the buffer returns to its pool, so steady state
//! allocates nothing. How the memory is obtained is a [`HostAlloc`]: plain aligned memory
//! by default; the CUDA crate supplies page-locked memory so host-to-device copies run at
//! full PCIe speed.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// Alignment of every buffer (a cache line; also what AVX-512 loads like).
pub const HOST_ALIGN: usize = 64;

/// Obtains and releases host memory for batch buffers.
///
/// # Safety
/// `alloc(len)` must return memory valid for reads and writes of `len` bytes, aligned to
/// [`HOST_ALIGN`], owned by nobody else until it is passed to `free`: the pool hands it out as
/// `&mut [u8]` and exports it to other runtimes (DLPack) on that promise.
pub unsafe trait HostAlloc: Send + Sync + 'static {
    /// `len` bytes aligned to [`HOST_ALIGN`], or `None` when none can be had.
    fn alloc(&self, len: usize) -> Option<NonNull<u8>>;
    /// Releases memory that `alloc(len)` returned.
    ///
    /// # Safety
    /// `ptr` must come from `self.alloc(len)` with the same `len`, and not be used after.
    unsafe fn free(&self, ptr: NonNull<u8>, len: usize);
    /// Whether the memory is page-locked (pinned) for device copies.
    fn pinned(&self) -> bool {
        false
    }
}

/// Ordinary aligned heap memory.
#[derive(Debug, Default)]
pub struct AlignedAlloc;

// SAFETY: memory from the global allocator with the stated layout, exclusively owned.
unsafe impl HostAlloc for AlignedAlloc {
    fn alloc(&self, len: usize) -> Option<NonNull<u8>> {
        let layout = Layout::from_size_align(len.max(1), HOST_ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
    }

    unsafe fn free(&self, ptr: NonNull<u8>, len: usize) {
        let layout = Layout::from_size_align(len.max(1), HOST_ALIGN).expect("valid at alloc");
        // SAFETY: the caller guarantees `ptr` came from `alloc(len)`, i.e. this layout.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) }
    }
}

struct Raw {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `Raw` is an owned allocation with no thread affinity; access goes through
// `HostBuf`, which hands out `&`/`&mut` under the usual borrow rules.
unsafe impl Send for Raw {}

struct PoolInner {
    alloc: Box<dyn HostAlloc>,
    free: Mutex<Vec<Raw>>,
    keep: usize,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        for r in self.free.get_mut().expect("not poisoned").drain(..) {
            // SAFETY: every pooled `Raw` came from `self.alloc.alloc(r.len)`.
            unsafe { self.alloc.free(r.ptr, r.len) };
        }
    }
}

/// A bounded pool of equally sized buffers. Buffers taken beyond what it keeps are freed on
/// return instead of pooled, so the pool never holds more than `keep` idle buffers.
#[derive(Clone)]
pub struct HostPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPool").field("keep", &self.inner.keep).finish()
    }
}

impl HostPool {
    /// A pool keeping at most `keep` idle buffers from `alloc`.
    pub fn new(alloc: Box<dyn HostAlloc>, keep: usize) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                alloc,
                free: Mutex::new(Vec::new()),
                keep,
            }),
        }
    }

    /// A buffer of exactly `len` bytes (contents unspecified), reused when one is idle.
    pub fn take(&self, len: usize) -> Option<HostBuf> {
        let reused = {
            let mut free = self.inner.free.lock().expect("not poisoned");
            free.iter().position(|r| r.len == len).map(|i| free.swap_remove(i))
        };
        let raw = match reused {
            Some(r) => r,
            None => Raw {
                ptr: self.inner.alloc.alloc(len)?,
                len,
            },
        };
        Some(HostBuf {
            raw: Some(raw),
            pool: self.inner.clone(),
        })
    }

    /// Idle buffers held now.
    pub fn idle(&self) -> usize {
        self.inner.free.lock().expect("not poisoned").len()
    }

    /// Whether buffers are page-locked.
    pub fn pinned(&self) -> bool {
        self.inner.alloc.pinned()
    }
}

/// One buffer from a [`HostPool`]; returns there on drop.
pub struct HostBuf {
    raw: Option<Raw>,
    pool: Arc<PoolInner>,
}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuf").field("len", &self.len()).finish()
    }
}

impl HostBuf {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.raw.as_ref().map_or(0, |r| r.len)
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Start address (for export to other runtimes; stays valid while `self` lives).
    pub fn as_ptr(&self) -> *const u8 {
        self.raw.as_ref().expect("present until drop").ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let r = self.raw.as_ref().expect("present until drop");
        // SAFETY: `ptr` owns `len` initialised bytes (zeroed or written before) and `&mut self`
        // makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(r.ptr.as_ptr(), r.len) }
    }

    /// The bytes as f32 (the buffer is 64-byte aligned; `len` must be a multiple of 4).
    pub fn as_mut_f32(&mut self) -> &mut [f32] {
        let r = self.raw.as_ref().expect("present until drop");
        assert_eq!(r.len % 4, 0);
        // SAFETY: 64-byte alignment satisfies f32's; the length is whole f32s; every bit
        // pattern is a valid f32; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(r.ptr.as_ptr().cast::<f32>(), r.len / 4) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let Some(r) = self.raw.take() else { return };
        let mut free = self.pool.free.lock().expect("not poisoned");
        if free.len() < self.pool.keep {
            free.push(r);
        } else {
            drop(free);
            // SAFETY: `r` came from this pool's allocator with this length.
            unsafe { self.pool.alloc.free(r.ptr, r.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_reused_and_bounded() {
        let pool = HostPool::new(Box::new(AlignedAlloc), 2);
        let mut a = pool.take(1000).unwrap();
        assert_eq!(a.as_ptr() as usize % HOST_ALIGN, 0);
        a.as_mut_slice()[999] = 7;
        let pa = a.as_ptr();
        drop(a);
        let b = pool.take(1000).unwrap();
        assert_eq!(b.as_ptr(), pa, "an idle buffer is reused");
        let c = pool.take(1000).unwrap();
        let d = pool.take(1000).unwrap();
        drop((b, c, d));
        assert_eq!(pool.idle(), 2, "the pool keeps at most 2 idle buffers");
    }
}
