//! The DLPack protocol's device and stream rules, as plain data, so they are tested without a GPU.
//!
//! A consumer calls `__dlpack_device__()` and then `__dlpack__(stream=S)`. For CUDA, `S` says
//! which of the consumer's streams will use the memory; the producer must order its own
//! pending work (the copy or kernel that filled the buffer) before anything the consumer queues
//! on `S`. The values (DLPack / array API standard):
//!
//! | `stream` | meaning |
//! |---|---|
//! | `None` | the legacy default stream |
//! | `1` | the legacy default stream |
//! | `2` | the per-thread default stream |
//! | `> 2` | a `cudaStream_t` / `CUstream`, as an integer |
//! | `-1` | no synchronisation: the consumer orders the work itself |
//! | `0`, `< -1` | invalid (`0` is ambiguous between the three defaults) |
//!
//! On the CPU only `None` is allowed, as NumPy requires.
//!
//! What the producer then does is [`Export`]: wait for the buffer's ready event on the
//! consumer's stream, and, when the consumer frees the tensor, record a release event on that
//! same stream. The buffer returns to its pool only once that event completes
//! ([`crate::pool::PoolBuf::release_after`]), so memory is never reused while a kernel the
//! trainer queued may still read it.

use crate::GpuError;

/// `kDLCPU`.
pub const KDL_CPU: i32 = 1;
/// `kDLCUDA`.
pub const KDL_CUDA: i32 = 2;
/// `kDLCUDAHost` (pinned host memory).
pub const KDL_CUDA_HOST: i32 = 3;

/// A DLPack device: `(device_type, device_id)` as `__dlpack_device__` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Device {
    /// `kDLCPU`, `kDLCUDA`, ...
    pub kind: i32,
    /// The ordinal (0 on the CPU).
    pub id: i32,
}

impl Device {
    /// The CPU.
    pub const CPU: Device = Device { kind: KDL_CPU, id: 0 };

    /// GPU `ordinal`.
    pub fn cuda(ordinal: usize) -> Device {
        Device {
            kind: KDL_CUDA,
            id: ordinal as i32,
        }
    }
}

/// The consumer's stream, decoded from `__dlpack__`'s `stream` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsumerStream {
    /// No stream: CPU memory.
    Host,
    /// The legacy default stream (`CU_STREAM_LEGACY`, handle 1).
    Legacy,
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`, handle 2).
    PerThread,
    /// A stream the consumer created (its `CUstream` as an integer).
    Handle(u64),
    /// `-1`: the consumer synchronises itself.
    NoSync,
}

impl ConsumerStream {
    /// The stream argument for memory on `device`, or why it is not allowed.
    pub fn parse(device: Device, stream: Option<i64>) -> Result<ConsumerStream, GpuError> {
        match device.kind {
            KDL_CPU | KDL_CUDA_HOST => match stream {
                None => Ok(ConsumerStream::Host),
                Some(s) => Err(invalid(format!(
                    "stream={s} given for a tensor in host memory; only stream=None is allowed there"
                ))),
            },
            KDL_CUDA => match stream {
                None | Some(1) => Ok(ConsumerStream::Legacy),
                Some(2) => Ok(ConsumerStream::PerThread),
                Some(-1) => Ok(ConsumerStream::NoSync),
                Some(0) => Err(invalid(
                    "stream=0 is ambiguous for CUDA (it could mean the legacy, per-thread or default stream); \
                     pass 1, 2 or a stream handle",
                )),
                Some(s) if s > 2 => Ok(ConsumerStream::Handle(s as u64)),
                Some(s) => Err(invalid(format!(
                    "stream={s} is not a valid CUDA stream (valid: None, -1, 1, 2, a handle)"
                ))),
            },
            other => Err(invalid(format!(
                "ramjet exports no tensors on DLPack device type {other}"
            ))),
        }
    }

    /// The driver handle to order work on: `None` when nothing is to be ordered (host memory,
    /// or the consumer's `-1`).
    pub fn handle(self) -> Option<u64> {
        match self {
            ConsumerStream::Host | ConsumerStream::NoSync => None,
            ConsumerStream::Legacy => Some(1),
            ConsumerStream::PerThread => Some(2),
            ConsumerStream::Handle(h) => Some(h),
        }
    }
}

/// An argument of `__dlpack__` refused.
fn invalid(reason: impl Into<String>) -> GpuError {
    GpuError::Invalid {
        what: "DLPack export",
        reason: reason.into(),
    }
}

/// Checks `__dlpack__`'s `dl_device` request against where the tensor is: ramjet never copies
/// between devices on export.
pub fn check_requested_device(have: Device, requested: Option<(i32, i32)>) -> Result<(), GpuError> {
    match requested {
        Some((kind, id)) if (kind, id) != (have.kind, have.id) => Err(invalid(format!(
            "the tensor is on DLPack device ({}, {}); exporting to ({kind}, {id}) would need a copy, \
             which ramjet does not make on export",
            have.kind, have.id
        ))),
        _ => Ok(()),
    }
}

/// The stream operations an export needs, so the protocol logic is tested with a recorder.
pub trait StreamOps: Send + Sync + 'static {
    /// Makes stream `consumer` wait for the buffer's ready event (asynchronously).
    fn wait_ready(&self, consumer: u64) -> Result<(), crate::GpuError>;
    /// Records an event on stream `consumer` now; its fence completes when the work the
    /// consumer queued before this point is done.
    fn record_release(&self, consumer: Option<u64>) -> Result<Box<dyn crate::pool::Fence>, crate::GpuError>;
}

/// One export of a device buffer: ordered after the producer's work on the consumer's stream,
/// released after the consumer's work on it.
pub struct Export {
    stream: ConsumerStream,
}

impl Export {
    /// Starts an export for `__dlpack__(stream=...)`: makes the consumer's stream wait for the
    /// buffer to be ready (unless the consumer asked for no synchronisation).
    ///
    /// `-1` ("the consumer synchronises itself") is refused for pooled device buffers: the
    /// release must be fenced on the stream that actually uses the memory, and `-1` names
    /// none. Recording it on the legacy default stream, as this did, orders nothing after
    /// non-blocking streams (torch's side streams, ramjet's own), so a buffer could be reused
    /// while a kernel still read it (issue 40, item 5).
    pub fn begin(ops: &dyn StreamOps, device: Device, stream: Option<i64>) -> Result<Export, GpuError> {
        let stream = ConsumerStream::parse(device, stream)?;
        if stream == ConsumerStream::NoSync {
            return Err(invalid(
                "stream=-1 is not accepted for ramjet's pooled GPU buffers: pass the stream that will \
                        use the tensor (torch.cuda.current_stream().cuda_stream), so that the buffer is \
                        reused only after that stream's work on it",
            ));
        }
        if let Some(h) = stream.handle() {
            ops.wait_ready(h)?;
        }
        Ok(Export { stream })
    }

    /// The consumer freed the tensor: the fence after which its memory may be reused,
    /// recorded on the consumer's own stream (the one it named in `__dlpack__`).
    pub fn release(&self, ops: &dyn StreamOps) -> Result<Box<dyn crate::pool::Fence>, crate::GpuError> {
        ops.record_release(self.stream.handle())
    }

    /// The consumer's stream as parsed.
    pub fn stream(&self) -> ConsumerStream {
        self.stream
    }
}

/// A pool buffer as [`Shared`] holds it (any allocator's).
pub trait Held: Send + 'static {
    /// Its address.
    fn addr(&self) -> u64;
    /// Returns it to its pool once `fence` completes.
    fn give_back_after(self: Box<Self>, fence: Box<dyn crate::pool::Fence>);
}

impl<A: crate::pool::Allocator> Held for crate::pool::PoolBuf<A> {
    fn addr(&self) -> u64 {
        crate::pool::PoolBuf::addr(self)
    }
    fn give_back_after(self: Box<Self>, fence: Box<dyn crate::pool::Fence>) {
        self.release_after(fence)
    }
}

/// Complete when every fence is; an error in any is the answer.
pub struct AllOf(pub Vec<Box<dyn crate::pool::Fence>>);

impl crate::pool::Fence for AllOf {
    fn is_complete(&self) -> Result<bool, GpuError> {
        for f in &self.0 {
            if !f.is_complete()? {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// A fence that can never be known complete: its buffer is never reused.
struct Unknown(String);

impl crate::pool::Fence for Unknown {
    fn is_complete(&self) -> Result<bool, GpuError> {
        Err(GpuError::Invalid {
            what: "exported buffer",
            reason: self.0.clone(),
        })
    }
}

/// A device buffer handed to consumers through DLPack, as many times as they ask: each export
/// waits for the buffer's ready event on the consumer's stream ([`Export::begin`]), each
/// consumer's release is fenced on its own stream ([`Shared::released`]), and the buffer goes
/// back to its pool only after all of them and the producer's own work (`idle`) completed,
/// when the last holder drops this. A release that cannot be recorded keeps the buffer out of
/// the pool for good (never reused while something may read it).
pub struct Shared {
    buf: Option<Box<dyn Held>>,
    ops: Box<dyn StreamOps>,
    device: Device,
    fences: std::sync::Mutex<Vec<Box<dyn crate::pool::Fence>>>,
}

impl Shared {
    /// `buf` on `device`, ready once `ops`' ready event is; `idle` completes when the producer's
    /// work on it does (the buffer's fence if no consumer ever takes it).
    pub fn new(
        buf: Box<dyn Held>,
        ops: Box<dyn StreamOps>,
        idle: Box<dyn crate::pool::Fence>,
        device: Device,
    ) -> Shared {
        Shared {
            buf: Some(buf),
            ops,
            device,
            fences: std::sync::Mutex::new(vec![idle]),
        }
    }

    /// The buffer's address.
    pub fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.addr())
    }

    /// Its device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// One export for `__dlpack__(stream=...)` ([`Export::begin`]).
    pub fn export(&self, stream: Option<i64>) -> Result<Export, GpuError> {
        Export::begin(self.ops.as_ref(), self.device, stream)
    }

    /// The consumer of `export` freed its tensor: the buffer waits for its stream too.
    pub fn released(&self, export: &Export) {
        let fence = match export.release(self.ops.as_ref()) {
            Ok(f) => f,
            Err(e) => Box::new(Unknown(format!("a consumer's release could not be recorded: {e}"))),
        };
        self.fences.lock().unwrap_or_else(|p| p.into_inner()).push(fence);
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let fences = std::mem::take(&mut *self.fences.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(b) = self.buf.take() {
            b.give_back_after(Box::new(AllOf(fences)));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::pool::{Allocator, Fence, Memory, Pool};
    use crate::GpuError;

    #[test]
    fn the_stream_argument_follows_the_standard() {
        let gpu = Device::cuda(3);
        let cases: [(Option<i64>, Result<ConsumerStream, &str>); 8] = [
            (None, Ok(ConsumerStream::Legacy)),
            (Some(1), Ok(ConsumerStream::Legacy)),
            (Some(2), Ok(ConsumerStream::PerThread)),
            (Some(0x7f00_dead_b000), Ok(ConsumerStream::Handle(0x7f00_dead_b000))),
            (Some(-1), Ok(ConsumerStream::NoSync)),
            (Some(0), Err("ambiguous")),
            (Some(-2), Err("not a valid CUDA stream")),
            (Some(i64::MIN), Err("not a valid CUDA stream")),
        ];
        for (arg, want) in cases {
            match (ConsumerStream::parse(gpu, arg), want) {
                (Ok(got), Ok(w)) => assert_eq!(got, w, "stream={arg:?}"),
                (Err(e), Err(w)) => assert!(e.to_string().contains(w), "stream={arg:?}: {e}"),
                (got, w) => panic!("stream={arg:?}: got {got:?}, want {w:?}"),
            }
        }
        assert_eq!(ConsumerStream::parse(Device::CPU, None), Ok(ConsumerStream::Host));
        for s in [-1, 0, 1, 2, 12345] {
            let e = ConsumerStream::parse(Device::CPU, Some(s)).unwrap_err();
            assert!(e.to_string().contains("only stream=None"), "{e}");
        }
        assert!(ConsumerStream::parse(Device { kind: 10, id: 0 }, None).is_err());
    }

    #[test]
    fn a_device_request_elsewhere_is_refused_not_copied() {
        assert!(check_requested_device(Device::cuda(1), None).is_ok());
        assert!(check_requested_device(Device::cuda(1), Some((KDL_CUDA, 1))).is_ok());
        let e = check_requested_device(Device::cuda(1), Some((KDL_CUDA, 0))).unwrap_err();
        assert!(
            e.to_string().contains("(2, 1)") && e.to_string().contains("(2, 0)"),
            "{e}"
        );
        assert!(check_requested_device(Device::CPU, Some((KDL_CUDA, 0))).is_err());
    }

    /// Records the calls, and hands out fences the test completes.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<String>>,
        fences: Mutex<Vec<std::sync::Arc<std::sync::atomic::AtomicBool>>>,
    }

    struct Flag(std::sync::Arc<std::sync::atomic::AtomicBool>);

    impl Fence for Flag {
        fn is_complete(&self) -> Result<bool, GpuError> {
            Ok(self.0.load(std::sync::atomic::Ordering::SeqCst))
        }
    }

    impl StreamOps for Recorder {
        fn wait_ready(&self, consumer: u64) -> Result<(), GpuError> {
            self.calls.lock().unwrap().push(format!("wait {consumer:#x}"));
            Ok(())
        }
        fn record_release(&self, consumer: Option<u64>) -> Result<Box<dyn Fence>, GpuError> {
            self.calls.lock().unwrap().push(format!("release {consumer:?}"));
            let f = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            self.fences.lock().unwrap().push(f.clone());
            Ok(Box::new(Flag(f)))
        }
    }

    struct Heap;
    impl Allocator for Heap {
        fn memory(&self) -> Memory {
            Memory::Device { ordinal: 0 }
        }
        fn alloc(&mut self, bytes: usize) -> Result<u64, GpuError> {
            Ok(Box::into_raw(vec![0u8; bytes].into_boxed_slice()) as *mut u8 as u64)
        }
        unsafe fn free(&mut self, addr: u64, bytes: usize) {
            // SAFETY: made by `alloc` above from a boxed slice of `bytes` bytes.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(addr as *mut u8, bytes)) });
        }
    }

    #[test]
    fn each_stream_argument_waits_and_releases_on_the_consumer_s_stream() {
        let cases: [(Option<i64>, &[&str]); 3] = [
            (None, &["wait 0x1", "release Some(1)"]),
            (Some(2), &["wait 0x2", "release Some(2)"]),
            (Some(0xabc000), &["wait 0xabc000", "release Some(11255808)"]),
        ];
        for (arg, want) in cases {
            let ops = Recorder::default();
            let e = Export::begin(&ops, Device::cuda(0), arg).unwrap();
            let _fence = e.release(&ops).unwrap();
            assert_eq!(*ops.calls.lock().unwrap(), want, "stream={arg:?}");
        }
        // -1 names no stream to fence the release on (the legacy stream orders nothing after
        // non-blocking ones): refused, saying what to pass, before any stream is touched.
        let ops = Recorder::default();
        let e = Export::begin(&ops, Device::cuda(0), Some(-1))
            .err()
            .expect("-1 refused");
        assert!(
            e.to_string().contains("stream=-1") && e.to_string().contains("current_stream"),
            "{e}"
        );
        assert!(Export::begin(&ops, Device::cuda(0), Some(0)).is_err());
        assert!(
            ops.calls.lock().unwrap().is_empty(),
            "a refused export touched a stream"
        );
    }

    /// A buffer shared with two consumers goes back to its pool only after the producer's work
    /// and both consumers' streams passed their releases, and only when the last holder
    /// dropped it.
    #[test]
    fn a_shared_buffer_waits_for_every_consumer_and_the_producer() {
        let pool = Pool::new(Heap, 1 << 30);
        let ops = std::sync::Arc::new(Recorder::default());
        struct Ops(std::sync::Arc<Recorder>);
        impl StreamOps for Ops {
            fn wait_ready(&self, c: u64) -> Result<(), GpuError> {
                self.0.wait_ready(c)
            }
            fn record_release(&self, c: Option<u64>) -> Result<Box<dyn Fence>, GpuError> {
                self.0.record_release(c)
            }
        }
        let idle = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let buf = pool.get(100).unwrap();
        let addr = buf.addr();
        let shared = Shared::new(
            Box::new(buf),
            Box::new(Ops(ops.clone())),
            Box::new(Flag(idle.clone())),
            Device::cuda(0),
        );
        assert_eq!(shared.addr(), addr);
        let a = shared.export(Some(0x7000)).unwrap();
        let b = shared.export(None).unwrap();
        assert!(shared.export(Some(-1)).is_err());
        shared.released(&a);
        shared.released(&b);
        drop(shared);
        assert_eq!(
            *ops.calls.lock().unwrap(),
            ["wait 0x7000", "wait 0x1", "release Some(28672)", "release Some(1)"]
        );
        let set =
            |f: &std::sync::Arc<std::sync::atomic::AtomicBool>| f.store(true, std::sync::atomic::Ordering::SeqCst);
        for step in 0..3 {
            assert_eq!(
                pool.stats().pending,
                Pool::<Heap>::GRAIN,
                "reusable after {step} of 3 fences"
            );
            match step {
                0 => set(&idle),
                _ => set(&ops.fences.lock().unwrap()[step - 1]),
            }
        }
        assert_eq!(pool.stats().pending, 0);
        assert_eq!(pool.get(100).unwrap().addr(), addr);
    }

    #[test]
    fn an_exported_buffer_returns_to_its_pool_after_the_consumer_s_work() {
        let pool = Pool::new(Heap, 1 << 30);
        let ops = Recorder::default();
        let buf = pool.get(1000).unwrap();
        let addr = buf.addr();
        let export = Export::begin(&ops, Device::cuda(0), Some(0x5000)).unwrap();
        // The consumer frees the tensor while its kernels still run.
        buf.release_after(export.release(&ops).unwrap());
        assert_eq!(pool.stats().pending, Pool::<Heap>::GRAIN);
        let next = pool.get(1000).unwrap();
        assert_ne!(
            next.addr(),
            addr,
            "reused before the consumer's stream passed the release"
        );
        ops.fences.lock().unwrap()[0].store(true, std::sync::atomic::Ordering::SeqCst);
        drop(next);
        let s = pool.stats();
        assert_eq!((s.pending, s.idle), (0, 2 * Pool::<Heap>::GRAIN));
    }
}
