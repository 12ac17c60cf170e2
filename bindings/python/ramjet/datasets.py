"""The ramjetio dataset surface (``from ramjet.datasets import UniversalDataset``): one split
of a YOLO dataset packed by ``ramjet pack`` at an S3 prefix (or any ramjet URL), its sample
list, reads by sample path, and the two local exports its page documents:

- :meth:`UniversalDataset.export_labels_only`: the real labels, a small placeholder JPEG per
  sample and a ``data.yaml``, the bootstrap :func:`ramjet.integrations.ultralytics.streaming_train`
  reads labels from while the images stream (P3);
- :meth:`UniversalDataset.export_local`: the whole split on local disk as Ultralytics' files
  (P2), read through the host's cache daemon (``ramjet.init()``) and the cluster ring.

Both are written by one process a host (``LOCAL_RANK`` 0, else the rank given modulo the
ranks a host); the host's other ranks wait for its ``data.yaml``, written last.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import ramjet
from ramjet import InvalidInputError, NotFoundError

__all__ = ["UniversalDataset", "Client"]

#: Seconds a host's other ranks wait for its first rank's export.
EXPORT_WAIT_S = float(os.environ.get("RAMJET_EXPORT_WAIT_S", "1800"))

_LABELS = ("path", "width", "height", "boxes")


def _placeholder() -> bytes:
    """A 32 x 32 grey JPEG (written once, the same bytes for every sample)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), (114, 114, 114)).save(out, format="JPEG", quality=75)
    return out.getvalue()


class Client:
    """Reads a split's encoded images by sample path (``get_bytes(path)``, as ramjetio's client)
    or by index, through ramjet (the node cache and the ring when a daemon runs)."""

    def __init__(self, url: str, paths: List[str]) -> None:
        self.url = url
        self._at = {p: i for i, p in enumerate(paths)}
        self._reader: Optional[ramjet.Reader] = None

    def get_bytes(self, path: Union[str, int]) -> bytes:
        """The encoded image of the sample at ``path`` (its ``path`` column, or an index)."""
        i = path if isinstance(path, int) else self._at.get(str(path).lstrip("/"))
        if i is None:
            raise NotFoundError(f"{self.url}: no sample at path {path!r}")
        if self._reader is None:
            self._reader = ramjet.Reader(self.url, image_size=None)
        return self._reader.get_bytes(i, "image")

    def __getstate__(self) -> Dict[str, Any]:
        s = self.__dict__.copy()
        s["_reader"] = None
        return s


class UniversalDataset:
    """Split ``split`` of the dataset at ``source``: ``{source}/{split}`` when that holds a
    manifest, else ``source`` itself. ``samples`` lists its sample paths in dataset order."""

    def __init__(self, split: str = "train", source: Optional[str] = None) -> None:
        if not source:
            raise InvalidInputError("UniversalDataset: give source= (the dataset's URL, s3://bucket/prefix)")
        base = str(source).rstrip("/")
        try:
            ramjet.inspect(f"{base}/{split}")
            self.url = f"{base}/{split}"
        except NotFoundError:
            ramjet.inspect(base)  # raises NotFoundError naming the manifest when neither is there
            self.url = base
        self.split = split
        info = ramjet.inspect(self.url)
        have = {name for name, _ty in info["schema"]}
        missing = [c for c in _LABELS if c not in have]
        if missing:
            raise InvalidInputError(f"{self.url}: a YOLO split needs the columns {list(_LABELS)} (ramjet pack of a "
                                    f"YOLO folder writes them); it lacks {missing}")
        meta = json.loads(info.get("meta_json") or "{}")
        self.names: List[str] = list(meta.get("classes") or [])
        self._table: Optional[Dict[str, List[Any]]] = None
        self._reads: Optional[Client] = None

    def _columns(self) -> Dict[str, List[Any]]:
        if self._table is None:
            self._table = dict(ramjet.columns(self.url, list(_LABELS)))
        return self._table

    @property
    def samples(self) -> List[str]:
        """The split's sample paths (its ``path`` column), in dataset order."""
        return list(self._columns()["path"])

    def __len__(self) -> int:
        return int(ramjet.inspect(self.url)["samples"])

    @property
    def client(self) -> Client:
        """The split's reader by sample path."""
        if self._reads is None:
            self._reads = Client(self.url, self.samples)
        return self._reads

    @property
    def _client(self) -> Client:
        """ramjetio's name for :attr:`client` (its page passes ``source=dataset._client``)."""
        return self.client

    # ----- exports --------------------------------------------------------------------

    def export_labels_only(self, out_dir: Union[str, os.PathLike], rank: Optional[int] = None,
                           world_size: Optional[int] = None) -> str:
        """Writes ``{out_dir}/{split}/labels/*.txt`` (each sample's real YOLO labels),
        ``{out_dir}/{split}/images/*`` (one 32 x 32 placeholder JPEG each, so Ultralytics finds
        its files) and ``{out_dir}/data.yaml`` (with ``ramjet:`` naming this split's URL, which
        ``streaming_train`` streams the images from). Returns the data.yaml's path."""
        return self._export(Path(out_dir), rank, world_size, images=False)

    def export_local(self, out_dir: Union[str, os.PathLike], rank: Optional[int] = None,
                     world_size: Optional[int] = None) -> str:
        """Writes the whole split as Ultralytics' files: each image's encoded bytes as stored
        (verified against the manifest, read through the host's cache daemon and the ring when
        ``ramjet.init()`` runs), its labels, and ``{out_dir}/data.yaml``. Returns its path."""
        return self._export(Path(out_dir), rank, world_size, images=True)

    def _export(self, out: Path, rank: Optional[int], world_size: Optional[int], images: bool) -> str:
        rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
        world = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
        if world < 1 or not 0 <= rank < world:
            raise InvalidInputError(f"export: rank={rank} of world_size={world} does not exist")
        yaml = out / "data.yaml"
        local_rank = os.environ.get("LOCAL_RANK")
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        first = int(local_rank) == 0 if local_rank is not None else rank % max(per_host, 1) == 0
        if not first:
            return _wait_for(yaml)
        t = self._columns()
        root = out / self.split
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "labels").mkdir(parents=True, exist_ok=True)
        names = [_file_name(p, i) for i, p in enumerate(t["path"])]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})[:3]
            raise InvalidInputError(f"export: {self.url} has samples whose file names collide ({twice}): Ultralytics' "
                                    "folder layout keeps one file per name")
        for name, boxes in zip(names, t["boxes"]):
            rows = json.loads(boxes) if boxes else []
            text = "".join(_label_line(row) for row in rows)
            (root / "labels" / (Path(name).stem + ".txt")).write_text(text)
        if images:
            self._write_images(root / "images", names)
        else:
            blank = _placeholder()
            for name in names:
                (root / "images" / (Path(name).stem + ".jpg")).write_bytes(blank)
        return _write_yaml(yaml, out, self.split, self.url, self.names)

    def _write_images(self, to: Path, names: List[str]) -> None:
        ds = ramjet.StreamingDataset(self.url, image_size=None, shuffle=False, rank=0, world_size=1, batch_size=64,
                                     boxes_column=None, cache_limit=None)
        for batch in ds:
            for i, data in zip(batch["_index"].tolist(), batch["image"]):
                (to / names[int(i)]).write_bytes(bytes(data))


def _file_name(path: str, i: int) -> str:
    name = Path(str(path)).name
    return name if name else f"{i:08d}.jpg"


def _label_line(row: List[Any]) -> str:
    """One YOLO label line: the class, then the box as the shortest text of each float (read
    back to the very same value)."""
    return " ".join([str(int(row[0]))] + [repr(float(v)) for v in row[1:]]) + "\n"


def _write_yaml(yaml: Path, out: Path, split: str, url: str, names: List[str]) -> str:
    text = (f"path: {out}\ntrain: {split}/images\nval: {split}/images\n"
            f"names: {json.dumps(dict(enumerate(names)))}\nramjet:\n  train: {url}\n  val: {url}\n")
    tmp = yaml.with_suffix(".yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, yaml)  # last, whole: the host's other ranks wait for it
    return str(yaml)


def _wait_for(yaml: Path) -> str:
    t0 = time.monotonic()
    while not yaml.exists():
        if time.monotonic() - t0 > EXPORT_WAIT_S:
            raise ramjet.Error(f"export: {yaml} did not appear in {EXPORT_WAIT_S:.0f} s (the host's first rank "
                               "writes it; RAMJET_EXPORT_WAIT_S sets the wait)")
        time.sleep(0.2)
    return str(yaml)
