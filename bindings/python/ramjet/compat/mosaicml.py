"""MosaicML Streaming's API over ramjet: change ``from streaming import ...`` to
``from ramjet.compat.mosaicml import ...`` and the script runs on ramjet's engine.

- :class:`StreamingDataset` yields one sample at a time, a dict of each column decoded as
  MosaicML decodes it (a PIL image for ``jpeg``, ``png`` and ``pil`` columns, a NumPy array for
  ``ndarray``, a NumPy scalar of the written type for ``uint8`` ... ``float64``, ``str``,
  ``int``, JSON values), so ``DataLoader(dataset=StreamingDataset(...), batch_size=...)``
  works as theirs. MDS is read in place (``index.json``, its shards, checked as ramjet's own),
  as are ramjet's own datasets and WebDataset tars (their image column is a PIL image).
- :class:`Stream` is one input of a mix (``proportion``, ``repeat``, ``choose``).
- :class:`StreamingDataLoader` resumes exactly mid-epoch with ``state_dict()`` /
  ``load_state_dict()``, with or without workers.

Each argument either does what MosaicML's does or raises :class:`ramjet.InvalidInputError`
saying what ramjet does instead; none is ignored. The sample order is ramjet's (one global
order, the same for any number of ranks and workers; ``docs/order.md``), not MosaicML's.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

import ramjet
from ramjet import InvalidInputError

try:  # torch is optional for ramjet, not for this module's DataLoader
    import torch
    from torch.utils.data import IterableDataset
except ImportError:  # pragma: no cover - the test venv has torch
    raise ImportError("ramjet.compat.mosaicml needs torch (pip install 'ramjet[torch]')") from None

__all__ = ["Stream", "StreamingDataset", "StreamingDataLoader"]

# MosaicML's defaults, accepted as they are (what ramjet does is the same or its own rule).
_DEFAULT_RETRY, _DEFAULT_TIMEOUT = 2, 60.0
_SHARD_LOCAL_ALGOS = ("py1e", "py1br", "py1b", "py1s", "py2s")
_SCALARS = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float16", "float32",
            "float64")


def _refuse(arg: str, value: Any, instead: str) -> InvalidInputError:
    return InvalidInputError(f"{arg}={value!r}: {instead}")


def _size(value: Union[int, str, None], arg: str) -> Optional[int]:
    """MosaicML's sample counts: an int, or a number with a k, m, b or t suffix."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 0:
            raise _refuse(arg, value, "must be at least 0")
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmbtKMBT]?)\s*", str(value))
    if not m:
        raise _refuse(arg, value, "must be an int or a number with a k, m, b or t suffix")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()])


def _bytes(value: Union[int, str, None], arg: str) -> Optional[int]:
    """MosaicML's byte sizes: an int, or a number with b, kb, mb, gb, tb or pb (powers of 1024)."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 0:
            raise _refuse(arg, value, "must be at least 0")
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*(b|kb|mb|gb|tb|pb)?\s*", str(value).lower())
    if not m:
        raise _refuse(arg, value, "must be an int or a number with b, kb, mb, gb, tb or pb")
    return int(float(m.group(1)) * 1024 ** ("b kb mb gb tb pb".split().index(m.group(2) or "b")))


class Stream:
    """One input dataset of a mix, as MosaicML's ``Stream``.

    ``remote`` is where the dataset is (``s3://...`` or a path), ``local`` ramjet's node-local
    cache (a local dataset alone: ``Stream(local=path)``); ``split`` a subfolder of both.
    ``proportion`` (its share of the epoch), ``repeat`` (a factor on its size) or ``choose``
    (exactly this many samples an epoch): at most one. ``download_retry`` and
    ``download_timeout`` at MosaicML's defaults (ramjet retries a failed read on its own rule,
    docs/robustness.md), ``validate_hash`` ``None``, ``"xxh64"`` or ``"xxh3_64"`` (ramjet checks
    those of ``index.json`` always, and its own checksum of every shard), ``keep_zip`` ``False``.
    """

    def __init__(self, *, remote: Optional[str] = None, local: Optional[str] = None, split: Optional[str] = None,
                 proportion: Optional[float] = None, repeat: Optional[float] = None, choose: Optional[int] = None,
                 download_retry: Optional[int] = None, download_timeout: Optional[float] = None,
                 validate_hash: Optional[str] = None, keep_zip: Optional[bool] = None) -> None:
        if remote is None and local is None:
            raise InvalidInputError("Stream: give remote= (where the dataset is) or local= (a local dataset)")
        if sum(x is not None for x in (proportion, repeat, choose)) > 1:
            raise InvalidInputError("Stream: give at most one of proportion=, repeat= and choose=")
        _check_download(download_retry, download_timeout, validate_hash, keep_zip)
        split = split or ""
        join = lambda root: root.rstrip("/") + "/" + split if split else root  # noqa: E731
        self.remote = join(remote) if remote is not None else None
        self.local = join(local) if local is not None else None
        self.split = split
        self.proportion, self.repeat, self.choose = proportion, repeat, choose

    def _source(self) -> "ramjet.Source":
        # A remote dataset is read from where it is, cached under local; a local one alone is
        # read in place.
        url = self.remote if self.remote is not None else self.local
        return ramjet.Source(str(url), proportion=self.proportion, repeat=self.repeat, count=self.choose)


def _check_download(retry: Optional[int], timeout: Optional[float], validate_hash: Optional[str],
                    keep_zip: Optional[bool]) -> None:
    if retry not in (None, _DEFAULT_RETRY):
        raise _refuse("download_retry", retry, "ramjet retries a failed read on its own rule (docs/robustness.md); "
                      "leave it at 2")
    if timeout not in (None, _DEFAULT_TIMEOUT):
        raise _refuse("download_timeout", timeout, "ramjet times reads out on its own rule (docs/robustness.md); "
                      "leave it at 60")
    if validate_hash not in (None, "xxh64", "xxh3_64"):
        raise _refuse("validate_hash", validate_hash, "ramjet checks an MDS index's xxh64 and xxh3_64 hashes "
                      "(always) and its own checksum of every shard; give None, 'xxh64' or 'xxh3_64'")
    if keep_zip:
        raise _refuse("keep_zip", keep_zip, "ramjet's cache keeps the shards as read; leave it False")


# ----- decoding as MosaicML does ---------------------------------------------------------


def _pil(data: bytes) -> Any:
    from PIL import Image

    width, height, mode_len = np.frombuffer(data[:12], np.uint32)
    mode = data[12:12 + mode_len].decode("utf-8")
    return Image.frombytes(mode, (int(width), int(height)), data[12 + mode_len:])


def _image(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data))


def _items(data: bytes, at: int) -> List[bytes]:
    """The items of MosaicML's list layouts: a u32 count at ``at``, the u32 sizes, the items."""
    n = int(np.frombuffer(data[at:at + 4], np.uint32)[0])
    sizes = np.frombuffer(data[at + 4:at + 4 + 4 * n], np.uint32)
    at, out = at + 4 + 4 * n, []
    for size in sizes:
        out.append(data[at:at + int(size)])
        at += int(size)
    return out


def _list(data: bytes, one: Any) -> List[Any]:
    """MosaicML's list encodings: a u32 placeholder, then the items."""
    return [one(x) for x in _items(data, 4)]


def _jpeg_array(data: bytes) -> List[Any]:
    """MosaicML's ``jpeg_array``: the JPEGs, with no placeholder."""
    return [_image(x) for x in _items(data, 0)]


_BYTES_DECODERS = {
    "bytes": bytes,
    "jpeg": _image,
    "png": _image,
    "pil": _pil,
    "list[pil]": lambda d: _list(d, _pil),
    "list[jpeg]": lambda d: _list(d, _image),
    "list[png]": lambda d: _list(d, _image),
    "jpeg_array": _jpeg_array,
    "jpegarray": _jpeg_array,
}


def _plain(v: Any) -> Any:
    """A tensor value as NumPy (an array) or a Python scalar (0-d)."""
    if isinstance(v, torch.Tensor):
        a = v.numpy()
        return a[()] if a.ndim == 0 else a
    return v


def _decode(value: Any, encoding: Optional[str], is_image: bool) -> Any:
    """One column's value as MosaicML's encoding decodes it (``None``: a ramjet column)."""
    if encoding is None:
        if is_image and isinstance(value, (bytes, bytearray)):
            return _image(bytes(value))
        return _plain(value)
    name = encoding.split(":")[0]
    if name in _BYTES_DECODERS:
        return _BYTES_DECODERS[name](bytes(value))
    v = _plain(value)
    if name in _SCALARS:
        return np.array(v).astype(name)[()]
    if name == "int" or name == "str_int":
        return int(v)
    if name == "str_float":
        return float(v)
    if name == "str_decimal":
        from decimal import Decimal

        return Decimal(str(v))
    if name == "json" and isinstance(v, str):
        return json.loads(v)
    if name == "ndarray" and isinstance(v, np.ndarray):
        return v.copy()
    return v


def _samples(batch: Dict[str, Any], encodings: Dict[str, str], image_column: str) -> Iterator[Dict[str, Any]]:
    """The samples of one of ramjet's batches, each column decoded."""
    names = [k for k in batch if not k.startswith("_") and not (
        k.endswith(("_offsets", "_shapes")) and k.rsplit("_", 1)[0] in batch)]
    for i in range(len(batch["_index"])):
        out = {}
        for k in names:
            v = batch[k]
            if f"{k}_offsets" in batch:  # a ragged array column: this value's slice, reshaped
                o = batch[f"{k}_offsets"]
                x = v[o[i]:o[i + 1]]
                if f"{k}_shapes" in batch:
                    x = x.reshape(batch[f"{k}_shapes"][i].tolist())
            else:
                x = v[i]
            out[k] = _decode(x, encodings.get(k), k == image_column)
        yield out


# ----- the dataset -----------------------------------------------------------------------


class StreamingDataset(IterableDataset):
    """MosaicML's ``StreamingDataset``, on ramjet: one sample at a time (a dict, each column
    decoded as MosaicML decodes it), ``len()`` this rank's samples per epoch
    (``ceil(epoch_size / world_size)``, as theirs: every rank the same count, padded).

    The arguments, against MosaicML's (docs/migrate.md has the table):

    - ``streams`` or ``remote``/``local``/``split`` (and the download arguments), as
      :class:`Stream`; ``local`` is ramjet's node-local cache when ``remote`` is given.
    - ``epoch_size``: samples an epoch (one stream), as theirs; with several streams, give each
      ``Stream`` its ``choose=``.
    - ``predownload``: samples read ahead a worker (ramjet's ``prefetch_batches`` in batches).
    - ``cache_limit``: the cache's byte budget, as theirs (an int or ``"64gb"``).
    - ``num_canonical_nodes``: ramjet's canonical partitions (``partitions``): node counts
      dividing it read only their share and resume exactly across a change (docs/order.md).
    - ``batch_size``: the per-device batch size, as theirs; state is taken at its boundaries.
    - ``shuffle``, ``shuffle_seed``; ``shuffle_algo`` ``py1e``, ``py1br``, ``py1b``, ``py1s``
      and ``py2s`` are ramjet's shard-block shuffle (shuffled shards, their samples shuffled
      within a window), ``naive`` its global permutation; ``shuffle_block_size`` the window in
      samples (rounded to whole shards of the first stream).
    - ``sampling_method="balanced"``, ``sampling_granularity=1``, ``partition_algo="relaxed"``
      and ``batching_method="random"`` (theirs' defaults) name ramjet's own rules; another
      value raises, saying what ramjet does. ``allow_unsafe_types=True`` raises: ramjet never
      unpickles. ``replication`` ``None`` or 1.
    """

    def __init__(self, *, streams: Optional[Sequence[Stream]] = None, remote: Optional[str] = None,
                 local: Optional[str] = None, split: Optional[str] = None, download_retry: int = _DEFAULT_RETRY,
                 download_timeout: float = _DEFAULT_TIMEOUT, validate_hash: Optional[str] = None,
                 keep_zip: bool = False, epoch_size: Union[int, str, None] = None, predownload: Optional[int] = None,
                 cache_limit: Union[int, str, None] = None, sampling_method: str = "balanced",
                 sampling_granularity: int = 1, partition_algo: str = "relaxed",
                 num_canonical_nodes: Optional[int] = None, batch_size: Optional[int] = None, shuffle: bool = False,
                 shuffle_algo: str = "py1e", shuffle_seed: int = 9176, shuffle_block_size: Optional[int] = None,
                 batching_method: str = "random", allow_unsafe_types: bool = False,
                 replication: Optional[int] = None, stream_name: str = "stream",
                 stream_config: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        _check_rules(sampling_method, sampling_granularity, partition_algo, batching_method, allow_unsafe_types,
                     replication, stream_name, stream_config)
        if streams is not None:
            if remote is not None or local is not None or split is not None:
                raise InvalidInputError("StreamingDataset: give streams= or remote=/local=/split=, not both (a "
                                        "Stream takes its own split=)")
            streams = list(streams)
            if not streams or not all(isinstance(s, Stream) for s in streams):
                raise InvalidInputError("StreamingDataset: streams= must be a non-empty list of Stream")
        else:
            streams = [Stream(remote=remote, local=local, split=split, download_retry=download_retry,
                              download_timeout=download_timeout, validate_hash=validate_hash, keep_zip=keep_zip)]
        _check_download(download_retry, download_timeout, validate_hash, keep_zip)
        self.streams = streams
        self.epoch_size = _size(epoch_size, "epoch_size")
        if self.epoch_size is not None:
            if len(streams) > 1:
                raise _refuse("epoch_size", epoch_size, "with several streams, give each Stream its choose=")
            if streams[0].proportion is not None or streams[0].repeat is not None or streams[0].choose is not None:
                raise _refuse("epoch_size", epoch_size, "the stream already says its size (proportion, repeat or choose)")
        if shuffle_algo not in (*_SHARD_LOCAL_ALGOS, "naive"):
            raise _refuse("shuffle_algo", shuffle_algo, f"must be one of {(*_SHARD_LOCAL_ALGOS, 'naive')}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise _refuse("batch_size", batch_size, "must be a positive int")
        if predownload is not None and (not isinstance(predownload, int) or predownload < 0):
            raise _refuse("predownload", predownload, "must be an int of at least 0")
        self.batch_size = batch_size
        self.shuffle, self.shuffle_algo, self.shuffle_seed = shuffle, shuffle_algo, shuffle_seed
        self.shuffle_block_size, self.predownload = shuffle_block_size, predownload
        self.num_canonical_nodes = num_canonical_nodes
        self.cache_limit = _bytes(cache_limit, "cache_limit")
        self._encodings = _mds_encodings(streams[0])
        self._image_column = "image"
        self._inner: Optional[ramjet.StreamingDataset] = None
        self._loaded: Optional[Dict[str, Any]] = None
        self._yielded = 0  # samples this process yielded this epoch
        self._pending = 0  # samples of the current batch not yet yielded

    # ----- the engine's dataset, made on first use (after a fork, in the worker) ------

    def _options(self) -> Dict[str, Any]:
        batch = self.batch_size or 1
        sources = [s._source() for s in self.streams]
        if self.epoch_size is not None:
            sources = [ramjet.Source(sources[0].remote, count=self.epoch_size)]
        first = self.streams[0]
        opts: Dict[str, Any] = dict(batch_size=batch, shuffle=self.shuffle, seed=self.shuffle_seed,
                                    image_size=None, partitions=self.num_canonical_nodes)
        opts["shuffle_algo"] = "global" if self.shuffle_algo == "naive" else "shard_block"
        if self.shuffle_block_size is not None and opts["shuffle_algo"] == "shard_block":
            per_shard = _samples_per_shard(first)
            opts["shuffle_window"] = max(1, math.ceil(self.shuffle_block_size / per_shard))
        if self.predownload is not None:
            opts["prefetch_batches"] = max(1, math.ceil(self.predownload / batch))
        # A remote dataset is cached under the first stream's local; a local one is read in place.
        opts["local"] = first.local if first.remote is not None else None
        opts["cache_limit"] = self.cache_limit if self.cache_limit is not None else "64GiB"
        return dict(remote=sources, **opts)

    def _engine(self) -> "ramjet.StreamingDataset":
        if self._inner is None:
            options = self._options()
            self._inner = ramjet.StreamingDataset(options.pop("remote"), **options)
            if self._loaded is not None:
                self._inner.load_state_dict(self._loaded)
        return self._inner

    # ----- iteration and size ---------------------------------------------------------

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        inner = self._engine()
        self._yielded = self._pending = 0
        for batch in inner:
            self._pending = len(batch["_index"])
            for sample in _samples(batch, self._encodings, self._image_column):
                self._yielded += 1
                self._pending -= 1
                yield sample

    def __len__(self) -> int:
        inner = self._engine()
        world = inner._topology()["world"]
        return -(-inner.num_samples // world)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        """Sample ``index`` of the first stream (random access, as theirs' ``dataset[i]``), its
        columns decoded as MosaicML decodes them."""
        got = self._engine()[index]
        return {k: _decode(v, self._encodings.get(k), k == self._image_column)
                for k, v in got.items() if not k.startswith("_")}

    @property
    def size(self) -> int:
        """Samples in one epoch across the job (MosaicML's ``epoch_size`` once resolved)."""
        return self._engine().num_samples

    def set_epoch(self, epoch: int) -> None:
        self._engine().set_epoch(epoch)

    # ----- state ----------------------------------------------------------------------

    def state_dict(self, num_samples: Optional[int] = None, from_beginning: bool = True) -> Dict[str, Any]:
        """The position after the samples this process yielded: MosaicML's keys (``epoch``,
        ``sample_in_epoch``, ``num_canonical_nodes``, ``shuffle_seed``) and ramjet's exact state
        (``"ramjet"``), which is what :meth:`load_state_dict` resumes from. ``num_samples`` and
        ``from_beginning`` (MosaicML's count of samples seen, which its own loader passes) are
        checked, not needed: ramjet counts its own. Taken inside a batch (its samples partly
        yielded) it raises: give ``batch_size`` the DataLoader's (:class:`StreamingDataLoader`
        does)."""
        inner = self._engine()
        if self._pending:
            raise InvalidInputError(
                f"state_dict with {self._pending} samples of a batch of {self.batch_size or 1} not yet yielded: ramjet "
                "saves state between its batches; give StreamingDataset(batch_size=) the DataLoader's batch size")
        world = inner._topology()["world"]
        if num_samples is not None and from_beginning and num_samples != self._yielded * world:
            raise _refuse("num_samples", num_samples,
                          f"this process yielded {self._yielded} samples this epoch ({self._yielded * world} across "
                          "the ranks)")
        state = inner.state_dict()
        return {
            "epoch": state.get("epoch", inner.epoch),
            "sample_in_epoch": self._yielded * world,
            "num_canonical_nodes": self.num_canonical_nodes,
            "shuffle_seed": self.shuffle_seed,
            "initial_physical_nodes": None,
            "ramjet": state,
        }

    def load_state_dict(self, obj: Dict[str, Any]) -> None:
        """Continues from a :meth:`state_dict`: the next iteration yields the rest of its epoch.
        A MosaicML state (no ``"ramjet"``) raises: its position is in MosaicML's order."""
        if not isinstance(obj, dict) or "ramjet" not in obj:
            raise InvalidInputError("load_state_dict: not a state this dataset saved (no 'ramjet' key); a MosaicML "
                                    "state's position is in MosaicML's sample order, which ramjet does not follow")
        self._loaded = obj["ramjet"]
        if self._inner is not None:
            self._inner.load_state_dict(self._loaded)

    def __getstate__(self) -> Dict[str, Any]:
        # A spawned worker makes its own engine dataset; a forked one is caught by ramjet's.
        d = dict(self.__dict__)
        if self._inner is not None:
            d["_inner"] = self._inner
        return d


def _check_rules(sampling_method: str, sampling_granularity: int, partition_algo: str, batching_method: str,
                 allow_unsafe_types: bool, replication: Optional[int], stream_name: str,
                 stream_config: Optional[Dict[str, Any]]) -> None:
    if sampling_method != "balanced":
        raise _refuse("sampling_method", sampling_method, "ramjet draws a stream's samples of an epoch its own "
                      "balanced way (docs/order.md, 'Mixing'); leave it 'balanced'")
    if sampling_granularity != 1:
        raise _refuse("sampling_granularity", sampling_granularity, "ramjet samples whole samples; leave it 1")
    if partition_algo != "relaxed":
        raise _refuse("partition_algo", partition_algo, "ramjet deals the one global order by its own rule "
                      "(docs/order.md, 'The deal'), which resumes across world sizes; leave it 'relaxed'")
    if batching_method != "random":
        raise _refuse("batching_method", batching_method, "ramjet mixes streams within each batch by their "
                      "weights; leave it 'random'")
    if allow_unsafe_types:
        raise _refuse("allow_unsafe_types", allow_unsafe_types, "ramjet never unpickles (a pkl column is refused); "
                      "re-encode the column (json, bytes, ndarray)")
    if replication not in (None, 1):
        raise _refuse("replication", replication, "ramjet has no replication of samples across ranks")
    if stream_name != "stream" or stream_config is not None:
        raise _refuse("stream_name", stream_name, "ramjet has one Stream class; leave stream_name and stream_config")


def _mds_encodings(stream: Stream) -> Dict[str, str]:
    """The first stream's MDS column encodings as written (empty: not MDS)."""
    url = stream.remote if stream.remote is not None else stream.local
    meta = json.loads(ramjet.inspect(str(url)).get("meta_json") or "{}")
    enc = meta.get("mds_encodings") if isinstance(meta, dict) else None
    return dict(enc) if isinstance(enc, dict) else {}


def _samples_per_shard(stream: Stream) -> float:
    url = stream.remote if stream.remote is not None else stream.local
    info = ramjet.inspect(str(url))
    return max(1.0, int(info["samples"]) / max(1, int(info.get("shards", 1))))


# ----- the loader ------------------------------------------------------------------------


try:
    from torchdata.stateful_dataloader import StatefulDataLoader as _Stateful
except ImportError:  # pragma: no cover - the test venv has torchdata
    _Stateful = None


class StreamingDataLoader(_Stateful if _Stateful is not None else torch.utils.data.DataLoader):  # type: ignore[misc]
    """MosaicML's ``StreamingDataLoader``: a DataLoader whose ``state_dict()`` /
    ``load_state_dict()`` resume mid-epoch exactly, with or without workers (torchdata's
    ``StatefulDataLoader`` underneath: each worker's position is saved after each batch it
    makes). A :class:`StreamingDataset` without ``batch_size`` takes the loader's; one with
    another raises naming both. ``num_samples_yielded`` counts this rank's samples, as theirs."""

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        if _Stateful is None:
            raise ImportError("StreamingDataLoader needs torchdata (pip install 'ramjet[torchdata]')")
        batch = kwargs.get("batch_size", args[0] if args else 1)
        if isinstance(dataset, StreamingDataset) and batch is not None:
            if dataset.batch_size is None:
                dataset.batch_size = batch
            elif dataset.batch_size != batch:
                raise InvalidInputError(
                    f"StreamingDataLoader(batch_size={batch}) over StreamingDataset(batch_size={dataset.batch_size}): "
                    "ramjet saves state between the dataset's batches; give both the same")
        super().__init__(dataset, *args, **kwargs)
        self.num_samples_yielded = 0

    def __iter__(self) -> Iterator[Any]:
        self.num_samples_yielded = 0
        for batch in super().__iter__():
            self.num_samples_yielded += _batch_len(batch)
            yield batch


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        for v in batch.values():
            return len(v)
        return 0
    return len(batch) if isinstance(batch, torch.Tensor) else len(batch[0])
