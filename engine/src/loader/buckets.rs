//! Aspect-ratio buckets (`buckets=[(h, w), ...]`): each sample goes to the bucket whose
//! aspect ratio is nearest its own (from its `width` and `height` columns, which `pack`
//! records: nothing is decoded to choose), and every batch is `batch_size` samples of one
//! bucket, decoded to that bucket's size (`docs/order.md`, "Aspect-ratio buckets").
//!
//! A batch leaves when its bucket fills, so batches leave out of read order. Every consumer
//! yields the same number of batches in an epoch, so no rank of a DDP job waits at a step the
//! others never take: `N = (least - K (B - 1)) / B`, where `least` is the smallest share any
//! consumer has of the epoch, `K` the buckets and `B` the batch size. Whatever the mix of
//! ratios, a share of `least` samples fills at least `N` buckets (each bucket leaves fewer than
//! `B` behind), so every consumer reaches `N`; what it has read past that, and what is left in
//! its buckets, sits out the epoch (at most `K (B - 1)` samples plus its share's excess over
//! `least`; [`crate::metrics::Metrics::samples_left_out`] counts them). The `N`-th batch leaves
//! when the consumer's share is all read, with the epoch's end state, so that the job's state
//! after it starts the next epoch.
//!
//! The state after each batch ([`BucketProgress`]) stands at the first sample still waiting in
//! a bucket and lists the waiting ones: a resumed consumer reads again from there, keeps only
//! those, and goes on exactly as it would have.

use std::sync::Arc;

use super::cut::{Cut, CutBatch, Read};
use super::EpochEnd;
use crate::error::{Error, Location, Result};
use crate::format::{Schema, ValueRef};
use crate::image::ImageSpec;
use crate::metrics::Metrics;
use crate::stream::{least_share, Audit, BucketProgress, Sample, StreamState};

/// The most buckets.
pub const BUCKETS_MAX: usize = 256;

/// Batches every consumer yields in an epoch whose least share is `least` samples, with
/// `buckets` buckets of `batch_size` (see the module's documentation).
pub fn epoch_batches(least: u64, buckets: usize, batch_size: usize) -> u64 {
    let bs = batch_size.max(1) as u64;
    least.saturating_sub((buckets as u64).saturating_mul(bs - 1)) / bs
}

/// The buckets' sizes, `(height, width)`, and which one a sample of a given size goes to.
#[derive(Debug, Clone)]
pub struct BucketSizes {
    sizes: Vec<(u32, u32)>,
    log_ratios: Vec<f64>,
}

impl BucketSizes {
    /// Buckets of these `(height, width)` sizes: 1 to [`BUCKETS_MAX`] of them, each side at
    /// least 1 pixel, no size twice.
    pub fn new(sizes: &[(u32, u32)]) -> Result<BucketSizes> {
        if sizes.is_empty() || sizes.len() > BUCKETS_MAX {
            return Err(Error::invalid(
                "buckets",
                format!("{} buckets; give 1 to {BUCKETS_MAX} (height, width) sizes", sizes.len()),
            ));
        }
        for (i, &(h, w)) in sizes.iter().enumerate() {
            if h == 0 || w == 0 {
                return Err(Error::invalid(
                    format!("buckets[{i}]"),
                    format!("({h}, {w}) has a side of 0"),
                ));
            }
            if sizes[..i].contains(&(h, w)) {
                return Err(Error::invalid(
                    format!("buckets[{i}]"),
                    format!("({h}, {w}) is given twice"),
                ));
            }
        }
        Ok(BucketSizes {
            log_ratios: sizes.iter().map(|&(h, w)| (w as f64 / h as f64).ln()).collect(),
            sizes: sizes.to_vec(),
        })
    }

    /// The sizes, `(height, width)`.
    pub fn sizes(&self) -> &[(u32, u32)] {
        &self.sizes
    }

    /// The bucket nearest an image of `width` x `height` by aspect ratio (on a log scale, so
    /// 2:1 and 1:2 are as far from 1:1); ties go to the bucket given first.
    pub fn nearest(&self, width: u64, height: u64) -> usize {
        let r = (width as f64 / height as f64).ln();
        let mut best = (0, f64::INFINITY);
        for (i, lr) in self.log_ratios.iter().enumerate() {
            let d = (r - lr).abs();
            if d < best.1 {
                best = (i, d);
            }
        }
        best.0
    }
}

/// A sample waiting in its bucket.
struct Held {
    sample: Sample,
    url: String,
    /// Its index in this consumer's deal.
    k: u64,
    /// The stream's audit before it.
    audit_before: Audit,
    /// Its audit hash.
    hash: u64,
}

/// This consumer's buckets through the epochs (see the module's documentation).
pub(super) struct Fill {
    sizes: BucketSizes,
    specs: Vec<Arc<ImageSpec>>,
    bs: usize,
    /// The `width` and `height` columns.
    cols: (usize, usize),
    metrics: Arc<Metrics>,
    /// The epoch being filled.
    epoch: Option<u64>,
    held: Vec<Vec<Held>>,
    /// The epoch's batches per consumer, and those this one yielded.
    batches: u64,
    emitted: u64,
    /// The epoch's last batch, held until the consumer's share is all read.
    last: Option<CutBatch>,
    /// A resumed consumer's buckets (its epoch and progress), until that epoch starts.
    resumed: Option<(u64, BucketProgress)>,
    /// Re-reading after a resume: below `upto`, only the `pending` samples go back in.
    skip: Option<(u64, Vec<u64>)>,
}

impl Fill {
    /// Buckets of `sizes` over `spec` (each bucket's batches decoded at its size), for samples
    /// of `schema`; `resume` is the consumer's saved state, if it resumes from one.
    pub fn new(
        sizes: &[(u32, u32)],
        spec: &ImageSpec,
        bs: usize,
        schema: &Schema,
        metrics: Arc<Metrics>,
        resume: Option<&StreamState>,
    ) -> Result<Fill> {
        let sizes = BucketSizes::new(sizes)?;
        let col = |name: &str| {
            schema
                .index_of(name)
                .filter(|&i| schema.columns[i].ty == crate::format::ColumnType::Int64)
        };
        let (Some(w), Some(h)) = (col("width"), col("height")) else {
            return Err(Error::invalid(
                "buckets",
                "the dataset has no int64 width and height columns to choose buckets by (ramjet pack records them for images)",
            ));
        };
        let specs = sizes
            .sizes()
            .iter()
            .map(|&(height, width)| {
                Arc::new(ImageSpec {
                    height,
                    width,
                    ..spec.clone()
                })
            })
            .collect();
        let resumed = match resume.and_then(|s| s.buckets.clone().map(|b| (s, b))) {
            None => None,
            Some((s, b)) => {
                let dealt = s.base.deal(s.len, s.consumer, &s.rule()).len();
                b.validate(s.delivered, dealt)
                    .map_err(|why| Error::invalid("resume state", why))?;
                Some((s.base.epoch, b))
            }
        };
        Ok(Fill {
            held: (0..sizes.sizes().len()).map(|_| Vec::new()).collect(),
            sizes,
            specs,
            bs,
            cols: (w, h),
            metrics,
            epoch: None,
            batches: 0,
            emitted: 0,
            last: None,
            resumed,
            skip: None,
        })
    }

    /// Samples waiting in the buckets.
    fn waiting(&self) -> u64 {
        self.held.iter().map(|b| b.len() as u64).sum()
    }

    /// A new epoch begins with the state after its first sample: what is still in the
    /// buckets sits it out, and its batch count is set (the saved one, for a resumed epoch).
    fn begin(&mut self, epoch: u64, state: &StreamState) {
        Metrics::add(&self.metrics.samples_left_out, self.waiting());
        self.held.iter_mut().for_each(Vec::clear);
        self.last = None;
        self.epoch = Some(epoch);
        match self.resumed.take() {
            Some((e, b)) if e == epoch => {
                (self.batches, self.emitted) = (b.batches, b.emitted);
                self.skip = Some((b.upto, b.pending));
            }
            _ => {
                let least = least_share(&state.base, state.len, &state.rule());
                self.batches = epoch_batches(least, self.held.len(), self.bs);
                self.emitted = 0;
                self.skip = None;
            }
        }
    }

    /// Takes one more sample: a batch when its bucket fills (the epoch's last waits for the end
    /// of the share), an epoch's end when the share is read. A sample without a positive width
    /// and height is an error naming it.
    pub fn push(&mut self, r: Read) -> Result<Option<Cut>> {
        let Read {
            sample,
            url,
            state,
            left,
        } = r;
        if self.epoch != Some(sample.epoch) {
            self.begin(sample.epoch, &state);
        }
        let k = state.delivered - 1;
        let replayed = match &self.skip {
            Some((upto, pending)) if k < *upto => pending.binary_search(&k).is_err(),
            _ => false,
        };
        if self.skip.as_ref().is_some_and(|(upto, _)| k + 1 >= *upto) {
            self.skip = None;
        }
        if !replayed {
            if self.emitted >= self.batches {
                Metrics::add(&self.metrics.samples_left_out, 1);
            } else {
                let b = self.bucket_of(&sample, &url)?;
                let hash = Audit::sample_hash(sample.id);
                let audit_before = Audit {
                    count: state.audit.count.wrapping_sub(1),
                    digest: state.audit.digest.wrapping_sub(hash),
                };
                self.held[b].push(Held {
                    sample,
                    url,
                    k,
                    audit_before,
                    hash,
                });
                if self.held[b].len() == self.bs {
                    if let Some(cut) = self.full(b, &state) {
                        return Ok(Some(cut));
                    }
                }
            }
        }
        if left == 0 {
            return Ok(Some(self.end(state)));
        }
        Ok(None)
    }

    /// Bucket `b` is full: its batch, or `None` when it is the epoch's last (held for the end).
    fn full(&mut self, b: usize, state: &StreamState) -> Option<Cut> {
        let held = std::mem::take(&mut self.held[b]);
        self.emitted += 1;
        let (samples, urls) = held.into_iter().map(|h| (h.sample, h.url)).unzip();
        let batch = CutBatch {
            epoch: self.epoch.unwrap_or(state.base.epoch),
            samples,
            urls,
            state: self.saved(state),
            end_of_epoch: false,
            spec: Some(self.specs[b].clone()),
        };
        if self.emitted == self.batches {
            self.last = Some(batch);
            return None;
        }
        Some(Cut::Batch(batch))
    }

    /// The share is read: the epoch's last batch with the epoch's end state, or, if there is
    /// none (a share too small for one batch in every bucket), the end with no batch.
    fn end(&mut self, state: StreamState) -> Cut {
        Metrics::add(&self.metrics.samples_left_out, self.waiting());
        self.held.iter_mut().for_each(Vec::clear);
        match self.last.take() {
            Some(mut batch) => {
                batch.state = state;
                batch.end_of_epoch = true;
                Cut::Batch(batch)
            }
            None => Cut::EpochEnd(EpochEnd {
                epoch: state.base.epoch,
                state: Some(state),
            }),
        }
    }

    /// The state to save now (`state` is the stream's after the last sample read): at the
    /// first sample still waiting, with the waiting ones listed.
    fn saved(&self, state: &StreamState) -> StreamState {
        let mut waiting: Vec<&Held> = self.held.iter().flatten().collect();
        waiting.sort_unstable_by_key(|h| h.k);
        let (delivered, audit) = waiting
            .first()
            .map_or((state.delivered, state.audit), |h| (h.k, h.audit_before));
        let waiting_audit = waiting.iter().fold(Audit::default(), |a, h| Audit {
            count: a.count + 1,
            digest: a.digest.wrapping_add(h.hash),
        });
        let span_audit = Audit {
            count: state
                .audit
                .count
                .wrapping_sub(audit.count)
                .wrapping_sub(waiting_audit.count),
            digest: state
                .audit
                .digest
                .wrapping_sub(audit.digest)
                .wrapping_sub(waiting_audit.digest),
        };
        StreamState {
            delivered,
            audit,
            buckets: Some(BucketProgress {
                upto: state.delivered,
                pending: waiting.iter().map(|h| h.k).collect(),
                span_audit,
                batches: self.batches,
                emitted: self.emitted,
            }),
            ..state.clone()
        }
    }

    /// The bucket of `s`, by its width and height columns.
    fn bucket_of(&self, s: &Sample, url: &str) -> Result<usize> {
        let values = s.values()?;
        match (&values[self.cols.0], &values[self.cols.1]) {
            (ValueRef::Int64(w), ValueRef::Int64(h)) if *w > 0 && *h > 0 => {
                Ok(self.sizes.nearest(*w as u64, *h as u64))
            }
            (w, h) => Err(Error::corrupt(
                Location::sample(url, s.global_index),
                format!("width {w:?} and height {h:?}: buckets need a positive width and height"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_bucket_by_log_ratio() {
        let b = BucketSizes::new(&[(256, 256), (192, 320), (320, 192)]).unwrap();
        assert_eq!(b.nearest(640, 640), 0);
        assert_eq!(b.nearest(1600, 900), 1, "16:9 is wide");
        assert_eq!(b.nearest(900, 1600), 2, "9:16 is tall");
        // Exactly between 1:1 and 5:3 on a log scale goes to the first given.
        let mid = (5.0f64 / 3.0).sqrt();
        assert_eq!(b.nearest((mid * 1e6) as u64, 1_000_000), 0);
    }

    #[test]
    fn bucket_sizes_refused_when_absurd() {
        assert!(BucketSizes::new(&[]).unwrap_err().to_string().contains("buckets"));
        let e = BucketSizes::new(&[(8, 8), (8, 0)]).unwrap_err().to_string();
        assert!(e.contains("buckets[1]") && e.contains("side of 0"), "{e}");
        let e = BucketSizes::new(&[(8, 8), (8, 8)]).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn epoch_batches_is_the_bound_every_share_reaches() {
        // 3 buckets of 8: a share of 100 fills at least (100 - 21) / 8 = 9 whatever the mix.
        assert_eq!(epoch_batches(100, 3, 8), 9);
        assert_eq!(epoch_batches(20, 3, 8), 0);
        assert_eq!(epoch_batches(5, 1, 1), 5);
        // Worst case: every bucket left with B - 1.
        for mix in [[33u64, 33, 34], [7, 7, 86], [0, 0, 100]] {
            let full: u64 = mix.iter().map(|n| n / 8).sum();
            assert!(full >= epoch_batches(100, 3, 8), "{mix:?}");
        }
    }
}
