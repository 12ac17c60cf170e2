#!/usr/bin/env python3
"""Warm loader-only epochs of two or more builds of the `ramjet` package, interleaved round by
round (the order of the builds alternates), each build in a fresh process per round with a
disk cache of its own that stays warm across rounds. The bench's settings: batch 8, 224x224
RandomResizedCrop, the default shard-block shuffle. A round runs `--epochs` epochs and counts
all but the first (which may fill the cache).

Usage (tools/env.sh sourced, the S3 server of the dataset running):
  benches/python/warm_builds.py --url s3://ramjet/bench/ramjet-bench/1000-16m/ramjet-rst32 \\
      --pkg before=/tmp/pkg-a --pkg after=/tmp/pkg-b [--rounds 6] [--epochs 3]

Each --pkg puts DIR first on the child's PYTHONPATH (a build installed there with
`pip install --no-deps --target DIR ramjet-*.whl`). `--data NAME=URL` has that contender read
URL instead of --url: two packings of the same images, read by one build, are compared by
naming the same DIR twice (`--pkg rst64=DIR --pkg rst32=DIR --data rst32=s3://...`).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import torch  # noqa: F401 - as in the bench's loader processes
import ramjet
ds = ramjet.StreamingDataset(sys.argv[1], local=sys.argv[2], cache_limit="64GiB", batch_size=8, shuffle=True, seed=0,
                             image_size=224, augment="train", image_column="image", boxes_column="boxes")
out = []
for ep in range(int(sys.argv[3])):
    ds.set_epoch(ep)
    t, c = time.perf_counter(), time.process_time()
    n = sum(b["image"].shape[0] for b in ds)
    out.append({"samples_per_s": n / (time.perf_counter() - t), "cpu_per_1000": (time.process_time() - c) / n * 1e3,
                "package": ramjet.__file__})
print(json.dumps(out))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--pkg", action="append", required=True, help="NAME=DIR: a build of the package in DIR")
    p.add_argument("--data", action="append", default=[], help="NAME=URL: the dataset that contender reads")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()
    builds = [tuple(x.split("=", 1)) for x in a.pkg]
    urls = dict(x.split("=", 1) for x in a.data)
    if unknown := set(urls) - {name for name, _ in builds}:
        p.error(f"--data names no --pkg: {', '.join(sorted(unknown))}")
    rows = {name: [] for name, _ in builds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, pkg in builds if r % 2 == 0 else builds[::-1]:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (pkg, os.environ.get("PYTHONPATH")) if x))
                out = subprocess.run([sys.executable, "-c", CHILD, urls.get(name, a.url), str(Path(tmp) / f"cache-{name}"),
                                      str(a.epochs)], env=env, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
                eps = json.loads(out.stdout.strip().splitlines()[-1])[1:]
                rows[name].append(eps)
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{e['samples_per_s']:,.0f}/s {e['cpu_per_1000']:.2f} CPU s/1000" for e in eps), flush=True)
    print()
    print("| build | warm samples/s, median | CPU s per 1,000 images, median |")
    print("|---|---|---|")
    for name, _ in builds:
        eps = [e for rr in rows[name] for e in rr]
        print(f"| {name} | {statistics.median(e['samples_per_s'] for e in eps):,.0f} | "
              f"{statistics.median(e['cpu_per_1000'] for e in eps):.2f} |")
    base = builds[0][0]
    for name, _ in builds[1:]:
        per = [statistics.median(e["samples_per_s"] for e in b) / statistics.median(e["samples_per_s"] for e in a_)
               for a_, b in zip(rows[base], rows[name])]
        print(f"\n{name} / {base}, warm rate, per round: " + ", ".join(f"{v:.3f}" for v in per) +
              f" (median {statistics.median(per):.3f})")


if __name__ == "__main__":
    main()
