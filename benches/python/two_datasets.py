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

With --like-bench the pair is ramjet-bench's (see the option's help), the one in which the
issue measured 1.7x; the ratio is then the first dataset's CPU per image, with the second
alive against alone.

    benches/python/two_datasets.py [--rounds 5] [--samples 1000] [--epochs 2] [--quick] [--like-bench]
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
mode, cfg, epochs, a, b = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
def make(u, cache):
    return ramjet.StreamingDataset(u, local=cache, batch_size=cfg["batch"], image_size=224, shuffle=True, seed=1,
                                   augment=cfg["augment"], **({"cache_limit": "64GiB"} if cache else {}))
sets = [make(a, cfg["cache_a"])] if mode == "one" else [make(a, cfg["cache_a"]), make(b, cfg["cache_b"])]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def epoch(ds, e):
    ds.set_epoch(e)
    n = 0
    for batch in ds:
        n += len(batch["_index"])
    return n
for ds in sets:
    epoch(ds, 0)
c0, w0, n, n_a, cpu_a, wall_a = cpu(), time.perf_counter(), 0, 0, 0.0, 0.0
for e in range(1, epochs + 1):
    for i, ds in enumerate(sets):
        c, w = cpu(), time.perf_counter()
        k = epoch(ds, e)
        n += k
        if i == 0:
            n_a, cpu_a, wall_a = n_a + k, cpu_a + cpu() - c, wall_a + time.perf_counter() - w
print(json.dumps({"images": n, "cpu_s": cpu() - c0, "wall_s": time.perf_counter() - w0,
                  "images_a": n_a, "cpu_a_s": cpu_a, "wall_a_s": wall_a}))
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
    ap.add_argument(
        "--like-bench",
        action="store_true",
        help="ramjet-bench's pair instead: A streamed from the local S3 server with a disk cache (P3), B read "
        "from a local copy without one (P2), batch 8, train augmentation; the ratio is A's CPU per image with "
        "B alive over A's alone (needs tools/env.sh's S3 settings)",
    )
    ap.add_argument("--out", default=str(ROOT / "target/bench/two_datasets.json"))
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.samples, a.epochs = 2, 200, 1
    work = Path(tempfile.mkdtemp(prefix="ramjet-two-"))
    sh(RAMJET, "synth", str(work / "synth"), "--samples", str(a.samples))
    urls = []
    if a.like_bench:
        bucket = os.environ.get("RAMJET_BUCKET", "ramjet")
        s3 = f"s3://{bucket}/bench/two-datasets/{work.name}"
        sh(RAMJET, "pack", str(work / "synth"), s3, "--shard-size", "16MiB")
        sh(RAMJET, "pack", str(work / "synth"), str(work / "b"), "--shard-size", "16MiB")
        urls = [s3, str(work / "b")]
        cfg = {"cache_a": str(work / "cache"), "cache_b": None, "batch": 8, "augment": "train"}
    else:
        for name in "ab":
            d = work / name
            sh(RAMJET, "pack", str(work / "synth"), str(d), "--shard-size", "4MiB")
            urls.append(str(d))
        cfg = {"cache_a": str(work / "cache"), "cache_b": str(work / "cache"), "batch": 32, "augment": "train"}
    # With --like-bench the two datasets differ, so the ratio is dataset A's CPU per image.
    key = "_a" if a.like_bench else ""
    rows = []
    for r in range(a.rounds):
        got = {}
        order = ["one", "two"] if r % 2 == 0 else ["two", "one"]
        for mode in order:
            out = sh(sys.executable, "-c", CHILD, mode, json.dumps(cfg), str(a.epochs), *urls)
            got[mode] = json.loads(out.strip().splitlines()[-1])
        row = {"round": r + 1}
        for mode in ("one", "two"):
            g = got[mode]
            row[f"{mode}_cpu_ms_per_img"] = 1000 * g[f"cpu{key}_s"] / g[f"images{key}"]
            row[f"{mode}_wall_ms_per_img"] = 1000 * g[f"wall{key}_s"] / g[f"images{key}"]
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
