//! [`ImageError`]: why an image could not be probed, decoded, resized or encoded.

/// Why an image could not be probed, decoded, resized or encoded. The message names what was
/// wrong (a marker, a chunk, a size, a codec's own words); the loader and `ramjet pack` add the
/// dataset, shard and sample or file (as `Error::Corrupt` or `Error::InvalidInput`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// Not a JPEG, PNG or WebP, or its structure is broken: a header, segment, chunk or the data.
    #[error("{0}")]
    Malformed(String),
    /// The image declares more pixels, or would take more memory, than ramjet decodes
    /// (`DECODE_PIXELS_MAX`, `DECODE_BYTES_MAX`).
    #[error("{0}")]
    TooLarge(String),
    /// The codec or resizer failed or refused a request on data that looked sound.
    #[error("{0}")]
    Codec(String),
    /// A sound image of a kind ramjet does not decode (an animated WebP).
    #[error("{0}")]
    Unsupported(String),
    /// A caller's argument is not usable: a buffer's size, a scale, a region.
    #[error("{0}")]
    Argument(String),
}

impl ImageError {
    /// The message alone (what `Display` prints).
    pub fn message(&self) -> &str {
        match self {
            ImageError::Malformed(m)
            | ImageError::TooLarge(m)
            | ImageError::Codec(m)
            | ImageError::Argument(m)
            | ImageError::Unsupported(m) => m,
        }
    }

    /// Whether `text` appears in the message.
    pub fn contains(&self, text: &str) -> bool {
        self.message().contains(text)
    }
}
