#!/usr/bin/env python3
"""Issue 20: `ramjet pack` of a large input, two builds interleaved round by round.

Each round packs SRC into a fresh local folder with each build (the order of the two reversed
every other round), under /usr/bin/time: wall time, CPU (user + system) and peak RSS. Reports
every round, the medians, the per-round ratios, and CPU seconds per 1,000 inputs, and checks
that both builds wrote the same manifest version (the same shards, byte for byte).

Usage: benches/python/pack_scale.py --old /tmp/old-ramjet --new target/release/ramjet \
         --src /tmp/ramjet-folder-scale/f500k --inputs 500000 [--rounds 5] [--shard-size 8MiB]
         [--json out.json]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (steal share)


def run(binary, src, dst, extra):
    shutil.rmtree(dst, ignore_errors=True)
    st = measure.proc_stat()
    out = subprocess.run(
        ["/usr/bin/time", "-f", "TIME %e %U %S %M", binary, "pack", src, "file://" + dst, *extra],
        capture_output=True, text=True,
    )
    if out.returncode != 0:
        sys.exit(f"{binary} pack failed:\n{out.stderr[-3000:]}")
    line = [l for l in out.stderr.splitlines() if l.startswith("TIME ")][-1].split()
    wall, user, sys_, kb = float(line[1]), float(line[2]), float(line[3]), int(line[4])
    with open(os.path.join(dst, "manifest.json")) as f:
        version = json.load(f)["version"]
    return {"wall_s": wall, "cpu_s": user + sys_, "rss_mib": kb / 1024, "version": version,
            "steal": measure.steal_share(st, measure.proc_stat())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--inputs", type=int, required=True, help="inputs in SRC (for CPU per 1,000)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shard-size", help="pack's --shard-size (default: pack's own)")
    ap.add_argument("--json")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ramjet-pack-scale-")
    rows = {"old": [], "new": []}
    try:
        for r in range(a.rounds):
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            for who in order:
                extra = ["--shard-size", a.shard_size] if a.shard_size else []
                rows[who].append(run(getattr(a, who), a.src, os.path.join(work, who), extra))
            o, n = rows["old"][-1], rows["new"][-1]
            print(f"round {r}: before {o['wall_s']:.2f} s, {o['cpu_s']:.2f} CPU s, {o['rss_mib']:.0f} MiB; "
                  f"now {n['wall_s']:.2f} s, {n['cpu_s']:.2f} CPU s, {n['rss_mib']:.0f} MiB; "
                  f"wall ratio {o['wall_s'] / n['wall_s']:.2f}x; steal {measure.fmt_steal(o['steal'])} / "
                  f"{measure.fmt_steal(n['steal'])}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    versions = {x["version"] for w in rows.values() for x in w}
    summary = {}
    for who, rs in rows.items():
        summary[who] = {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "cpu_s", "rss_mib")}
        summary[who]["cpu_s_per_1000"] = summary[who]["cpu_s"] / a.inputs * 1000
    ratios = [o["wall_s"] / n["wall_s"] for o, n in zip(rows["old"], rows["new"])]
    for who in ("old", "new"):
        s = summary[who]
        print(f"{who}: median {s['wall_s']:.2f} s, {s['cpu_s']:.2f} CPU s ({s['cpu_s_per_1000'] * 1000:.1f} CPU ms "
              f"per 1,000 inputs), peak RSS {s['rss_mib']:.0f} MiB")
    print(f"wall ratio (before / now) per round: {', '.join('%.2f' % x for x in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    print("same manifest from both builds" if len(versions) == 1 else f"MANIFESTS DIFFER: {versions}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "ratios": ratios}, f, indent=1)
    return 0 if len(versions) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
