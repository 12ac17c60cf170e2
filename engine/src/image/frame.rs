//! A JPEG's frame header, read without decoding: the coding process (baseline, progressive,
//! ...), the sample precision, the size, each component's sampling factors, the Adobe colour
//! transform and the restart interval. [`crate::image::probe`] takes its size from here, and
//! the GPU decode routing ([`crate::image::route`]) decides from the rest which decoder can
//! take the image: nvJPEG's hardware engine reads only 8-bit baseline (or extended Huffman)
//! single-scan JPEGs in its chroma layouts, its hybrid decoder more, the CPU anything.

use crate::image::ImageError;

/// How the frame is coded (the start-of-frame marker, ITU T.81 table B.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JpegCoding {
    /// SOF0: baseline sequential DCT, Huffman.
    Baseline,
    /// SOF1: extended sequential DCT, Huffman.
    Extended,
    /// SOF2: progressive DCT, Huffman.
    Progressive,
    /// SOF3: lossless, Huffman.
    Lossless,
    /// SOF5 to SOF7, SOF13 to SOF15: hierarchical.
    Hierarchical,
    /// SOF9 to SOF11: arithmetic coding.
    Arithmetic,
}

/// One component of the frame: its identifier and sampling factors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Component {
    /// Component identifier.
    pub id: u8,
    /// Horizontal sampling factor (1 to 4).
    pub h: u8,
    /// Vertical sampling factor (1 to 4).
    pub v: u8,
}

/// Chroma layout, named as nvJPEG names it (`nvjpegChromaSubsampling_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subsampling {
    /// 4:4:4: no chroma subsampling.
    S444,
    /// 4:2:2: chroma halved horizontally.
    S422,
    /// 4:2:0: chroma halved both ways.
    S420,
    /// 4:4:0: chroma halved vertically.
    S440,
    /// 4:1:1: chroma quartered horizontally.
    S411,
    /// 4:1:0: chroma quartered horizontally and halved vertically.
    S410,
    /// One component.
    Gray,
    /// Anything else: four components (CMYK, YCCK), unusual factors.
    Other,
}

/// What a JPEG's headers say, up to its start-of-frame segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JpegFrame {
    /// The coding process.
    pub coding: JpegCoding,
    /// Bits per sample (8 for nearly every photo, 12 in some medical images).
    pub precision: u8,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// The components, in frame order (1 to 4).
    pub components: Vec<Component>,
    /// The Adobe APP14 colour transform when present (0: none or CMYK, 1: YCbCr, 2: YCCK).
    pub adobe_transform: Option<u8>,
    /// The restart interval in MCUs from a DRI segment before the frame, 0 when none.
    pub restart_interval: u16,
}

impl JpegFrame {
    /// The chroma layout, from the sampling factors: the luma's against chroma of 1x1.
    pub fn subsampling(&self) -> Subsampling {
        match self.components.as_slice() {
            [_] => Subsampling::Gray,
            [y, cb, cr] if (cb.h, cb.v, cr.h, cr.v) == (1, 1, 1, 1) => match (y.h, y.v) {
                (1, 1) => Subsampling::S444,
                (2, 1) => Subsampling::S422,
                (2, 2) => Subsampling::S420,
                (1, 2) => Subsampling::S440,
                (4, 1) => Subsampling::S411,
                (4, 2) => Subsampling::S410,
                _ => Subsampling::Other,
            },
            _ => Subsampling::Other,
        }
    }

    /// The MCU's size in pixels: 8 times the largest sampling factor each way (8x8 for one
    /// component, whose scan is not interleaved).
    pub fn mcu(&self) -> (u32, u32) {
        if self.components.len() == 1 {
            return (8, 8);
        }
        let h = self.components.iter().map(|c| c.h).max().unwrap_or(1) as u32;
        let v = self.components.iter().map(|c| c.v).max().unwrap_or(1) as u32;
        (8 * h, 8 * v)
    }

    /// Four components: CMYK, or YCCK with Adobe's transform 2.
    pub fn is_cmyk(&self) -> bool {
        self.components.len() == 4
    }
}

/// Reads the frame header, checking the structure a decoder relies on: an end-of-image
/// marker near the end, segments that fit, a start-of-frame segment before the scan, a
/// nonzero size, 1 to 4 components with sampling factors 1 to 4.
pub fn jpeg_frame(b: &[u8]) -> Result<JpegFrame, ImageError> {
    let bad = |m: String| Err(ImageError::Malformed(format!("malformed JPEG: {m}")));
    let tail = &b[b.len().saturating_sub(4096)..];
    if !tail.windows(2).any(|w| w == [0xFF, 0xD9]) {
        return bad("no end-of-image marker (truncated?)".into());
    }
    let (mut adobe_transform, mut restart_interval) = (None, 0u16);
    let mut i = 2usize;
    loop {
        // Skip to the next marker; fill bytes (0xFF runs) are allowed between segments.
        while i < b.len() && b[i] != 0xFF {
            i += 1;
        }
        while i < b.len() && b[i] == 0xFF {
            i += 1;
        }
        let Some(&m) = b.get(i) else {
            return bad("no start-of-frame segment".into());
        };
        i += 1;
        match m {
            0xD8 | 0x01 | 0xD0..=0xD7 => continue,
            0xDA | 0xD9 => return bad("scan data before any start-of-frame segment".into()),
            _ => {}
        }
        let Some(l) = b.get(i..i + 2) else {
            return bad("segment header runs past the end".into());
        };
        let len = u16::from_be_bytes([l[0], l[1]]) as usize;
        if len < 2 || i + len > b.len() {
            return bad(format!("segment 0x{m:02X} length {len} runs past the end"));
        }
        let body = &b[i + 2..i + len];
        match m {
            0xEE if body.len() >= 12 && body.starts_with(b"Adobe") => adobe_transform = Some(body[11]),
            0xDD if body.len() >= 2 => restart_interval = u16::from_be_bytes([body[0], body[1]]),
            0xC0..=0xCF if !matches!(m, 0xC4 | 0xC8 | 0xCC) => {
                return frame_from_sof(m, body, adobe_transform, restart_interval);
            }
            _ => {}
        }
        i += len;
    }
}

/// The frame from a start-of-frame segment's body (after its length).
fn frame_from_sof(
    m: u8,
    body: &[u8],
    adobe_transform: Option<u8>,
    restart_interval: u16,
) -> Result<JpegFrame, ImageError> {
    let bad = |m: String| Err(ImageError::Malformed(format!("malformed JPEG: {m}")));
    if body.len() < 6 {
        return bad("start-of-frame segment too short".into());
    }
    let precision = body[0];
    let height = u16::from_be_bytes([body[1], body[2]]) as u32;
    let width = u16::from_be_bytes([body[3], body[4]]) as u32;
    if width == 0 || height == 0 {
        return bad(format!("frame size {width}x{height}"));
    }
    let n = body[5] as usize;
    if !(1..=4).contains(&n) || body.len() < 6 + 3 * n {
        return bad(format!(
            "start-of-frame declares {n} components in {} bytes",
            body.len()
        ));
    }
    let mut components = Vec::with_capacity(n);
    for c in body[6..6 + 3 * n].chunks_exact(3) {
        let (h, v) = (c[1] >> 4, c[1] & 0x0F);
        if !(1..=4).contains(&h) || !(1..=4).contains(&v) {
            return bad(format!("component {} has sampling factors {h}x{v}", c[0]));
        }
        components.push(Component { id: c[0], h, v });
    }
    let coding = match m {
        0xC0 => JpegCoding::Baseline,
        0xC1 => JpegCoding::Extended,
        0xC2 => JpegCoding::Progressive,
        0xC3 => JpegCoding::Lossless,
        0xC9..=0xCB => JpegCoding::Arithmetic,
        _ => JpegCoding::Hierarchical,
    };
    Ok(JpegFrame {
        coding,
        precision,
        width,
        height,
        components,
        adobe_transform,
        restart_interval,
    })
}

/// A flat-grey-ish JPEG of `w` x `h` in the given layout, from a real encoder (tests here and
/// in [`crate::image::route`]).
#[cfg(test)]
pub(crate) fn test_jpeg(
    w: u16,
    h: u16,
    sampling: jpeg_encoder::SamplingFactor,
    progressive: bool,
    color: jpeg_encoder::ColorType,
) -> Vec<u8> {
    use jpeg_encoder::ColorType::{Cmyk, CmykAsYcck, Luma, Ycck};
    let bpp = match color {
        Luma => 1,
        Cmyk | CmykAsYcck | Ycck => 4,
        _ => 3,
    };
    let px: Vec<u8> = (0..w as usize * h as usize * bpp)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let mut out = Vec::new();
    let mut e = jpeg_encoder::Encoder::new(&mut out, 85);
    e.set_sampling_factor(sampling);
    e.set_progressive(progressive);
    e.encode(&px, w, h, color).expect("encodes");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jpeg(sampling: jpeg_encoder::SamplingFactor, progressive: bool, color: jpeg_encoder::ColorType) -> Vec<u8> {
        test_jpeg(40, 24, sampling, progressive, color)
    }

    /// The sampling factors, coding and components of real encoder output, every layout the
    /// routing tells apart.
    #[test]
    fn reads_what_an_encoder_wrote() {
        use jpeg_encoder::ColorType::{Cmyk, Luma, Rgb};
        use jpeg_encoder::SamplingFactor::*;
        for (s, want) in [
            (F_1_1, Subsampling::S444),
            (F_2_1, Subsampling::S422),
            (F_2_2, Subsampling::S420),
            (F_1_2, Subsampling::S440),
            (F_4_1, Subsampling::S411),
            (F_4_2, Subsampling::S410),
        ] {
            let f = jpeg_frame(&jpeg(s, false, Rgb)).unwrap();
            assert_eq!(
                (f.subsampling(), f.coding, f.precision),
                (want, JpegCoding::Baseline, 8),
                "{s:?}"
            );
            assert_eq!((f.width, f.height), (40, 24));
            let (y, c) = (f.components[0], f.components[1]);
            assert_eq!(f.mcu(), (8 * y.h as u32, 8 * y.v as u32), "{s:?}");
            assert_eq!((c.h, c.v), (1, 1));
        }
        let p = jpeg_frame(&jpeg(F_2_2, true, Rgb)).unwrap();
        assert_eq!(
            (p.coding, p.subsampling()),
            (JpegCoding::Progressive, Subsampling::S420)
        );
        let g = jpeg_frame(&jpeg(F_2_2, false, Luma)).unwrap();
        assert_eq!(
            (g.subsampling(), g.mcu(), g.is_cmyk()),
            (Subsampling::Gray, (8, 8), false)
        );
        let k = jpeg_frame(&jpeg(F_1_1, false, Cmyk)).unwrap();
        assert!(k.is_cmyk());
        assert_eq!(k.subsampling(), Subsampling::Other);
        assert!(
            k.adobe_transform.is_some(),
            "jpeg-encoder writes an Adobe segment for CMYK"
        );
    }

    /// Broken frames are refused by name, never read past their end.
    #[test]
    fn refuses_broken_frames() {
        let good = jpeg(jpeg_encoder::SamplingFactor::F_2_2, false, jpeg_encoder::ColorType::Rgb);
        let sof = good.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
        let mut zero_components = good.clone();
        zero_components[sof + 9] = 0;
        assert!(jpeg_frame(&zero_components)
            .unwrap_err()
            .contains("declares 0 components"));
        let mut bad_factor = good.clone();
        bad_factor[sof + 11] = 0x51;
        assert!(jpeg_frame(&bad_factor).unwrap_err().contains("sampling factors 5x1"));
        assert!(jpeg_frame(&good[..good.len() - 2])
            .unwrap_err()
            .contains("end-of-image"));
        for cut in 3..sof + 12 {
            let mut j = good[..cut].to_vec();
            j.extend_from_slice(&[0xFF, 0xD9]);
            assert!(jpeg_frame(&j).is_err(), "cut at {cut}");
        }
    }
}
