//! A subset of a source's samples as the order sees it: the samples a filter (or a pack's
//! dedupe) keeps, shard by shard. The order deals kept samples only (so every rank agrees,
//! `len` counts them and a resume position names the same sample); [`ShardCounts::real`] maps
//! a kept sample back to its index in the shard.

use std::sync::Arc;

use super::{CountList, ShardCounts};
use crate::error::Result;

/// Which samples of one shard are kept: a bit per sample (bit `i % 64` of word `i / 64`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptBits {
    words: Vec<u64>,
    samples: u64,
}

impl KeptBits {
    /// Every one of `samples` samples dropped, until [`KeptBits::keep`].
    pub fn none(samples: u64) -> KeptBits {
        KeptBits {
            words: vec![0; samples.div_ceil(64) as usize],
            samples,
        }
    }

    /// Keeps sample `i` (`i < samples`).
    pub fn keep(&mut self, i: u64) {
        assert!(i < self.samples, "sample {i} of a shard of {}", self.samples);
        self.words[(i / 64) as usize] |= 1 << (i % 64);
    }

    /// Drops sample `i` (`i < samples`).
    pub fn drop_sample(&mut self, i: u64) {
        assert!(i < self.samples, "sample {i} of a shard of {}", self.samples);
        self.words[(i / 64) as usize] &= !(1 << (i % 64));
    }

    /// Every sample kept.
    pub fn all(samples: u64) -> KeptBits {
        let mut b = KeptBits::none(samples);
        for (w, word) in b.words.iter_mut().enumerate() {
            let left = samples - w as u64 * 64;
            *word = if left >= 64 { u64::MAX } else { (1u64 << left) - 1 };
        }
        b
    }

    /// Samples kept.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// Whether sample `i` is kept.
    pub fn is_kept(&self, i: u64) -> bool {
        i < self.samples && self.words[(i / 64) as usize] >> (i % 64) & 1 == 1
    }

    /// The index of the `k`-th kept sample (`k < count`).
    pub fn select(&self, mut k: u64) -> Option<u64> {
        for (w, &word) in self.words.iter().enumerate() {
            let n = word.count_ones() as u64;
            if k < n {
                let mut x = word;
                for _ in 0..k {
                    x &= x - 1;
                }
                return Some(w as u64 * 64 + x.trailing_zeros() as u64);
            }
            k -= n;
        }
        None
    }

    /// Keeps only what both keep.
    pub fn and(&mut self, other: &KeptBits) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= b;
        }
    }
}

/// A source's kept samples: each shard's kept count (the order's counts) and, for a shard that
/// drops any, which ones. Memory: 8 bytes per shard and a bit per sample of a shard with drops.
#[derive(Debug)]
pub struct Selected {
    counts: CountList,
    /// Per shard: `None` when every sample is kept.
    kept: Vec<Option<KeptBits>>,
    /// Samples of the source before selection.
    stored: u64,
}

impl Selected {
    /// The selection `kept` (one entry per shard of the source, `None` for all kept) over
    /// shards of `samples[i]` samples each.
    pub fn new(samples: &[u64], kept: Vec<Option<KeptBits>>) -> Selected {
        assert_eq!(samples.len(), kept.len(), "one entry per shard");
        let counts = CountList::new(
            samples
                .iter()
                .zip(&kept)
                .map(|(&n, k)| k.as_ref().map_or(n, |k| k.count()))
                .collect(),
        );
        let kept = kept
            .into_iter()
            .zip(samples)
            .map(|(k, &n)| k.filter(|k| k.count() != n))
            .collect();
        Selected {
            counts,
            kept,
            stored: samples.iter().sum(),
        }
    }

    /// Samples dropped.
    pub fn dropped(&self) -> u64 {
        self.stored - self.counts.total()
    }

    /// As the order's counts.
    pub fn into_counts(self) -> Arc<dyn ShardCounts> {
        Arc::new(self)
    }
}

impl ShardCounts for Selected {
    fn shards(&self) -> u64 {
        self.counts.shards()
    }
    fn total(&self) -> u64 {
        self.counts.total()
    }
    fn samples(&self, shard: u64) -> Result<u64> {
        self.counts.samples(shard)
    }
    fn locate(&self, o: u64) -> Result<(u64, u64)> {
        self.counts.locate(o)
    }
    fn real(&self, shard: u64, k: u64) -> u64 {
        match &self.kept[shard as usize] {
            None => k,
            Some(b) => b
                .select(k)
                .expect("a kept sample's rank is below the shard's kept count"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_finds_each_kept_sample_in_order() {
        let mut b = KeptBits::none(200);
        let keep = [0u64, 3, 63, 64, 65, 127, 128, 199];
        for &i in &keep {
            b.keep(i);
        }
        assert_eq!(b.count(), keep.len() as u64);
        for (k, &i) in keep.iter().enumerate() {
            assert_eq!(b.select(k as u64), Some(i));
            assert!(b.is_kept(i));
        }
        assert_eq!(b.select(keep.len() as u64), None);
        assert_eq!(KeptBits::all(130).count(), 130);
        let mut a = KeptBits::all(130);
        a.drop_sample(5);
        a.and(&KeptBits::all(130));
        assert_eq!((a.count(), a.select(5)), (129, Some(6)));
    }

    #[test]
    fn a_selection_counts_and_maps_kept_samples() {
        let mut b = KeptBits::all(10);
        b.drop_sample(0);
        b.drop_sample(4);
        let s = Selected::new(&[5, 10, 3], vec![None, Some(b), Some(KeptBits::all(3))]);
        assert_eq!((s.total(), s.dropped()), (16, 2));
        assert_eq!(s.samples(1).unwrap(), 8);
        assert_eq!(s.locate(5).unwrap(), (1, 0));
        assert_eq!(s.real(1, 0), 1);
        assert_eq!(s.real(1, 3), 5);
        assert_eq!(s.real(0, 4), 4);
        assert_eq!(s.real(2, 2), 2);
    }

    #[test]
    fn an_order_over_a_selection_holds_each_kept_sample_once() {
        use crate::order::{global_order, OrderSpec, Shuffle, SourceShape, Weight};
        let sizes = [40u64, 7, 0, 65];
        let kept: Vec<Option<KeptBits>> = sizes
            .iter()
            .map(|&n| {
                let mut b = KeptBits::none(n);
                (0..n).filter(|i| i % 3 != 1).for_each(|i| b.keep(i));
                Some(b)
            })
            .collect();
        let want: Vec<(u32, u32)> = sizes
            .iter()
            .enumerate()
            .flat_map(|(s, &n)| (0..n).filter(|i| i % 3 != 1).map(move |i| (s as u32, i as u32)))
            .collect();
        let shape = SourceShape {
            version: "v".into(),
            counts: Selected::new(&sizes, kept).into_counts(),
            weight: Weight::Natural,
        };
        for shuffle in [
            Shuffle::None,
            Shuffle::Global,
            Shuffle::ShardBlock {
                window_shards: 2,
                block_samples: 4,
            },
        ] {
            let spec = OrderSpec {
                shuffle,
                ..OrderSpec::default()
            };
            let mut got: Vec<(u32, u32)> = global_order(std::slice::from_ref(&shape), &spec, 1)
                .unwrap()
                .iter()
                .map(|r| (r.shard, r.index))
                .collect();
            got.sort();
            assert_eq!(got, want, "{shuffle:?}");
        }
    }
}
