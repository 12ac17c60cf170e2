//! Cutting the stream's samples into batches: one batch after another in read order (this
//! file), or by aspect-ratio bucket ([`super::buckets`]). Either takes one sample at a time,
//! with the stream's state after it, and says when a batch (or an epoch's end with no batch) is
//! ready.

use std::sync::Arc;

use super::EpochEnd;
use crate::image::ImageSpec;
use crate::stream::{Sample, StreamState};

/// A batch cut from the stream, not yet decoded.
pub(super) struct CutBatch {
    /// Epoch.
    pub epoch: u64,
    /// Its samples, in the order they go into the batch.
    pub samples: Vec<Sample>,
    /// Each sample's shard URL.
    pub urls: Vec<String>,
    /// The state to save after it.
    pub state: StreamState,
    /// The epoch's last batch for this consumer.
    pub end_of_epoch: bool,
    /// The image settings of its bucket (`None`: the loader's own).
    pub spec: Option<Arc<ImageSpec>>,
}

/// What a cutter made of one more sample.
pub(super) enum Cut {
    /// A batch to decode.
    Batch(CutBatch),
    /// This consumer's epoch ended with no batch.
    EpochEnd(EpochEnd),
}

/// One sample the stream delivered, with the stream's state after it and how many of the
/// epoch's samples this consumer has still to read.
pub(super) struct Read {
    pub sample: Sample,
    pub url: String,
    pub state: StreamState,
    pub left: usize,
}

/// Batches in read order: `batch_size` samples each; the epoch's last one may be short, or,
/// with `drop_last`, dropped (a share shorter than one batch then ends with no batch).
pub(super) struct InOrder {
    bs: usize,
    drop_last: bool,
    cur: Vec<Sample>,
    urls: Vec<String>,
    /// The last epoch whose end went to the consumer (on a batch, or as an EpochEnd).
    ended: Option<u64>,
}

impl InOrder {
    pub fn new(bs: usize, drop_last: bool) -> InOrder {
        InOrder {
            bs,
            drop_last,
            cur: Vec::with_capacity(bs),
            urls: Vec::with_capacity(bs),
            ended: None,
        }
    }

    /// An epoch that had no sample for this consumer ended.
    pub fn empty_epoch(&mut self, epoch: u64) {
        self.ended = Some(epoch);
    }

    /// Takes one more sample.
    pub fn push(&mut self, r: Read) -> Option<Cut> {
        let (bs, epoch) = (self.bs, r.sample.epoch);
        self.urls.push(r.url);
        self.cur.push(r.sample);
        if self.cur.len() < bs && r.left > 0 {
            return None;
        }
        // With drop_last, the batch before a short remainder is the epoch's last.
        let end_of_epoch = r.left == 0 || (self.drop_last && r.left < bs);
        let samples = std::mem::replace(&mut self.cur, Vec::with_capacity(bs));
        let urls = std::mem::replace(&mut self.urls, Vec::with_capacity(bs));
        if samples.len() < bs && self.drop_last {
            // A share shorter than one batch: the epoch still ends, with no batch.
            if end_of_epoch && self.ended != Some(epoch) {
                self.ended = Some(epoch);
                return Some(Cut::EpochEnd(EpochEnd {
                    epoch,
                    state: Some(r.state),
                }));
            }
            return None;
        }
        if end_of_epoch {
            self.ended = Some(epoch);
        }
        Some(Cut::Batch(CutBatch {
            epoch,
            samples,
            urls,
            state: r.state,
            end_of_epoch,
            spec: None,
        }))
    }
}
