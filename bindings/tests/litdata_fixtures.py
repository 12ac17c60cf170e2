"""Writes LitData datasets with litdata's own `optimize`, and records how LitData's own
StreamingDataset reads every sample back (run by the peers' venv, tools/bench-venv.sh, never
the core venv).

usage: litdata_fixtures.py OUT_DIR

OUT_DIR gets plain/ (a dict sample: an int index, a JPEG file, a PIL image, JPEG bytes, a label, a
string, a float, a flat float32 array and an int16 array with its shape, in chunks of ~2 KB)
and zstd/ (the same, compressed, which ramjet refuses), plus expected.json: each sample's
fields as LitData reads them (peer_values.described).
"""

import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from peer_values import described


def sample(i):
    jpeg = io.BytesIO()
    Image.fromarray(np.full((6, 9, 3), 20 * (i % 10), np.uint8)).save(jpeg, format="JPEG")
    return {
        "index": i,
        "photo": Image.open(io.BytesIO(jpeg.getvalue())),  # a JPEG file: LitData's jpeg serializer
        "image": Image.fromarray(np.full((8 + i % 5, 6, 3), i, np.uint8)),
        "raw": jpeg.getvalue(),
        "label": i % 3,
        "name": f"sample-{i}",
        "score": i / 7,
        "flat": np.arange(4, dtype=np.float32) * i,
        "grid": np.arange(6, dtype=np.int16).reshape(2, 3) - i,
    }


def main(out):
    import litdata as ld

    out = Path(out)
    n = 23
    ld.optimize(fn=sample, inputs=list(range(n)), output_dir=str(out / "plain"), chunk_bytes="2KB", num_workers=1)
    ld.optimize(fn=sample, inputs=list(range(n)), output_dir=str(out / "zstd"), chunk_bytes="2KB", num_workers=1,
                compression="zstd")
    ds = ld.StreamingDataset(str(out / "plain"))
    # LitData decodes a jpeg field to a tensor with its own decoder: the file's bytes stand in.
    expected = {str(s["index"]): {k: described(v) for k, v in s.items() if k != "photo"} for s in ds}
    for k, v in expected.items():
        v["photo_hex"] = sample(int(k))["raw"].hex()
    (out / "expected.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    main(sys.argv[1])
