from typing import TypedDict

__version__: str

class Error(Exception):
    """Base class of every error ramjet raises."""

class NotFoundError(Error): ...
class CorruptError(Error): ...
class OriginError(Error): ...
class LocalError(Error): ...
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

def gpu_info() -> Dict[str, Any]:
    """Whether the CUDA driver loads, the GPUs it sees, and where nvJPEG, NVRTC and cuFile were found."""

def verify(url: str, parallel: int = 4) -> VerifyResult:
    """Re-read every shard and check every checksum; ``problems`` names each bad shard and sample."""

def columns(url: str, names: list[str]) -> dict[str, list[Any]]:
    """Columns ``names`` of every sample, in sample order, from the columns sidecars when the
    dataset has them (labels without the images); ``bytes`` columns are refused."""

class RingFreeze:
    """A lease holding the cluster ring at one version; released by ``release()`` or ``with``."""

    def release(self) -> None: ...
    def __enter__(self) -> "RingFreeze": ...
    def __exit__(self, *exc: Any) -> None: ...

def freeze(socket: str) -> RingFreeze:
    """Hold the ring of the daemon at ``socket`` at its current version for a training run."""

class Reader:
    """Random access to one dataset's samples by global index (see ``ramjet.Reader``'s docstring)."""

    url: str
    device: str
    def __init__(self, url: str, *, resident_bytes: Optional[int] = None, **options: Any) -> None: ...
    def get(self, index: int) -> Dict[str, Any]: ...
    def get_bytes(self, index: int, column: str) -> bytes: ...
    def metrics(self) -> Dict[str, float]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Reader": ...
    def __exit__(self, *exc: Any) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Dict[str, Any]: ...

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

class Tensor:
    """A host tensor exported through DLPack (``torch.from_dlpack(t)`` copies nothing)."""

    @property
    def shape(self) -> list[int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def data_ptr(self) -> int: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

@dataclass(frozen=True)
class Source:
    """One dataset of a mix, with at most one of ``proportion``, ``repeat``, ``count``."""

    remote: str
    proportion: Optional[float] = None
    repeat: Optional[float] = None
    count: Optional[int] = None

@dataclass(frozen=True)
class Stream(Source):
    """Deprecated name of ``Source``."""

class StreamingDataset:
    """Batches from packed datasets as dicts of tensors; see docs/python.md."""

    batch_size: int
    def __init__(
        self,
        remote: Union[str, Source, Sequence[Union[str, Source]]],
        local: Optional[str] = None,
        *,
        batch_size: int = 32,
        shuffle: bool = True,
        shuffle_algo: str = "shard_block",
        seed: int = 0,
        shuffle_window: int = 4,
        shuffle_block: int = 1,
        partitions: Optional[int] = None,
        tail: Optional[str] = None,
        shares: str = "rotate",
        drop_last: bool = False,
        cache_limit: Union[int, str, None] = "64GiB",
        image_size: Union[int, Tuple[int, int], None] = 224,
        augment: str = "train",
        normalize: bool = False,
        mean: Sequence[float] = ...,
        std: Sequence[float] = ...,
        scale: Tuple[float, float] = (0.08, 1.0),
        ratio: Tuple[float, float] = ...,
        flip: float = 0.5,
        crop_fraction: float = 0.875,
        dct_scaling: bool = True,
        exif_orientation: bool = True,
        image_column: str = "image",
        boxes_column: Optional[str] = "boxes",
        num_threads: Optional[int] = None,
        prefetch_batches: Optional[int] = None,
        on_corrupt: str = "error",
        filter: Optional[str] = None,
        buckets: Optional[Sequence[Tuple[int, int]]] = None,
        decode: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        daemon: Optional[str] = None,
        device: str = "cpu",
    ) -> None: ...
    device: str
    """Where batches are yielded: ``"cpu"`` or ``"cuda:N"`` (``"auto"`` resolved)."""
    def __iter__(self) -> Iterator[Dict[str, Any]]:
        """Batches of the current epoch (ramjet's loader: Rust threads, GIL released)."""
    def __len__(self) -> int:
        """Batches this process yields per epoch."""
    def __getitem__(self, index: int) -> Dict[str, Any]:
        """Sample ``index`` of the first dataset, decoded with the evaluation transform."""
    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration reads (from its start)."""
    @property
    def epoch(self) -> int: ...
    @property
    def num_samples(self) -> int:
        """Samples in one epoch across the whole job."""
    @property
    def samples_per_rank(self) -> int:
        """Samples this consumer reads per epoch."""
    def state_dict(self) -> Dict[str, Any]:
        """The job's position after the last yielded batch (collective under torch.distributed)."""
    def audit(self) -> Dict[str, Any]:
        """The exactly-once audit of the epoch in progress: ``exactly_once``, ``complete``,
        ``delivered``, ``expected``, ``message``."""
    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Continue from a state_dict: the next iteration yields the rest of its epoch. A state
        whose data contract's transform spec differs is refused naming the field (strict=False:
        a warning)."""
    def contract(self) -> Dict[str, Any]:
        """The data contract: ramjet's version, the sources and their manifest versions, the
        order, the transform spec (also in every state_dict, as "contract")."""
    def metrics(self) -> Dict[str, float]:
        """Counters of the running loader."""
    def close(self) -> None:
        """Stops this process's loader and reader; the position is kept."""
    def __enter__(self) -> "StreamingDataset": ...
    def __exit__(self, *exc: Any) -> None: ...

class TokenDataset:
    """Fixed-length token windows for causal language models; see docs/python.md, "Token streams"."""

    seq_len: int
    batch_size: int
    eos: Optional[int]
    def __init__(
        self,
        remote: Union[str, Source, Sequence[Union[str, Source]]],
        local: Optional[str] = None,
        *,
        seq_len: int = 2048,
        batch_size: int = 8,
        column: str = "tokens",
        eos: Union[int, str, None] = "auto",
        pad: Optional[int] = None,
        boundaries: bool = False,
        dtype: str = "int64",
        token_dtype: Optional[str] = None,
        shuffle: bool = True,
        shuffle_algo: str = "shard_block",
        seed: int = 0,
        shuffle_window: int = 4,
        shuffle_block: int = 1,
        partitions: int = 1,
        shares: str = "rotate",
        cache_limit: Union[int, str, None] = "64GiB",
        prefetch_batches: int = 4,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        daemon: Optional[str] = None,
    ) -> None: ...
    def __iter__(self) -> Iterator[Dict[str, Any]]:
        """Batches of the current epoch's windows: ``tokens``, ``input_ids``, ``labels``,
        ``lengths``, ``window`` (and ``position_ids``, ``segment_ids`` with boundaries)."""
    def set_epoch(self, epoch: int) -> None: ...
    @property
    def epoch(self) -> int: ...
    def state_dict(self) -> Dict[str, Any]:
        """The job's position: the first window not delivered, inside its document."""
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...
    def consumer_state(self) -> str:
        """This consumer's own position (JSON), for :meth:`combine_states`."""
    def combine_states(self, states: Sequence[str]) -> Dict[str, Any]:
        """The job's state from every consumer's own."""
    def close(self) -> None:
        """Stops the token stream; the position is kept (iterating again goes on from it)."""
    def __enter__(self) -> "TokenDataset": ...
    def __exit__(self, *exc: Any) -> None: ...

def init(
    cache_dir: Optional[str] = None,
    *,
    socket: Optional[str] = None,
    cache_limit: Union[int, str] = "64GiB",
) -> str: ...
