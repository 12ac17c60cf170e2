#!/usr/bin/env python3
"""A high-latency link (issue 45): the cold epoch of `ramjet stream` over the WAN-like link of
tools/ramjet-bench (a SeaweedFS in a network namespace behind a veth shaped to `--rate`, with
`--rtt-ms` of round trip), with

  tuned:   the origin control (the default: requests in flight and ranged GET size from what
           it measures);
  fixed:   today's fixed settings (`RAMJET_ORIGIN_TUNE=off`, 32 MiB ranges pinned);
  sweep:   hand-set settings, each pinned: ranged GETs of --sweep-ranges MiB with
           --sweep-requests requests in flight (`RAMJET_ORIGIN_REQUESTS`).

Every contender runs once a round, the order rotated, each from an empty cache (no cache:
`ramjet stream` without --cache-dir reads the origin every epoch). Medians of the rounds; the
best hand-set setting is the one with the lowest median.

Targets: tuned at least as fast as fixed; the best hand-set setting no more than 10% faster
than tuned.

    sudo benches/python/wan_tune.py [--samples 1000] [--rounds 5] [--rate 200mbit] [--rtt-ms 20]
        [--sweep-ranges 8,32,64] [--sweep-requests 4,8,16] [--out target/bench/wan_tune.json]

Needs root (ip netns, tc) and tools/env.sh's S3 settings, like tools/ramjet-bench's WAN run.
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
import measure  # noqa: E402
import ramjet_bench  # noqa: E402 - the WAN-like link (wan_up / wan_down)

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")


def contenders(a):
    out = {"tuned": ({}, []), "fixed": ({"RAMJET_ORIGIN_TUNE": "off"}, ["--range-size", "32MiB"])}
    for r in a.sweep_ranges.split(","):
        for n in a.sweep_requests.split(","):
            out[f"{r}MiB x{n}"] = ({"RAMJET_ORIGIN_REQUESTS": n}, ["--range-size", f"{r}MiB"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--shard-size", default="16MiB")
    ap.add_argument("--sweep-ranges", default="8,32,64")
    ap.add_argument("--sweep-requests", default="4,8,16")
    ap.add_argument("--out", default=str(ROOT / "target/bench/wan_tune.json"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ramjet-wan-tune-"))
    subprocess.run([RAMJET, "synth", str(work / "synth"), "--samples", str(a.samples)], check=True,
                   capture_output=True)
    link = ramjet_bench.wan_up(a.rate, a.rtt_ms)
    rows = []
    try:
        env = link.env()
        url = f"s3://{ramjet_bench.BUCKET}/wan-tune/{work.name}"
        subprocess.run([RAMJET, "pack", str(work / "synth"), url, "--shard-size", a.shard_size], check=True,
                       env=env, capture_output=True)
        cs = contenders(a)
        for r in range(a.rounds):
            for name in measure.order(list(cs), r):
                extra_env, args = cs[name]
                t = time.perf_counter()
                p = subprocess.run([RAMJET, "stream", url, "--shuffle", "none", "--json", *args],
                                   env={**env, **extra_env}, capture_output=True, text=True)
                wall = time.perf_counter() - t
                if p.returncode != 0:
                    raise SystemExit(f"{name}: ramjet stream failed: {p.stderr[-2000:]}")
                m = measure.stream_json(p.stdout)
                x = {"round": r, "contender": name, "wall_s": wall,
                     "tune": {k: v for k, v in m.items() if k.startswith(("tune_origin", "tune_shards"))}}
                rows.append(x)
                print(f"round {r} {name}: {wall:.2f} s {x['tune'] if name == 'tuned' else ''}", flush=True)
    finally:
        ramjet_bench.wan_down(link)

    med = {c: statistics.median(x["wall_s"] for x in rows if x["contender"] == c) for c in contenders(a)}
    hand = {c: v for c, v in med.items() if c not in ("tuned", "fixed")}
    best = min(hand, key=hand.get)
    per_round = [{
        "tuned_vs_fixed": next(x["wall_s"] for x in rows if x["round"] == r and x["contender"] == "fixed")
        / next(x["wall_s"] for x in rows if x["round"] == r and x["contender"] == "tuned"),
        "best_vs_tuned": next(x["wall_s"] for x in rows if x["round"] == r and x["contender"] == "tuned")
        / next(x["wall_s"] for x in rows if x["round"] == r and x["contender"] == best),
    } for r in range(a.rounds)]
    summary = {"rate": a.rate, "rtt_ms": a.rtt_ms, "samples": a.samples, "rounds": a.rounds, "medians_s": med,
               "best_hand_set": best,
               "tuned_speed_vs_fixed": med["fixed"] / med["tuned"],
               "best_hand_set_speed_vs_tuned": med["tuned"] / med[best],
               "per_round": per_round, "rows": rows}
    for c in sorted(med, key=med.get):
        print(f"{c:>14}: {med[c]:.2f} s (median of {a.rounds})")
    print(f"tuned {summary['tuned_speed_vs_fixed']:.3f}x the speed of fixed (target >= 1.0); the best hand-set "
          f"({best}) {summary['best_hand_set_speed_vs_tuned']:.3f}x tuned (target <= 1.1); per round "
          f"{[round(p['tuned_vs_fixed'], 3) for p in per_round]} / {[round(p['best_vs_tuned'], 3) for p in per_round]}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
