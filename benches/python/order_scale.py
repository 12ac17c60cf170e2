#!/usr/bin/env python3
"""Issue 20: the cost of starting an epoch, and the global shuffle's read rate.

For file:// datasets of tiny JSONL samples (packed once per size, kept under --work):

* start: `ramjet stream URL --limit 1 --json` per shuffle (block, global), rounds interleaved
  between the builds given (--ramjet, and --old for the build before the lazy order): time to
  first sample (the stream's own `first_sample_s`), the process's wall time, and its peak RSS;
* pack: `ramjet pack` of the JSONL (wall, CPU and peak RSS), builds interleaved;
* warm: a whole epoch with a warm disk cache, `--shuffle block` against `--shuffle global`,
  rounds interleaved: samples/s and CPU seconds per million samples, and the per-round ratio.

Medians of --rounds rounds, with every round's figures. Usage:
  benches/python/order_scale.py --ramjet target/release/ramjet [--old /tmp/old-ramjet]
      --sizes 100000,1000000,4000000 [--rounds 5] [--pack-rounds 3] [--warm 1000000]
      [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (steal share, CPU of a run)


def run(cmd):
    """Runs cmd, failing the bench with its stderr if it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return p.stdout


def run_ru(cmd):
    """Runs cmd with its own rusage: (stdout, wall s, cpu s, peak RSS MB, the machine's steal
    share while it ran)."""
    try:
        out, wall, cpu, steal, rss = measure.run(cmd)
    except RuntimeError as e:
        sys.exit(str(e))
    return out, wall, cpu, rss, steal


def make_jsonl(path, n):
    if os.path.exists(path):
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for i in range(n):
            f.write('{"id": %d, "text": "sample %d"}\n' % (i, i))
    os.rename(tmp, path)


def med(xs):
    return statistics.median(xs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ramjet", required=True)
    ap.add_argument("--old")
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pack-rounds", type=int, default=0)
    ap.add_argument("--warm", type=int, default=0, help="size for the warm-epoch global vs block run")
    ap.add_argument("--work", default="/tmp/ramjet-order-scale")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    builds = [("new", a.ramjet)] + ([("old", a.old)] if a.old else [])
    result = {"start": {}, "pack": {}, "warm": {}}
    for n in [int(x) for x in a.sizes.split(",")]:
        src = f"{a.work}/s{n}.jsonl"
        make_jsonl(src, n)
        ds = f"{a.work}/d{n}"
        if not os.path.exists(f"{ds}/manifest.json"):
            run([a.ramjet, "pack", src, f"file://{ds}"])
        # pack, interleaved (into throwaway prefixes)
        packs = {b: [] for b, _ in builds}
        for r in range(a.pack_rounds):
            for b, binary in (builds if r % 2 == 0 else builds[::-1]):
                dst = f"{a.work}/p{n}-{b}"
                subprocess.run(["rm", "-rf", dst], check=True)
                _, wall, cpu, rss, steal = run_ru([binary, "pack", src, f"file://{dst}"])
                packs[b].append({"wall_s": wall, "cpu_s": cpu, "rss_mb": rss, "steal": steal})
                print(f"pack n={n} {b} round {r}: {wall:.2f} s wall, {cpu:.2f} s CPU, {rss:.0f} MB, "
                      f"steal {measure.fmt_steal(steal)}", flush=True)
        if a.pack_rounds:
            result["pack"][n] = packs
        for shuffle in ["block", "global"]:
            rows = {b: [] for b, _ in builds}
            for r in range(a.rounds):
                for b, binary in (builds if r % 2 == 0 else builds[::-1]):
                    out, wall, cpu, rss, steal = run_ru(
                        [binary, "stream", f"file://{ds}", "--shuffle", shuffle, "--limit", "1", "--json"]
                    )
                    m = json.loads(out[out.index("{"):])
                    rows[b].append({"ttfs_s": m["first_sample_s"], "wall_s": wall, "cpu_s": cpu, "rss_mb": rss,
                                    "steal": steal})
            result["start"].setdefault(n, {})[shuffle] = rows
            for b, _ in builds:
                x = rows[b]
                print(
                    f"start n={n} {shuffle} {b}: TTFS median {med([r['ttfs_s'] for r in x]):.4f} s "
                    f"(rounds {', '.join('%.4f' % r['ttfs_s'] for r in x)}), "
                    f"wall {med([r['wall_s'] for r in x]):.3f} s, RSS {med([r['rss_mb'] for r in x]):.0f} MB, "
                    f"steal {', '.join(measure.fmt_steal(r['steal']) for r in x)}",
                    flush=True,
                )
    if a.warm:
        n = a.warm
        ds = f"{a.work}/d{n}"
        cache = f"{a.work}/cache{n}"
        subprocess.run(["rm", "-rf", cache], check=True)
        base = [a.ramjet, "stream", f"file://{ds}", "--cache-dir", cache, "--json"]
        run_ru(base + ["--shuffle", "block"])  # fills the cache
        rows = {"block": [], "global": []}
        for r in range(a.rounds):
            for shuffle in (["block", "global"] if r % 2 == 0 else ["global", "block"]):
                out, wall, cpu, rss, steal = run_ru(base + ["--shuffle", shuffle])
                m = json.loads(out[out.index("{"):])
                rows[shuffle].append({"samples_per_s": m["samples_per_s"], "cpu_s_per_m": cpu / m["samples"] * 1e6,
                                      "hit_rate": m["hit_rate"], "steal": steal})
            ratio = rows["global"][-1]["samples_per_s"] / rows["block"][-1]["samples_per_s"]
            print(
                f"warm n={n} round {r}: block {rows['block'][-1]['samples_per_s']:.0f}/s, "
                f"global {rows['global'][-1]['samples_per_s']:.0f}/s, ratio {ratio:.2f}, steal "
                f"{measure.fmt_steal(rows['block'][-1]['steal'])} / {measure.fmt_steal(rows['global'][-1]['steal'])}",
                flush=True,
            )
        ratios = [g["samples_per_s"] / b["samples_per_s"] for g, b in zip(rows["global"], rows["block"])]
        result["warm"] = {"n": n, "rows": rows, "ratios": ratios}
        for s in ["block", "global"]:
            print(
                f"warm {s}: median {med([x['samples_per_s'] for x in rows[s]]):.0f} samples/s, "
                f"{med([x['cpu_s_per_m'] for x in rows[s]]):.2f} CPU s per million"
            )
        print(f"warm global/block: median ratio {med(ratios):.2f} (rounds {', '.join('%.2f' % r for r in ratios)})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
