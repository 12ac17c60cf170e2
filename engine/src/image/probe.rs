//! Probing an encoded image's format and size from its header, before any pixel is decoded:
//! `ramjet pack` refuses malformed or unsupported images with it before they reach a shard, and
//! the loader plans each crop from it.

use crate::image::ImageError;

/// Encoded image formats ramjet reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// JPEG (baseline or progressive).
    Jpeg,
    /// PNG.
    Png,
}

/// What a header says about an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// Format.
    pub format: ImageFormat,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

/// Reads format and size from an encoded image, checking the structure a decoder will rely
/// on: for JPEG, a start-of-frame segment before the scan and an end-of-image marker near the
/// end; for PNG, the signature, an IHDR chunk first and an IEND chunk last.
pub fn probe(b: &[u8]) -> Result<ImageInfo, ImageError> {
    if b.starts_with(&[0xFF, 0xD8, 0xFF]) {
        probe_jpeg(b)
    } else if b.starts_with(b"\x89PNG\r\n\x1a\n") {
        probe_png(b)
    } else {
        let head: Vec<String> = b.iter().take(4).map(|x| format!("{x:02x}")).collect();
        Err(ImageError::Malformed(format!(
            "not a JPEG or PNG (first bytes {})",
            head.join(" ")
        )))
    }
}

fn probe_jpeg(b: &[u8]) -> Result<ImageInfo, ImageError> {
    let tail = &b[b.len().saturating_sub(4096)..];
    if !tail.windows(2).any(|w| w == [0xFF, 0xD9]) {
        return Err(ImageError::Malformed(
            "malformed JPEG: no end-of-image marker (truncated?)".into(),
        ));
    }
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
            return Err(ImageError::Malformed(
                "malformed JPEG: no start-of-frame segment".into(),
            ));
        };
        i += 1;
        match m {
            0xD8 | 0x01 | 0xD0..=0xD7 => continue,
            0xDA | 0xD9 => {
                return Err(ImageError::Malformed(
                    "malformed JPEG: scan data before any start-of-frame segment".into(),
                ))
            }
            _ => {}
        }
        let len = match b.get(i..i + 2) {
            Some(l) => u16::from_be_bytes([l[0], l[1]]) as usize,
            None => {
                return Err(ImageError::Malformed(
                    "malformed JPEG: segment header runs past the end".into(),
                ))
            }
        };
        if len < 2 || i + len > b.len() {
            return Err(ImageError::Malformed(format!(
                "malformed JPEG: segment 0x{m:02X} length {len} runs past the end"
            )));
        }
        let is_sof = matches!(m, 0xC0..=0xCF) && !matches!(m, 0xC4 | 0xC8 | 0xCC);
        if is_sof {
            if len < 8 {
                return Err(ImageError::Malformed(
                    "malformed JPEG: start-of-frame segment too short".into(),
                ));
            }
            let height = u16::from_be_bytes([b[i + 3], b[i + 4]]) as u32;
            let width = u16::from_be_bytes([b[i + 5], b[i + 6]]) as u32;
            if width == 0 || height == 0 {
                return Err(ImageError::Malformed(format!(
                    "malformed JPEG: frame size {width}x{height}"
                )));
            }
            return Ok(ImageInfo {
                format: ImageFormat::Jpeg,
                width,
                height,
            });
        }
        i += len;
    }
}

fn probe_png(b: &[u8]) -> Result<ImageInfo, ImageError> {
    if b.len() < 8 + 25 + 12 || &b[12..16] != b"IHDR" {
        return Err(ImageError::Malformed("malformed PNG: IHDR chunk missing".into()));
    }
    if &b[b.len() - 8..b.len() - 4] != b"IEND" {
        return Err(ImageError::Malformed(
            "malformed PNG: no IEND chunk at the end (truncated?)".into(),
        ));
    }
    let width = u32::from_be_bytes(b[16..20].try_into().expect("4"));
    let height = u32::from_be_bytes(b[20..24].try_into().expect("4"));
    if width == 0 || height == 0 || width > 1 << 24 || height > 1 << 24 {
        return Err(ImageError::Malformed(format!(
            "malformed PNG: image size {width}x{height}"
        )));
    }
    Ok(ImageInfo {
        format: ImageFormat::Png,
        width,
        height,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_text_and_truncated_jpeg() {
        assert!(probe(b"hello world").unwrap_err().contains("not a JPEG or PNG"));
        let mut j = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x04, 0, 0];
        j.extend_from_slice(&[0xFF, 0xC0, 0x00, 0x0B, 8, 0x01, 0xE0, 0x02, 0x80, 1, 0x11, 0]);
        assert!(probe(&j).unwrap_err().contains("end-of-image"));
        j.extend_from_slice(&[0xFF, 0xD9]);
        assert_eq!(
            probe(&j).unwrap(),
            ImageInfo {
                format: ImageFormat::Jpeg,
                width: 640,
                height: 480
            }
        );
    }
}
