//! A pool of reusable buffers: page-locked host memory (`cuMemHostAlloc`, `PORTABLE`) or device
//! memory, behind one [`Allocator`] trait so its accounting is tested with a fake allocator on
//! machines without a GPU.
//!
//! Allocating and freeing pinned memory per batch costs milliseconds and serialises the
//! device, so buffers are kept and reused. Requests are rounded up to a [`Pool::GRAIN`]
//! multiple, and a buffer is reused only for a request of the same rounded size: a training
//! job asks for the same few sizes again and again.
//!
//! A buffer the GPU may still be reading cannot be reused at once. [`PoolBuf::release_after`]
//! parks it with a [`Fence`] (a CUDA event recorded on the consumer's stream), and the pool
//! takes it back only once the fence reports completion. A fence that fails (a broken context)
//! never hands its buffer back: the memory is leaked on purpose and counted, because freeing or
//! reusing memory a device may still touch would corrupt a later batch.
//!
//! The pool holds at most `limit` bytes. A request beyond it first reclaims completed fences,
//! then frees idle buffers of other sizes, and otherwise fails with [`GpuError::PoolExhausted`],
//! which the caller treats as back-pressure (wait for the trainer to drop batches).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::{driver_err, GpuError};

/// Where an [`Allocator`]'s memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Page-locked host memory, readable by the CPU and copied by DMA.
    PinnedHost,
    /// Device memory of GPU `ordinal`.
    Device {
        /// The GPU.
        ordinal: usize,
    },
}

/// Hands out and takes back raw allocations. Implementations: [`CudaHost`], [`CudaDevice`],
/// and fakes in tests.
pub trait Allocator: Send + 'static {
    /// What kind of memory this is.
    fn memory(&self) -> Memory;
    /// A new allocation of exactly `bytes` bytes; its address (a host pointer or a device
    /// pointer, per [`Allocator::memory`]).
    fn alloc(&mut self, bytes: usize) -> Result<u64, GpuError>;
    /// Releases an allocation.
    ///
    /// # Safety
    /// `addr` came from [`Allocator::alloc`] of this allocator with the same `bytes`, is freed
    /// once, and nothing (CPU or GPU) uses it any more.
    unsafe fn free(&mut self, addr: u64, bytes: usize);
}

/// Completion of the work that last used a buffer (a CUDA event, in practice).
pub trait Fence: Send + 'static {
    /// `Ok(true)` once the work is done, `Ok(false)` while it runs, `Err` when it can no longer
    /// be known (the buffer is then never reused).
    fn is_complete(&self) -> Result<bool, GpuError>;

    /// Blocks until the work is done: polls [`Fence::is_complete`], sleeping a little longer
    /// each time (up to 1 ms), and gives up after [`FENCE_WAIT_MAX`] with an error, so a stuck
    /// GPU is an error, not a hang.
    fn wait(&self) -> Result<(), GpuError> {
        let start = std::time::Instant::now();
        let mut nap = std::time::Duration::from_micros(2);
        while !self.is_complete()? {
            if start.elapsed() > FENCE_WAIT_MAX {
                return Err(GpuError::Driver {
                    doing: "waiting for queued GPU work",
                    reason: format!("not done after {} s", FENCE_WAIT_MAX.as_secs()),
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_millis(1));
        }
        Ok(())
    }
}

/// The longest [`Fence::wait`] waits (queued copies and decodes take milliseconds).
pub const FENCE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// The pool's accounting, in bytes (sizes rounded to the grain) and in calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes allocated from the allocator and not freed: `in_use + pending + idle + leaked`.
    pub allocated: usize,
    /// Bytes of buffers handed out.
    pub in_use: usize,
    /// Bytes of released buffers waiting for their fence.
    pub pending: usize,
    /// Bytes of buffers ready for reuse.
    pub idle: usize,
    /// Bytes never to be reused because their fence failed.
    pub leaked: usize,
    /// The most `allocated` has been.
    pub high_water: usize,
    /// Calls to the allocator's `alloc`.
    pub allocs: u64,
    /// Calls to the allocator's `free`.
    pub frees: u64,
    /// Requests served by an idle buffer.
    pub reuses: u64,
}

struct Parked {
    addr: u64,
    cap: usize,
    fence: Box<dyn Fence>,
}

struct Inner<A: Allocator> {
    alloc: A,
    limit: usize,
    idle: BTreeMap<usize, Vec<u64>>,
    parked: Vec<Parked>,
    stats: PoolStats,
}

impl<A: Allocator> Inner<A> {
    /// Moves every parked buffer whose fence completed to the idle lists; a failed fence's
    /// buffer is leaked.
    fn reclaim(&mut self) {
        let mut i = 0;
        while i < self.parked.len() {
            match self.parked[i].fence.is_complete() {
                Ok(false) => i += 1,
                done => {
                    let p = self.parked.swap_remove(i);
                    self.stats.pending -= p.cap;
                    if done.is_ok() {
                        self.idle.entry(p.cap).or_default().push(p.addr);
                        self.stats.idle += p.cap;
                    } else {
                        self.stats.leaked += p.cap;
                    }
                }
            }
        }
    }

    /// Frees idle buffers (of any size) until `want` more bytes fit under the limit.
    fn make_room(&mut self, want: usize) {
        while self.stats.allocated + want > self.limit {
            let Some((&cap, list)) = self.idle.iter_mut().next_back() else {
                return;
            };
            let addr = list.pop().expect("idle lists are never left empty");
            if list.is_empty() {
                self.idle.remove(&cap);
            }
            // SAFETY: an idle buffer came from this allocator with this size, is in no list
            // any more, and nothing uses it (its fence completed, or it was never exported).
            unsafe { self.alloc.free(addr, cap) };
            self.stats.frees += 1;
            self.stats.idle -= cap;
            self.stats.allocated -= cap;
        }
    }

    fn take(&mut self, cap: usize) -> Result<u64, GpuError> {
        if let Some(list) = self.idle.get_mut(&cap) {
            let addr = list.pop().expect("idle lists are never left empty");
            if list.is_empty() {
                self.idle.remove(&cap);
            }
            self.stats.idle -= cap;
            self.stats.in_use += cap;
            self.stats.reuses += 1;
            return Ok(addr);
        }
        self.make_room(cap);
        if self.stats.allocated + cap > self.limit {
            return Err(GpuError::PoolExhausted {
                want: cap,
                in_use: self.stats.in_use,
                pending: self.stats.pending,
                limit: self.limit,
            });
        }
        let addr = self.alloc.alloc(cap)?;
        self.stats.allocs += 1;
        self.stats.allocated += cap;
        self.stats.in_use += cap;
        self.stats.high_water = self.stats.high_water.max(self.stats.allocated);
        Ok(addr)
    }
}

impl<A: Allocator> Drop for Inner<A> {
    fn drop(&mut self) {
        self.reclaim();
        for (cap, list) in std::mem::take(&mut self.idle) {
            for addr in list {
                // SAFETY: as in `make_room`: idle, from this allocator, this size.
                unsafe { self.alloc.free(addr, cap) };
            }
        }
        // Buffers still parked may be in use by a GPU: they are left allocated.
    }
}

/// A pool of reusable buffers from one [`Allocator`]. Cloning shares the pool.
pub struct Pool<A: Allocator> {
    inner: Arc<Mutex<Inner<A>>>,
}

impl<A: Allocator> Clone for Pool<A> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<A: Allocator> Pool<A> {
    /// Sizes are rounded up to a multiple of this (64 KiB).
    pub const GRAIN: usize = 64 << 10;

    /// A pool that holds at most `limit` bytes of `alloc`'s memory.
    pub fn new(alloc: A, limit: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                alloc,
                limit,
                idle: BTreeMap::new(),
                parked: Vec::new(),
                stats: PoolStats::default(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<A>> {
        // A panic while the lock was held left the accounting as it was before the call (every
        // update follows the fallible step), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of at least `bytes` bytes: an idle one of the same rounded size, else a new one.
    pub fn get(&self, bytes: usize) -> Result<PoolBuf<A>, GpuError> {
        let cap = bytes.max(1).div_ceil(Self::GRAIN) * Self::GRAIN;
        let mut g = self.lock();
        g.reclaim();
        let addr = g.take(cap)?;
        let memory = g.alloc.memory();
        drop(g);
        Ok(PoolBuf {
            addr,
            len: bytes,
            cap,
            memory,
            pool: Some(self.clone()),
        })
    }

    /// The accounting now (parked buffers whose fence completed are reclaimed first).
    pub fn stats(&self) -> PoolStats {
        let mut g = self.lock();
        g.reclaim();
        g.stats
    }

    fn give_back(&self, addr: u64, cap: usize, fence: Option<Box<dyn Fence>>) {
        let mut g = self.lock();
        g.stats.in_use -= cap;
        match fence {
            None => {
                g.idle.entry(cap).or_default().push(addr);
                g.stats.idle += cap;
            }
            Some(fence) => {
                g.parked.push(Parked { addr, cap, fence });
                g.stats.pending += cap;
            }
        }
    }
}

/// A buffer from a [`Pool`]. Dropping it returns it for reuse at once (nothing on a GPU used
/// it); [`PoolBuf::release_after`] returns it once a fence completes.
pub struct PoolBuf<A: Allocator> {
    addr: u64,
    len: usize,
    cap: usize,
    memory: Memory,
    pool: Option<Pool<A>>,
}

impl<A: Allocator> PoolBuf<A> {
    /// The address (host or device, per [`PoolBuf::memory`]).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether zero bytes were asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes reserved (the request rounded up to the grain).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Where the memory is.
    pub fn memory(&self) -> Memory {
        self.memory
    }

    /// The buffer as bytes, for the CPU to fill or read: `None` for device memory.
    pub fn host_slice_mut(&mut self) -> Option<&mut [u8]> {
        match self.memory {
            // SAFETY: host memory of at least `len` bytes, owned by this buffer alone until it
            // goes back to the pool, and borrowed mutably through `self`.
            Memory::PinnedHost => Some(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }),
            Memory::Device { .. } => None,
        }
    }

    /// Returns the buffer to the pool once `fence` completes (the consumer's last use of it).
    pub fn release_after(mut self, fence: Box<dyn Fence>) {
        if let Some(pool) = self.pool.take() {
            pool.give_back(self.addr, self.cap, Some(fence));
        }
    }
}

impl<A: Allocator> Drop for PoolBuf<A> {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give_back(self.addr, self.cap, None);
        }
    }
}

/// Page-locked host memory from the driver (`cuMemHostAlloc` with `PORTABLE`, so every context
/// can DMA from it; not write-combined, because the CPU reads it for checksums and decoding).
pub struct CudaHost {
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl CudaHost {
    /// Pinned memory registered with `ctx`'s driver.
    pub fn new(ctx: Arc<cudarc::driver::CudaContext>) -> Self {
        Self { ctx }
    }
}

impl Allocator for CudaHost {
    fn memory(&self) -> Memory {
        Memory::PinnedHost
    }

    fn alloc(&mut self, bytes: usize) -> Result<u64, GpuError> {
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: a plain allocation call with a live, current context.
        let p = unsafe { cudarc::driver::result::malloc_host(bytes, cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(driver_err("allocating pinned host memory"))?;
        Ok(p as u64)
    }

    unsafe fn free(&mut self, addr: u64, _bytes: usize) {
        if let Ok(_current) = crate::current::enter(&self.ctx) {
            // SAFETY: the caller guarantees `addr` came from `malloc_host` and is unused.
            let _ = unsafe { cudarc::driver::result::free_host(addr as *mut std::ffi::c_void) };
        }
    }
}

/// Device memory from the driver (`cuMemAlloc`), on the context's GPU.
pub struct CudaDevice {
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl CudaDevice {
    /// Memory on `ctx`'s GPU.
    pub fn new(ctx: Arc<cudarc::driver::CudaContext>) -> Self {
        Self { ctx }
    }
}

impl Allocator for CudaDevice {
    fn memory(&self) -> Memory {
        Memory::Device {
            ordinal: self.ctx.ordinal(),
        }
    }

    fn alloc(&mut self, bytes: usize) -> Result<u64, GpuError> {
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: a plain allocation call with a live, current context.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(driver_err("allocating device memory"))
    }

    unsafe fn free(&mut self, addr: u64, _bytes: usize) {
        if let Ok(_current) = crate::current::enter(&self.ctx) {
            // SAFETY: the caller guarantees `addr` came from `malloc_sync` and is unused.
            let _ = unsafe { cudarc::driver::result::free_sync(addr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU8, Ordering};

    use super::*;

    /// Host memory from the global allocator, with a ledger of what is live, so the tests
    /// see every allocation and free the pool makes.
    #[derive(Clone, Default)]
    struct Fake {
        ledger: Arc<Mutex<FakeLedger>>,
    }

    #[derive(Default)]
    struct FakeLedger {
        live: BTreeMap<u64, usize>,
        fail_next: bool,
    }

    impl Fake {
        fn live_bytes(&self) -> usize {
            self.ledger.lock().unwrap().live.values().sum()
        }
    }

    impl Allocator for Fake {
        fn memory(&self) -> Memory {
            Memory::PinnedHost
        }
        fn alloc(&mut self, bytes: usize) -> Result<u64, GpuError> {
            let mut l = self.ledger.lock().unwrap();
            if std::mem::take(&mut l.fail_next) {
                return Err(GpuError::Driver {
                    doing: "allocating pinned host memory",
                    reason: "CUDA_ERROR_OUT_OF_MEMORY".into(),
                });
            }
            let v = vec![0u8; bytes].into_boxed_slice();
            let addr = Box::into_raw(v) as *mut u8 as u64;
            l.live.insert(addr, bytes);
            Ok(addr)
        }
        unsafe fn free(&mut self, addr: u64, bytes: usize) {
            let mut l = self.ledger.lock().unwrap();
            assert_eq!(
                l.live.remove(&addr),
                Some(bytes),
                "freed {addr:#x} ({bytes} B) not live"
            );
            // SAFETY: made by `alloc` above from a boxed slice of `bytes` bytes.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(addr as *mut u8, bytes)) });
        }
    }

    /// 0 running, 1 complete, 2 failed.
    #[derive(Clone, Default)]
    struct Flag(Arc<AtomicU8>);

    impl Fence for Flag {
        fn is_complete(&self) -> Result<bool, GpuError> {
            match self.0.load(Ordering::SeqCst) {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(GpuError::Driver {
                    doing: "querying an event",
                    reason: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
                }),
            }
        }
    }

    /// `wait` returns once the work completes (here: from another thread, 20 ms later), and
    /// passes on a fence's error instead of waiting for ever.
    #[test]
    fn a_fence_is_waited_for_until_it_completes_or_fails() {
        let flag = Arc::new(AtomicU8::new(0));
        let f = Flag(flag.clone());
        let t0 = std::time::Instant::now();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            flag.store(1, Ordering::SeqCst);
        });
        f.wait().unwrap();
        assert!(t0.elapsed() >= std::time::Duration::from_millis(20));
        setter.join().unwrap();
        let e = Flag(Arc::new(AtomicU8::new(2))).wait().unwrap_err();
        assert!(e.to_string().contains("ILLEGAL_ADDRESS"), "{e}");
    }

    const G: usize = Pool::<Fake>::GRAIN;

    fn consistent(s: &PoolStats, fake: &Fake) {
        assert_eq!(s.allocated, s.in_use + s.pending + s.idle + s.leaked, "{s:?}");
        assert_eq!(s.allocated, fake.live_bytes(), "the ledger disagrees: {s:?}");
    }

    #[test]
    fn buffers_are_reused_by_rounded_size_and_the_books_balance() {
        let fake = Fake::default();
        let pool = Pool::new(fake.clone(), 16 * G);
        let mut a = pool.get(G + 1).unwrap();
        assert_eq!((a.len(), a.capacity()), (G + 1, 2 * G));
        a.host_slice_mut().unwrap().fill(7);
        let addr = a.addr();
        drop(a);
        // Same rounded size: the same memory, no new allocation.
        let b = pool.get(2 * G - 5).unwrap();
        assert_eq!(b.addr(), addr);
        let s = pool.stats();
        assert_eq!((s.allocs, s.reuses, s.in_use, s.idle), (1, 1, 2 * G, 0));
        consistent(&s, &fake);
        // Another size: a new allocation.
        let c = pool.get(3 * G).unwrap();
        assert_ne!(c.addr(), addr);
        drop((b, c));
        let s = pool.stats();
        assert_eq!((s.allocs, s.in_use, s.idle, s.high_water), (2, 0, 5 * G, 5 * G));
        consistent(&s, &fake);
        drop(pool);
        assert_eq!(fake.live_bytes(), 0, "dropping the pool frees its idle buffers");
    }

    /// A pool of 16 G with one G buffer released behind a fence the test completes or fails;
    /// returns the buffer's address too.
    fn one_parked() -> (Fake, Pool<Fake>, u64, Flag) {
        let fake = Fake::default();
        let pool = Pool::new(fake.clone(), 16 * G);
        let a = pool.get(G).unwrap();
        let addr = a.addr();
        let fence = Flag::default();
        a.release_after(Box::new(fence.clone()));
        (fake, pool, addr, fence)
    }

    #[test]
    fn a_released_buffer_comes_back_only_after_its_fence_completes() {
        let (fake, pool, addr, fence) = one_parked();
        let s = pool.stats();
        assert_eq!((s.in_use, s.pending, s.idle), (0, G, 0));
        consistent(&s, &fake);
        // While the consumer's stream still runs, the same size gets other memory.
        let b = pool.get(G).unwrap();
        assert_ne!(b.addr(), addr, "a buffer was reused while the GPU could still read it");
        drop(b);
        fence.0.store(1, Ordering::SeqCst);
        let s = pool.stats();
        assert_eq!((s.pending, s.idle), (0, 2 * G));
        consistent(&s, &fake);
        let mut got = [pool.get(G).unwrap().addr(), 0];
        got[1] = pool.get(G).unwrap().addr();
        assert!(got.contains(&addr), "the fenced buffer was not reused once complete");
    }

    #[test]
    fn a_failed_fence_leaks_its_buffer_rather_than_reuse_it() {
        let (fake, pool, addr, fence) = one_parked();
        fence.0.store(2, Ordering::SeqCst);
        let s = pool.stats();
        assert_eq!((s.pending, s.idle, s.leaked), (0, 0, G));
        consistent(&s, &fake);
        assert_ne!(pool.get(G).unwrap().addr(), addr);
        drop(pool);
        assert_eq!(fake.live_bytes(), G, "only the leaked buffer stays allocated");
    }

    #[test]
    fn the_limit_frees_idle_buffers_of_other_sizes_then_pushes_back() {
        let fake = Fake::default();
        let pool = Pool::new(fake.clone(), 4 * G);
        drop(pool.get(3 * G).unwrap());
        // 3 G idle; 2 G more fits only after the idle 3 G buffer is freed.
        let a = pool.get(2 * G).unwrap();
        let s = pool.stats();
        assert_eq!((s.allocated, s.frees, s.idle), (2 * G, 1, 0));
        consistent(&s, &fake);
        // 2 G in use and 2 G parked: a third is refused, naming what holds the memory.
        let b = pool.get(2 * G).unwrap();
        let fence = Flag::default();
        b.release_after(Box::new(fence.clone()));
        let err = match pool.get(G) {
            Err(e) => e,
            Ok(_) => panic!("the pool went over its limit"),
        };
        assert_eq!(
            err,
            GpuError::PoolExhausted {
                want: G,
                in_use: 2 * G,
                pending: 2 * G,
                limit: 4 * G
            }
        );
        assert!(err.to_string().contains("waiting for the GPU"), "{err}");
        // Once the fence completes, the parked buffer is freed to make room.
        fence.0.store(1, Ordering::SeqCst);
        let c = pool.get(G).unwrap();
        let s = pool.stats();
        assert_eq!((s.allocated, s.in_use), (3 * G, 3 * G));
        consistent(&s, &fake);
        drop((a, c));
    }

    #[test]
    fn an_allocator_failure_is_an_error_and_changes_no_books() {
        let fake = Fake::default();
        let pool = Pool::new(fake.clone(), 16 * G);
        fake.ledger.lock().unwrap().fail_next = true;
        let err = match pool.get(G) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("the failure was not reported"),
        };
        assert!(err.contains("OUT_OF_MEMORY"), "{err}");
        assert_eq!(pool.stats(), PoolStats::default());
        assert!(pool.get(G).is_ok(), "the pool works after a failed allocation");
    }

    #[test]
    fn buffers_outliving_their_pool_handle_still_come_back() {
        let fake = Fake::default();
        let pool = Pool::new(fake.clone(), 16 * G);
        let a = pool.get(G).unwrap();
        drop(pool);
        assert_eq!(fake.live_bytes(), G);
        drop(a);
        assert_eq!(fake.live_bytes(), 0, "the last buffer's return freed the pool");
    }
}
