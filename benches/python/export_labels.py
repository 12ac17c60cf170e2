#!/usr/bin/env python3
"""Issue 70: `UniversalDataset.export_labels_only` on the published scenario's 5,315 samples
(ramjetio's page: about 30 s for 5k samples), from a split packed at an S3 prefix.

Each round exports into a fresh folder in a fresh process (the labels read from the
manifest's sidecar columns, a placeholder JPEG and a label file per sample, the data.yaml)
and reports its wall and CPU seconds; medians over --rounds rounds.
Usage (the local S3 server running, tools/env.sh sourced):
  .venv/bin/python benches/python/export_labels.py [--samples 5315] [--rounds 5] [--dir /tmp/el]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")

ONE = """
import json, resource, sys, time
t0 = time.perf_counter()
from ramjet.datasets import UniversalDataset
ds = UniversalDataset(split="train", source=sys.argv[1])
ds.export_labels_only(sys.argv[2], rank=0, world_size=1)
r = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": r.ru_utime + r.ru_stime, "samples": len(ds)}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=5315)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/export-labels")
    args = ap.parse_args()
    d = Path(args.dir)
    src = d / "files"
    if not (src / "train").exists():
        print(f"synth: {args.samples} samples", flush=True)
        subprocess.run([RAMJET, "synth", str(src / "train"), "--samples", str(args.samples)], check=True,
                       capture_output=True)
    url = f"s3://{os.environ.get('RAMJET_S3_BUCKET', 'ramjet')}/bench-export-labels/{uuid.uuid4().hex[:8]}"
    print(f"pack: {url}/train", flush=True)
    subprocess.run([RAMJET, "pack", str(src / "train"), f"{url}/train"], check=True, capture_output=True)
    runs = []
    for r in range(args.rounds):
        out = d / f"out-{r}"
        shutil.rmtree(out, ignore_errors=True)
        got = subprocess.run([sys.executable, "-c", ONE, url, str(out)], check=True, capture_output=True, text=True)
        x = json.loads(got.stdout.strip().splitlines()[-1])
        runs.append(x)
        print(f"round {r + 1}: {x['samples']} samples in {x['wall_s']:.2f} s wall, {x['cpu_s']:.2f} CPU s", flush=True)
    wall = statistics.median(x["wall_s"] for x in runs)
    cpu = statistics.median(x["cpu_s"] for x in runs)
    print(json.dumps({"samples": runs[0]["samples"], "median_wall_s": wall, "median_cpu_s": cpu,
                      "wall_s": [x["wall_s"] for x in runs]}))


if __name__ == "__main__":
    main()
