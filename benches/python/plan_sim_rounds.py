#!/usr/bin/env python3
"""Issue 67: the first sample at the seed's scale, simulated (`ramjet plan-sim`), builds and
deals interleaved round by round.

Each round runs, for each build given (--ramjet, and --old for the build before a change),
`plan-sim` of --samples samples in shards of --shard-samples, once as one partition (today's
single-node order) and once as rank 0 of --nodes nodes x --ranks-per-node ranks over
--partitions partitions, each build over the dataset it wrote (--dir, and --dir + "-old": a
table layout can change). Reports every round's first-sample time (`ttfs_s`) and peak RSS, the
medians over --rounds rounds, and the per-round ratios (job / one partition; new / old).
Usage:
  benches/python/plan_sim_rounds.py --ramjet target/release/ramjet [--old /tmp/old-ramjet]
      [--dir /tmp/ps] [--rounds 5] [--json out.json]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (rotated order, CPU and steal of a run)


def sim(binary, d, args, job):
    cmd = [binary, "plan-sim", "--dir", d, "--samples", str(args.samples),
           "--shard-samples", str(args.shard_samples)]
    if job:
        cmd += ["--nodes", str(args.nodes), "--ranks-per-node", str(args.ranks_per_node),
                "--partitions", str(args.partitions)]
    out, _, cpu_s, steal, _ = measure.run(cmd)
    d = json.loads(out.strip().splitlines()[-1])
    return d["ttfs_s"] * 1000, d["rss_peak_mb"], cpu_s, steal


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ramjet", required=True)
    ap.add_argument("--old")
    ap.add_argument("--dir", default="/tmp/ps")
    ap.add_argument("--samples", type=int, default=1_000_500_000)
    ap.add_argument("--shard-samples", type=int, default=435)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--partitions", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    builds = {"new": args.ramjet, **({"old": args.old} if args.old else {})}
    runs = {(b, job): [] for b in builds for job in (False, True)}
    for r in range(args.rounds):
        # Rotated each round, so no contender is always first.
        for b, job in measure.order(runs, r):
            # Each build writes and reads its own simulated dataset (a table layout can change).
            ms, mb, cpu_s, steal = sim(builds[b], args.dir if b == "new" else args.dir + "-old", args, job)
            runs[(b, job)].append((ms, mb))
            print(f"round {r + 1}: {b} {'job' if job else 'one partition'}: first sample {ms:.1f} ms, "
                  f"{mb:.1f} MB peak RSS, process {cpu_s:.2f} CPU s, steal {measure.fmt_steal(steal)}", flush=True)
    out = {}
    for (b, job), xs in runs.items():
        key = f"{b} {'job' if job else 'one'}"
        out[key] = {"ms": [x[0] for x in xs], "mb": [x[1] for x in xs],
                    "median_ms": statistics.median(x[0] for x in xs),
                    "median_mb": statistics.median(x[1] for x in xs)}
        print(f"{key}: median {out[key]['median_ms']:.1f} ms, {out[key]['median_mb']:.1f} MB")
    for b in builds:
        ratios = [j[0] / o[0] for j, o in zip(runs[(b, True)], runs[(b, False)])]
        out[f"{b} job/one"] = ratios
        print(f"{b}: job / one partition per round {[round(x, 2) for x in ratios]}, median {statistics.median(ratios):.2f}")
    if "old" in builds:
        ratios = [n[0] / o[0] for n, o in zip(runs[("new", True)], runs[("old", True)])]
        out["job new/old"] = ratios
        print(f"job: new / old per round {[round(x, 2) for x in ratios]}, median {statistics.median(ratios):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
