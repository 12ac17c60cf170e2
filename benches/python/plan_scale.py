#!/usr/bin/env python3
"""Issue 20: time to first sample and peak RSS against sample count, 10^5 to 10^9.

Runs `ramjet plan-sim` (a real manifest and binary shard table, every shard served by a stub
from one real tiny shard; each measurement in a fresh process) for every size, the sizes
interleaved round by round, and reports medians with every round's figures. With --baseline
(a JSON from benches/python/order_scale.py run against the build before the lazy order), its
file:// points are drawn beside them. Writes a log-log PNG.

Usage: benches/python/plan_scale.py --ramjet target/release/ramjet [--rounds 5]
         [--sizes 1e5,1e6,1e7,1e8,1e9] [--shuffle block] [--baseline old.json]
         [--png docs/img/order_scale.png] [--json out.json]
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (steal share)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ramjet", required=True)
    ap.add_argument("--dir", default="/tmp/ramjet-plansim")
    ap.add_argument("--sizes", default="1e5,1e6,1e7,1e8,1e9")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shuffle", default="block")
    ap.add_argument("--baseline")
    ap.add_argument("--png")
    ap.add_argument("--json")
    a = ap.parse_args()
    sizes = [int(float(x)) for x in a.sizes.split(",")]
    rows = {n: [] for n in sizes}
    for n in sizes:  # prepare once (not timed)
        subprocess.run([a.ramjet, "plan-sim", "--dir", a.dir, "--samples", str(n), "--shuffle", a.shuffle],
                       check=True, capture_output=True)
    for r in range(a.rounds):
        order = sizes if r % 2 == 0 else sizes[::-1]
        for n in order:
            before, st = resource.getrusage(resource.RUSAGE_CHILDREN), measure.proc_stat()
            out = subprocess.run(
                [a.ramjet, "plan-sim", "--dir", a.dir, "--samples", str(n), "--shuffle", a.shuffle],
                check=True, capture_output=True, text=True,
            ).stdout
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            row = json.loads(out)
            # CPU of both processes (the launcher and its measuring child), start-up included.
            row["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            row["steal"] = measure.steal_share(st, measure.proc_stat())
            rows[n].append(row)
        print(f"round {r}: " + ", ".join(f"{n:.0e} {rows[n][-1]['ttfs_s'] * 1e3:.1f} ms "
                                         f"(steal {measure.fmt_steal(rows[n][-1]['steal'])})" for n in sizes)
              + f"; {sizes[-1]:.0e}/{sizes[0]:.0e} {rows[sizes[-1]][-1]['ttfs_s'] / rows[sizes[0]][-1]['ttfs_s']:.2f}x",
              flush=True)
    summary = []
    for n in sizes:
        t = [x["ttfs_s"] for x in rows[n]]
        m = [x["rss_peak_mb"] for x in rows[n]]
        c = [x["cpu_s"] for x in rows[n]]
        b = [x.get("table_blocks_read", 0) for x in rows[n]]
        summary.append({"samples": n, "shards": rows[n][0]["shards"], "table_bytes": rows[n][0]["table_bytes"],
                        "table_blocks": rows[n][0].get("table_blocks", 0),
                        "ttfs_s": statistics.median(t), "rss_peak_mb": statistics.median(m),
                        "cpu_s": statistics.median(c), "blocks_read": statistics.median(b),
                        "ttfs_rounds": t, "rss_rounds": m, "cpu_rounds": c, "blocks_rounds": b})
        print(f"{n:>13,} samples, {rows[n][0]['shards']:>9,} shards: time to first sample median "
              f"{statistics.median(t) * 1e3:.1f} ms (rounds {', '.join('%.1f' % (x * 1e3) for x in t)}), "
              f"peak RSS median {statistics.median(m):.0f} MB, CPU median {statistics.median(c) * 1e3:.0f} ms "
              f"(whole run), table blocks read median {statistics.median(b):.0f} of {rows[n][0].get('table_blocks', 0)}")
    base = summary[0]["ttfs_s"]
    ratios = [x / y for x, y in zip(summary[-1]["ttfs_rounds"], summary[0]["ttfs_rounds"])]
    print(f"time to first sample at {sizes[-1]:.0e} / at {sizes[0]:.0e}: {summary[-1]['ttfs_s'] / base:.2f}x "
          f"(medians); per round {', '.join('%.2f' % x for x in ratios)}, median {statistics.median(ratios):.2f}x")
    old = None
    if a.baseline:
        with open(a.baseline) as f:
            old = json.load(f)
    if a.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        xs = [s["samples"] for s in summary]
        ax1.loglog(xs, [s["ttfs_s"] for s in summary], "o-", label="lazy order + shard table (plan-sim)")
        ax2.loglog(xs, [s["rss_peak_mb"] for s in summary], "o-", label="lazy order + shard table (plan-sim)")
        if old:
            st = old["start"]
            ox = sorted(int(k) for k in st)
            for key, ax in (("ttfs_s", ax1), ("rss_mb", ax2)):
                for build, style, label in (("old", "s--", "array order (build before), file:// JSONL"),
                                            ("new", "^-", "lazy order, file:// JSONL")):
                    ys = [statistics.median(r[key] for r in st[str(n)]["block"][build]) for n in ox]
                    ax.loglog(ox, ys, style, label=label)
        ax1.axhline(0.1, color="grey", lw=0.8, ls=":")
        ax1.text(xs[0], 0.11, "target at 10^9: 0.1 s", fontsize=8, color="grey")
        ax2.axhline(200, color="grey", lw=0.8, ls=":")
        ax2.text(xs[0], 215, "target at 10^9: 200 MB", fontsize=8, color="grey")
        ax1.set(xlabel="samples in the epoch", ylabel="time to first sample (s)", title="Time to first sample")
        ax2.set(xlabel="samples in the epoch", ylabel="peak RSS (MB)", title="Peak RSS per consumer")
        for ax in (ax1, ax2):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Starting an epoch, --shuffle {a.shuffle} (medians of {a.rounds} rounds)")
        fig.tight_layout()
        fig.savefig(a.png, dpi=110)
        print(f"wrote {a.png}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
