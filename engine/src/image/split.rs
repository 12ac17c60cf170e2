//! The automatic split of a batch between the decoders (issue 41, item 4).
//!
//! DALI sets the hardware engine's share by hand (`hw_decoder_load`). Here each path's rate
//! is measured as it runs, in units of work per second (a unit is one decoded pixel: the
//! region the decoder writes, so a 1/8-scale decode weighs 1/64 of a full one), and each batch
//! is split so that every path is predicted to finish at the same time:
//!
//! - an image the GPU decoders cannot take ([`Path::Cpu`] from [`crate::image::route`]) goes
//!   to the CPU;
//! - the rest, largest first, each go to whichever of their GPU decoder and the CPU threads
//!   would finish it first given the work already placed there (longest-processing-time
//!   first scheduling);
//! - a path with no rate yet gets a first share to measure: the CPU as many images as it has
//!   threads, a GPU decoder its whole eligible share (the GPU is assumed faster until shown).
//!
//! Rates are smoothed over batches (an exponential average, weight [`Split::SMOOTHING`] on
//! the newest). The CPU's rate is that of all its threads: a batch that gave it fewer images
//! than threads is scaled up by the parallelism it lacked.

use crate::image::route::Path;

/// One image to place: the GPU decoder it may go to ([`Path::Cpu`] when none) and its work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Item {
    /// The decoder the routing chose; the split may move a GPU image to the CPU.
    pub path: Path,
    /// Decoded pixels.
    pub work: f64,
}

/// What the split last did, for `metrics()` and Prometheus.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SplitStats {
    /// The last batch's images per path ([`Path::ALL`] order).
    pub images: [u64; 3],
    /// The last batch's share of work per path, 0 to 1.
    pub share: [f64; 3],
    /// Each path's measured rate in decoded pixels per second, once measured.
    pub rate: [Option<f64>; 3],
}

/// The automatic split (see the module's text).
#[derive(Debug, Clone)]
pub struct Split {
    cpu_threads: usize,
    rate: [Option<f64>; 3],
    last: SplitStats,
}

fn at(p: Path) -> usize {
    match p {
        Path::Hardware => 0,
        Path::Hybrid => 1,
        Path::Cpu => 2,
    }
}

impl Split {
    /// Weight of the newest measurement in each path's rate.
    pub const SMOOTHING: f64 = 0.3;

    /// A split with no rates yet, for a CPU side of `cpu_threads` decode threads.
    pub fn new(cpu_threads: usize) -> Split {
        Split {
            cpu_threads: cpu_threads.max(1),
            rate: [None; 3],
            last: SplitStats::default(),
        }
    }

    /// Places every item of a batch: the decoder of each, in the items' order.
    pub fn assign(&mut self, items: &[Item]) -> Vec<Path> {
        let mut out: Vec<Path> = items.iter().map(|i| i.path).collect();
        let mut load = [0f64; 3];
        let mut order: Vec<usize> = (0..items.len()).collect();
        // Largest first; ties by index, so a batch always splits the same way.
        order.sort_by(|&a, &b| items[b].work.total_cmp(&items[a].work).then(a.cmp(&b)));
        for &i in &order {
            if items[i].path == Path::Cpu {
                load[2] += items[i].work;
            }
        }
        // A CPU with no rate yet measures on its threads' worth of the smallest GPU images.
        let mut explore = if self.rate[2].is_none() { self.cpu_threads } else { 0 };
        for &i in order.iter().rev() {
            if explore == 0 {
                break;
            }
            if items[i].path != Path::Cpu {
                out[i] = Path::Cpu;
                load[2] += items[i].work;
                explore -= 1;
            }
        }
        for &i in &order {
            let (p, w) = (items[i].path, items[i].work);
            if p == Path::Cpu || out[i] == Path::Cpu {
                continue;
            }
            let to = match (self.rate[at(p)], self.rate[2]) {
                (Some(g), Some(c)) if (load[2] + w) / c < (load[at(p)] + w) / g => Path::Cpu,
                _ => p,
            };
            out[i] = to;
            load[at(to)] += w;
        }
        self.record(items, &out);
        out
    }

    /// Records a batch placed without [`assign`](Self::assign) (a fixed mode): what
    /// [`stats`](Self::stats) then reports.
    pub fn record(&mut self, items: &[Item], to: &[Path]) {
        let mut load = [0f64; 3];
        let mut images = [0u64; 3];
        for (i, p) in items.iter().zip(to) {
            load[at(*p)] += i.work;
            images[at(*p)] += 1;
        }
        let total: f64 = load.iter().sum();
        self.last = SplitStats {
            images,
            share: load.map(|l| if total > 0.0 { l / total } else { 0.0 }),
            rate: self.rate,
        };
    }

    /// Records that `path` decoded `images` images of `work` pixels in all in `seconds`.
    pub fn observe(&mut self, path: Path, images: usize, work: f64, seconds: f64) {
        if images == 0 || !work.is_finite() || work <= 0.0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let mut r = work / seconds;
        if path == Path::Cpu {
            r *= self.cpu_threads as f64 / images.min(self.cpu_threads) as f64;
        }
        let slot = &mut self.rate[at(path)];
        *slot = Some(match *slot {
            None => r,
            Some(old) => old + Self::SMOOTHING * (r - old),
        });
        self.last.rate = self.rate;
    }

    /// Records that one of the CPU's threads decoded `work` pixels in `seconds`, while the
    /// others did the same beside it (the loader's decode threads each decode their own
    /// batch's share): the CPU's rate is that thread's times the threads.
    pub fn observe_one_thread(&mut self, work: f64, seconds: f64) {
        let threads = self.cpu_threads;
        self.observe(Path::Cpu, threads, work * threads as f64, seconds);
    }

    /// What the split last did.
    pub fn stats(&self) -> SplitStats {
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decoders of fixed rates; the CPU's is that of all its threads together, reached only
    /// with at least as many images as threads. Returns each path's time for a placement.
    struct Fake {
        rate: [f64; 3],
        threads: usize,
    }

    impl Fake {
        fn run(&self, items: &[Item], to: &[Path], split: &mut Split) -> [f64; 3] {
            let mut t = [0f64; 3];
            for p in Path::ALL {
                let (n, w) = items
                    .iter()
                    .zip(to)
                    .filter(|(_, q)| **q == p)
                    .fold((0, 0.0), |(n, w), (i, _)| (n + 1, w + i.work));
                if n == 0 {
                    continue;
                }
                let mut r = self.rate[at(p)];
                if p == Path::Cpu {
                    r *= n.min(self.threads) as f64 / self.threads as f64;
                }
                t[at(p)] = w / r;
                split.observe(p, n, w, t[at(p)]);
            }
            t
        }
    }

    /// A batch like ImageNet's: mostly baseline images of varied size, some the engine cannot
    /// take, a few only the CPU can.
    fn batch(seed: u64) -> Vec<Item> {
        let mut s = seed | 1;
        (0..256)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let path = match i % 20 {
                    0 => Path::Cpu,
                    1 | 2 => Path::Hybrid,
                    _ => Path::Hardware,
                };
                Item {
                    path,
                    work: 50_000.0 + (s % 400_000) as f64,
                }
            })
            .collect()
    }

    fn max(t: [f64; 3]) -> f64 {
        t.into_iter().fold(0.0, f64::max)
    }

    /// On decoders of fixed rates the split converges within a few batches: the CPU finishes
    /// within 10% of the GPU, the batch at least 1.1x faster than the best
    /// fixed split (all GPU-eligible images on their GPU decoder, or all on the CPU).
    #[test]
    fn converges_on_fixed_rates_and_beats_every_fixed_split() {
        for rate in [[8e8, 2e8, 5e8], [3e8, 1e8, 3e8], [1e9, 3e8, 2e8], [4e8, 4e8, 4e8]] {
            let fake = Fake { rate, threads: 8 };
            let mut split = Split::new(8);
            let mut last = [0.0; 3];
            for b in 0..8 {
                let items = batch(b);
                let to = split.assign(&items);
                last = fake.run(&items, &to, &mut split);
            }
            let items = batch(99);
            let auto = max(fake.run(&items, &split.assign(&items), &mut split));
            // The CPU and the slowest GPU decoder finish together (a GPU decoder with only a
            // few images it alone can take may finish early: nothing can move to it).
            let gpu_end = last[0].max(last[1]);
            assert!(
                (last[2] / gpu_end - 1.0).abs() < 0.10,
                "rates {rate:?}: paths finish at {last:?}"
            );
            let gpu: Vec<Path> = items.iter().map(|i| i.path).collect();
            let cpu = vec![Path::Cpu; items.len()];
            let best_fixed =
                max(fake.run(&items, &gpu, &mut Split::new(8))).min(max(fake.run(&items, &cpu, &mut Split::new(8))));
            assert!(
                best_fixed / auto >= 1.1,
                "rates {rate:?}: auto {auto:.4} s, best fixed {best_fixed:.4} s"
            );
            let st = split.stats();
            assert_eq!(st.images.iter().sum::<u64>(), 256);
            assert!((st.share.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            for p in Path::ALL {
                let r = st.rate[at(p)].expect("every path measured");
                assert!(
                    (r / rate[at(p)] - 1.0).abs() < 0.05,
                    "{p:?}: measured {r}, true {}",
                    rate[at(p)]
                );
            }
        }
    }

    /// Before any measurement the CPU gets its threads' worth of the smallest GPU images, and
    /// never an image the routing sent to the CPU less; afterwards, a CPU much slower than
    /// the GPU gets only what it must.
    #[test]
    fn explores_first_then_sends_the_cpu_only_what_pays() {
        let items = batch(5);
        let mut split = Split::new(4);
        let to = split.assign(&items);
        let forced = items.iter().filter(|i| i.path == Path::Cpu).count();
        assert_eq!(to.iter().filter(|p| **p == Path::Cpu).count(), forced + 4);
        for (i, p) in items.iter().zip(&to) {
            if i.path == Path::Cpu {
                assert_eq!(*p, Path::Cpu);
            }
            assert!(
                *p == i.path || *p == Path::Cpu,
                "an image went to a decoder it cannot use"
            );
        }
        let fake = Fake {
            rate: [1e10, 1e10, 1e6],
            threads: 4,
        };
        for _ in 0..3 {
            let to = split.assign(&items);
            fake.run(&items, &to, &mut split);
        }
        let to = split.assign(&items);
        assert_eq!(to.iter().filter(|p| **p == Path::Cpu).count(), forced);
        // Nonsense measurements change nothing.
        let before = split.stats().rate;
        split.observe(Path::Cpu, 3, f64::NAN, 1.0);
        split.observe(Path::Cpu, 3, 1.0, 0.0);
        split.observe(Path::Cpu, 0, 1.0, 1.0);
        assert_eq!(split.stats().rate, before);
    }
}
