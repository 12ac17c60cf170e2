#!/usr/bin/env python3
"""CPU per image with one dataset alive versus two alive and used in turn, in one process.

Issue 13's check of the shared thread set: before it, each dataset brought its own runtime,
blocking pool, decode threads and cache writers, and with two alive an epoch cost about 1.7x
the CPU. Each round runs both contenders, in alternating order, each in a fresh process:

  one: dataset A alone; a warm-up epoch, then `--epochs` measured epochs of A;
  two: datasets A and B alive; a warm-up epoch of each, then `--epochs` measured epochs of
       each, A and B in turn.

The cache is warm (a first pass fills it), so the work is cache reads, verification and
decode. Reported: per round, CPU seconds (user + system, this process and its threads) per
1,000 images and wall seconds per 1,000 images; the two/one ratio; medians over rounds.

    benches/python/two_datasets.py [--rounds 5] [--samples 1000] [--epochs 2] [--quick]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")

CHILD = r"""
import json, os, sys, time, resource
import ramjet
mode, cache, epochs, a, b = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
def make(u):
    return ramjet.StreamingDataset(u, cache, batch_size=32, image_size=224, shuffle=True, seed=1)
sets = [make(a)] if mode == "one" else [make(a), make(b)]
def epoch(ds):
    n = 0
    for batch in ds:
        n += len(batch["_index"])
    return n
for ds in sets:
    epoch(ds)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, w0, n = cpu(), time.perf_counter(), 0
for _ in range(epochs):
    for ds in sets:
        n += epoch(ds)
print(json.dumps({"images": n, "cpu_s": cpu() - c0, "wall_s": time.perf_counter() - w0}))
"""


def sh(*args):
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 200 images (CI)")
    ap.add_argument("--out", default=str(ROOT / "target/bench/two_datasets.json"))
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.samples, a.epochs = 2, 200, 1
    work = Path(tempfile.mkdtemp(prefix="ramjet-two-"))
    sh(RAMJET, "synth", str(work / "synth"), "--samples", str(a.samples))
    urls = []
    for name in "ab":
        d = work / name
        sh(RAMJET, "pack", str(work / "synth"), str(d), "--shard-size", "4MiB")
        urls.append(str(d))
    cache = str(work / "cache")
    rows = []
    for r in range(a.rounds):
        got = {}
        order = ["one", "two"] if r % 2 == 0 else ["two", "one"]
        for mode in order:
            out = sh(sys.executable, "-c", CHILD, mode, cache, str(a.epochs), *urls)
            got[mode] = json.loads(out.strip().splitlines()[-1])
        row = {"round": r + 1}
        for mode in ("one", "two"):
            g = got[mode]
            row[f"{mode}_cpu_ms_per_img"] = 1000 * g["cpu_s"] / g["images"]
            row[f"{mode}_wall_ms_per_img"] = 1000 * g["wall_s"] / g["images"]
        row["cpu_ratio"] = row["two_cpu_ms_per_img"] / row["one_cpu_ms_per_img"]
        row["wall_ratio"] = row["two_wall_ms_per_img"] / row["one_wall_ms_per_img"]
        rows.append(row)
        print(
            f"round {r + 1}/{a.rounds}: CPU ms/img one {row['one_cpu_ms_per_img']:.3f} "
            f"two {row['two_cpu_ms_per_img']:.3f} (x{row['cpu_ratio']:.3f}); wall ms/img one "
            f"{row['one_wall_ms_per_img']:.3f} two {row['two_wall_ms_per_img']:.3f} (x{row['wall_ratio']:.3f})",
            flush=True,
        )
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "round"}
    print("median: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rounds": rows, "median": med, "samples": a.samples, "epochs": a.epochs}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
