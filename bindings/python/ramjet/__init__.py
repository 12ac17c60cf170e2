"""ramjet: stream training data from object storage into PyTorch at GPU speed.

Quick start::

    import ramjet
    ds = ramjet.StreamingDataset(remote="s3://bucket/dataset", local="/nvme/ramjet",
                                 batch_size=256, image_size=224)
    for epoch in range(10):
        ds.set_epoch(epoch)
        for batch in ds:            # dict of torch tensors, decoded by Rust threads
            train_step(batch["image"], batch["label"])

Iterating the dataset directly is ramjet's own loader: shards are fetched and images are
decoded and augmented by Rust threads with the GIL released, so no worker processes are
needed. Inside ``torch.utils.data.DataLoader(ds, batch_size=None, num_workers=N)`` each
worker reads its own share of every epoch instead.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ramjet import _ramjet
from ramjet._ramjet import (
    AuthError,
    CorruptError,
    Error,
    InvalidInputError,
    LocalError,
    NotFoundError,
    OriginError,
    Tensor,
    __version__,
    columns,
    freeze,
    inspect,
    verify,
)

# The base exception is made in Rust as ramjet.RamjetError and exported as ramjet.Error. Pickle
# finds a class by module and name, so under its Rust name an error raised in a DataLoader worker
# could not travel back to the trainer (torch pickles the worker's exception type): named here
# as it is exported, it can.
Error.__name__ = Error.__qualname__ = "Error"

try:  # torch is optional: without it batches hold numpy arrays.
    import torch
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]
    _Base = object  # type: ignore[assignment,misc]

__all__ = [
    "AuthError",
    "CorruptError",
    "Error",
    "InvalidInputError",
    "LocalError",
    "NotFoundError",
    "OriginError",
    "Reader",
    "Source",
    "Stream",
    "StreamingDataset",
    "Tensor",
    "TokenDataset",
    "__version__",
    "columns",
    "decode_image",
    "freeze",
    "gpu_info",
    "init",
    "inspect",
    "verify",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

def decode_image(data: bytes, image: Optional[Dict[str, Any]] = None, seed: int = 0, epoch: int = 0,
                 sample: int = 0, exif_orientation: bool = True) -> Any:
    """Decodes one encoded image (JPEG, PNG or WebP) as the loader's decode threads do.

    Without ``image``: the whole image as its EXIF orientation shows it (as stored with
    ``exif_orientation=False``), a ``[h, w, 3]`` uint8 RGB numpy array (alpha dropped).
    With ``image``, a dict of the decoder's options (``width``, ``height``, ``augment``
    (``"train"``, ``"eval"`` or ``"resize"``), ``scale``, ``ratio``, ``flip``,
    ``crop_fraction``, ``float``, ``mean``, ``std``, ``dct_scaling``, ``exif_orientation``; any
    left out take the loader's defaults): the ``[3, h, w]`` image the loader would yield for sample ``sample`` of
    ``epoch`` under ``seed`` (uint8, or float32 when ``float``). Raises ``CorruptError``
    naming what is wrong with a damaged or unsupported image.
    """
    import numpy as np

    config = None if image is None else json.dumps(image)
    raw, shape = _ramjet.decode_image(bytes(data), config, seed, epoch, sample, exif_orientation)
    dtype = np.float32 if image is not None and image.get("float") else np.uint8
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def gpu_info() -> Dict[str, Any]:
    """What this process can use of the GPU path.

    Returns ``{"driver": bool, "devices": int, "error": str | None, "libraries": {...}}``:
    whether the CUDA driver (libcuda) loads, how many GPUs it sees or why none, and for each
    CUDA user library ramjet loads at run time (``nvjpeg``, ``nvrtc``, ``cufile``) either
    ``{"path", "origin"}`` or ``{"error"}``. Libraries are looked for through
    ``RAMJET_NVJPEG`` / ``RAMJET_NVRTC`` / ``RAMJET_CUFILE`` (a file or a folder), then this
    Python environment's ``nvidia/*/lib`` folders (the PyPI wheels: ``pip install
    'ramjet[cuda]'`` brings nvJPEG), then the system. Nothing is initialised on a GPU beyond
    the driver's device count.
    """
    roots = [p for p in dict.fromkeys(sys.path) if p and os.path.isdir(p)]
    return _ramjet.gpu_info(roots)


def _resolve_device(device: str, status: Optional[Dict[str, Any]] = None, torch_cuda: Optional[bool] = None) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a ``device`` argument, or a clear error.

    ``status`` is :func:`gpu_info`'s driver part and ``torch_cuda`` whether torch can use CUDA;
    both are looked up when not given (the tests give them to check every branch).
    """
    if not isinstance(device, str):
        raise InvalidInputError(f'device must be "cpu", "cuda", "cuda:N" or "auto", not {device!r}')
    d = device.strip().lower()
    if d == "cpu":
        return "cpu"
    if d not in ("auto", "cuda") and not (d.startswith("cuda:") and d[5:].isdigit()):
        raise InvalidInputError(f'device must be "cpu", "cuda", "cuda:N" or "auto", not {device!r}')
    if status is None:
        status = _ramjet.gpu_info([])
    if torch_cuda is None:
        torch_cuda = torch is not None and torch.cuda.is_available()
    reason = None
    if status["error"] is not None:
        reason = status["error"]
    elif status["devices"] < 1:
        reason = "the CUDA driver sees no GPU"
    elif not torch_cuda:
        reason = "torch cannot use CUDA in this process (a CPU-only torch build, or no torch)"
    if reason is not None:
        if d == "auto":
            warnings.warn(f'ramjet: device="auto" runs on the CPU: {reason}', RuntimeWarning, stacklevel=3)
            return "cpu"
        raise Error(f'device={device!r}: no usable GPU: {reason}. Use device="cpu", or "auto" to fall back to it')
    if d.startswith("cuda:"):
        n = int(d[5:])
        if n >= status["devices"]:
            raise InvalidInputError(f"device={device!r}: this process sees {status['devices']} GPU(s)")
        return f"cuda:{n}"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return f"cuda:{local % status['devices']}"


# The host daemon's socket once init() ran in this process (inherited by forked workers).
_daemon_socket: Optional[str] = None


def _ramjetio_environment() -> List[str]:
    """Maps the environment variables ramjetio's page documents to ramjet's own, once, at
    import (before the engine reads its settings), and says so once on stderr. Returns the
    notices given.

    - ``RAMJET_HTTP_POOL_SIZE=N``: ``RAMJET_ORIGIN_REQUESTS=N`` (requests in flight to the
      origin), unless that is set;
    - ``RAMJET_SINGLEFLIGHT``: the host daemon always coalesces concurrent reads of a shard
      (``RAMJET_SINGLEFLIGHT_TIMEOUT_MS`` bounds a wait on another's read); ``0`` cannot turn
      it off, and says so.
    ``RAMJET_ULTRALYTICS_STRICT`` is read by ``ramjet.integrations.ultralytics`` as documented.
    """
    notes: List[str] = []
    pool = os.environ.get("RAMJET_HTTP_POOL_SIZE")
    if pool is not None:
        if not pool.strip().isdigit() or int(pool) < 1:
            notes.append(f"RAMJET_HTTP_POOL_SIZE={pool!r} is not a positive integer: left unmapped")
        elif "RAMJET_ORIGIN_REQUESTS" in os.environ:
            notes.append("RAMJET_HTTP_POOL_SIZE is ramjetio's; RAMJET_ORIGIN_REQUESTS, set too, wins")
        else:
            os.environ["RAMJET_ORIGIN_REQUESTS"] = str(int(pool))
            notes.append(f"RAMJET_HTTP_POOL_SIZE={int(pool)} is ramjetio's: read as RAMJET_ORIGIN_REQUESTS={int(pool)}")
    single = os.environ.get("RAMJET_SINGLEFLIGHT")
    if single is not None:
        off = single.strip().lower() in ("0", "false", "no", "off")
        notes.append(
            "RAMJET_SINGLEFLIGHT is ramjetio's: ramjet's host daemon always coalesces concurrent reads of a shard"
            + (" (it cannot be turned off)" if off else "")
            + "; RAMJET_SINGLEFLIGHT_TIMEOUT_MS bounds a wait on another's read"
        )
    for n in notes:
        print(f"ramjet: {n}", file=sys.stderr)
    return notes


_ramjetio_environment()


def init(
    cache_dir: Optional[str] = None,
    *,
    socket: Optional[str] = None,
    cache_limit: Union[int, str] = "64GiB",
) -> str:
    """Uses the host's cache daemon (``ramjet serve``), starting one inside this process if
    none is running, so a single host needs no set-up. Every ``StreamingDataset`` created
    afterwards (in this process and its DataLoader workers) reads whole shards through it:
    one node cache shared by all ranks and workers, and, with peers, the cluster ring.

    Returns the daemon's socket path. ``socket`` defaults to ``RAMJET_SOCKET`` or a per-user
    path; ``cache_dir`` (default ``RAMJET_CACHE_DIR`` or ``~/.cache/ramjet``) is used only if
    the daemon starts here.
    """
    global _daemon_socket
    cache = cache_dir or os.environ.get("RAMJET_CACHE_DIR") or os.path.expanduser("~/.cache/ramjet")
    path, _embedded = _ramjet.init(os.fspath(cache), cache_limit, socket)
    _daemon_socket = path
    return path


# Native objects inherited through fork() have no threads in the child; dropping them there
# could wait on threads that do not exist, so they are parked here and never dropped.
_inherited: List[Any] = []


@dataclass(frozen=True)
class Source:
    """One input dataset of a mix (a *source*), with at most one of ``proportion``, ``repeat``,
    ``count``.

    - ``proportion``: this source's share of all proportional sources' samples per epoch;
    - ``repeat``: a factor on its own size (2.0 takes every sample twice, 0.5 half of them);
    - ``count``: exactly this many samples per epoch.
    """

    remote: str
    proportion: Optional[float] = None
    repeat: Optional[float] = None
    count: Optional[int] = None

    def _arg(self) -> Dict[str, Any]:
        """This source as the engine's option ``remote`` takes it (the engine checks it)."""
        return {"remote": self.remote, "proportion": self.proportion, "repeat": self.repeat, "count": self.count}


@dataclass(frozen=True)
class Stream(Source):
    """Deprecated name of :class:`Source` (a "stream" is one consumer's walk over an epoch);
    kept for one release, with a ``DeprecationWarning``."""

    def __post_init__(self) -> None:
        warnings.warn("ramjet.Stream is renamed ramjet.Source", DeprecationWarning, stacklevel=3)


def _positions(index: Any, n: int) -> Tuple[List[int], bool]:
    """NumPy-style ``index`` into ``n`` samples as positions, in the order asked, and whether it
    was one integer: an integer (negative counts from the end), a slice, a ``range``, a
    sequence, array or tensor of integers, or a boolean mask of length ``n``. An index out of range is an
    ``IndexError`` naming it."""

    def one(i: Any) -> int:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise TypeError(f"index {i!r} is not an integer")
        j = i.__index__()
        k = j + n if j < 0 else j
        if not 0 <= k < n:
            raise IndexError(f"index {j} is out of range for a dataset of {n} samples")
        return k

    if isinstance(index, slice):
        return list(range(*index.indices(n))), False
    if hasattr(index, "tolist"):  # a NumPy array or a torch tensor
        dtype = str(getattr(index, "dtype", ""))
        shape = tuple(getattr(index, "shape", ()))
        if len(shape) == 0:
            if "bool" in dtype:
                raise TypeError("a boolean scalar is not an index")
            return [one(index.item())], True
        if len(shape) != 1:
            raise IndexError(f"an index array of shape {shape}: one axis is indexed")
        if "bool" in dtype:
            return _mask(index.tolist(), n), False
        if "int" not in dtype:
            raise TypeError(f"an index array of dtype {dtype}: integers or booleans index")
        return [one(i) for i in index.tolist()], False
    if isinstance(index, range):
        return [one(i) for i in index], False
    if isinstance(index, (list, tuple)):
        if index and all(isinstance(i, bool) for i in index):
            return _mask(list(index), n), False
        if any(isinstance(i, bool) for i in index):
            raise TypeError("an index list mixes booleans and integers")
        return [one(i) for i in index], False
    if isinstance(index, bool):
        raise TypeError("a boolean is not an index")
    if hasattr(index, "__index__"):
        return [one(index.__index__())], True
    raise TypeError(f"index {index!r}: an integer, a slice, a sequence of integers or a boolean mask")


def _mask(mask: List[bool], n: int) -> List[int]:
    if len(mask) != n:
        raise IndexError(f"a boolean mask of {len(mask)} for a dataset of {n} samples")
    return [i for i, m in enumerate(mask) if m]


def _to_array(t: Tensor) -> Any:
    if torch is not None:
        return torch.from_dlpack(t)
    import numpy

    return numpy.from_dlpack(t)


def _convert(d: Dict[str, Any], device: str = "cpu") -> Dict[str, Any]:
    out = {k: _to_array(v) if isinstance(v, Tensor) else v for k, v in d.items()}
    if device != "cpu":
        out = {k: v.to(device) if torch is not None and isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out


def _with_aliases(d: Dict[str, Any]) -> Dict[str, Any]:
    """Adds the deprecated names of a batch's columns (for one release): ``_stream`` is
    ``_source`` (the same tensor, not a copy)."""
    if "_source" in d:
        d["_stream"] = d["_source"]
    return d


def _copy_order(batch: Dict[str, Any]) -> List[str]:
    """The keys of a batch's tensors in the order their host-to-device copies are queued:
    pageable ones (small columns: indexes, labels) before pinned ones (the image, in ramjet's
    page-locked buffer), each group in the batch's own order."""
    tensors = [k for k, v in batch.items() if hasattr(v, "is_pinned") and hasattr(v, "to")]
    return [k for k in tensors if not batch[k].is_pinned()] + [k for k in tensors if batch[k].is_pinned()]


def _transform_spec(base: Dict[str, Any]) -> Dict[str, Any]:
    """The transform spec of a loader configuration: what turns a sample into its tensors."""
    return {
        "image_column": base.get("image_column"),
        "boxes_column": base.get("boxes_column"),
        "image": base.get("image"),
        "filter": base.get("filter"),
        "buckets": base.get("buckets"),
    }


def _differences(saved: Any, here: Any, path: str) -> List[str]:
    """The fields (dotted paths) where two JSON values differ, with both values."""
    if isinstance(saved, dict) and isinstance(here, dict):
        out: List[str] = []
        for k in sorted(set(saved) | set(here)):
            out += _differences(saved.get(k), here.get(k), f"{path}.{k}")
        return out
    if saved != here:
        return [f"{path} is {json.dumps(saved)} in the state, {json.dumps(here)} here"]
    return []


def _check_contract(contract: Any, transform: Dict[str, Any], strict: bool) -> None:
    """Refuses (or, not strict, warns about) a state whose transform spec is not this one."""
    if not isinstance(contract, dict) or not isinstance(contract.get("transform"), dict):
        raise InvalidInputError("load_state_dict: the state's \"contract\" is not a data contract (no \"transform\")")
    diff = _differences(contract["transform"], transform, "transform")
    if not diff:
        return
    why = "load_state_dict: the state was saved with another transform spec: " + "; ".join(diff)
    if strict:
        raise InvalidInputError(why + " (strict=False loads it anyway)")
    warnings.warn(why + "; loading it anyway (strict=False)", RuntimeWarning, stacklevel=3)


def _jsonable(v: Any) -> Any:
    """A value ``json`` cannot write as itself: an integer type (numpy's) as the int, anything
    else as its repr (the engine then refuses it, naming the field)."""
    if hasattr(v, "__index__"):
        return v.__index__()
    return repr(v)


def _dist() -> Optional[Tuple[int, int]]:
    """torch.distributed's (rank, world size) when it is initialised."""
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None


_strided_warned: set = set()


def _asking_loader_workers(ds: Any) -> int:
    """The ``num_workers`` of the DataLoader over ``ds`` whose ``__len__`` is asking (0 when
    none asks, or in a worker): ``len(loader)`` calls ``len(dataset)`` from
    ``DataLoader.__len__``, and the DataLoader does not tell the dataset its workers otherwise."""
    if torch is None or torch.utils.data.get_worker_info() is not None:
        return 0
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            break
        who = f.f_locals.get("self")
        if isinstance(who, torch.utils.data.DataLoader) and who.dataset is ds:
            return int(who.num_workers)
        f = f.f_back
    return 0


def _warn_strided(order: Dict[str, Any], topo: Dict[str, int]) -> None:
    """Warns once a job when several nodes cannot each read only their share (docs/order.md,
    "Dealing the order to consumers"): the data is the same, every node reads all of it."""
    if topo["world"] <= 1:
        return
    why = _ramjet.why_strided(json.dumps(order), json.dumps(topo))
    if why is None or why in _strided_warned:
        return
    _strided_warned.add(why)
    warnings.warn(
        f"ramjet: every node reads the whole dataset each epoch because {why}; set partitions to a "
        f"multiple of the node count so each node reads only its share (the order is the same either way)",
        stacklevel=3,
    )


def _launch(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int, int, int]:
    """(rank, world, local_rank, local_world) from the arguments, torch.distributed and the
    launcher's environment (RANK/WORLD_SIZE/LOCAL_*, Slurm's in an srun step), each checked
    alike by the engine: a bad value or a contradiction raises InvalidInputError naming both."""
    return _ramjet.launch(rank, world_size, _dist())


class StreamingDataset(_Base):  # type: ignore[misc,valid-type]
    """Batches from one or more packed datasets, as dicts of tensors.

    Args:
        remote: dataset URL (``s3://bucket/prefix``, a local path, ...), or a list of URLs or
            :class:`Source` objects to mix.
        local: node-local cache directory (shared by every process on the host); ``None``
            streams from the origin without a cache.
        cache_limit: byte budget of the cache (int or ``"64GiB"``); default 64 GiB.
        batch_size: samples per batch.
        shuffle: shuffle the order (``shuffle_algo`` picks how).
        shuffle_algo: ``"shard_block"`` (locality-preserving, few shards live at once) or
            ``"global"`` (a full permutation).
        seed: seed of the order and of the augmentations.
        shuffle_window: shards per shuffle window (shard_block).
        shuffle_block: consecutive samples kept together (shard_block).
        partitions: canonical partitions of the order; when the job's node count divides
            them, each node reads only its share of the shards (docs/order.md). ``None`` (the
            default): the run's own, kept in :meth:`state_dict`: a loaded state's, else the
            job's node count (``WORLD_SIZE / LOCAL_WORLD_SIZE``) at its first start, so a
            fresh job of ``n`` nodes reads its shares and resumes exactly on any node count
            dividing ``n``. Give a number with many divisors (say 64) for a job that may grow.
        tail: ``"uneven"`` (every sample once), ``"drop"`` or ``"pad"`` when the epoch does
            not divide across ranks and workers; by default ``"uneven"`` on one rank and
            ``"pad"`` on several, so every rank steps the same number of batches.
        shares: ``"rotate"`` (each epoch draws which shards a node reads afresh) or
            ``"sticky"`` (a node reads the same shards every epoch and its host daemon keeps
            them, so a share that fits the node's cache is read from its own disk after the
            first epoch; docs/order.md, "Later epochs").
        drop_last: drop an epoch's last batch when it is short.
        image_size: decode the image column to this size (int or ``(height, width)``);
            ``None`` yields encoded bytes.
        augment: ``"train"`` (RandomResizedCrop + horizontal flip), ``"eval"`` (resize +
            center crop) or ``"resize"``.
        normalize: yield float32 images normalised with ``mean``/``std`` instead of uint8.
        dct_scaling: let JPEG decode at a reduced DCT scale (1/2, 1/4, 1/8) when the crop is at
            least twice the output: the smallest that keeps the crop at least the output size
            (a WebP's crop is scaled inside libwebp by the same rule).
        exif_orientation: show each image as its EXIF orientation says (JPEG, WebP, PNG) before
            the crop, as Pillow's ``ImageOps.exif_transpose`` does; ``False`` keeps the stored
            pixels.
        image_column / boxes_column: column names.
        num_threads: this dataset's batches decoding at once on the process's shared decode pool.
            ``None`` (the default): this rank's share of the host's decode budget (about one
            thread per core for all ranks of the host together, split by demand through the
            host daemon; without one, one per core divided among DataLoader workers); a number
            pins it.
        prefetch_batches: batches prepared ahead. ``None`` (the default): sized as it runs, to
            cover the longest recent gather of one batch at the trainer's rate, within this
            rank's share of the host's memory budget; a number pins it.
        on_corrupt: ``"error"`` (default: raise :class:`CorruptError` naming dataset, shard and
            sample) or ``"skip"`` (leave the sample out and count it).
        filter: keep only the samples whose sidecar columns pass it, for example
            ``"quality_flags & 0b101 == 0 and label is not null"`` (``and``/``or``/``not``,
            ``== != < <= > >=``, integer ``&``/``|``, ``is [not] null``; docs/order.md,
            "Filters"). Applied in the order before dealing: every rank agrees, ``len()``
            counts the kept samples and resume is exact. The first use reads every shard's
            columns sidecar once.
        buckets: aspect-ratio buckets, ``[(height, width), ...]`` (at most 256): each sample
            goes to the bucket nearest its aspect ratio, by the ``width`` and ``height`` columns
            ``ramjet pack`` records (nothing is decoded to choose), and each batch is
            ``batch_size`` images of one bucket, decoded at its size (``image_size`` must still
            be given, since images are decoded; the bucket sizes replace it, and the other image
            settings apply to every bucket).
            Every rank yields the same number of batches per epoch, all full:
            ``(least_share - buckets * (batch_size - 1)) // batch_size`` per consumer, the
            rest of a share sitting that epoch out (``metrics()["samples_left_out"]``).
            Deterministic, and resumed exactly (docs/order.md, "Aspect-ratio buckets"). Decoded
            on the CPU path.
        decode: with a CUDA ``device``, decode and augment images on the GPU: ``"auto"`` (the
            hardware JPEG engine, nvJPEG's hybrid decoder and the CPU threads, split by their
            measured rates), ``"gpu"`` (every image a GPU decoder takes goes to it) or ``"cpu"``
            (the CPU threads decode, the fused kernel augments on the GPU). The image column is
            then a CUDA tensor in ramjet's own device memory (``torch.from_dlpack`` copies
            nothing); ``metrics()`` gives each decoder's images, reasons and rate. ``None``
            (default): images are decoded and augmented on the CPU and copied. The GPU path
            has run only against a fake nvJPEG so far (docs/gpu.md), hence not the default.
        rank / world_size: override the topology (default: torch.distributed when
            initialised, else ``RANK``/``WORLD_SIZE``, else Slurm's ``SLURM_PROCID`` /
            ``SLURM_NTASKS`` inside an ``srun`` step). Each source is checked: a value that is
            not a count, a rank past its world, or two sources that disagree raise
            :class:`InvalidInputError` naming both. Both arguments together override the job;
            one alone must fit the job's other.
        daemon: the host daemon's socket (default: the one :func:`init` connected to, else
            ``RAMJET_SOCKET``, else none: this process reads shards itself).
        device: where batches are yielded: ``"cpu"`` (default), ``"cuda"`` (GPU
            ``LOCAL_RANK`` modulo the GPUs seen), ``"cuda:N"``, or ``"auto"`` (a GPU when one
            is usable, else the CPU with a ``RuntimeWarning`` saying why). Without a driver or
            a GPU, ``"cuda"`` raises :class:`Error`. CUDA is not fork-safe: in a forked
            DataLoader worker a CUDA device raises :class:`Error`; iterate the dataset
            directly (ramjet's loader is threaded). Without ``decode``, images are decoded on the
            CPU and copied to the GPU by torch.
    """

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
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        scale: Tuple[float, float] = (0.08, 1.0),
        ratio: Tuple[float, float] = (3 / 4, 4 / 3),
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
    ) -> None:
        options = {k: v for k, v in locals().items() if k not in ("self", "daemon", "device", "__class__")}
        # No tail given: every sample once on one rank; under several ranks, every rank the same
        # number of batches (pad, as DistributedSampler does), so DDP never waits at the end.
        self._tail_default = tail is None
        options["tail"] = "uneven" if tail is None else tail
        if isinstance(remote, (str, Source)):
            remote = [remote]
        streams = [s if isinstance(s, Source) else Source(str(s)) for s in remote]
        options["remote"] = [s._arg() for s in streams]
        if local is not None:
            options["local"] = os.fspath(local)
        # Every option is checked once, by the engine, which names a bad one.
        config, rank, world_size, num_threads, batch_size, drop_last = _ramjet.loader_options(options)
        self.batch_size = batch_size
        self.streams = streams
        self._rank_override = (rank, world_size)
        self._num_threads = num_threads
        self._daemon = daemon
        self._drop_last = drop_last
        self._base: Dict[str, Any] = json.loads(config)
        # Which epoch the next iteration reads, where it starts, the state to save, and the
        # loader running for it: the engine's (ramjet_engine::loader::Epochs).
        self._session = _ramjet.Session()
        self._reader: Any = None
        self._pid = os.getpid()
        # The process this object was made in, or unpickled in (a spawned worker): any other
        # process holding it got it through fork().
        self._origin_pid = self._pid
        self.device = _resolve_device(device)
        if decode is not None and device == "cpu":
            raise InvalidInputError(f"decode={decode!r} decodes on a GPU: it needs device=\"cuda\" (or \"cuda:N\"), not \"cpu\"")
        # device="auto" without a usable GPU: the CPU path (its warning says why).
        self._decode = decode if self.device != "cpu" else None
        self._copy_stream: Any = None  # the host-to-device copies' CUDA stream (device="cuda")
        self._in_flight: List[Any] = []  # (copy event, host batch) until the copy completes
        self._lengths: Dict[Any, Tuple[int, int, int]] = {}
        self._first_len: Optional[int] = None  # samples of the first source (indexing)
        self._contract_sources: Optional[List[Dict[str, Any]]] = None  # (contract) read once

    # ----- topology -------------------------------------------------------------------

    def _topology(self, as_worker: Optional[Tuple[int, int]] = None) -> Dict[str, int]:
        rank, world, local_rank, local_world = _launch(*self._rank_override)
        worker, workers = 0, 1
        if as_worker is not None:
            worker, workers = as_worker
        elif torch is not None:
            info = torch.utils.data.get_worker_info()
            if info is not None:
                worker, workers = info.id, info.num_workers
        return {
            "rank": int(rank),
            "world": int(world),
            "worker": worker,
            "workers": workers,
            "local_rank": local_rank,
            "local_world": local_world,
        }

    def _config(self, as_worker: Optional[Tuple[int, int]] = None, **extra: Any) -> str:
        topo = self._topology(as_worker)
        cfg = dict(self._base, topology=topo, **extra)
        if self._tail_default and topo["world"] > 1:
            cfg["order"] = dict(cfg["order"], tail="pad_repeat")
        if cfg.get("partitions_from_job"):
            # No partitions given: the run's (a loaded state's, else the job's node count).
            cfg["order"] = dict(cfg["order"], partitions=self._session.partitions(json.dumps(cfg)))
        _warn_strided(cfg["order"], topo)
        daemon = self._daemon or _daemon_socket or os.environ.get("RAMJET_SOCKET")
        if daemon:
            cfg["daemon"] = daemon
        if self._num_threads is not None:
            cfg["threads"] = self._num_threads
            cfg["threads_pinned"] = True
        else:
            cfg["threads"] = max(1, (os.cpu_count() or 2) // topo["workers"])
        return json.dumps(cfg)

    def _check_device_process(self) -> None:
        if self.device != "cpu" and os.getpid() != self._origin_pid:
            raise Error(
                f"StreamingDataset(device={self.device!r}) in a forked process (a DataLoader worker): "
                "CUDA is not fork-safe. Iterate the dataset directly (ramjet decodes on its own threads, "
                'no workers needed), or use device="cpu" in the workers and move batches in the trainer'
            )

    def _after_fork(self) -> None:
        self._check_device_process()
        if os.getpid() != self._pid:
            # The parent's native objects stay, never dropped, in the child; the session's
            # position goes on in a fresh one (the engine starts a loader for this process).
            _inherited.extend(x for x in (self._session, self._reader) if x is not None)
            self._session = self._session.forked()
            self._reader = None
            self._pid = os.getpid()

    @property
    def _loader(self) -> Any:
        """The running native loader, if any (tests read raw batches from it)."""
        return self._session.loader()

    @property
    def _state(self) -> Optional[str]:
        """This consumer's state after the last batch it yielded (JSON), if any."""
        return self._session.consumer_state()

    # ----- iteration ------------------------------------------------------------------

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        self._after_fork()
        extra: Dict[str, Any] = {}
        if self.device != "cpu":
            extra["pinned_gpu"] = int(self.device.split(":")[1])
            if self._decode is not None:
                # Every folder on the path, as gpu_info() searches: wheels installed with
                # `pip --target` (the device check's) live outside any site-packages.
                roots = [p for p in dict.fromkeys(sys.path) if p and os.path.isdir(p)]
                extra["gpu_decode"] = {"ordinal": extra["pinned_gpu"], "roots": roots}
        # The engine decides whether the running loader goes on (same epoch and topology) or
        # a new one starts, and where (the epoch's start, or a loaded state); it ends the
        # iteration after the epoch's last batch.
        self._session.begin(self._config(**extra))
        # The contract's manifest versions, read here once, so that a state taken after every
        # batch (a StatefulDataLoader worker's) never calls into the engine for them.
        self.contract()
        while True:
            got = self._session.next_batch()
            if got is None:
                return
            cols, meta = got
            if meta["skipped"]:
                cols["_skipped"] = meta["skipped"]
            yield _with_aliases(self._to_device(_convert(cols)) if self.device != "cpu" else _convert(cols))

    def _to_device(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """Copies a batch's tensors (in ramjet's page-locked buffers) to the GPU on a stream of
        its own, so the copy overlaps the training step; the trainer's current stream waits
        for it. The host buffers are kept until their copy completes, and only then go back
        to ramjet's pool for the next batch."""
        dev = torch.device(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(dev)
        consumer = torch.cuda.current_stream(dev)
        with torch.cuda.stream(self._copy_stream):
            # Pageable columns first: a non_blocking copy from pageable memory is staged and
            # waits on the host, so made after the pinned image's copy it would wait for that
            # copy too; made first, it is done before the asynchronous ones are queued.
            out = {k: batch[k] for k in batch}
            for k in _copy_order(batch):
                out[k] = batch[k].to(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        consumer.wait_event(done)
        for v in out.values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(consumer)  # allocated on the copy stream, used on the consumer's
        self._in_flight.append((done, batch))
        # At most 3 kept here, so with the next batch taken 4 host batches are out of the
        # loader's hands: its IN_FLIGHT_COPIES, counted in the pinned working set it allocates
        # at start.
        while self._in_flight and (self._in_flight[0][0].query() or len(self._in_flight) > 3):
            self._in_flight[0][0].synchronize()
            self._in_flight.pop(0)
        return out

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration reads, from its start.

        After :meth:`load_state_dict`, setting the epoch the restored state belongs to keeps
        the resume (the usual loop, ``for epoch in range(start, n): ds.set_epoch(epoch)``,
        continues mid-epoch); setting another epoch drops it."""
        self._session.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return self._session.epoch

    # ----- state ----------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The job's position after the last batch this process yielded.

        Under torch.distributed every rank must call it at the same step (it gathers the
        ranks' states); the result is the same on every rank. Restoring it continues with
        exactly the samples not yet seen, also with another world size.

        Inside a DataLoader worker (torchdata's ``StatefulDataLoader`` calls it there after
        every batch) it returns this worker's own position instead: a string already at
        hand, so taking it costs nothing. The loader restores each worker from its own, which
        continues exactly when the topology (ranks and workers) is the same.
        """
        if torch is not None and torch.utils.data.get_worker_info() is not None:
            return dict(json.loads(self._session.worker_state()), contract=self.contract())
        state = self._state
        if state is None:
            return dict(json.loads(self._session.unstarted_job_state()), contract=self.contract())
        states = [state]
        world = self._topology()["world"]
        if world > 1:
            if torch is None or not torch.distributed.is_initialized():
                raise InvalidInputError(
                    "state_dict with world_size > 1 needs torch.distributed to gather the ranks' states"
                )
            gathered: List[Optional[str]] = [None] * world
            torch.distributed.all_gather_object(gathered, state)
            states = [s for s in gathered if s is not None]
            if len(states) != world:
                raise InvalidInputError("state_dict: some ranks have not read any batch yet")
        return dict(json.loads(_ramjet.job_state(states)), contract=self.contract())

    def contract(self) -> Dict[str, Any]:
        """The data contract of this dataset, for a trainer's run metadata and in every
        :meth:`state_dict` (``"contract"``): ramjet's version, each source's URL, weight and
        manifest version, the order as given (``partitions`` None when not given: the run's are the
        state's ``"partitions"``), and the transform
        spec (``"transform"``: the image and boxes columns, the image settings: augment,
        size, crop and flip parameters, normalization, and the filter). :meth:`load_state_dict` refuses a state
        whose transform spec differs, naming the field, unless ``strict=False``."""
        if self._contract_sources is None:
            self._contract_sources = [
                {"url": s["url"], "weight": s.get("weight"), "manifest_version": _ramjet.inspect(s["url"])["version"]}
                for s in self._base["sources"]
            ]
        order = dict(self._base["order"])
        if self._base.get("partitions_from_job"):
            order["partitions"] = None  # the run's: the state's "partitions" once it has started
        return {
            "ramjet": __version__,
            "sources": [dict(s) for s in self._contract_sources],
            "order": order,
            "transform": _transform_spec(self._base),
        }

    def audit(self) -> Dict[str, Any]:
        """The exactly-once audit of the epoch in progress (or just finished): whether each
        sample the job yielded so far came exactly once, across every rank and every resume.

        Each consumer keeps, as it yields, a count and an order-independent digest of the
        samples (carried in :meth:`state_dict`, so they survive a restart, also with another
        world size); this compares their sum with what the epoch's order gives for the
        positions the job's progress covers. Under torch.distributed every rank must call it at
        the same step (it gathers the ranks' states, as :meth:`state_dict` does). Returns a
        dict: ``exactly_once``, ``complete`` (the whole epoch was read), ``delivered`` and
        ``expected`` counts, the two digests, ``epoch``, ``len`` and ``message``. Its cost is
        one hash per sample delivered so far in the epoch, in Rust.

        In a DataLoader worker there is no job view: audit the workers' saved states with
        ``ramjet audit URL --state FILE...`` instead."""
        if torch is not None and torch.utils.data.get_worker_info() is not None:
            raise InvalidInputError(
                "audit() needs the whole job: call it in the trainer, or run `ramjet audit` on the workers' states"
            )
        state = self._state
        if state is None:
            resume = self._session.resume()
            if resume is None:
                raise InvalidInputError("audit(): nothing was read yet, and no state was loaded")
            return json.loads(_ramjet.audit(self._config(), resume=resume))
        states = [state]
        world = self._topology()["world"]
        if world > 1:
            if torch is None or not torch.distributed.is_initialized():
                raise InvalidInputError("audit() with world_size > 1 needs torch.distributed to gather the ranks' states")
            gathered: List[Optional[str]] = [None] * world
            torch.distributed.all_gather_object(gathered, state)
            states = [s for s in gathered if s is not None]
            if len(states) != world:
                raise InvalidInputError("audit(): some ranks have not read any batch yet")
        return json.loads(_ramjet.audit(self._config(), states=states))

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Continues from a :meth:`state_dict`: the next iteration yields the rest of its epoch.

        A state that is not one :meth:`state_dict` made (not a dict, a missing or wrong-typed
        field, JSON that does not parse, an ``epoch`` that disagrees with its ``resume``)
        raises :class:`InvalidInputError` naming the field, and changes nothing. So does a
        state whose data contract's transform spec differs from this dataset's (another
        ``augment``, size, crop, flip or normalization: the run would go on with other data),
        naming each field that differs; with ``strict=False`` that is a warning and the state
        is loaded. A state without a contract (an older one) is loaded as it is."""
        if isinstance(state, dict) and "contract" in state:
            _check_contract(state["contract"], _transform_spec(self._base), strict)
            state = {k: v for k, v in state.items() if k != "contract"}
        self._session.load_state(json.dumps(state, default=_jsonable))

    # ----- sizes and random access ----------------------------------------------------

    def _epoch_lengths(self, as_worker: Optional[Tuple[int, int]] = None) -> Tuple[int, int, int]:
        config = self._config(as_worker)
        order = json.loads(config)["order"]
        key = json.dumps([self._topology(as_worker), order], sort_keys=True)
        if key not in self._lengths:
            self._lengths[key] = _ramjet.epoch_lengths(config)
        return self._lengths[key]

    @property
    def num_samples(self) -> int:
        """Samples in one epoch across the whole job."""
        return self._epoch_lengths()[0]

    @property
    def samples_per_rank(self) -> int:
        """Samples this consumer reads per epoch."""
        return self._epoch_lengths()[1]

    def __len__(self) -> int:
        """Batches this consumer yields per epoch: in a DataLoader worker, that worker's; asked
        by a DataLoader (``len(loader)``), the sum of its ``num_workers`` workers' (each worker
        is a consumer with its own share and its own last batch); otherwise, iterated
        directly, this rank's."""
        batches = lambda n: n // self.batch_size if self._drop_last else -(-n // self.batch_size)  # noqa: E731
        workers = _asking_loader_workers(self)
        buckets = self._base.get("buckets")
        if buckets:
            # Every consumer the same count, from the job's least share (the engine's rule).
            least = self._epoch_lengths((0, workers) if workers > 1 else None)[2]
            return max(workers, 1) * _ramjet.bucket_batches(least, len(buckets), self.batch_size)
        if workers <= 1:
            return batches(self.samples_per_rank)
        return sum(batches(self._epoch_lengths((w, workers))[1]) for w in range(workers))

    def __getitem__(self, index: Any) -> Any:
        """Samples of the first dataset, decoded with the evaluation transform, by NumPy-style
        ``index``: an integer (negative counts from the end) gives one sample's dict; a slice, a
        sequence, array or tensor of integers, or a boolean mask gives a list of them in the
        order asked. Each shard touched is read once per call (fetched whole when not local, all
        at once). Out of range: ``IndexError``."""
        self._after_fork()
        if self._reader is None:
            self._reader = _ramjet.Reader(self._config())
        if getattr(self, "_first_len", None) is None:
            self._first_len = int(inspect(self.streams[0].remote)["samples"])
        at, scalar = _positions(index, self._first_len)
        if scalar:
            return _with_aliases(_convert(self._reader.get(0, at[0]), self.device))
        return [_with_aliases(_convert(d, self.device)) for d in self._reader.get_many(0, at)]

    def metrics(self) -> Dict[str, float]:
        """Counters of the running loader: origin and cache bytes, hit rate, batch wait."""
        return dict(self._session.metrics())

    def close(self) -> None:
        """Stops this process's loader (its threads, the shards it holds) and drops its
        random-access reader. The position is kept: iterating again goes on from it with a new
        loader, and :meth:`state_dict` says the same before and after. In a forked child, the
        parent's objects are left alone (kept, never dropped, there)."""
        if self._pid == os.getpid():
            # The state first: a session without a loader starts its epoch over unless told.
            state = self.state_dict()
            self._session = self._session.forked()
            self._reader = None
            self.load_state_dict(state)

    def __enter__(self) -> "StreamingDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        urls = [x.get("url") for x in self._base.get("sources", [])]
        seed = self._base.get("order", {}).get("seed")
        return (f"StreamingDataset({urls[0] if len(urls) == 1 else urls!r}, batch_size={self.batch_size}, "
                f"seed={seed}, epoch={self._session.epoch}, device={self.device!r})")

    def __getstate__(self) -> Dict[str, Any]:
        s = self.__dict__.copy()
        s["_session"] = self._session.position()
        s["_reader"] = s["_copy_stream"] = None
        s["_in_flight"] = []
        return s

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._session = _ramjet.Session.from_position(state["_session"])
        # Unpickled (a spawned worker, another host): a fresh process, where CUDA is usable.
        self._origin_pid = self._pid = os.getpid()


class Reader:
    """Random access to one dataset's samples by global index, for map-style datasets.

    ``Reader(url, **options)`` takes :class:`StreamingDataset`'s options (checked the same way,
    by the engine) and reads sample ``i`` on request: from a shard held in memory, the node
    cache, or the origin with ranged GETs (a shard read often is then loaded whole in the
    background and held, up to ``resident_bytes``). Every sample read was verified against the
    manifest. Nothing is prefetched.

    - ``get(i)``: the sample decoded as a dict, with the evaluation transform (``augment="train"``
      is read as ``"eval"``: a reader has no epoch to draw random crops from);
    - ``get_bytes(i, column)``: one ``bytes`` column undecoded (an encoded image, for a
      framework that decodes itself);
    - ``len(reader)``: the dataset's samples.

    A forked child (a DataLoader worker) opens its own on first use; the parent's is kept, never
    dropped, in the child.
    """

    def __init__(self, url: str, *, resident_bytes: Optional[int] = None, **options: Any) -> None:
        options.setdefault("image_size", None)
        ds = StreamingDataset(url, shuffle=False, rank=0, world_size=1, **options)
        self.url = url
        self.device = ds.device
        self._config_json = ds._config()
        self._resident_bytes = _ramjet.Reader.check_resident_bytes(resident_bytes)
        self._native: Any = None
        self._pid = -1
        self._len: Optional[int] = None

    def _reader(self) -> Any:
        if self._native is None or self._pid != os.getpid():
            if self._native is not None:
                _inherited.append(self._native)
            self._native = _ramjet.Reader(self._config_json, self._resident_bytes)
            self._pid = os.getpid()
        return self._native

    def get(self, index: Any) -> Any:
        """Sample ``index``, decoded (images as ``(3, H, W)`` tensors when ``image_size`` is set,
        else every column as stored). NumPy-style indexing as ``StreamingDataset[...]``: an
        integer gives one dict, a slice, integers or a boolean mask a list in the order asked,
        each shard touched read once per call."""
        at, scalar = _positions(index, len(self))
        if scalar:
            return _with_aliases(_convert(self._reader().get(0, at[0]), self.device))
        return [_with_aliases(_convert(d, self.device)) for d in self._reader().get_many(0, at)]

    def get_bytes(self, index: int, column: str) -> bytes:
        """Column ``column`` of sample ``index``, a ``bytes`` column, undecoded."""
        if index < 0:
            raise IndexError(index)
        return self._reader().get_bytes(0, int(index), column)

    def metrics(self) -> Dict[str, float]:
        """Counters of the reads so far: ranged and resident samples, origin bytes."""
        return {} if self._native is None else dict(self._native.metrics())

    def close(self) -> None:
        """Drops this process's reader (the shards it holds); the next read opens a new one.
        In a forked child the parent's is left alone."""
        if self._pid == os.getpid():
            self._native = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reader({self.url!r}, device={self.device!r}, open={self._native is not None})"

    def __len__(self) -> int:
        if self._len is None:
            self._len = int(inspect(self.url)["samples"])
        return self._len

    def __getitem__(self, index: Any) -> Any:
        return self.get(index)

    def __getstate__(self) -> Dict[str, Any]:
        s = self.__dict__.copy()
        s["_native"] = None
        return s


class TokenDataset(_Base):  # type: ignore[misc,valid-type]
    """Fixed-length token windows for causal language-model training, from datasets whose
    samples are documents of tokens (an integer array column, e.g. ``tokens: uint16[]`` as
    ``ramjet pack --tokenizer`` writes it, or a MosaicML ``tokens`` bytes column with
    ``token_dtype``).

    The documents of an epoch, in its global order (shuffled at document level, mixed by
    proportion like :class:`StreamingDataset`'s samples), are concatenated with ``eos`` after
    each and cut into windows of ``seq_len + 1`` tokens; each batch is a dict:

    - ``tokens``: ``(B, seq_len + 1)``; ``input_ids`` and ``labels`` are its views
      ``tokens[:, :-1]`` and ``tokens[:, 1:]`` (no copy);
    - ``lengths``: ``(B,)`` real tokens of each row (``seq_len + 1`` except a padded last window);
    - ``window``: ``(B,)`` each row's window index in the epoch;
    - with ``boundaries=True``: ``position_ids`` (each input token's offset in its document,
      restarting at 0 after every ``eos``) and ``segment_ids`` (its document's index in the row,
      -1 on padding), ``(B, seq_len)`` each, for attention that stays inside documents.

    The windows are the same for any world size and worker count (window ``k`` is always the
    same tokens; the job's consumers take them in turn) and :meth:`state_dict` names a position
    inside a document, so a job resumes exactly, also on another world size.

    Args:
        remote: dataset URL, or a list of URLs or :class:`Source` objects to mix.
        local: node-local cache directory; ``None`` streams without a cache.
        seq_len: tokens a row feeds the model.
        batch_size: windows per batch.
        column: the token column.
        eos: token appended after every document; ``"auto"`` (default) takes the one
            ``ramjet pack --tokenizer`` recorded in the first dataset's metadata, else none;
            ``None``: nothing appended.
        pad: pad the epoch's last, partial window with this token instead of dropping it.
        boundaries: also yield ``position_ids`` and ``segment_ids``.
        dtype: ``"int64"`` (default) or ``"int32"``.
        token_dtype: the element type of a ``bytes`` token column (``"int32"``, ``"uint16"``...).
        shuffle, shuffle_algo, seed, shuffle_window, shuffle_block, partitions, shares,
            cache_limit: the document order and cache, as for :class:`StreamingDataset`.
        prefetch_batches: batches cut ahead on ramjet's own thread.
        rank / world_size: override the topology (default: torch.distributed when
            initialised, else ``RANK``/``WORLD_SIZE``, else Slurm's ``SLURM_PROCID`` /
            ``SLURM_NTASKS`` inside an ``srun`` step). Each source is checked: a value that is
            not a count, a rank past its world, or two sources that disagree raise
            :class:`InvalidInputError` naming both. Both arguments together override the job;
            one alone must fit the job's other.
        daemon: the host daemon's socket (default as for :class:`StreamingDataset`).

    Cutting runs on a Rust thread of its own, so iterate the dataset directly
    (``num_workers=0``). Inside DataLoader workers each worker is a consumer of its own: its
    :meth:`state_dict` (taken in the worker) is its own position, and :meth:`combine_states` of
    every worker's gives the job's. The trainer process's copy of the dataset has not iterated
    and knows no position.
    """

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
    ) -> None:
        if isinstance(remote, (str, Source)):
            remote = [remote]
        streams = [s if isinstance(s, Source) else Source(str(s)) for s in remote]
        options: Dict[str, Any] = {
            "remote": [s._arg() for s in streams],
            "shuffle": shuffle,
            "shuffle_algo": shuffle_algo,
            "seed": seed,
            "shuffle_window": shuffle_window,
            "shuffle_block": shuffle_block,
            "partitions": partitions,
            "shares": shares,
            "cache_limit": cache_limit,
            "image_size": None,
            "rank": rank,
            "world_size": world_size,
        }
        if local is not None:
            options["local"] = os.fspath(local)
        config, rank, world_size, _, _, _ = _ramjet.loader_options(options)
        if eos == "auto":
            meta = json.loads(inspect(streams[0].remote).get("meta_json") or "{}")
            tok = meta.get("tokenizer") if isinstance(meta, dict) else None
            eos = tok.get("eos") if isinstance(tok, dict) else None
        elif isinstance(eos, str):
            raise InvalidInputError(f'eos={eos!r}: give a token id, None, or "auto"')
        for name, v in (("seq_len", seq_len), ("batch_size", batch_size), ("eos", eos), ("pad", pad),
                        ("prefetch_batches", prefetch_batches)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise InvalidInputError(f"{name}={v!r}: must be an integer")
        self.streams = streams
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.eos = eos
        self._tokens = {
            "column": column,
            "seq_len": seq_len,
            "eos": eos,
            "pad": pad,
            "boundaries": bool(boundaries),
            "dtype": dtype,
            "bytes_dtype": token_dtype,
            "batch_size": batch_size,
            "prefetch_batches": prefetch_batches,
        }
        self._base: Dict[str, Any] = json.loads(config)
        self._rank_override = (rank, world_size)
        self._daemon = daemon
        self._epoch = 0
        self._resume: Optional[Dict[str, Any]] = None
        self._stream: Any = None  # the running native stream (this process's)
        self._pid = os.getpid()
        # Options are checked by the engine now, not at the first batch.
        _ramjet.token_options_check(json.dumps(self._tokens))

    _topology = StreamingDataset._topology

    def _config(self) -> str:
        cfg = dict(self._base, topology=self._topology())
        daemon = self._daemon or _daemon_socket or os.environ.get("RAMJET_SOCKET")
        if daemon:
            cfg["daemon"] = daemon
        return json.dumps({"loader": cfg, "tokens": self._tokens, "epoch": self._epoch, "resume": self._resume})

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        if os.getpid() != self._pid:
            # A forked worker: the parent's native stream (if any) is parked, never dropped here.
            if self._stream is not None:
                _inherited.append(self._stream)
            self._stream = None
            self._pid = os.getpid()
        # Opened here, not at the first next(): a consumer that takes no batch still has its
        # position (its first window located) for state_dict.
        self._stream = _ramjet.TokenStream(self._config())
        self._finished = False
        return self._batches(self._stream)

    def _batches(self, stream: Any) -> Iterator[Dict[str, Any]]:
        while True:
            got = stream.next_batch()
            if got is None:
                break
            yield self._convert(got)
        # The epoch is over for this consumer: the next iteration reads the next one.
        self._epoch += 1
        self._resume = None
        self._finished = True

    def close(self) -> None:
        """Stops this process's token stream (its thread and the shards it holds). The position
        is kept: iterating again goes on from it, and :meth:`state_dict` says the same before
        and after (so under torch.distributed every rank closes at the same step, as every rank
        takes a state). Inside a DataLoader worker, or in a forked child, the stream is only
        let go (a worker's own state does not restore alone; the parent's is left alone)."""
        if self._stream is None or self._pid != os.getpid():
            return
        in_worker = torch is not None and torch.utils.data.get_worker_info() is not None
        if getattr(self, "_finished", False) or in_worker:
            self._stream = None
            return
        state = self.state_dict()
        self._stream = None
        self.load_state_dict(state)

    def __enter__(self) -> "TokenDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        urls = [s.remote for s in self.streams]
        return (f"TokenDataset({urls[0] if len(urls) == 1 else urls!r}, seq_len={self.seq_len}, "
                f"batch_size={self.batch_size}, eos={self.eos}, epoch={self._epoch}, "
                f"open={self._stream is not None})")

    def _convert(self, got: Dict[str, Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for k, v in got.items():
            if isinstance(v, Tensor):
                # CPU memory: the capsule itself (the protocol's device and stream questions
                # cost more than the tensor, at a few microseconds a batch).
                out[k] = torch.from_dlpack(v.__dlpack__()) if torch is not None else _to_array(v)
            else:
                out[k] = v
        t = out["tokens"]
        out["input_ids"] = t[:, :-1]
        out["labels"] = t[:, 1:]
        if "positions" in out:
            out["position_ids"] = out.pop("positions")[:, :-1]
            out["segment_ids"] = out.pop("segments")[:, :-1]
        return out

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration reads; a loaded state of another epoch is dropped."""
        if self._resume is not None and self._resume.get("epoch") != epoch:
            self._resume = None
        self._epoch = int(epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (or is reading)."""
        return self._epoch

    def _consumer_state(self) -> str:
        if self._stream is None:
            raise InvalidInputError("state_dict(): this dataset has not been iterated yet in this process")
        return self._stream.state()

    def state_dict(self) -> Dict[str, Any]:
        """The job's position after the last batch each consumer yielded: the first window not
        yet delivered (its document and the offset inside it) and the windows delivered past it.
        Under torch.distributed every rank calls it at the same step (it gathers the ranks'
        states). Before any iteration it is the loaded state, or the current epoch's start."""
        if self._stream is None:
            if self._resume is not None:
                return dict(self._resume)
            return {"kind": "tokens", "epoch": self._epoch, "fresh": True}
        if torch is not None and torch.utils.data.get_worker_info() is not None:
            return {"kind": "tokens-consumer", "state": json.loads(self._consumer_state())}
        states = [self._consumer_state()]
        world = self._topology()["world"]
        if world > 1:
            if torch is None or not torch.distributed.is_initialized():
                raise InvalidInputError("state_dict with world_size > 1 needs torch.distributed to gather the ranks' states")
            gathered: List[Optional[str]] = [None] * world
            torch.distributed.all_gather_object(gathered, states[0])
            states = [s for s in gathered if s is not None]
        return json.loads(_ramjet.token_job_state(states))

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continues from a :meth:`state_dict`: the next iteration yields the rest of its epoch
        (with any world size). A state that is not one raises :class:`InvalidInputError`."""
        if not isinstance(state, dict):
            raise InvalidInputError(f"load_state_dict: a state is a dict, not {type(state).__name__}")
        if state.get("kind") == "tokens-consumer":
            raise InvalidInputError(
                "load_state_dict: this is one DataLoader worker's token state, which does not restore alone: "
                "combine every consumer's with combine_states() (a job state), or iterate without workers"
            )
        if state.get("fresh") is True and state.get("kind") == "tokens":
            self._resume = None
            self._epoch = int(state.get("epoch", 0))
            return
        checked = json.loads(_ramjet.token_resume_check(json.dumps(state, default=_jsonable)))
        self._resume = checked
        self._epoch = int(checked["epoch"])

    def combine_states(self, states: Sequence[Union[str, Dict[str, Any]]]) -> Dict[str, Any]:
        """The job's state from every consumer's own: ``consumer_state()`` of each, or the
        ``state_dict()`` of each DataLoader worker."""
        texts = [json.dumps(s["state"]) if isinstance(s, dict) and s.get("kind") == "tokens-consumer"
                 else s if isinstance(s, str) else json.dumps(s) for s in states]
        return json.loads(_ramjet.token_job_state(texts))

    def consumer_state(self) -> str:
        """This consumer's own position (JSON text), to combine with the others' by
        :meth:`combine_states` (for jobs without torch.distributed)."""
        return self._consumer_state()

    def __getstate__(self) -> Dict[str, Any]:
        s = self.__dict__.copy()
        s["_stream"] = None
        return s
