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
    /// WebP, lossy or lossless (a still image).
    Webp,
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
/// end; for PNG, the signature, an IHDR chunk first and an IEND chunk last; for WebP, the RIFF
/// container's size against the bytes given, and a still image (an animation is refused).
pub fn probe(b: &[u8]) -> Result<ImageInfo, ImageError> {
    if b.starts_with(&[0xFF, 0xD8, 0xFF]) {
        probe_jpeg(b)
    } else if b.starts_with(b"\x89PNG\r\n\x1a\n") {
        probe_png(b)
    } else if crate::image::webp::is_webp(b) {
        let f = crate::image::webp::features(b)?;
        Ok(ImageInfo {
            format: ImageFormat::Webp,
            width: f.width,
            height: f.height,
        })
    } else {
        let head: Vec<String> = b.iter().take(4).map(|x| format!("{x:02x}")).collect();
        Err(ImageError::Malformed(format!(
            "not a JPEG, PNG or WebP (first bytes {})",
            head.join(" ")
        )))
    }
}

fn probe_jpeg(b: &[u8]) -> Result<ImageInfo, ImageError> {
    let f = crate::image::frame::jpeg_frame(b)?;
    Ok(ImageInfo {
        format: ImageFormat::Jpeg,
        width: f.width,
        height: f.height,
    })
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
        assert!(probe(b"hello world").unwrap_err().contains("not a JPEG, PNG or WebP"));
        let mut j = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x04, 0, 0];
        j.extend_from_slice(&[0xFF, 0xC0, 0x00, 0x0B, 8, 0x01, 0xE0, 0x02, 0x80, 1, 0x01, 0x11, 0]);
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
