"""Ultralytics YOLO training streamed from object storage through ramjet.

::

    from ramjet.integrations.ultralytics import streaming_train
    streaming_train("yolov8n.yaml", data="s3://bucket/yolo-set", epochs=50, batch=16, workers=8)

No file of the dataset is written to local disk outside ramjet's cache:

- labels (classes, boxes) and image sizes come from the shards' columns sidecars, a few KB
  per shard, so nothing is scanned or verified image by image before the first step;
- ``load_image(i)`` reads sample ``i`` by its global index through ramjet (a whole shard held
  in memory, the node cache, the host daemon and its cluster ring, or two ranged GETs while
  the shard loads), then decodes it with OpenCV exactly as Ultralytics decodes a file. Mosaic
  and every other Ultralytics transform run unchanged on real images;
- validation runs for real, on the val split streamed the same way.

Tested with ultralytics 8.4.190 (see ``ULTRALYTICS_TESTED``). Install with
``pip install 'ramjet[ultralytics]'``.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

import ramjet
from ramjet import InvalidInputError, NotFoundError

try:
    import cv2
    from ultralytics.data.dataset import YOLODataset
    from ultralytics.models.yolo.detect import DetectionTrainer, DetectionValidator
    from ultralytics.utils import LOCAL_RANK, LOGGER, RANK, colorstr
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ramjet.integrations.ultralytics needs Ultralytics: pip install 'ramjet[ultralytics]'"
    ) from e

__all__ = [
    "RamjetDetectionTrainer",
    "RamjetDetectionValidator",
    "RamjetYOLODataset",
    "StepTimer",
    "ULTRALYTICS_TESTED",
    "check_version",
    "offline_environment",
    "resolve_data",
    "streaming_train",
]

#: Ultralytics versions this integration is tested with (CI pins the first).
ULTRALYTICS_TESTED = ("8.4.190",)


def check_version(version: str, strict: Optional[bool] = None) -> None:
    """Ultralytics ``version`` against :data:`ULTRALYTICS_TESTED`: an untested one is an
    ``ImportError`` when ``strict`` (default: ``RAMJET_ULTRALYTICS_STRICT=1``), else a warning
    naming the tested versions."""
    if version in ULTRALYTICS_TESTED:
        return
    if strict is None:
        strict = os.environ.get("RAMJET_ULTRALYTICS_STRICT", "") not in ("", "0")
    why = (f"ramjet.integrations.ultralytics is tested with ultralytics {', '.join(ULTRALYTICS_TESTED)}, "
           f"not {version}")
    if strict:
        raise ImportError(why + " (RAMJET_ULTRALYTICS_STRICT is set; pip install 'ramjet[ultralytics]')")
    import warnings

    warnings.warn(why + "; set RAMJET_ULTRALYTICS_STRICT=1 to refuse it", RuntimeWarning, stacklevel=3)


def _installed_version() -> str:
    import ultralytics

    return str(getattr(ultralytics, "__version__", "unknown"))


check_version(_installed_version())

_SCHEMES = ("s3://", "gs://", "az://", "file://", "http://", "https://")


def _is_url(s: Any) -> bool:
    return isinstance(s, str) and s.startswith(_SCHEMES)


def offline_environment(config_dir: Optional[str] = None) -> Dict[str, str]:
    """Sets the environment so Ultralytics never reaches the network: ``YOLO_OFFLINE``, a
    private ``YOLO_CONFIG_DIR`` (a temporary one unless given or already set) with settings
    sync and hub off. Returns the variables it set. Call it before Ultralytics is imported
    for the config dir to apply; the settings are also written to the live settings object.
    """
    env = {"YOLO_OFFLINE": "1"}
    if "YOLO_CONFIG_DIR" not in os.environ:
        env["YOLO_CONFIG_DIR"] = config_dir or tempfile.mkdtemp(prefix="ramjet-yolo-config-")
    os.environ.update(env)
    try:
        from ultralytics.utils import SETTINGS

        SETTINGS.update({"sync": False, "hub": False})
    except Exception:  # pragma: no cover - settings are best effort
        pass
    return env


# ----- data resolution ------------------------------------------------------------------


def _inspect(url: str) -> Dict[str, Any]:
    info = dict(ramjet.inspect(url))
    info["meta"] = json.loads(info.pop("meta_json", "{}"))
    return info


def resolve_data(data: Union[str, Dict[str, Any]]) -> Dict[str, Any]:
    """The Ultralytics data dict for ``data``, with ``train`` and ``val`` as ramjet URLs.

    ``data`` is one of:

    - a ramjet dataset URL whose prefix holds ``train/`` and ``val/`` datasets (each with its
      manifest); without them, the dataset itself serves as both splits;
    - a data.yaml (path) or dict whose ``train`` and ``val`` entries are ramjet URLs.

    Class names come from the yaml's ``names``, else from the train manifest's
    ``meta.classes``. Nothing touches the local disk or the network beyond the manifests.
    """
    cfg: Dict[str, Any]
    if isinstance(data, dict):
        cfg = dict(data)
    elif _is_url(data):
        base = data.rstrip("/")
        try:
            _inspect(base + "/train")
            _inspect(base + "/val")
            cfg = {"train": base + "/train", "val": base + "/val"}
        except NotFoundError:
            cfg = {"train": base, "val": base}
    elif isinstance(data, (str, Path)) and str(data).endswith((".yaml", ".yml")):
        from ultralytics.utils import YAML

        cfg = dict(YAML.load(str(data)))
        cfg.setdefault("yaml_file", str(data))
        streamed = cfg.get("ramjet")
        if isinstance(streamed, dict):
            # A data.yaml from UniversalDataset.export_labels_only: the splits stream from ramjet.
            cfg.update(train=streamed.get("train"), val=streamed.get("val"))
    else:
        raise InvalidInputError(f"data {data!r}: give a ramjet dataset URL or a data.yaml whose splits are URLs")
    for split in ("train", "val"):
        v = cfg.get(split)
        if split == "val" and v in (None, ""):
            continue
        if not _is_url(v):
            raise InvalidInputError(
                f"data {data!r}: {split} is {v!r}, not a ramjet dataset URL (s3://..., file://...)"
            )
    train = _inspect(cfg["train"])
    names = cfg.get("names")
    if names is None:
        classes = train["meta"].get("classes")
        if not classes:
            raise InvalidInputError(f"{cfg['train']}: no class names in data nor in the manifest's meta.classes")
        names = classes
    if isinstance(names, (list, tuple)):
        names = dict(enumerate(names))
    names = {int(k): str(v) for k, v in names.items()}
    cfg.update(names=names, nc=len(names), channels=int(cfg.get("channels", 3)))
    cfg.setdefault("path", cfg["train"])
    cfg.setdefault("test", None)
    return cfg


# ----- the dataset ----------------------------------------------------------------------

_LABEL_COLUMNS = ("path", "width", "height", "boxes")


def _label_table(url: str) -> Dict[str, List[Any]]:
    info = _inspect(url)
    have = {name for name, _ty in info["schema"]}
    missing = [c for c in _LABEL_COLUMNS if c not in have]
    if missing:
        raise InvalidInputError(
            f"{url}: a YOLO dataset needs the columns {list(_LABEL_COLUMNS)} (ramjet pack of a YOLO folder writes "
            f"them); it has {sorted(have)}"
        )
    return dict(ramjet.columns(url, list(_LABEL_COLUMNS)))


class RamjetYOLODataset(YOLODataset):
    """Ultralytics' ``YOLODataset`` over a packed ramjet dataset: ``img_path`` is its URL.

    Labels come from the shards' ``boxes``, ``width`` and ``height`` columns; images are read
    by global index through ramjet. The engine handle is opened lazily in each process and
    dropped when the dataset is pickled, so DataLoader workers and DDP re-launches each open
    their own.
    """

    def __init__(self, *args: Any, resident_bytes: Optional[int] = None, **kwargs: Any) -> None:
        self._reader: Optional[ramjet.Reader] = None
        self._resident_bytes = resident_bytes
        self._index: List[int] = []
        self.skipped: List[Tuple[int, str]] = []
        super().__init__(*args, **kwargs)

    # Ultralytics' file discovery, replaced: the manifest is the file list.
    def get_img_files(self, img_path: Union[str, List[str]]) -> List[str]:
        if isinstance(img_path, (list, tuple)):
            if len(img_path) != 1:
                raise InvalidInputError(f"one ramjet dataset URL per split, not {img_path!r}")
            img_path = img_path[0]
        if not _is_url(img_path):
            raise InvalidInputError(f"{img_path!r} is not a ramjet dataset URL")
        self.url = str(img_path).rstrip("/")
        self._table = _label_table(self.url)
        n = len(self._table["path"])
        keep = list(range(n))
        f = self.fraction
        count = f if isinstance(f, int) and not isinstance(f, bool) else max(1, round(n * float(f)))
        if count < n:
            keep = keep[:count]
        # Stock Ultralytics samples 5 files here for a read-speed check (random.sample). The
        # same draw keeps Python's generator in step with it, so a seed gives the very same
        # augmentations as training stock Ultralytics on exported files.
        random.sample(keep, min(5, len(keep)))
        self._index = keep
        return [f"{self.url}/{self._table['path'][g]}" for g in keep]

    def get_labels(self) -> List[Dict[str, Any]]:
        nc = int(self.data.get("nc", 0)) or None
        labels: List[Dict[str, Any]] = []
        index: List[int] = []
        t = self._table
        for g, im_file in zip(self._index, self.im_files):
            try:
                lb = np.asarray(json.loads(t["boxes"][g]) or np.zeros((0, 5)), dtype=np.float32).reshape(-1, 5)
                if len(lb):
                    if lb[:, 1:].max() > 1.01 or lb[:, 1:].min() < -0.01 or lb[:, 3:].min() < 0:
                        raise ValueError("box coordinates outside [0, 1]")
                    if (lb[:, 0] % 1 != 0).any() or lb[:, 0].min() < 0:
                        raise ValueError("class ids that are not non-negative integers")
                    if nc is not None and not self.single_cls and lb[:, 0].max() >= nc:
                        raise ValueError(f"class {int(lb[:, 0].max())} but the dataset has {nc} classes")
                    _, keep = np.unique(lb, axis=0, return_index=True)
                    lb = lb[np.sort(keep)]  # duplicate rows removed, as Ultralytics does
                w, h = int(t["width"][g]), int(t["height"][g])
                if w <= 0 or h <= 0:
                    raise ValueError(f"image size {w}x{h}")
            except (ValueError, TypeError) as e:
                # As Ultralytics does with a corrupt label file: leave the image out, say which.
                self.skipped.append((g, str(e)))
                continue
            labels.append(
                {
                    "im_file": im_file,
                    "shape": (h, w),
                    "cls": lb[:, 0:1],
                    "bboxes": lb[:, 1:],
                    "segments": [],
                    "keypoints": None,
                    "normalized": True,
                    "bbox_format": "xywh",
                }
            )
            index.append(g)
        if self.skipped:
            shown = "; ".join(f"sample {g}: {why}" for g, why in self.skipped[:5])
            LOGGER.warning(f"{self.prefix}{self.url}: {len(self.skipped)} samples left out for bad labels ({shown})")
        if not labels:
            raise InvalidInputError(f"{self.url}: no sample has usable labels")
        self._index = index
        self.im_files = [lb["im_file"] for lb in labels]
        del self._table  # the labels hold what is needed; the raw columns can go
        return labels

    def set_rectangle(self) -> None:
        # Ultralytics sorts images by aspect ratio: the global indices follow the same order.
        s = np.array([x["shape"] for x in self.labels])
        irect = (s[:, 0] / s[:, 1]).argsort()
        super().set_rectangle()
        self._index = [self._index[i] for i in irect]

    def cache_images(self) -> None:
        if self.cache == "disk":
            raise InvalidInputError(
                "cache='disk' writes decoded images beside image files; with ramjet the node cache (NVMe) already "
                "holds the shards: use cache=False or cache='ram'"
            )
        super().cache_images()

    def check_cache_disk(self, safety_margin: float = 0.1) -> bool:
        return True  # refused in cache_images with a clear message

    # ----- reads ----------------------------------------------------------------------

    def _engine(self) -> "ramjet.Reader":
        if self._reader is None:
            # A forked worker's copy opens its own native reader on first use (ramjet.Reader).
            self._reader = ramjet.Reader(self.url, image_size=None, resident_bytes=self._resident_bytes)
        return self._reader

    def read_bytes(self, i: int) -> bytes:
        """The encoded image of dataset item ``i`` (its position in this split, as Ultralytics
        indexes it), read through ramjet."""
        return self._engine().get_bytes(self._index[i], "image")

    def load_image(self, i: int, rect_mode: bool = True, resize_short: bool = False):
        """Ultralytics' ``load_image``, reading through ramjet instead of a file: the same
        OpenCV decode, resize and mosaic buffer."""
        im = self.ims[i]
        if im is not None:
            return self.ims[i], self.im_hw0[i], self.im_hw[i]
        g = self._index[i]
        raw = self.read_bytes(i)
        im = cv2.imdecode(np.frombuffer(raw, np.uint8), self.cv2_flag)
        if im is None:
            raise ramjet.CorruptError(f"{self.url} sample {g} ({self.im_files[i]}): the image does not decode")
        h0, w0 = im.shape[:2]
        shape = tuple(self.imgsz) if isinstance(self.imgsz, (tuple, list)) else (self.imgsz, self.imgsz)
        imgsz = max(shape)
        if rect_mode:
            if resize_short:
                r = imgsz / min(h0, w0)
                if r != 1:
                    w, h = (math.ceil(w0 * r), imgsz) if h0 < w0 else (imgsz, math.ceil(h0 * r))
                    im = cv2.resize(im, (w, h), interpolation=cv2.INTER_LINEAR)
            else:
                r = imgsz / max(h0, w0)
                if r != 1:
                    w, h = (min(math.ceil(w0 * r), imgsz), min(math.ceil(h0 * r), imgsz))
                    im = cv2.resize(im, (w, h), interpolation=cv2.INTER_LINEAR)
        elif (h0, w0) != shape:
            im = cv2.resize(im, shape[::-1], interpolation=cv2.INTER_LINEAR)
        if im.ndim == 2:
            im = im[..., None]
        if self.augment and self.cache != "ram":
            self.ims[i], self.im_hw0[i], self.im_hw[i] = im, (h0, w0), im.shape[:2]
            self.buffer.append(i)
            if 1 < len(self.buffer) >= self.max_buffer_length:
                j = self.buffer.pop(0)
                self.ims[j], self.im_hw0[j], self.im_hw[j] = None, None, None
        return im, (h0, w0), im.shape[:2]

    def __getstate__(self) -> Dict[str, Any]:
        s = self.__dict__.copy()
        s["_reader"] = None
        return s


def _build(cfg: Any, img_path: str, mode: str, batch: Optional[int], data: Dict[str, Any], stride: int):
    from ultralytics.data.build import get_split_fraction

    return RamjetYOLODataset(
        img_path=img_path,
        imgsz=cfg.imgsz,
        batch_size=batch,
        augment=mode == "train",
        hyp=cfg,
        rect=cfg.rect or mode == "val",
        cache=cfg.cache or None,
        single_cls=cfg.single_cls or False,
        stride=stride,
        pad=0.0 if mode == "train" else 0.5,
        prefix=colorstr(f"{mode}: "),
        task=cfg.task,
        classes=cfg.classes,
        data=data,
        fraction=get_split_fraction(cfg.fraction, "train" if mode == "train" else cfg.split),
    )


# ----- the validator and the trainer ----------------------------------------------------


class RamjetDetectionValidator(DetectionValidator):
    """Ultralytics' ``DetectionValidator`` on a split streamed through ramjet. Inside training
    it uses the trainer's loader; on its own (the final evaluation of ``best.pt``, or
    ``YOLO(...).val(validator=RamjetDetectionValidator, data=url)``) it resolves ``data`` with
    :func:`resolve_data` instead of looking for files."""

    def __call__(self, trainer: Any = None, model: Any = None):
        import ultralytics.engine.validator as v

        # Ultralytics resolves `data` through a module-level function of the validator's
        # module; it is swapped for the length of this call only (validation runs on the
        # trainer's thread).
        stock = v.check_det_dataset
        v.check_det_dataset = lambda d, *a, **k: resolve_data(d)
        try:
            return super().__call__(trainer=trainer, model=model)
        finally:
            v.check_det_dataset = stock

    def build_dataset(self, img_path: str, mode: str = "val", batch: Optional[int] = None):
        return _build(self.args, img_path, mode, batch, self.data, int(max(self.stride.max(), 32)) if hasattr(self.stride, "max") else 32)



class RamjetDetectionTrainer(DetectionTrainer):
    """Ultralytics' ``DetectionTrainer`` whose train and val splits are ramjet URLs.

    ``get_dataset`` resolves ``data`` (see :func:`resolve_data`) without any path, font or
    download check; ``build_dataset`` builds :class:`RamjetYOLODataset`. Rank and world size
    are the trainer's own (Ultralytics' DistributedSampler splits the indices), so DDP, with
    Ultralytics' own re-launch, needs nothing else.
    """

    def __init__(self, cfg: Any = None, overrides: Optional[Dict[str, Any]] = None, _callbacks: Any = None) -> None:
        from ultralytics.utils import DEFAULT_CFG

        super().__init__(cfg if cfg is not None else DEFAULT_CFG, overrides, _callbacks)
        # Stock Ultralytics loads in the main process on CPU (workers=0): a CPU step is long
        # and the loading cores are the training cores. Loading through ramjet in worker
        # processes overlaps it with the step instead; workers given explicitly are kept.
        asked = (overrides or {}).get("workers")
        if self.device.type == "cpu" and asked:
            self.args.workers = int(asked)
        # Launched by torchrun on CPUs: each process is a rank of a gloo job (stock Ultralytics
        # trains on one CPU process only).
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.device.type == "cpu" and world > 1 and LOCAL_RANK != -1:
            self.world_size = world

    def _setup_ddp(self) -> None:
        if self.device.type != "cpu":
            return super()._setup_ddp()
        import torch.distributed as dist

        if not dist.is_initialized():
            from datetime import timedelta

            dist.init_process_group("gloo", rank=RANK, world_size=self.world_size, timeout=timedelta(hours=3))
        return None

    def final_eval(self) -> None:
        if self.device.type != "cpu" or self.world_size <= 1:
            return super().final_eval()
        # A CPU job's final evaluation of best.pt runs on rank 0 as one process does (stock
        # Ultralytics would look for the rank's accelerator); the others pass its barrier.
        import ultralytics.engine.validator as v
        import ultralytics.models.yolo.detect.val as dv

        ranks, best = (v.RANK, v.LOCAL_RANK, dv.RANK, dv.LOCAL_RANK), self.best
        if RANK == 0:
            v.RANK = v.LOCAL_RANK = dv.RANK = dv.LOCAL_RANK = -1
        else:
            self.best = best.with_name(best.name + ".rank0-only")
        try:
            return super().final_eval()
        finally:
            (v.RANK, v.LOCAL_RANK, dv.RANK, dv.LOCAL_RANK), self.best = ranks, best

    def _setup_train(self) -> None:
        if self.device.type != "cpu" or self.world_size <= 1:
            return super()._setup_train()
        import torch.nn as nn

        real = nn.parallel.DistributedDataParallel

        class CpuDDP(real):  # type: ignore[misc,valid-type]
            """Ultralytics' wrap on CPUs: no device ids (a CPU module has none), and
            ``find_unused_parameters=True`` (YOLO heads leave some unused with workers)."""

            def __init__(self, module: Any, device_ids: Any = None, **kw: Any) -> None:
                kw["find_unused_parameters"] = True
                super().__init__(module, device_ids=None, **kw)

        nn.parallel.DistributedDataParallel = CpuDDP
        try:
            return super()._setup_train()
        finally:
            nn.parallel.DistributedDataParallel = real

    def get_dataset(self) -> Dict[str, Any]:
        data = resolve_data(self.args.data)
        if self.args.single_cls:
            data["names"], data["nc"] = {0: "item"}, 1
        return data

    def build_dataset(self, img_path: str, mode: str = "train", batch: Optional[int] = None):
        from ultralytics.utils.torch_utils import unwrap_model

        gs = max(int(unwrap_model(self.model).stride.max()), 32) if self.model is not None else 32
        return _build(self.args, img_path, mode, batch, self.data, gs)

    def get_validator(self) -> RamjetDetectionValidator:
        from copy import copy

        return RamjetDetectionValidator(
            self.test_loader, save_dir=self.save_dir, args=copy(self.args), _callbacks=self.callbacks
        )


# ----- measuring ------------------------------------------------------------------------


def _total(items: Any) -> float:
    """The sum of a step's loss items (a dict of tensors in Ultralytics 8.4, a tensor
    before)."""
    if items is None:
        return float("nan")
    if isinstance(items, dict):
        return float(sum(float(v) for v in items.values()))
    return float(items.sum()) if hasattr(items, "sum") else float(items)


class StepTimer:
    """Ultralytics callbacks that time every training step: when it started (from the
    trainer's start), how long it waited for its batch, and its loss. Attach to a ``YOLO``
    model before ``train``; works with any trainer (the stock one too)."""

    def __init__(self, t0: Optional[float] = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.steps: List[Dict[str, float]] = []
        self.epochs: List[Dict[str, float]] = []
        self.first_step_s: Optional[float] = None
        self._last_end: Optional[float] = None
        self._start: Optional[float] = None
        self._epoch_start: Optional[float] = None

    def attach(self, model: Any) -> "StepTimer":
        model.add_callback("on_train_epoch_start", self._on_epoch_start)
        model.add_callback("on_train_batch_start", self._on_batch_start)
        model.add_callback("on_train_batch_end", self._on_batch_end)
        model.add_callback("on_train_epoch_end", self._on_epoch_end)
        return self

    def _on_epoch_start(self, trainer: Any) -> None:
        self._epoch_start = self._last_end = time.perf_counter()

    def _on_batch_start(self, trainer: Any) -> None:
        self._start = time.perf_counter()

    def _on_batch_end(self, trainer: Any) -> None:
        now = time.perf_counter()
        wait = (self._start or now) - (self._last_end or self._start or now)
        step_loss = _total(trainer.loss_items)
        self.steps.append(
            {
                "epoch": int(trainer.epoch),
                "at_s": now - self.t0,
                "wait_s": wait,
                "step_s": now - (self._last_end or self._start or now),
                "loss": step_loss,
            }
        )
        if self.first_step_s is None:
            self.first_step_s = now - self.t0
        self._last_end = now

    def _on_epoch_end(self, trainer: Any) -> None:
        now = time.perf_counter()
        mine = [s for s in self.steps if s["epoch"] == int(trainer.epoch)]
        self.epochs.append(
            {
                "epoch": int(trainer.epoch),
                "wall_s": now - (self._epoch_start or now),
                "steps": len(mine),
                "wait_s": sum(s["wait_s"] for s in mine),
            }
        )


# ----- the entry point ------------------------------------------------------------------


def _with_source(data: Any, source: Any, samples: Optional[List[str]]) -> Any:
    """``data`` with its splits reading ``source`` where they are not ramjet URLs, and
    ``samples`` checked against the training split."""
    url = source if source is None or _is_url(source) else getattr(source, "url", None)
    if source is not None and not _is_url(url):
        raise InvalidInputError(f"source={source!r}: give a ramjet URL or a ramjet.datasets.Client (dataset._client)")
    if url is not None:
        if data is None:
            data = url
        elif not _is_url(data) and not isinstance(data, dict):
            from ultralytics.utils import YAML

            cfg = dict(YAML.load(str(data)))
            if not isinstance(cfg.get("ramjet"), dict):
                for split in ("train", "val"):
                    if not _is_url(cfg.get(split)):
                        cfg[split] = url
                data = cfg
    if samples is not None:
        train = resolve_data(data)["train"]
        have = list(ramjet.columns(train, ["path"])["path"])
        if list(samples) != have:
            raise InvalidInputError(
                f"samples=: {len(samples)} paths that are not {train}'s {len(have)} samples in order; ramjet trains on "
                "the whole split (keep a subset with filter= on a StreamingDataset, or pack the subset)")
    return data


def streaming_train(
    model: Any,
    data: Union[str, Dict[str, Any], None] = None,
    epochs: int = 100,
    batch: int = 16,
    workers: int = 8,
    *,
    cache_dir: Optional[str] = None,
    daemon: Optional[bool] = None,
    offline: bool = True,
    source: Any = None,
    samples: Optional[List[str]] = None,
    **train_args: Any,
) -> Any:
    """Trains a YOLO detection model on a dataset streamed from object storage.

    Mirrors the published entry point ``streaming_train(model, data=..., epochs=...,
    batch=..., workers=...)``. ``model`` is a model yaml (``"yolov8n.yaml"``, built without a
    weight download), a checkpoint path, or a ``YOLO`` object; ``data`` a ramjet URL or a
    data.yaml whose ``train`` and ``val`` are ramjet URLs (see :func:`resolve_data`). Other
    keyword arguments go to Ultralytics' ``train`` (``imgsz``, ``device``, ``val``, ...).

    - ``daemon``: read through the host's cache daemon (``ramjet serve``), starting one
      embedded in this process if none runs (default: yes, with ``cache_dir``, else
      ``RAMJET_CACHE_DIR`` or ``~/.cache/ramjet``). The cluster ring is frozen for the whole
      run and unfrozen at its end, after an error too. ``False`` reads without a daemon.
    - ``offline``: see :func:`offline_environment` (on by default); ``amp`` defaults to
      ``False`` because Ultralytics' AMP check downloads a model.

    - ``source``: where the images stream from, as ramjetio's page passes it: a
      :class:`ramjet.datasets.Client` (``dataset._client``) or a ramjet URL. With a ``data``
      whose splits are local folders (a placeholder export), both splits read ``source``.
    - ``samples``: the split's sample paths (``dataset.samples``); ramjet trains on the whole
      split, so another list raises, naming ``filter=`` as the way to keep a subset.

    Returns the trained ``YOLO`` model; ``model.trainer`` holds the run (``save_dir``,
    ``metrics``).
    """
    data = _with_source(data, source, samples)
    if offline:
        offline_environment()
    from ultralytics import YOLO

    yolo = model if isinstance(model, YOLO) else YOLO(model)
    socket: Optional[str] = None
    if daemon is None or daemon:
        socket = ramjet.init(cache_dir)
        # DDP re-launches run in new processes: they find the daemon through the environment.
        os.environ["RAMJET_SOCKET"] = socket
    args = dict(train_args)
    args.setdefault("amp", False)
    # The freeze is a lease on its own connection: released at the end, after an error too,
    # and by the daemon when this process is killed.
    lease = ramjet.freeze(socket) if socket is not None else None
    try:
        yolo.train(trainer=RamjetDetectionTrainer, data=data, epochs=epochs, batch=batch, workers=workers, **args)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # The ranks of a host end together: the first one's process may hold the host's
            # embedded daemon, which the others read through until their last evaluation.
            dist.barrier()
    finally:
        if lease is not None:
            try:
                lease.release()
            except ramjet.Error as e:  # pragma: no cover - the daemon went away (which released it)
                LOGGER.warning(f"ramjet: could not unfreeze the ring at {socket}: {e}")
    return yolo
