"""ramjet: stream training data from object storage into PyTorch at GPU speed.

This release exposes dataset inspection and verification; the streaming loader builds on
these (see docs/architecture.md).
"""

from ramjet._ramjet import (
    AuthError,
    CorruptError,
    Error,
    InvalidInputError,
    NotFoundError,
    OriginError,
    __version__,
    inspect,
    verify,
)

__all__ = [
    "AuthError",
    "CorruptError",
    "Error",
    "InvalidInputError",
    "NotFoundError",
    "OriginError",
    "__version__",
    "inspect",
    "verify",
]
