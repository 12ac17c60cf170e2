//! Copies and GPU work on two streams joined by events, over a ring of device staging slots
//! (issue 40, item 6): the host-to-device copy of batch N+1 runs on the copy stream while the
//! work of batch N (the fused kernel; nvJPEG's decode later) runs on the compute stream, and the
//! trainer's stream waits only for its own batch's `done` event.
//!
//! Per batch, [`Pipeline::submit`] queues:
//!
//! ```text
//! copy stream:     wait(slot's last reader done) -> H2D into slot -> record copied
//! compute stream:  wait(copied) -> work(slot) -> record done, record slot's reader done
//! ```
//!
//! so a slot is never overwritten while the work of the batch before it still reads it (the
//! copy waits for it), work never starts before its bytes arrived (it waits for `copied`), and
//! nothing waits on the host. With one slot every copy waits for the previous batch's work;
//! with two (the default) the copy of one batch overlaps the work of the one before.
//!
//! The ordering is written once, over the [`Streams`] trait: [`CudaStreams`] on a GPU, and a
//! timeline fake in the tests that checks the overlap and the hazards on a machine without one.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::gpu::Event;
use crate::pool::{CudaDevice, PoolBuf};
use crate::{driver_err as err, GpuError};

/// The stream operations the pipeline orders its work with.
pub trait Streams {
    /// A stream handle.
    type Stream: Copy;
    /// An event recorded on a stream.
    type Event;
    /// An event that completes when the work queued on `s` so far does.
    fn record(&self, s: Self::Stream) -> Result<Self::Event, GpuError>;
    /// Makes `s` wait for `e` before its later work (no host wait).
    fn wait(&self, s: Self::Stream, e: &Self::Event) -> Result<(), GpuError>;
    /// Queues a copy of `bytes` bytes from pinned host address `src` to device address `dst`.
    ///
    /// # Safety
    /// `src` is pinned host memory of at least `bytes` bytes and `dst` device memory of at
    /// least as many, both left alone until an event recorded afterwards on `s` completes.
    unsafe fn copy(&self, s: Self::Stream, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError>;
}

/// What one submitted batch left to wait for.
pub struct Submitted<E> {
    /// The host buffer's bytes are on the device: it may be refilled after this.
    pub copied: E,
    /// The batch's work is done: the consumer's stream waits for this before reading its output.
    pub done: E,
    /// The staging slot the batch went through.
    pub slot: usize,
}

struct Slot<E> {
    addr: u64,
    len: usize,
    /// The compute stream's event after the last work that read this slot.
    reader_done: Option<E>,
}

/// The ordering of copies and work over a ring of staging slots (see the module's text).
pub struct Pipeline<S: Streams> {
    api: S,
    copy: S::Stream,
    compute: S::Stream,
    slots: Vec<Slot<S::Event>>,
    next: usize,
}

impl<S: Streams> Pipeline<S> {
    /// A pipeline over device staging slots `(address, bytes)`, at least one.
    pub fn new(api: S, copy: S::Stream, compute: S::Stream, slots: &[(u64, usize)]) -> Result<Self, GpuError> {
        if slots.is_empty() {
            return Err(GpuError::Driver {
                doing: "making a copy/compute pipeline",
                reason: "no staging slot".into(),
            });
        }
        Ok(Pipeline {
            api,
            copy,
            compute,
            slots: slots
                .iter()
                .map(|&(addr, len)| Slot {
                    addr,
                    len,
                    reader_done: None,
                })
                .collect(),
            next: 0,
        })
    }

    /// Staging slots in the ring.
    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    /// The stream operations (for the caller's own work).
    pub fn api(&self) -> &S {
        &self.api
    }

    /// Queues one batch: `bytes` bytes of pinned host memory at `src` copied into the next slot
    /// on the copy stream, then `work(compute stream, slot address, bytes)` on the compute
    /// stream once they arrived. A batch larger than a slot is refused before anything is queued.
    ///
    /// # Safety
    /// `src` is pinned host memory of at least `bytes` bytes that stays untouched until the
    /// returned `copied` event completes.
    pub unsafe fn submit(
        &mut self,
        src: u64,
        bytes: usize,
        work: impl FnOnce(S::Stream, u64, usize) -> Result<(), GpuError>,
    ) -> Result<Submitted<S::Event>, GpuError> {
        let i = self.next;
        let slot = &mut self.slots[i];
        if bytes > slot.len {
            return Err(GpuError::Driver {
                doing: "staging a batch",
                reason: format!("{bytes} B do not fit a staging slot of {} B", slot.len),
            });
        }
        if let Some(e) = &slot.reader_done {
            self.api.wait(self.copy, e)?;
        }
        // SAFETY: the caller vouches for `src`; the slot holds `bytes` (checked) and no queued
        // work reads it once the copy stream passed the wait above.
        unsafe { self.api.copy(self.copy, slot.addr, src, bytes)? };
        let copied = self.api.record(self.copy)?;
        self.api.wait(self.compute, &copied)?;
        work(self.compute, slot.addr, bytes)?;
        let done = self.api.record(self.compute)?;
        slot.reader_done = Some(self.api.record(self.compute)?);
        self.next = (i + 1) % self.slots.len();
        Ok(Submitted { copied, done, slot: i })
    }

    /// Each slot's event after its last reader (to release the slots' memory after).
    pub fn into_last_readers(self) -> Vec<Option<S::Event>> {
        self.slots.into_iter().map(|s| s.reader_done).collect()
    }
}

/// [`Streams`] on a GPU: driver streams and events of one context.
pub struct CudaStreams {
    ctx: Arc<CudaContext>,
}

impl CudaStreams {
    /// Stream operations in `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Self {
        CudaStreams { ctx }
    }
}

impl Streams for CudaStreams {
    type Stream = u64;
    type Event = Event;

    fn record(&self, s: u64) -> Result<Event, GpuError> {
        Event::record(&self.ctx, s)
    }

    fn wait(&self, s: u64, e: &Event) -> Result<(), GpuError> {
        e.make_wait(s)
    }

    unsafe fn copy(&self, s: u64, dst: u64, src: u64, bytes: usize) -> Result<(), GpuError> {
        let _current = crate::current::enter(&self.ctx)?;
        // SAFETY: the caller vouches for both ranges and for leaving them alone until the copy
        // completes; `src` is pinned, so the copy is asynchronous.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const std::ffi::c_void, bytes, s as sys::CUstream).result() }
            .map_err(err("queueing a host-to-device copy"))
    }
}

/// A [`Pipeline`] on a GPU that owns its staging buffers: dropped, each goes back to its pool
/// once the last work that read it completes.
pub struct GpuPipeline {
    inner: Option<Pipeline<CudaStreams>>,
    bufs: Vec<PoolBuf<CudaDevice>>,
}

impl GpuPipeline {
    /// A pipeline on `copy` and `compute` (streams of `ctx`) over `bufs` as its slots.
    pub fn new(
        ctx: Arc<CudaContext>,
        copy: u64,
        compute: u64,
        bufs: Vec<PoolBuf<CudaDevice>>,
    ) -> Result<Self, GpuError> {
        let slots: Vec<(u64, usize)> = bufs.iter().map(|b| (b.addr(), b.len())).collect();
        Ok(GpuPipeline {
            inner: Some(Pipeline::new(CudaStreams::new(ctx), copy, compute, &slots)?),
            bufs,
        })
    }

    /// The ordering itself.
    pub fn pipeline(&mut self) -> &mut Pipeline<CudaStreams> {
        self.inner.as_mut().expect("present until dropped")
    }
}

impl Drop for GpuPipeline {
    fn drop(&mut self) {
        let readers = self.inner.take().map(Pipeline::into_last_readers).unwrap_or_default();
        for (buf, reader) in self.bufs.drain(..).zip(readers) {
            match reader {
                Some(e) => buf.release_after(Box::new(e)),
                None => drop(buf),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A timeline: every stream runs its operations in order, each starting when the stream's
    /// previous one ended and every event it was told to wait for completed. Events are the
    /// times they complete. Work reads a slot for a given duration.
    #[derive(Default)]
    struct Timeline {
        ends: RefCell<[f64; 2]>,
        log: RefCell<Vec<Op>>,
        copy_ms_per_mb: f64,
    }

    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Kind {
        Copy,
        Work,
    }

    #[derive(Debug, Clone, Copy)]
    struct Op {
        kind: Kind,
        batch: usize,
        slot_addr: u64,
        start: f64,
        end: f64,
    }

    impl Timeline {
        fn run(&self, s: usize, kind: Kind, batch: usize, slot_addr: u64, ms: f64) {
            let mut ends = self.ends.borrow_mut();
            let start = ends[s];
            ends[s] = start + ms;
            self.log.borrow_mut().push(Op {
                kind,
                batch,
                slot_addr,
                start,
                end: start + ms,
            });
        }
    }

    impl Streams for &Timeline {
        type Stream = usize;
        type Event = f64;
        fn record(&self, s: usize) -> Result<f64, GpuError> {
            Ok(self.ends.borrow()[s])
        }
        fn wait(&self, s: usize, e: &f64) -> Result<(), GpuError> {
            let mut ends = self.ends.borrow_mut();
            ends[s] = ends[s].max(*e);
            Ok(())
        }
        unsafe fn copy(&self, s: usize, dst: u64, _src: u64, bytes: usize) -> Result<(), GpuError> {
            let batch = self.log.borrow().iter().filter(|o| o.kind == Kind::Copy).count();
            self.run(s, Kind::Copy, batch, dst, bytes as f64 / 1e6 * self.copy_ms_per_mb);
            Ok(())
        }
    }

    const COPY: usize = 0;
    const COMPUTE: usize = 1;

    /// `n` batches of 1 MB through `depth` slots, work taking `work_ms(batch)`; the consumer
    /// (the trainer) waits for each `done` and trains for `train_ms`. Returns the log and when
    /// each batch's done event completed.
    fn drive(depth: usize, n: usize, copy_ms: f64, work_ms: impl Fn(usize) -> f64) -> (Vec<Op>, Vec<f64>) {
        let t = Timeline {
            copy_ms_per_mb: copy_ms,
            ..Timeline::default()
        };
        let slots: Vec<(u64, usize)> = (0..depth).map(|i| (0x1000 * (i as u64 + 1), 1 << 20)).collect();
        let mut p = Pipeline::new(&t, COPY, COMPUTE, &slots).unwrap();
        let mut done = Vec::new();
        for b in 0..n {
            // SAFETY: the fake copies nothing.
            let s = unsafe {
                p.submit(0xdead, 1_000_000, |stream, addr, _| {
                    assert_eq!(stream, COMPUTE);
                    t.run(stream, Kind::Work, b, addr, work_ms(b));
                    Ok(())
                })
            }
            .unwrap();
            assert_eq!(s.slot, b % depth);
            assert!(s.copied <= s.done);
            done.push(s.done);
        }
        let log = t.log.borrow().clone();
        (log, done)
    }

    fn ops(log: &[Op], kind: Kind) -> Vec<Op> {
        log.iter().filter(|o| o.kind == kind).copied().collect()
    }

    #[test]
    fn the_copy_of_the_next_batch_overlaps_the_work_of_this_one() {
        let (log, done) = drive(2, 8, 1.0, |_| 2.0);
        let (copies, works) = (ops(&log, Kind::Copy), ops(&log, Kind::Work));
        for b in 1..8 {
            assert!(
                copies[b].start < works[b - 1].end,
                "batch {b}'s copy waited for batch {}'s work: {:?} {:?}",
                b - 1,
                copies[b],
                works[b - 1]
            );
        }
        // Work-bound: one copy, then the kernels back to back.
        assert_eq!(*done.last().unwrap(), 1.0 + 8.0 * 2.0);
        // One slot serialises copy and work: every batch pays both.
        let (log1, done1) = drive(1, 8, 1.0, |_| 2.0);
        assert_eq!(*done1.last().unwrap(), 8.0 * 3.0);
        let (c1, w1) = (ops(&log1, Kind::Copy), ops(&log1, Kind::Work));
        for b in 1..8 {
            assert!(c1[b].start >= w1[b - 1].end);
        }
    }

    #[test]
    fn a_slot_is_never_overwritten_while_work_reads_it_and_work_never_runs_before_its_bytes() {
        let mut s = 0x2545f4914f6cdd1du64;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 1000) as f64 / 100.0
        };
        let durations: Vec<f64> = (0..200).map(|_| rnd()).collect();
        for depth in [1, 2, 3] {
            for copy_ms in [0.1, 1.0, 7.0] {
                let (log, done) = drive(depth, 200, copy_ms, |b| durations[b]);
                let (copies, works) = (ops(&log, Kind::Copy), ops(&log, Kind::Work));
                for b in 0..200 {
                    assert_eq!(works[b].slot_addr, copies[b].slot_addr);
                    assert!(
                        works[b].start >= copies[b].end,
                        "depth {depth}: batch {b}'s work before its copy"
                    );
                    assert_eq!(done[b], works[b].end);
                    // Every earlier work on the same slot ended before this copy began.
                    for w in works[..b].iter().filter(|w| w.slot_addr == copies[b].slot_addr) {
                        assert!(
                            copies[b].start >= w.end,
                            "depth {depth}, copy {copy_ms} ms: batch {b} overwrote slot {:#x} while batch {} read it",
                            w.slot_addr,
                            w.batch
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_batch_larger_than_a_slot_is_refused_before_anything_is_queued() {
        let t = Timeline::default();
        let mut p = Pipeline::new(&t, COPY, COMPUTE, &[(0x1000, 100)]).unwrap();
        // SAFETY: the fake copies nothing.
        let e = unsafe { p.submit(0, 101, |_, _, _| panic!("work queued")) }
            .err()
            .unwrap();
        assert!(
            e.to_string().contains("101 B do not fit a staging slot of 100 B"),
            "{e}"
        );
        assert!(t.log.borrow().is_empty());
        assert!(Pipeline::new(&t, COPY, COMPUTE, &[]).is_err());
    }
}
