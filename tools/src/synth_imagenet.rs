//! `ramjet synth --profile imagenet`: JPEGs shaped like ImageNet's, to exercise every decode
//! path of the GPU decode (issue 41, item 10).
//!
//! Sizes: 85% with the long side 400 to 640 px (ImageNet's median image is 500x375), 12%
//! 640 to 1,600, 3% 1,600 to 4,000; the short side 0.55 to 1 of the long one, and never under
//! 200; portrait or landscape. Layouts, by share: 4:2:0 baseline 70.5%, 4:2:2 10%, 4:4:4
//! 10%, progressive 4:2:0 5%, greyscale 3%, CMYK (Adobe's inverted form) 1%, and 4:1:1 0.5%
//! (which the hardware engine does not read). `damaged_per_mille` more are baseline files
//! whose entropy-coded data is overwritten in the middle (their headers and end marker
//! intact, so `ramjet pack` takes them and the decoders must refuse or survive them).
//! Everything derives from (seed, index).

use jpeg_encoder::{ColorType, Encoder, SamplingFactor};

use crate::synth::{Rng, ValueNoise};

/// What an image of the profile is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Baseline 4:2:0.
    S420,
    /// Baseline 4:2:2.
    S422,
    /// Baseline 4:4:4.
    S444,
    /// Baseline 4:1:1.
    S411,
    /// Progressive 4:2:0.
    Progressive,
    /// One component.
    Gray,
    /// Four components, Adobe's inverted CMYK.
    Cmyk,
    /// Baseline 4:2:0 with its entropy-coded data overwritten in the middle.
    Damaged,
}

impl Kind {
    /// The name `ramjet synth` reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::S420 => "4:2:0",
            Kind::S422 => "4:2:2",
            Kind::S444 => "4:4:4",
            Kind::S411 => "4:1:1",
            Kind::Progressive => "progressive",
            Kind::Gray => "grey",
            Kind::Cmyk => "cmyk",
            Kind::Damaged => "damaged",
        }
    }
}

/// The kind and size of image `index` of dataset `seed`.
pub fn shape(seed: u64, index: u64, damaged_per_mille: u32) -> (Kind, u32, u32) {
    let mut rng = Rng::new(seed ^ 0x1A6E_7E57 ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let k = rng.below(1000) as u32;
    let kind = if k < damaged_per_mille.min(1000) {
        Kind::Damaged
    } else {
        match rng.below(1000) {
            0..=4 => Kind::S411,
            5..=14 => Kind::Cmyk,
            15..=44 => Kind::Gray,
            45..=94 => Kind::Progressive,
            95..=194 => Kind::S444,
            195..=294 => Kind::S422,
            _ => Kind::S420,
        }
    };
    let long = match rng.below(100) {
        0..=84 => rng.range(400.0, 640.0),
        85..=96 => rng.range(640.0, 1600.0),
        _ => rng.range(1600.0, 4000.0),
    };
    let short = (long * rng.range(0.55, 1.0)).max(200.0);
    let (long, short) = (long.round() as u32, short.round() as u32);
    let (w, h) = if rng.below(4) == 0 {
        (short, long)
    } else {
        (long, short)
    };
    (kind, w, h)
}

/// Image `index` of dataset `seed`: its kind and its JPEG bytes.
pub fn image(seed: u64, index: u64, damaged_per_mille: u32) -> (Kind, Vec<u8>) {
    let (kind, w, h) = shape(seed, index, damaged_per_mille);
    let mut rng = Rng::new(seed.wrapping_add(index).wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
    let rgb = pixels(&mut rng, w as usize, h as usize);
    let (color, data): (ColorType, Vec<u8>) = match kind {
        Kind::Gray => (
            ColorType::Luma,
            rgb.chunks_exact(3)
                .map(|p| ((p[0] as u32 * 3 + p[1] as u32 * 6 + p[2] as u32) / 10) as u8)
                .collect(),
        ),
        // Inks from the colour, K from the darkness; the encoder stores them inverted.
        Kind::Cmyk => (
            ColorType::Cmyk,
            rgb.chunks_exact(3)
                .flat_map(|p| {
                    let k = 255 - *p.iter().max().unwrap_or(&0);
                    [255 - p[0], 255 - p[1], 255 - p[2]]
                        .map(|c| c.saturating_sub(k))
                        .into_iter()
                        .chain([k])
                })
                .collect(),
        ),
        _ => (ColorType::Rgb, rgb),
    };
    let mut out = Vec::with_capacity(w as usize * h as usize / 3);
    let mut e = Encoder::new(&mut out, 88);
    e.set_sampling_factor(match kind {
        Kind::S422 => SamplingFactor::F_2_1,
        Kind::S444 | Kind::Cmyk => SamplingFactor::F_1_1,
        Kind::S411 => SamplingFactor::F_4_1,
        _ => SamplingFactor::F_2_2,
    });
    e.set_progressive(kind == Kind::Progressive);
    e.encode(&data, w as u16, h as u16, color)
        .expect("encoding an in-memory buffer of the stated size cannot fail");
    if kind == Kind::Damaged {
        damage(&mut out, &mut rng);
    }
    (kind, out)
}

/// Overwrites 64 bytes in the middle of the entropy-coded data (after the last start-of-scan
/// segment, before the end marker) with bytes that are no valid Huffman code run.
fn damage(jpeg: &mut [u8], rng: &mut Rng) {
    let sos = jpeg.windows(2).rposition(|w| w == [0xFF, 0xDA]).unwrap_or(2);
    let start = sos + 2 + u16::from_be_bytes([jpeg[sos + 2], jpeg[sos + 3]]) as usize;
    let end = jpeg.len() - 2;
    let at = start + (end - start) / 2;
    for b in jpeg.iter_mut().skip(at).take(64.min(end - at)) {
        // Never 0xFF: a marker inside the data would end the scan early instead.
        *b = rng.below(255) as u8;
    }
}

/// A photo-like picture: smooth colour fields at two scales, an edge and some grain, so
/// that the JPEG's size per pixel is a photo's (about 0.3 to 0.6 bytes at quality 88).
fn pixels(rng: &mut Rng, w: usize, h: usize) -> Vec<u8> {
    let coarse = ValueNoise::sized(rng, 3, 3, w, h);
    let fine = ValueNoise::sized(rng, (w / 24).max(2), (h / 24).max(2), w, h);
    let base: [f32; 3] = [rng.range(60.0, 190.0), rng.range(60.0, 190.0), rng.range(60.0, 190.0)];
    let tint: [f32; 3] = [rng.range(-60.0, 60.0), rng.range(-60.0, 60.0), rng.range(-60.0, 60.0)];
    let edge = rng.range(0.3, 0.7) * w as f32;
    let mut s = rng.next_u64() | 1;
    let mut px = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let grain = ((s >> 58) as f32 - 32.0) * 0.35;
            let (c, f) = (coarse.at(x, y), fine.at(x, y) * 28.0);
            let step = if (x as f32) < edge + 40.0 * c { 0.0 } else { 35.0 };
            for ch in 0..3 {
                let v = base[ch] + tint[ch] * c + f + grain + step;
                px.push(v.clamp(0.0, 255.0) as u8);
            }
        }
    }
    px
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramjet_engine::image::frame::{jpeg_frame, JpegCoding, Subsampling};

    /// Every kind occurs in a few thousand images, near its share, each file what its kind
    /// says (read back by the frame parser), sizes within the stated bounds.
    #[test]
    fn every_kind_occurs_and_is_what_it_says() {
        let mut counts = std::collections::BTreeMap::new();
        for i in 0..4000 {
            let (kind, w, h) = shape(7, i, 5);
            *counts.entry(kind).or_insert(0) += 1;
            assert!((200..=4000).contains(&w) && (200..=4000).contains(&h), "{w}x{h}");
        }
        for (kind, share) in [
            (Kind::S420, 0.70),
            (Kind::Progressive, 0.05),
            (Kind::Gray, 0.03),
            (Kind::Cmyk, 0.01),
        ] {
            let got = counts[&kind] as f64 / 4000.0;
            assert!((got - share).abs() < share * 0.5 + 0.004, "{kind:?}: {got}");
        }
        for k in [Kind::S411, Kind::Damaged, Kind::S422, Kind::S444] {
            assert!(counts.get(&k).copied().unwrap_or(0) > 0, "{k:?} never occurs");
        }
        // One of each kind, decoded back: the frame says what the kind says.
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..4000u64 {
            let (kind, w, h) = shape(7, i, 5);
            if w * h > 700_000 || !seen.insert(kind) {
                continue;
            }
            let (k2, bytes) = image(7, i, 5);
            assert_eq!(k2, kind);
            let f = jpeg_frame(&bytes).unwrap();
            assert_eq!((f.width, f.height), (w, h));
            let want = match kind {
                Kind::S420 | Kind::Damaged | Kind::Progressive => Subsampling::S420,
                Kind::S422 => Subsampling::S422,
                Kind::S444 => Subsampling::S444,
                Kind::S411 => Subsampling::S411,
                Kind::Gray => Subsampling::Gray,
                Kind::Cmyk => Subsampling::Other,
            };
            assert_eq!(f.subsampling(), want, "{kind:?}");
            assert_eq!(f.coding == JpegCoding::Progressive, kind == Kind::Progressive);
            assert_eq!(f.is_cmyk(), kind == Kind::Cmyk);
            // The CPU path takes every kind but the damaged: whole, and as a training crop.
            let px = ramjet_engine::image::decode_rgb(&bytes, 1, None);
            let spec = ramjet_engine::image::ImageSpec::train(224);
            let mut out = vec![0u8; spec.elems()];
            let mut rng = ramjet_engine::image::SampleRng::new(1, 0, 0, i);
            let slot = ramjet_engine::image::Slot::U8(&mut out);
            let crop = ramjet_engine::image::process(&bytes, &spec, &mut rng, slot, &mut Default::default());
            if kind != Kind::Damaged {
                assert!(px.is_ok() && crop.is_ok(), "{kind:?}: {px:?} {crop:?}");
            }
        }
        assert_eq!(seen.len(), 8);
        assert_eq!(image(7, 3, 5).1, image(7, 3, 5).1, "not deterministic");
    }
}
