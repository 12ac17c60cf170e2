"""Writes MDS datasets with MosaicML's own MDSWriter, as its quick start does, and records how
MosaicML's own StreamingDataset decodes every sample (run by the peers' venv,
tools/bench-venv.sh, never the core venv).

usage: mosaicml_fixtures.py OUT_DIR

OUT_DIR gets quick/ (the quick start's uuid/img/clf dataset, zstd), xy/ (the fast-resumption
page's x/y fields, 40 samples) and typed/ (a column of every scalar encoding, pil, png,
ndarray and json), plus decoded.json: per dataset, each sample's columns as MosaicML decodes
them (an image as mode, size and a hash of its pixels; NumPy values as dtype and value).
"""

import json
import sys
from pathlib import Path
from uuid import uuid4

import numpy as np
from PIL import Image
from streaming import MDSWriter, StreamingDataset

from peer_values import described


def main(out):
    out = Path(out)
    # The quick start's writer, as its page gives it (out_root changed).
    out_root = str(out / "quick")
    columns = {"uuid": "str", "img": "jpeg", "clf": "int"}
    compression = "zstd"
    samples = [
        {
            "uuid": str(uuid4()),
            "img": Image.fromarray(np.random.randint(0, 256, (32, 48, 3), np.uint8)),
            "clf": np.random.randint(10),
        }
        for _ in range(1000)
    ]
    with MDSWriter(out=out_root, columns=columns, compression=compression, size_limit=1 << 16) as w:
        for sample in samples:
            w.write(sample)
    with MDSWriter(out=str(out / "xy"), columns={"x": "int", "y": "str"}, size_limit=256) as w:
        for i in range(40):
            w.write({"x": i, "y": f"y{i}"})
    typed = {"id": "int", "u8": "uint8", "i16": "int16", "f32": "float32", "f64": "float64", "s": "str",
             "pil": "pil", "png": "png", "arr": "ndarray:float32:2,3", "meta": "json"}
    with MDSWriter(out=str(out / "typed"), columns=typed, size_limit=1 << 12) as w:
        for i in range(12):
            w.write({"id": i, "u8": np.uint8(200 + i), "i16": np.int16(-300 * i), "f32": np.float32(i / 3),
                     "f64": i / 7, "s": f"s{i}", "pil": Image.fromarray(np.full((3 + i, 5, 3), i * 9, np.uint8)),
                     "png": Image.fromarray(np.full((4, 2 + i), 17 * i, np.uint8), "L"),
                     "arr": np.arange(6, dtype=np.float32).reshape(2, 3) * i, "meta": {"i": i, "l": [i] * 2}})
    decoded = {}
    for name, key in (("quick", "uuid"), ("typed", "id")):
        ds = StreamingDataset(local=str(out / name), shuffle=False, batch_size=1)
        decoded[name] = {str(ds[i][key]): {k: described(v) for k, v in ds[i].items()} for i in range(ds.size)}
    (out / "decoded.json").write_text(json.dumps(decoded))


if __name__ == "__main__":
    main(sys.argv[1])
