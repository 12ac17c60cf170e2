#!/usr/bin/env python3
"""Shards prefetched ahead, sized from rates (issue 45, item 3): `ramjet stream` over the local S3
server with the default (the shards held ahead cover one fetch at the consumer's pace) beside
the fixed depth (`RAMJET_PREFETCH_TUNE=off`: the whole prefetch budget, 512 MiB, filled ahead).

Two consumers, each from an empty cache (no --cache-dir: every epoch reads the origin):

  fast:  the stream alone (the consumer never keeps the prefetcher waiting): the cold epoch's
         wall time must not suffer;
  slow:  a simulated training step of --step-ms a sample (`ramjet stream --step-ms`): the
         memory held ahead should fall to what covers a fetch, the consumer's waits stay ~0.

Every contender runs once a round, the order rotated; medians of the rounds, every round's
ratios. Per run: wall seconds, CPU seconds (the process, from wait4), peak RSS, the consumer's
wait for data, and the depth the stream chose (`tune_shards_ahead`, its peak).

    benches/python/prefetch_tune.py [--samples 4000] [--rounds 5] [--step-ms 2]
        [--out target/bench/prefetch_tune.json] [--plot docs/img/prefetch-tune.png] [--from JSON]

Needs tools/env.sh's S3 settings (the local SeaweedFS).
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

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")


def run_one(url, tuned, step_ms):
    """One `ramjet stream` run; its own rusage (wait4) gives its CPU seconds and peak RSS."""
    env = dict(os.environ)
    if not tuned:
        env["RAMJET_PREFETCH_TUNE"] = "off"
    cmd = [RAMJET, "stream", url, "--json"] + (["--step-ms", str(step_ms)] if step_ms else [])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise SystemExit(f"ramjet stream failed: {err.read()[-2000:]}")
        m = measure.stream_json(out.read())
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "rss_mib": ru.ru_maxrss / 1024,
            "wait_s": m["wait_s"], "samples": m.get("samples"),
            "shards_ahead": m.get("tune_shards_ahead"), "shards_ahead_peak": m.get("tune_shards_ahead_peak")}


def plot(summary, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows, names = summary["rows"], list(summary["medians"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for n in names:
        ys = [x["rss_mib"] for x in rows if x["contender"] == n]
        axes[0].plot(range(len(ys)), ys, marker="o", label=n)
    axes[0].set(title="peak RSS, MiB", xlabel="round", ylim=(0, None))
    for c, per in summary["per_round"].items():
        axes[1].plot(range(len(per)), [p["speed_tuned_vs_fixed"] for p in per], marker="o", label=f"{c} consumer")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set(title="speed, tuned / fixed (same round)", xlabel="round", ylim=(0, 1.5))
    for ax in axes:
        ax.legend()
    fig.suptitle(f"ramjet stream, {summary['samples']:,} samples in {summary['shard_size']} shards, local S3\n"
                 f"shards ahead from rates (tuned) vs the 512 MiB budget (fixed); slow: {summary['step_ms']} ms a sample")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-ms", type=int, default=2)
    ap.add_argument("--shard-size", default="16MiB")
    ap.add_argument("--out", default=str(ROOT / "target/bench/prefetch_tune.json"))
    ap.add_argument("--plot")
    ap.add_argument("--from", dest="from_json", help="plot a summary written before (no runs)")
    a = ap.parse_args()
    if a.from_json:
        plot(json.loads(Path(a.from_json).read_text()), a.plot)
        return
    work = Path(tempfile.mkdtemp(prefix="ramjet-prefetch-tune-"))
    subprocess.run([RAMJET, "synth", str(work / "synth"), "--samples", str(a.samples)], check=True,
                   capture_output=True)
    url = f"s3://{BUCKET}/prefetch-tune/{work.name}"
    subprocess.run([RAMJET, "pack", str(work / "synth"), url, "--shard-size", a.shard_size], check=True,
                   capture_output=True)
    contenders = [(c, tuned) for c in ("fast", "slow") for tuned in (True, False)]
    names = [f"{c} {'tuned' if t else 'fixed'}" for c, t in contenders]
    rows = []
    for r in range(a.rounds):
        for name in measure.order(names, r):
            consumer, how = name.split()
            before, t0 = measure.proc_stat(), time.perf_counter()
            x = run_one(url, how == "tuned", a.step_ms if consumer == "slow" else 0)
            others = measure.others_share(before, measure.proc_stat(), x["cpu_s"], time.perf_counter() - t0)
            x.update(round=r, contender=name, others=others)
            rows.append(x)
            print(f"round {r} {name:>10}: {x['wall_s']:.2f} s, {x['cpu_s']:.2f} CPU s, peak RSS "
                  f"{x['rss_mib']:.0f} MiB, waited {x['wait_s']:.2f} s, ahead {x['shards_ahead']} "
                  f"(peak {x['shards_ahead_peak']}), {measure.fmt_others(others)}", flush=True)
    med = {n: {k: statistics.median(x[k] for x in rows if x["contender"] == n)
               for k in ("wall_s", "cpu_s", "rss_mib", "wait_s")} for n in names}
    ratios = {}
    for c in ("fast", "slow"):
        per = []
        for r in range(a.rounds):
            t = next(x for x in rows if x["round"] == r and x["contender"] == f"{c} tuned")
            f = next(x for x in rows if x["round"] == r and x["contender"] == f"{c} fixed")
            per.append({"speed_tuned_vs_fixed": f["wall_s"] / t["wall_s"],
                        "rss_tuned_vs_fixed": t["rss_mib"] / f["rss_mib"],
                        "cpu_tuned_vs_fixed": t["cpu_s"] / f["cpu_s"]})
        ratios[c] = per
    for n in names:
        m = med[n]
        print(f"{n:>10}: {m['wall_s']:.2f} s, {m['cpu_s']:.2f} CPU s ({m['cpu_s'] / a.samples * 1000:.3f} "
              f"per 1,000 samples), peak RSS {m['rss_mib']:.0f} MiB, waited {m['wait_s']:.2f} s (medians)")
    for c, per in ratios.items():
        print(f"{c}: tuned/fixed per round: speed {[round(p['speed_tuned_vs_fixed'], 3) for p in per]}, "
              f"peak RSS {[round(p['rss_tuned_vs_fixed'], 3) for p in per]}, "
              f"CPU {[round(p['cpu_tuned_vs_fixed'], 3) for p in per]}")
    summary = {"samples": a.samples, "shard_size": a.shard_size, "step_ms": a.step_ms, "rounds": a.rounds,
               "medians": med, "per_round": ratios, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))
    if a.plot:
        plot(summary, a.plot)


if __name__ == "__main__":
    main()
