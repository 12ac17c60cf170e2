//! The engine's one public error type.
//!
//! Every variant names the thing that was wrong (object key or URL, shard, sample, path) so the
//! message alone is enough to act on. Backend errors (object_store, io) are converted at the
//! boundary and never leak as their own types.

use std::fmt;

/// Result alias used throughout the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where in a dataset a corruption was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// Object key or URL of the shard (or manifest).
    pub object: String,
    /// Sample index inside the shard, when the problem is in one sample.
    pub sample: Option<u64>,
    /// Byte offset inside the object, when known.
    pub offset: Option<u64>,
}

impl Location {
    /// A whole object.
    pub fn object(object: impl Into<String>) -> Self {
        Self {
            object: object.into(),
            sample: None,
            offset: None,
        }
    }

    /// One sample of an object.
    pub fn sample(object: impl Into<String>, sample: u64) -> Self {
        Self {
            object: object.into(),
            sample: Some(sample),
            offset: None,
        }
    }

    /// Adds a byte offset.
    pub fn at(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.object)?;
        if let Some(s) = self.sample {
            write!(f, " sample {s}")?;
        }
        if let Some(o) = self.offset {
            write!(f, " at byte {o}")?;
        }
        Ok(())
    }
}

/// Why a value was refused (a key, a schema, a brace pattern, a saved position, a shard table,
/// a boxes column), before the caller names whose it was: the caller turns it into an
/// [`Error`] that names the object, input or sample (`Error::invalid(what, reason)`,
/// `Error::corrupt(at, reason)`, a manifest error). Validation helpers return it instead of a
/// bare `String`, so an unexplained string can never pass for an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(String);

impl Invalid {
    /// The reason.
    pub fn new(reason: impl Into<String>) -> Self {
        Invalid(reason.into())
    }

    /// The reason, as text.
    pub fn reason(&self) -> &str {
        &self.0
    }

    /// Whether `text` appears in the reason.
    pub fn contains(&self, text: &str) -> bool {
        self.0.contains(text)
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Invalid {}

impl From<String> for Invalid {
    fn from(reason: String) -> Self {
        Invalid(reason)
    }
}

impl From<&str> for Invalid {
    fn from(reason: &str) -> Self {
        Invalid(reason.to_owned())
    }
}

impl From<Invalid> for String {
    fn from(i: Invalid) -> Self {
        i.0
    }
}

/// Errors a caller can act on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The object does not exist at the origin.
    #[error("missing object {key}: not found")]
    NotFound {
        /// Full URL or key of the missing object.
        key: String,
    },
    /// Bytes do not match their checksum or the format's structure.
    #[error("corrupt {at}: {reason}")]
    Corrupt {
        /// Where.
        at: Location,
        /// What was wrong, with expected and found values where there are some.
        reason: String,
    },
    /// An object is shorter than the manifest or its own header says.
    #[error("truncated {object}: expected {expected} bytes, found {actual}")]
    Truncated {
        /// Object key or URL.
        object: String,
        /// Bytes expected.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// A shard's schema differs from the manifest's.
    #[error("schema mismatch in {object}: manifest has {expected}, shard has {found}")]
    SchemaMismatch {
        /// Shard key or URL.
        object: String,
        /// Schema the manifest declares.
        expected: String,
        /// Schema found in the shard.
        found: String,
    },
    /// The manifest cannot be used.
    #[error("bad manifest {object}: {reason}")]
    Manifest {
        /// Manifest key or URL.
        object: String,
        /// What was wrong.
        reason: String,
    },
    /// The origin failed after every retry, or refused the request.
    #[error("origin error on {object} after {attempts} attempt(s): {reason}")]
    Origin {
        /// Object key or URL.
        object: String,
        /// Attempts made.
        attempts: u32,
        /// The last error.
        reason: String,
    },
    /// The origin refused our credentials.
    #[error("access denied to {object}: {reason}")]
    Auth {
        /// Object key or URL.
        object: String,
        /// The origin's message.
        reason: String,
    },
    /// A local file could not be read or written.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// File path.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Input given to a writer (a sample, a file to pack, an option) is not acceptable.
    #[error("invalid input {what}: {reason}")]
    InvalidInput {
        /// The offending input: a path, `path:line`, or a sample description.
        what: String,
        /// Why it was refused.
        reason: String,
    },
    /// A URL could not be understood.
    #[error("invalid URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why.
        reason: String,
    },
    /// One of ramjet's own threads failed (a bug): the work it carried is lost, and said so.
    #[error("internal error in {thread}: {reason}")]
    Internal {
        /// The thread, by name.
        thread: String,
        /// What it reported (the panic message).
        reason: String,
    },
}

impl Clone for Error {
    /// A copy for every waiter of a shared fetch. An `Io` error's OS error is kept (its code,
    /// or its kind and message).
    fn clone(&self) -> Self {
        use Error::*;
        match self {
            NotFound { key } => NotFound { key: key.clone() },
            Corrupt { at, reason } => Corrupt {
                at: at.clone(),
                reason: reason.clone(),
            },
            Truncated {
                object,
                expected,
                actual,
            } => Truncated {
                object: object.clone(),
                expected: *expected,
                actual: *actual,
            },
            SchemaMismatch {
                object,
                expected,
                found,
            } => SchemaMismatch {
                object: object.clone(),
                expected: expected.clone(),
                found: found.clone(),
            },
            Manifest { object, reason } => Manifest {
                object: object.clone(),
                reason: reason.clone(),
            },
            Origin {
                object,
                attempts,
                reason,
            } => Origin {
                object: object.clone(),
                attempts: *attempts,
                reason: reason.clone(),
            },
            Auth { object, reason } => Auth {
                object: object.clone(),
                reason: reason.clone(),
            },
            Io { path, source } => Io {
                path: path.clone(),
                source: match source.raw_os_error() {
                    Some(code) => std::io::Error::from_raw_os_error(code),
                    None => std::io::Error::new(source.kind(), source.to_string()),
                },
            },
            InvalidInput { what, reason } => InvalidInput {
                what: what.clone(),
                reason: reason.clone(),
            },
            InvalidUrl { url, reason } => InvalidUrl {
                url: url.clone(),
                reason: reason.clone(),
            },
            Internal { thread, reason } => Internal {
                thread: thread.clone(),
                reason: reason.clone(),
            },
        }
    }
}

impl Error {
    /// Shorthand for a [`Error::Corrupt`].
    pub fn corrupt(at: Location, reason: impl Into<String>) -> Self {
        Error::Corrupt {
            at,
            reason: reason.into(),
        }
    }

    /// Shorthand for an [`Error::Io`].
    pub fn io(path: impl fmt::Display, source: std::io::Error) -> Self {
        Error::Io {
            path: path.to_string(),
            source,
        }
    }

    /// Shorthand for an [`Error::InvalidInput`].
    pub fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// An [`Error::Internal`] from a caught panic's payload.
    pub fn from_panic(thread: &str, payload: &(dyn std::any::Any + Send)) -> Self {
        let reason = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panicked".into());
        Error::Internal {
            thread: thread.to_owned(),
            reason: format!("panicked: {reason}"),
        }
    }

    /// True when the bytes themselves are bad (re-fetching from elsewhere may help).
    pub fn is_data_error(&self) -> bool {
        matches!(
            self,
            Error::Corrupt { .. } | Error::Truncated { .. } | Error::SchemaMismatch { .. }
        )
    }
}
