"""Writes Parquet datasets with the peers' own writers, pyarrow and Hugging Face `datasets`, and
records every sample as written (run by the peers' venv, tools/bench-venv.sh, never the core
venv).

usage: parquet_fixtures.py OUT_DIR

OUT_DIR gets:
- pa/: three files by `pyarrow.parquet.write_table`, one codec each (snappy, zstd, gzip) and
  row groups of 4, 7 and 5 rows (the gzip one with page CRC-32s): an int64 index, an int32
  label and a float32 score with nulls, a string name with nulls, a non-null string tag, raw
  bytes, a bool, a timestamp, a float32 list and an int16 list, and Hugging Face's image struct;
- hf/: `Dataset.from_dict(...).cast_column("image", Image())`, written by `to_parquet` (one
  file, row groups of 6) and by `save_to_disk` (saved/);
- expected.json: {"pa": {index: sample}, "hf": {index: sample}}, each value as JSON (bytes
  as hex, a timestamp as its microseconds, a null as null); "pages": for b.parquet's and
  c.parquet's row group 1, the file offset of the last byte of its "raw" column chunk (a
  byte of page data), and each file's row groups' first rows;
- refused/: decimal.parquet (a decimal column) and path-only.parquet (an image whose second
  row is only a path).
"""

import datetime
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def jpeg(i):
    b = io.BytesIO()
    Image.fromarray(np.full((5 + i % 4, 7, 3), 13 * (i % 17), np.uint8)).save(b, format="JPEG")
    return b.getvalue()


def png(i):
    b = io.BytesIO()
    Image.fromarray(np.full((4, 3 + i % 3, 3), 11 * (i % 20), np.uint8)).save(b, format="PNG")
    return b.getvalue()


def rows(lo, hi):
    out = []
    for i in range(lo, hi):
        out.append({
            "index": i,
            "label": None if i % 5 == 3 else i % 4,
            "score": None if i % 6 == 1 else i / 8,
            "name": None if i % 7 == 2 else f"name-{i}-é",
            "tag": f"t{i % 3}",
            "raw": bytes(range(i % 9)) + b"\x00\xff",
            "flag": i % 2 == 0,
            "when": datetime.datetime(2026, 1, 1) + datetime.timedelta(seconds=i),
            "vec": [float(i) / 2, -1.25, float(i)],
            "ids": list(range(i % 4)),
            "image": {"bytes": jpeg(i) if i % 3 else png(i), "path": None if i % 2 else f"img{i}.jpg"},
        })
    return out


def write_pa(out):
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("index", pa.int64()), ("label", pa.int32()), ("score", pa.float32()), ("name", pa.string()),
        ("tag", pa.string()), ("raw", pa.binary()), ("flag", pa.bool_()), ("when", pa.timestamp("us")),
        ("vec", pa.list_(pa.float32())), ("ids", pa.list_(pa.int16())),
        ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    ])
    (out / "pa").mkdir()
    plan = [("a.parquet", 0, 10, "snappy", 4, False), ("b.parquet", 10, 24, "zstd", 7, False),
            ("c.parquet", 24, 35, "gzip", 5, True)]
    for name, lo, hi, codec, rg, crc in plan:
        t = pa.Table.from_pylist(rows(lo, hi), schema=schema)
        pq.write_table(t, out / "pa" / name, compression=codec, row_group_size=rg, write_page_checksum=crc)
    (out / "refused").mkdir()
    pq.write_table(pa.table({"price": pa.array([1, 2], pa.decimal128(10, 2))}), out / "refused" / "decimal.parquet")
    img = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({"image": pa.array([{"bytes": jpeg(0), "path": None}, {"bytes": None, "path": "x.jpg"}], img)}),
                   out / "refused" / "path-only.parquet")
    pages = {}
    for name, lo, _, _, rg, _ in plan:
        m = pq.ParquetFile(out / "pa" / name).metadata
        c = m.row_group(1).column(5)
        start = c.dictionary_page_offset or c.data_page_offset
        pages[name] = {"offset": start + c.total_compressed_size - 1, "first_rows": list(range(lo, 35, rg))[:m.num_row_groups]}
    return {str(r["index"]): described(r) for r in rows(0, 35)}, pages


def write_hf(out):
    from datasets import Dataset, Image as HfImage

    n = 17
    ds = Dataset.from_dict({
        "image": [{"bytes": jpeg(i), "path": None} for i in range(n)],
        "label": [i % 5 for i in range(n)],
        "caption": [f"a photo, {i}" for i in range(n)],
    }).cast_column("image", HfImage())
    (out / "hf").mkdir()
    ds.to_parquet(str(out / "hf" / "train-00000-of-00001.parquet"), batch_size=6)
    ds.save_to_disk(str(out / "saved"))
    return {str(i): {"image": jpeg(i).hex(), "label": i % 5, "caption": f"a photo, {i}"} for i in range(n)}


def described(r):
    d = dict(r)
    d["raw"] = r["raw"].hex()
    d["when"] = int((r["when"] - datetime.datetime(1970, 1, 1)).total_seconds() * 1_000_000)
    d["flag"] = int(r["flag"])
    d["image"] = r["image"]["bytes"].hex()
    return d


def main(out):
    out = Path(out)
    pa_rows, pages = write_pa(out)
    expected = {"pa": pa_rows, "hf": write_hf(out), "pages": pages}
    (out / "expected.json").write_text(json.dumps(expected))


if __name__ == "__main__":
    main(sys.argv[1])
