#!/usr/bin/env python3
"""CPU per image with one dataset alive versus two alive and used in turn, in one process.

Issue 13's check of the shared thread set: before it, each dataset brought its own runtime,
blocking pool, decode threads and cache writers. Each round runs every contender, each in a
fresh process, their order rotating round by round:

  a:  dataset A alone; a warm-up epoch, then `--epochs` measured epochs of A;
  b:  dataset B alone, likewise (only with --like-bench, where B differs from A);
  ab: A and B alive; a warm-up epoch of each, then `--epochs` measured epochs of each, in turn.

The cache is warm (a first pass fills it), so the work is cache reads, verification and
decode. Before and after the measured epochs the process waits until it is idle, so every
window starts and ends with the loaders' bounded read-ahead full.

Reported per round and as medians:
- the headline ratio: everything the process spent per image with both alive, over the same
  epochs alone (A's and B's processes together);
- A's window: the process's CPU while A's epochs ran, two alive against alone. It charges
  B's read-ahead into its next epoch (which runs while A is being read) to A, and A's to B,
  so with two different datasets it overstates the cost; it is what the issue measured;
- A's wall time per image, likewise;
- the highest steal share the machine showed during the round's runs (flagged above
  measure.STEAL_FLAG).

With --like-bench the pair is ramjet-bench's (see the option's help), the one in which the
issue measured 1.7x.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (steal share)

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")

CHILD = r"""
import json, os, sys, time, resource
import ramjet
mode, cfg, epochs, a, b = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
def make(u, cache):
    return ramjet.StreamingDataset(u, local=cache, batch_size=cfg["batch"], image_size=224, shuffle=True, seed=1,
                                   augment=cfg["augment"], **({"cache_limit": "64GiB"} if cache else {}))
made = {"a": lambda: make(a, cfg["cache_a"]), "b": lambda: make(b, cfg["cache_b"])}
sets = [made[k]() for k in mode]
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
sys.path.insert(0, cfg["measure_dir"])
import measure
def quiet():
    # Wait until the loaders' read-ahead (bounded queues) is full and the process is idle,
    # so that every mode's window starts and ends in the same state.
    measure.wait_idle(quiet_s=0.3, busy=0.02, limit_s=15)
def epoch(ds, e):
    ds.set_epoch(e)
    n = 0
    for batch in ds:
        n += len(batch["_index"])
    return n
for ds in sets:
    epoch(ds, 0)
quiet()
c0, w0, n, n_a, cpu_a, wall_a = cpu(), time.perf_counter(), 0, 0, 0.0, 0.0
for e in range(1, epochs + 1):
    for i, ds in enumerate(sets):
        c, w = cpu(), time.perf_counter()
        k = epoch(ds, e)
        n += k
        if i == 0:
            n_a, cpu_a, wall_a = n_a + k, cpu_a + cpu() - c, wall_a + time.perf_counter() - w
wall = time.perf_counter() - w0
quiet()
print(json.dumps({"images": n, "cpu_s": cpu() - c0, "wall_s": wall,
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
        "from a local copy without one (P2), batch 8, train augmentation (needs tools/env.sh's S3 settings)",
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
    cfg["measure_dir"] = str(Path(__file__).resolve().parent)  # the child's measure.wait_idle
    # `a`: A alone; `b`: B alone (only where B differs from A); `ab`: both, used in turn.
    modes = ["a", "b", "ab"] if a.like_bench else ["a", "ab"]
    rows = []
    for r in range(a.rounds):
        got, steal = {}, {}
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        if r % 2:
            order.reverse()
        for mode in order:
            st = measure.proc_stat()
            out = sh(sys.executable, "-c", CHILD, mode, json.dumps(cfg), str(a.epochs), *urls)
            steal[mode] = measure.steal_share(st, measure.proc_stat())
            got[mode] = json.loads(out.strip().splitlines()[-1])
        one, two = got["a"], got["ab"]
        # Everything the process spent, per image: both datasets' epochs against what the
        # same epochs cost alone (B alone where it differs, else A's cost stands for B's).
        alone = [got[m] for m in modes if m != "ab"]
        alone_per_img = sum(g["cpu_s"] for g in alone) / sum(g["images"] for g in alone)
        row = {
            "round": r + 1,
            "order": " ".join(order),
            "alone_cpu_ms_per_img": 1000 * alone_per_img,
            "two_cpu_ms_per_img": 1000 * two["cpu_s"] / two["images"],
            # A's own epochs only: the process's CPU while A's epochs ran, so B's read-ahead
            # during them counts against A and A's read-ahead during B's does not.
            "a_window_one_cpu_ms_per_img": 1000 * one["cpu_a_s"] / one["images_a"],
            "a_window_two_cpu_ms_per_img": 1000 * two["cpu_a_s"] / two["images_a"],
            "a_wall_one_ms_per_img": 1000 * one["wall_a_s"] / one["images_a"],
            "a_wall_two_ms_per_img": 1000 * two["wall_a_s"] / two["images_a"],
        }
        row["cpu_ratio"] = row["two_cpu_ms_per_img"] / row["alone_cpu_ms_per_img"]
        row["a_window_cpu_ratio"] = row["a_window_two_cpu_ms_per_img"] / row["a_window_one_cpu_ms_per_img"]
        row["a_wall_ratio"] = row["a_wall_two_ms_per_img"] / row["a_wall_one_ms_per_img"]
        row["steal"] = max(steal.values())
        rows.append(row)
        print(
            f"round {r + 1}/{a.rounds} ({row['order']}): CPU ms/img alone {row['alone_cpu_ms_per_img']:.3f} "
            f"two {row['two_cpu_ms_per_img']:.3f} (x{row['cpu_ratio']:.3f}); A's window one "
            f"{row['a_window_one_cpu_ms_per_img']:.3f} two {row['a_window_two_cpu_ms_per_img']:.3f} "
            f"(x{row['a_window_cpu_ratio']:.3f}); A's wall x{row['a_wall_ratio']:.3f}; "
            f"steal {measure.fmt_steal(row['steal'])}",
            flush=True,
        )
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0] if k not in ("round", "order")}
    print("median: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rounds": rows, "median": med, "samples": a.samples, "epochs": a.epochs}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
