//! EXIF orientation: read from a JPEG's APP1 segment, a WebP's `EXIF` chunk or a PNG's `eXIf`
//! chunk, and the geometry of the eight orientations (the displayed size, the stored
//! rectangle a displayed one comes from, the stored pixel of a displayed one).
//!
//! Tag 0x0112 of the first IFD says how the stored pixels are shown: 1 as stored, 2 mirrored
//! left-right, 3 turned 180 degrees, 4 mirrored top-bottom, 5 transposed (mirrored about the
//! main diagonal), 6 turned 90 degrees clockwise, 7 transversed (about the other diagonal), 8
//! turned 90 degrees counter-clockwise: Pillow's `ImageOps.exif_transpose` applies the same
//! eight. A missing, unreadable or out-of-range tag reads as 1: a damaged EXIF block never
//! fails an image whose pixels decode.

use crate::image::Rect;

/// One of the eight EXIF orientations (1 to 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Orientation(u8);

impl Default for Orientation {
    fn default() -> Self {
        Orientation::UP
    }
}

impl Orientation {
    /// Shown as stored (1).
    pub const UP: Orientation = Orientation(1);

    /// Orientation `v`; anything outside 1-8 is [`Orientation::UP`].
    pub fn new(v: u16) -> Orientation {
        if (1..=8).contains(&v) {
            Orientation(v as u8)
        } else {
            Orientation::UP
        }
    }

    /// The tag's value, 1 to 8.
    pub fn value(self) -> u8 {
        self.0
    }

    /// Whether the displayed image swaps width and height (5 to 8).
    pub fn transposed(self) -> bool {
        self.0 >= 5
    }

    /// The displayed size of an image stored `w` x `h`.
    pub fn displayed(self, w: u32, h: u32) -> (u32, u32) {
        if self.transposed() {
            (h, w)
        } else {
            (w, h)
        }
    }

    /// This orientation, then the displayed image mirrored left-right when `mirror`.
    pub fn mirrored_if(self, mirror: bool) -> Orientation {
        if !mirror {
            return self;
        }
        // 1<->2, 3<->4, 5<->6, 7<->8.
        Orientation(if self.0 % 2 == 1 { self.0 + 1 } else { self.0 - 1 })
    }

    /// The stored pixel that displayed pixel (`x`, `y`) shows, in an image stored `w` x `h`.
    pub fn source(self, x: usize, y: usize, w: usize, h: usize) -> (usize, usize) {
        match self.0 {
            2 => (w - 1 - x, y),
            3 => (w - 1 - x, h - 1 - y),
            4 => (x, h - 1 - y),
            5 => (y, x),
            6 => (y, h - 1 - x),
            7 => (w - 1 - y, h - 1 - x),
            8 => (w - 1 - y, x),
            _ => (x, y),
        }
    }

    /// The stored rectangle that displayed rectangle `r` shows, in an image stored `w` x `h`.
    pub fn stored_rect(self, r: &Rect, w: f64, h: f64) -> Rect {
        let (x, y, rw, rh) = match self.0 {
            2 => (w - r.x - r.w, r.y, r.w, r.h),
            3 => (w - r.x - r.w, h - r.y - r.h, r.w, r.h),
            4 => (r.x, h - r.y - r.h, r.w, r.h),
            5 => (r.y, r.x, r.h, r.w),
            6 => (r.y, h - r.x - r.w, r.h, r.w),
            7 => (w - r.y - r.h, h - r.x - r.w, r.h, r.w),
            8 => (w - r.y - r.h, r.x, r.h, r.w),
            _ => (r.x, r.y, r.w, r.h),
        };
        Rect { x, y, w: rw, h: rh }
    }
}

/// The orientation an encoded image's EXIF gives (JPEG, WebP or PNG; UP for anything else).
pub fn orientation(b: &[u8]) -> Orientation {
    let tiff = if b.starts_with(&[0xFF, 0xD8]) {
        jpeg_exif(b)
    } else if crate::image::webp::is_webp(b) {
        webp_exif(b)
    } else if b.starts_with(b"\x89PNG\r\n\x1a\n") {
        png_exif(b)
    } else {
        None
    };
    tiff.map_or(Orientation::UP, tiff_orientation)
}

fn be16(b: &[u8], at: usize) -> Option<usize> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?) as usize)
}

/// The TIFF block of a JPEG's first `Exif` APP1 segment, looked for up to the scan.
fn jpeg_exif(b: &[u8]) -> Option<&[u8]> {
    let mut i = 2;
    while i + 4 <= b.len() {
        if b[i] != 0xFF {
            return None;
        }
        let m = b[i + 1];
        if m == 0xFF {
            i += 1; // fill byte
            continue;
        }
        if m == 0xDA || m == 0xD9 {
            return None; // the scan (or the end) comes before any EXIF
        }
        if m == 0x01 || (0xD0..=0xD7).contains(&m) {
            i += 2;
            continue;
        }
        let len = be16(b, i + 2)?;
        let seg = b.get(i + 4..(i + 2 + len).max(i + 4))?;
        if m == 0xE1 && seg.starts_with(b"Exif\0\0") {
            return Some(&seg[6..]);
        }
        i += 2 + len;
    }
    None
}

/// The TIFF block of a WebP's `EXIF` chunk (an `Exif\0\0` prefix, which some writers add,
/// skipped).
fn webp_exif(b: &[u8]) -> Option<&[u8]> {
    let mut i = 12;
    while i + 8 <= b.len() {
        let size = u32::from_le_bytes(b[i + 4..i + 8].try_into().ok()?) as usize;
        let data = b.get(i + 8..(i + 8).checked_add(size)?)?;
        if &b[i..i + 4] == b"EXIF" {
            return Some(data.strip_prefix(b"Exif\0\0").unwrap_or(data));
        }
        i += 8 + size + (size & 1);
    }
    None
}

/// The TIFF block of a PNG's `eXIf` chunk, looked for up to the image data.
fn png_exif(b: &[u8]) -> Option<&[u8]> {
    let mut i = 8;
    while i + 8 <= b.len() {
        let len = u32::from_be_bytes(b[i..i + 4].try_into().ok()?) as usize;
        let kind = &b[i + 4..i + 8];
        if kind == b"IDAT" || kind == b"IEND" {
            return None;
        }
        let data = b.get(i + 8..(i + 8).checked_add(len)?)?;
        if kind == b"eXIf" {
            return Some(data);
        }
        i += 12 + len;
    }
    None
}

/// Tag 0x0112 of a TIFF block's first IFD.
fn tiff_orientation(t: &[u8]) -> Orientation {
    let little = match t.get(..2) {
        Some(b"II") => true,
        Some(b"MM") => false,
        _ => return Orientation::UP,
    };
    let u16_at = |at: usize| -> Option<u16> {
        let x: [u8; 2] = t.get(at..at + 2)?.try_into().ok()?;
        Some(if little {
            u16::from_le_bytes(x)
        } else {
            u16::from_be_bytes(x)
        })
    };
    let u32_at = |at: usize| -> Option<u32> {
        let x: [u8; 4] = t.get(at..at + 4)?.try_into().ok()?;
        Some(if little {
            u32::from_le_bytes(x)
        } else {
            u32::from_be_bytes(x)
        })
    };
    let found = (|| {
        if u16_at(2)? != 42 {
            return None;
        }
        let ifd = u32_at(4)? as usize;
        let n = u16_at(ifd)? as usize;
        (0..n.min(512)).find_map(|k| {
            let e = ifd + 2 + 12 * k;
            // Orientation: SHORT (3), one value, in the entry's first two value bytes.
            (u16_at(e)? == 0x0112 && u16_at(e + 2)? == 3)
                .then(|| u16_at(e + 8))
                .flatten()
        })
    })();
    found.map_or(Orientation::UP, Orientation::new)
}

/// A TIFF block holding orientation `v` (after one other tag, as cameras write it), little-
/// or big-endian: for `ramjet synth` and tests.
pub fn tiff(v: u16, little: bool) -> Vec<u8> {
    let w16 = |x: u16| if little { x.to_le_bytes() } else { x.to_be_bytes() };
    let w32 = |x: u32| if little { x.to_le_bytes() } else { x.to_be_bytes() };
    let mut t = Vec::new();
    t.extend_from_slice(if little { b"II" } else { b"MM" });
    t.extend_from_slice(&w16(42));
    t.extend_from_slice(&w32(8));
    t.extend_from_slice(&w16(2));
    for (tag, val) in [(0x010F, 7u16), (0x0112, v)] {
        t.extend_from_slice(&w16(tag));
        t.extend_from_slice(&w16(3));
        t.extend_from_slice(&w32(1));
        t.extend_from_slice(&w16(val));
        t.extend_from_slice(&[0, 0]);
    }
    t.extend_from_slice(&w32(0));
    t
}

/// `jpeg` with an EXIF APP1 segment of orientation `v` after its SOI (big-endian TIFF for an
/// even `v`, little-endian for an odd one, so both are exercised).
pub fn with_exif(jpeg: &[u8], v: u16) -> Vec<u8> {
    let mut seg = b"Exif\0\0".to_vec();
    seg.extend(tiff(v, v % 2 == 0));
    let mut out = jpeg[..2].to_vec();
    out.extend_from_slice(&[0xFF, 0xE1]);
    out.extend_from_slice(&((seg.len() + 2) as u16).to_be_bytes());
    out.extend(seg);
    out.extend_from_slice(&jpeg[2..]);
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn every_orientation_reads_from_a_jpeg_and_damage_reads_as_up() {
        let j = crate::image::tests::jpeg(16, 8);
        assert_eq!(orientation(&j), Orientation::UP);
        for v in 1..=8 {
            assert_eq!(orientation(&with_exif(&j, v)).value(), v as u8);
        }
        assert_eq!(orientation(&with_exif(&j, 9)), Orientation::UP);
        let mut cut = with_exif(&j, 6);
        cut[10] = b'M'; // byte order mark broken
        assert_eq!(orientation(&cut), Orientation::UP);
        for n in 0..40 {
            let _ = orientation(&with_exif(&j, 6)[..n]); // never panics
        }
    }

    #[test]
    fn the_geometry_agrees_with_the_pixel_mapping() {
        // A displayed rectangle maps to the stored one that holds exactly its pixels.
        let (w, h) = (7usize, 5usize);
        for v in 1..=8 {
            let o = Orientation::new(v);
            let (dw, dh) = o.displayed(w as u32, h as u32);
            let r = Rect {
                x: 1.0,
                y: 2.0,
                w: 3.0,
                h: 2.0,
            };
            assert!(r.x + r.w <= dw as f64 && r.y + r.h <= dh as f64);
            let s = o.stored_rect(&r, w as f64, h as f64);
            for y in 2..4 {
                for x in 1..4 {
                    let (sx, sy) = o.source(x, y, w, h);
                    assert!(sx < w && sy < h, "{v}");
                    assert!(
                        (sx as f64) >= s.x && (sx as f64) < s.x + s.w && (sy as f64) >= s.y && (sy as f64) < s.y + s.h,
                        "orientation {v}: ({x}, {y}) -> ({sx}, {sy}) outside {s:?}"
                    );
                }
            }
            assert_eq!(s.w * s.h, r.w * r.h);
            // Mirroring twice is the orientation itself; mirroring changes every pixel's source.
            assert_eq!(o.mirrored_if(true).mirrored_if(true), o);
            assert_ne!(o.mirrored_if(true).source(0, 0, w, h), o.source(0, 0, w, h));
        }
    }

    /// A PNG of `px` (`w` x `h` RGB) with an `eXIf` chunk of orientation `v` (none for 0).
    fn png(px: &[u8], w: u32, h: u32, v: u16) -> Vec<u8> {
        let mut out = Vec::new();
        let mut e = png::Encoder::new(&mut out, w, h);
        e.set_color(png::ColorType::Rgb);
        let mut wr = e.write_header().unwrap();
        if v > 0 {
            wr.write_chunk(png::chunk::ChunkType(*b"eXIf"), &tiff(v, true)).unwrap();
        }
        wr.write_image_data(px).unwrap();
        drop(wr);
        out
    }

    #[test]
    fn a_turned_image_is_processed_as_its_shown_pixels() {
        use crate::image::{process, ImageSpec, SampleRng, Scratch, Slot};
        // Stored 90 x 60 with structure in both axes; for each orientation, the same image
        // stored already turned (no EXIF) must give the same samples, crops and flips included.
        let (w, h) = (90usize, 60usize);
        let px: Vec<u8> = (0..w * h)
            .flat_map(|i| [(i % w * 2) as u8, (i / w * 4) as u8, ((i % w) ^ (i / w)) as u8])
            .collect();
        let mut s = Scratch::default();
        for v in 1..=8u16 {
            let o = Orientation::new(v);
            let (dw, dh) = o.displayed(w as u32, h as u32);
            let mut shown = vec![0u8; w * h * 3];
            for y in 0..dh as usize {
                for x in 0..dw as usize {
                    let (sx, sy) = o.source(x, y, w, h);
                    let d = (y * dw as usize + x) * 3;
                    shown[d..d + 3].copy_from_slice(&px[(sy * w + sx) * 3..(sy * w + sx) * 3 + 3]);
                }
            }
            let tagged = png(&px, w as u32, h as u32, v);
            assert_eq!(orientation(&tagged).value(), v as u8);
            let plain = png(&shown, dw, dh, 0);
            let mut spec = ImageSpec::train(32);
            spec.height = 24;
            for i in 0..12 {
                let (mut a, mut b) = (vec![0u8; spec.elems()], vec![0u8; spec.elems()]);
                process(
                    &tagged,
                    &spec,
                    &mut SampleRng::new(1, 0, 0, i),
                    Slot::U8(&mut a),
                    &mut s,
                )
                .unwrap();
                process(&plain, &spec, &mut SampleRng::new(1, 0, 0, i), Slot::U8(&mut b), &mut s).unwrap();
                let worst = a.iter().zip(&b).map(|(x, y)| x.abs_diff(*y)).max().unwrap();
                assert!(worst <= 1, "orientation {v} sample {i}: a pixel differs by {worst}");
            }
            // Turned off, the stored pixels are used as they are.
            spec.exif_orientation = false;
            let (mut a, mut b) = (vec![0u8; spec.elems()], vec![0u8; spec.elems()]);
            process(
                &tagged,
                &spec,
                &mut SampleRng::new(1, 0, 0, 3),
                Slot::U8(&mut a),
                &mut s,
            )
            .unwrap();
            process(
                &png(&px, w as u32, h as u32, 0),
                &spec,
                &mut SampleRng::new(1, 0, 0, 3),
                Slot::U8(&mut b),
                &mut s,
            )
            .unwrap();
            assert_eq!(a, b, "orientation {v} with exif_orientation off");
            // The whole decode shows it too.
            let d = crate::image::decode_shown(&tagged, orientation(&tagged)).unwrap();
            assert_eq!((d.width, d.height, &d.data), (dw, dh, &shown), "orientation {v}");
        }
    }
}
