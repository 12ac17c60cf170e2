#!/usr/bin/env python3
"""Issue 69 item 4: what a filter costs when a dataset opens. A JSONL of --rows rows (a flags
column, a nullable label, a caption) packed into many small shards; each round, interleaved
(order rotated), a fresh process computes `len(StreamingDataset(...))` without a filter and with
`quality_flags & 0b101 == 0 and label is not null` (which reads every shard's columns sidecar
once). Reports wall and CPU seconds per open, medians and per-round ratios, and the filter's cost
per shard and per sample.
Usage: benches/python/filter_open.py [--rows 200000] [--shard-size 65536] [--rounds 5]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules

FILTER = "quality_flags & 0b101 == 0 and label is not null"
PROBE = """
import sys, ramjet
f = sys.argv[2] or None
ds = ramjet.StreamingDataset(sys.argv[1], image_size=None, batch_size=1, filter=f)
print(len(ds))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--shard-size", default="65536")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ramjet", default="target/release/ramjet")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="filter-open-"))
    with open(tmp / "rows.jsonl", "w") as f:
        for i in range(a.rows):
            f.write(json.dumps({"sample_id": i, "quality_flags": (i * 7) % 8,
                                "label": None if i % 5 == 0 else i % 1000, "caption": f"caption {i}"}) + "\n")
    subprocess.run([a.ramjet, "pack", str(tmp / "rows.jsonl"), str(tmp / "p"), "--column", "label:int64?",
                    "--shard-size", a.shard_size], check=True, capture_output=True)
    shards = len(list((tmp / "p" / "shards").iterdir()))
    rows = {"plain": [], "filter": []}
    lens = {}
    for r in range(a.rounds):
        for c in measure.order(["plain", "filter"], r):
            cmd = [sys.executable, "-c", PROBE, str(tmp / "p"), FILTER if c == "filter" else ""]
            t = time.perf_counter()
            out, _, cpu_s, _, _ = measure.run(cmd)
            rows[c].append((time.perf_counter() - t, cpu_s))
            lens[c] = out.strip().splitlines()[-1]
        p, k = rows["plain"][-1], rows["filter"][-1]
        print(f"round {r + 1}: plain open {p[0]:.2f} s ({p[1]:.2f} CPU s), filtered {k[0]:.2f} s "
              f"({k[1]:.2f} CPU s), ratio {k[0] / p[0]:.2f}", flush=True)
    med = statistics.median
    pw, fw = med(x[0] for x in rows["plain"]), med(x[0] for x in rows["filter"])
    pc, fc = med(x[1] for x in rows["plain"]), med(x[1] for x in rows["filter"])
    extra = fw - pw
    print(f"{a.rows} rows in {shards} shards: open {pw:.2f} s ({pc:.2f} CPU s) plain, {fw:.2f} s ({fc:.2f} CPU s) "
          f"with the filter (per round {[round(k[0] / p[0], 2) for p, k in zip(rows['plain'], rows['filter'])]}); "
          f"the filter's pass {extra:.2f} s: {extra / shards * 1e3:.2f} ms a shard, "
          f"{extra / a.rows * 1e6:.2f} us a row; len {lens['plain']} -> {lens['filter']} batches")


if __name__ == "__main__":
    main()
