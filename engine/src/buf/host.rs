//! Host buffers for batches: 64-byte aligned, reused through a bounded pool.
//!
//! A batch's image tensor lives in one [`HostBuf`]. When the last reference to it goes (the
//! training loop dropped the tensor), the buffer returns to its pool, so steady state
//! allocates nothing. How the memory is obtained is a [`HostAlloc`]: plain aligned memory
//! by default; the CUDA crate supplies page-locked memory so host-to-device copies run at
//! full PCIe speed.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::metrics::Metrics;

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
    /// Bytes allocated (a buffer serves any request up to this).
    cap: usize,
}

// SAFETY: `Raw` is an owned allocation with no thread affinity; access goes through
// `HostBuf`, which hands out `&`/`&mut` under the usual borrow rules.
unsafe impl Send for Raw {}

struct PoolInner {
    alloc: Box<dyn HostAlloc>,
    free: Mutex<Vec<Raw>>,
    keep: usize,
    /// Allocations and frees after [`HostPool::prefill`] (steady state: both should stay 0).
    late_allocs: AtomicU64,
    late_frees: AtomicU64,
    /// Whether the working set was allocated ([`HostPool::prefill`]).
    filled: std::sync::atomic::AtomicBool,
    /// Where late allocations and frees are counted too (the loader's metrics).
    metrics: OnceLock<Arc<Metrics>>,
}

impl PoolInner {
    fn count_late(&self, alloc: bool) {
        if !self.filled.load(Ordering::Relaxed) {
            return;
        }
        let (mine, theirs) = match (alloc, self.metrics.get()) {
            (true, m) => (&self.late_allocs, m.map(|m| &m.host_buffer_late_allocs)),
            (false, m) => (&self.late_frees, m.map(|m| &m.host_buffer_late_frees)),
        };
        mine.fetch_add(1, Ordering::Relaxed);
        if let Some(t) = theirs {
            Metrics::add(t, 1);
        }
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        for r in self.free.get_mut().expect("not poisoned").drain(..) {
            // SAFETY: every pooled `Raw` came from `self.alloc.alloc(r.cap)`.
            unsafe { self.alloc.free(r.ptr, r.cap) };
        }
    }
}

/// A bounded pool of batch buffers. Its working set is allocated at once ([`prefill`]), so
/// steady state neither allocates nor frees: page-locked allocation and release synchronise
/// the GPU's streams, which a decode thread must never do mid-training. A buffer serves any
/// request up to its size (a short last batch reuses a full one). Buffers taken beyond what it
/// keeps are freed on return instead of pooled; after `prefill`, every such allocation and free
/// is counted ([`late_allocs`], the loader's `host_buffer_late_allocs`).
///
/// [`prefill`]: HostPool::prefill
/// [`late_allocs`]: HostPool::late_allocs
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
                late_allocs: AtomicU64::new(0),
                late_frees: AtomicU64::new(0),
                filled: std::sync::atomic::AtomicBool::new(false),
                metrics: OnceLock::new(),
            }),
        }
    }

    /// Allocates the working set now: idle buffers of `len` bytes until the pool keeps as many
    /// as it may (`keep`), each touched so that its pages exist. From then on, allocations
    /// and frees are late, and counted. Returns how many it allocated (fewer when memory ran
    /// out: the rest come late).
    pub fn prefill(&self, len: usize) -> usize {
        let mut made = 0;
        loop {
            let have = self.inner.free.lock().expect("not poisoned").len();
            if have >= self.inner.keep {
                break;
            }
            let Some(ptr) = self.inner.alloc.alloc(len) else { break };
            // SAFETY: `alloc` returned `len` writable bytes that nobody else holds.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
            self.inner
                .free
                .lock()
                .expect("not poisoned")
                .push(Raw { ptr, cap: len });
            made += 1;
        }
        self.inner.filled.store(true, Ordering::Relaxed);
        made
    }

    /// Counts late allocations and frees in `metrics` too (the first call wins).
    pub fn count_in(&self, metrics: Arc<Metrics>) {
        let _ = self.inner.metrics.set(metrics);
    }

    /// Buffers allocated after [`prefill`](Self::prefill) (a working set too small, or a
    /// consumer holding more batches than the pool keeps).
    pub fn late_allocs(&self) -> u64 {
        self.inner.late_allocs.load(Ordering::Relaxed)
    }

    /// Buffers freed after [`prefill`](Self::prefill) (returned beyond what the pool keeps).
    pub fn late_frees(&self) -> u64 {
        self.inner.late_frees.load(Ordering::Relaxed)
    }

    /// A buffer of `len` bytes (contents unspecified): the smallest idle one that holds
    /// `len`, else a new one.
    pub fn take(&self, len: usize) -> Option<HostBuf> {
        let reused = {
            let mut free = self.inner.free.lock().expect("not poisoned");
            free.iter()
                .enumerate()
                .filter(|(_, r)| r.cap >= len)
                .min_by_key(|(_, r)| r.cap)
                .map(|(i, _)| i)
                .map(|i| free.swap_remove(i))
        };
        let raw = match reused {
            Some(r) => r,
            None => {
                let ptr = self.inner.alloc.alloc(len)?;
                self.inner.count_late(true);
                Raw { ptr, cap: len }
            }
        };
        Some(HostBuf {
            raw: Some(raw),
            len,
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
    /// Bytes asked for (at most the allocation's).
    len: usize,
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
        if self.raw.is_some() {
            self.len
        } else {
            0
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Start address (for export to other runtimes; stays valid while `self` lives).
    pub fn as_ptr(&self) -> *const u8 {
        self.raw.as_ref().expect("present until drop").ptr.as_ptr()
    }

    /// The bytes, read only.
    pub fn as_slice(&self) -> &[u8] {
        let r = self.raw.as_ref().expect("present until drop");
        // SAFETY: `ptr` owns `cap >= len` initialised bytes (zeroed or written before), and
        // `&self` rules out a `&mut` view while this one lives.
        unsafe { std::slice::from_raw_parts(r.ptr.as_ptr(), self.len) }
    }

    /// The bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let r = self.raw.as_ref().expect("present until drop");
        // SAFETY: `ptr` owns `cap >= len` initialised bytes (zeroed or written before) and
        // `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(r.ptr.as_ptr(), self.len) }
    }

    /// The bytes as f32 (the buffer is 64-byte aligned; `len` must be a multiple of 4).
    pub fn as_mut_f32(&mut self) -> &mut [f32] {
        let r = self.raw.as_ref().expect("present until drop");
        assert_eq!(self.len % 4, 0);
        // SAFETY: 64-byte alignment satisfies f32's; the length is whole f32s within the
        // allocation; every bit pattern is a valid f32; `&mut self` makes this the only
        // reference.
        unsafe { std::slice::from_raw_parts_mut(r.ptr.as_ptr().cast::<f32>(), self.len / 4) }
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
            self.pool.count_late(false);
            // SAFETY: `r` came from this pool's allocator with this size.
            unsafe { self.pool.alloc.free(r.ptr, r.cap) };
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

    /// Counts what it allocates and frees, as a pinned allocator would be asked.
    #[derive(Default)]
    struct Counting {
        allocs: std::sync::atomic::AtomicUsize,
        frees: std::sync::atomic::AtomicUsize,
    }

    // SAFETY: forwards to `AlignedAlloc`, which keeps the trait's promises.
    unsafe impl HostAlloc for Arc<Counting> {
        fn alloc(&self, len: usize) -> Option<NonNull<u8>> {
            self.allocs.fetch_add(1, Ordering::SeqCst);
            AlignedAlloc.alloc(len)
        }
        unsafe fn free(&self, ptr: NonNull<u8>, len: usize) {
            self.frees.fetch_add(1, Ordering::SeqCst);
            // SAFETY: the caller's promise, passed on.
            unsafe { AlignedAlloc.free(ptr, len) }
        }
    }

    /// Regression (issue 40, item 2): a pool miss allocated page-locked memory from a decode
    /// thread mid-training, and surplus buffers were freed (both synchronise the GPU's
    /// streams). The working set is now allocated at once; a steady loop of take and drop,
    /// short last batches included, then allocates and frees nothing; what a consumer holding
    /// too many batches costs is counted, in the pool and in the loader's metrics.
    #[test]
    fn the_working_set_is_allocated_at_once_and_steady_state_allocates_nothing() {
        let counting = Arc::new(Counting::default());
        let pool = HostPool::new(Box::new(counting.clone()), 6);
        let metrics = Arc::new(Metrics::default());
        pool.count_in(metrics.clone());
        assert_eq!(pool.prefill(4096), 6);
        assert_eq!(counting.allocs.load(Ordering::SeqCst), 6);
        for round in 0..100 {
            // The loader's ahead of 4 batches in flight, the last one short.
            let held: Vec<HostBuf> = (0..4)
                .map(|i| pool.take(if i == 3 && round % 10 == 9 { 1000 } else { 4096 }).unwrap())
                .collect();
            assert_eq!(held[0].len(), 4096);
            drop(held);
        }
        assert_eq!(
            counting.allocs.load(Ordering::SeqCst),
            6,
            "no allocation in steady state"
        );
        assert_eq!(counting.frees.load(Ordering::SeqCst), 0, "no free in steady state");
        assert_eq!((pool.late_allocs(), pool.late_frees()), (0, 0));
        // A consumer that holds 8 batches: 2 late allocations, then 2 late frees, counted.
        let held: Vec<HostBuf> = (0..8).map(|_| pool.take(4096).unwrap()).collect();
        drop(held);
        assert_eq!((pool.late_allocs(), pool.late_frees()), (2, 2));
        let snap = metrics.snapshot();
        assert_eq!((snap.host_buffer_late_allocs, snap.host_buffer_late_frees), (2, 2));
        // A short batch takes the smallest buffer that holds it and sees only its own length.
        let mut b = pool.take(100).unwrap();
        assert_eq!(b.as_mut_slice().len(), 100);
    }
}
