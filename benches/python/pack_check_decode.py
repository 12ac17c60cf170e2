#!/usr/bin/env python3
"""Issue 69: `ramjet pack --check-decode` beside a plain pack of the same folder, rounds
interleaved (the order rotated each round), with the whole-decode rate it implies.

Each round: a plain pack and a `--check-decode` pack of --src into fresh folders (wall and CPU
seconds of the process), and the single-core whole-decode rate of the same images
(`ramjet.decode_image` in this process). The extra time of the check is compared with what a
perfect spread of the decodes over the cores would cost: images / (cores x decode rate).
Usage: benches/python/pack_check_decode.py --src DIR [--ramjet target/release/ramjet] [--rounds 5]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules

import ramjet  # noqa: E402


def images(src):
    return [p for p in sorted(Path(src).rglob("*")) if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True)
    ap.add_argument("--ramjet", default="target/release/ramjet")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    files = [p.read_bytes() for p in images(a.src)]
    cores = len(os.sched_getaffinity(0))
    rows = {"plain": [], "check": [], "rate": []}
    tmp = Path(tempfile.mkdtemp(prefix="pack-check-"))
    for r in range(a.rounds):
        for c in measure.order(["plain", "check", "rate"], r):
            if c == "rate":
                t = time.perf_counter()
                for b in files:
                    ramjet.decode_image(b)
                rows["rate"].append(len(files) / (time.perf_counter() - t))
                continue
            out = tmp / f"{c}-{r}"
            cmd = [a.ramjet, "pack", a.src, str(out)] + (["--check-decode"] if c == "check" else [])
            t = time.perf_counter()
            _, _, cpu_s, steal, _ = measure.run(cmd)
            rows[c].append((time.perf_counter() - t, cpu_s))
            shutil.rmtree(out)
        p, k, rate = rows["plain"][-1], rows["check"][-1], rows["rate"][-1]
        print(f"round {r + 1}: plain {p[0]:.2f} s ({p[1]:.2f} CPU s), check {k[0]:.2f} s ({k[1]:.2f} CPU s), "
              f"ratio {k[0] / p[0]:.2f}; decode {rate:.0f} img/s a core: the check's bound "
              f"{len(files) / (cores * rate):.2f} s over {cores} cores, extra measured {k[0] - p[0]:.2f} s", flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    plain, check = med([x[0] for x in rows["plain"]]), med([x[0] for x in rows["check"]])
    rate = med(rows["rate"])
    print(f"{len(files)} images, {cores} cores: plain {plain:.2f} s, --check-decode {check:.2f} s "
          f"(per round {[round(k[0] / p[0], 2) for p, k in zip(rows['plain'], rows['check'])]}); "
          f"extra {check - plain:.2f} s against images / (cores x {rate:.0f} img/s) = {len(files) / (cores * rate):.2f} s")
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
