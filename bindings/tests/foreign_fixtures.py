"""Writes golden MDS and WebDataset fixtures with the real writers (run by the peers' venv,
tools/bench-venv.sh, never the core venv).

usage: foreign_fixtures.py IMAGES_DIR OUT_DIR N

OUT_DIR gets mds-plain/, mds-zstd/, mds-gz/ (MosaicML's MDSWriter, with xxh64 hashes),
mds-pkl/ (a pickled column, which ramjet must refuse), wds/ (webdataset's TarWriter, plain
tars) and wds-gz/ (gzipped tars), each shard holding a few samples, plus expected.json: every
sample's columns as the writers stored them (bytes as base64), for ramjet to match exactly.
"""

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image
from streaming import MDSWriter
from streaming.base.format.mds.encodings import mds_encode

images, out, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
files = sorted(p for p in images.rglob("*.jpg"))[:n]
assert len(files) == n, f"{len(files)} JPEGs in {images}, {n} wanted"

COLUMNS = {
    "image": "jpeg",
    "thumb": "png",
    "raw": "bytes",
    "label": "int",
    "small": "uint8",
    "neg": "int16",
    "weight": "float32",
    "half": "float16",
    "name": "str",
    "count": "str_int",
    "meta": "json",
    "arr": "ndarray:float32:2,3",
    "vec": "ndarray:int16",
    "free": "ndarray",
    "pil": "pil",
}


def sample(i, path):
    thumb = Image.new("RGB", (4 + i % 3, 3), (i * 7 % 256, 20, 30))
    return {
        "image": Image.open(path),
        "thumb": thumb,
        "raw": path.read_bytes()[:100] + bytes([i % 256]),
        "label": i * 1000003 - 5,
        "small": np.uint8(i % 256),
        "neg": np.int16(-i),
        "weight": np.float32(i / 8),
        "half": np.float16(0.5 + i),
        "name": f"sample-{i}-é",
        "count": i * 3,
        "meta": {"i": i, "tags": ["a", str(i)]},
        "arr": np.arange(6, dtype=np.float32).reshape(2, 3) * i,
        "vec": np.arange(i % 4 + 1, dtype=np.int16) - 3 * i,
        "free": (np.arange((i % 3 + 1) * 2, dtype=np.uint16) * 300 + i).reshape(i % 3 + 1, 2),
        "pil": thumb,
    }


def b64(b):
    return {"b64": base64.b64encode(b).decode()}


def array(a):
    """An array as ramjet must yield it: dtype, shape and row-major elements."""
    a = np.asarray(a)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "b64": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}


expected_mds = []
for i, p in enumerate(files):
    s = sample(i, p)
    e = {}
    for col, enc in COLUMNS.items():
        if enc.startswith("ndarray"):
            e[col] = array(s[col])
        elif enc in ("jpeg", "png", "bytes", "pil"):
            e[col] = b64(mds_encode(enc, s[col]))
        elif enc == "json":
            e[col] = s[col]
        elif enc in ("float32", "float16"):
            e[col] = float(s[col])
        elif enc == "str":
            e[col] = s[col]
        else:
            e[col] = int(s[col])
    expected_mds.append(e)

for name, comp in (("mds-plain", None), ("mds-zstd", "zstd"), ("mds-gz", "gz")):
    with MDSWriter(out=str(out / name), columns=COLUMNS, compression=comp, hashes=["sha1", "xxh64"], size_limit=200_000) as w:
        for i, p in enumerate(files):
            w.write(sample(i, p))

with MDSWriter(out=str(out / "mds-pkl"), columns={"x": "pkl", "label": "int"}) as w:
    w.write({"x": {"a": 1}, "label": 1})

def npy_array(i):
    """Sample i's .npy member: 2-D float32 of i % 3 + 1 rows, every third one in Fortran order
    and every fourth one big-endian (ramjet yields them all row-major, little-endian)."""
    a = np.arange((i % 3 + 1) * 3, dtype=np.float32).reshape(i % 3 + 1, 3) / 4 + i
    if i % 3 == 2:
        a = np.asfortranarray(a)
    if i % 4 == 3:
        a = a.astype(">f4")
    return a


def npy_member(i):
    buf = io.BytesIO()
    np.save(buf, npy_array(i))
    return buf.getvalue()


expected_wds = []
for name, ext in (("wds", "tar"), ("wds-gz", "tar.gz")):
    (out / name).mkdir(parents=True)
    per = 4
    for shard in range((n + per - 1) // per):
        with wds.TarWriter(str(out / name / f"train-{shard:03d}.{ext}"), compress=ext.endswith("gz")) as w:
            for i in range(shard * per, min(n, (shard + 1) * per)):
                p = files[i]
                s = {
                    "__key__": f"part{shard}/s{i:05d}",
                    "jpg": p.read_bytes(),
                    "cls": str(i % 5).encode(),
                    "json": json.dumps({"i": i}).encode(),
                    "npy": npy_member(i),
                }
                w.write(s)
                if name == "wds":
                    e = {k: b64(v) for k, v in s.items() if k not in ("__key__", "npy")}
                    expected_wds.append({"__key__": s["__key__"], **e, "npy": array(npy_array(i).astype("<f4"))})
    (out / name / "shards.txt").write_text(
        "".join(f"train-{s:03d}.{ext}\n" for s in range((n + per - 1) // per))
    )

(out / "expected.json").write_text(json.dumps({"mds": expected_mds, "wds": expected_wds}))
print(f"fixtures: {n} samples -> {out}")
