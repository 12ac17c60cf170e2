from typing import TypedDict

__version__: str

class Error(Exception):
    """Base class of every error ramjet raises."""

class NotFoundError(Error): ...
class CorruptError(Error): ...
class OriginError(Error): ...
class AuthError(Error): ...
class InvalidInputError(Error): ...

class DatasetInfo(TypedDict):
    url: str
    version: str
    source: str
    schema: list[tuple[str, str]]
    shards: int
    samples: int
    bytes: int

class VerifyResult(TypedDict):
    ok: bool
    shards: int
    samples: int
    bytes_read: int
    problems: list[str]

def inspect(url: str) -> DatasetInfo:
    """Read a dataset's manifest (``s3://bucket/prefix``, a local folder, or a manifest .json)."""

def verify(url: str, parallel: int = 4) -> VerifyResult:
    """Re-read every shard and check every checksum; ``problems`` names each bad shard and sample."""
