#!/usr/bin/env python3
"""Ranks sharing a host: 4 trainer processes, each a rank of one job, against 1 process reading
the same data (issue 45).

Both contenders read through one host daemon (`ramjet serve`, started here, its cache warmed by
a first pass), so the work measured is what a node of ranks does on a warm cache: cache reads,
verification, decode and augmentation. Each round runs both contenders, in an order rotated
round by round:

  one:   1 process, rank 0 of 1, one epoch of the whole dataset;
  ranks: 4 processes started together, rank r of 4 each, one epoch each (a quarter each).

Every process first runs a warm-up epoch and waits until it is idle (its bounded read-ahead
full); then the parent releases them at once and each measures its own window: its CPU
(getrusage) from the release until it is idle again after its last decode, and the
perf_counter time of its last decode. The job's wall time is the release to the last process's
last decode; its CPU is every process's window plus the daemon's CPU over the round
(/proc/<pid>/stat). Threads: the most threads the host's ramjet processes (the ranks and the
daemon) held at once, sampled from /proc every 50 ms during the window.

Reported per round and as medians: images/s, CPU seconds per 1,000 images, threads, and the
ratios ranks/one (targets: CPU at most 1.1x, rate at least 0.9x).

With `--base DIR` (a baseline build: `DIR/py` holding its Python package, `DIR/ramjet` its
binary, as benches/python/ab.py lays them out), the baseline's two contenders run in the same
rounds, each side with its own daemon, so "today's figure" and the new one come from one run.

    benches/python/host_ranks.py --remote s3://ramjet/bench/stream-5315 [--rounds 5] [--ranks 4]
        [--base target/ab/REV-out] [--out target/bench/host_ranks.json] [--env KEY=VALUE ...]
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (steal share)

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")

CHILD = r"""
import json, os, sys, time, resource
import ramjet
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["measure_dir"])
import measure
ds = ramjet.StreamingDataset(cfg["remote"], batch_size=cfg["batch"], image_size=cfg["image_size"], shuffle=True,
                             seed=1, augment="train", rank=cfg["rank"], world_size=cfg["world"], **cfg["kw"])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
def epoch(e):
    ds.set_epoch(e)
    n = 0
    for b in ds:
        n += len(b["_index"])
    return n
epoch(0)
measure.wait_idle(quiet_s=0.3, busy=0.02, limit_s=20)
print("ready", flush=True)
sys.stdin.readline()
c0, t0 = cpu(), time.perf_counter()
n = epoch(1)
end = measure.run_on_end(ds)
measure.wait_idle(quiet_s=0.3, busy=0.02, limit_s=20)
m = ds.metrics()
print(json.dumps({"images": n, "cpu_s": cpu() - c0, "t0": t0, "end": end,
                  "tune": {k: v for k, v in m.items() if k.startswith("tune_")}}), flush=True)
"""


def threads_of(pids):
    n = 0
    for p in pids:
        try:
            n += len(os.listdir(f"/proc/{p}/task"))
        except OSError:
            pass
    return n


def run_contender(a, world, env, daemon_pid):
    """One contender's window: `world` processes, rank r of `world` each."""
    procs = []
    for r in range(world):
        cfg = {"remote": a.remote, "batch": a.batch, "image_size": a.image_size, "rank": r, "world": world,
               "kw": json.loads(a.kw), "measure_dir": str(Path(__file__).resolve().parent)}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env))
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            for q in procs:
                q.kill()
            raise RuntimeError(f"a rank did not get ready: {line!r}")
    pids = [p.pid for p in procs] + [daemon_pid]
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], threads_of(pids))
            time.sleep(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    d0, st, st_t = measure.tree_cpu_s(daemon_pid), measure.proc_stat(), time.perf_counter()
    go = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [json.loads(p.stdout.readline()) for p in procs]
    # The window closes when the last process reported (its exit is not part of the work).
    after, span = measure.proc_stat(), time.perf_counter() - st_t
    daemon_cpu = measure.tree_cpu_s(daemon_pid) - d0
    stop.set()
    th.join()
    for p in procs:
        p.wait(timeout=120)
    wall = max(o["end"] for o in outs) - go
    images = sum(o["images"] for o in outs)
    cpu = sum(o["cpu_s"] for o in outs) + daemon_cpu
    return {
        "images": images, "wall_s": wall, "rate": images / wall, "cpu_s": cpu, "daemon_cpu_s": daemon_cpu,
        "cpu_per_1000": cpu / images * 1000, "threads_max": peak[0],
        "steal": measure.steal_share(st, after),
        "others": measure.others_share(st, after, cpu, span), "tune": [o["tune"] for o in outs],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--remote", required=True, help="a packed dataset (the local S3 server's, say)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=160)
    ap.add_argument("--kw", default="{}", help="more StreamingDataset keywords, as JSON (every process)")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every process (the daemon too)")
    ap.add_argument("--label", default="", help="a name for this run in the output")
    ap.add_argument("--base", help="a baseline build's directory (py/ and ramjet), run in the same rounds")
    ap.add_argument("--out", default=str(ROOT / "target/bench/host_ranks.json"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ramjet-ranks-"))
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    sides = {"new": (RAMJET, None)}
    if a.base:
        sides["base"] = (str(Path(a.base) / "ramjet"), str(Path(a.base) / "py"))
    envs, daemons = {}, {}
    rows = []
    try:
        for side, (binary, py) in sides.items():
            e = dict(env)
            sock = str(work / f"{side}.sock")
            e["RAMJET_SOCKET"] = sock
            if py:
                e["PYTHONPATH"] = py + os.pathsep + e.get("PYTHONPATH", "")
            log = open(work / f"{side}-daemon.log", "w")
            daemons[side] = subprocess.Popen([binary, "serve", "--cache-dir", str(work / f"{side}-cache"), "--socket",
                                              sock, "--http", "127.0.0.1:0"], env=e, stdout=log,
                                             stderr=subprocess.STDOUT)
            envs[side] = e
            for _ in range(200):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            # Warm the daemon's cache once (the first contender's warm-up epoch would do it too).
            run_contender(a, 1, e, daemons[side].pid)
        contenders = [(side, name) for side in sides for name in ("one", "ranks")]
        for r in range(a.rounds):
            for side, name in measure.order(contenders, r):
                x = run_contender(a, 1 if name == "one" else a.ranks, envs[side], daemons[side].pid)
                x.update(round=r, contender=name, side=side)
                rows.append(x)
                print(f"round {r} {side} {name}: {x['rate']:,.0f} img/s, {x['cpu_per_1000']:.2f} CPU s/1000 "
                      f"(daemon {x['daemon_cpu_s']:.2f} s), threads {x['threads_max']}, "
                      f"steal {measure.fmt_steal(x['steal'])}, other load {measure.fmt_others(x['others'])}",
                      flush=True)
    finally:
        for d in daemons.values():
            d.send_signal(signal.SIGTERM)
            try:
                d.wait(timeout=20)
            except subprocess.TimeoutExpired:
                d.kill()
        shutil.rmtree(work, ignore_errors=True)

    summary = {"label": a.label, "rounds": a.rounds, "ranks": a.ranks, "env": a.env, "kw": a.kw, "rows": rows,
               "sides": {}}
    for side in sides:
        def med(c, k):
            return statistics.median(x[k] for x in rows if x["contender"] == c and x["side"] == side)

        per_round = []
        for r in range(a.rounds):
            one = next(x for x in rows if x["round"] == r and x["contender"] == "one" and x["side"] == side)
            rk = next(x for x in rows if x["round"] == r and x["contender"] == "ranks" and x["side"] == side)
            per_round.append({"rate": rk["rate"] / one["rate"], "cpu": rk["cpu_per_1000"] / one["cpu_per_1000"]})
        flagged = sum(1 for x in rows if x["side"] == side and measure.flagged_row(x))
        d = {
            "one": {k: med("one", k) for k in ("rate", "cpu_per_1000", "threads_max")},
            "ranks": {k: med("ranks", k) for k in ("rate", "cpu_per_1000", "threads_max")},
            "rate_ratio": statistics.median(p["rate"] for p in per_round),
            "cpu_ratio": statistics.median(p["cpu"] for p in per_round),
            "per_round": [{k: round(v, 3) for k, v in p.items()} for p in per_round],
            "flagged_rows": flagged,
        }
        summary["sides"][side] = d
        print(f"{side}: {a.ranks} ranks vs 1 process, medians of {a.rounds} rounds: "
              f"rate {d['rate_ratio']:.3f}x (target >= 0.9), CPU per 1,000 images {d['cpu_ratio']:.3f}x "
              f"(target <= 1.1); per round rate {[p['rate'] for p in d['per_round']]}, "
              f"CPU {[p['cpu'] for p in d['per_round']]}; one {d['one']['rate']:,.0f} img/s "
              f"{d['one']['cpu_per_1000']:.3f} CPU s/1000, ranks {d['ranks']['rate']:,.0f} img/s "
              f"{d['ranks']['cpu_per_1000']:.3f} CPU s/1000; threads on the host (ranks and daemon): one "
              f"{d['one']['threads_max']:.0f}, ranks {d['ranks']['threads_max']:.0f}; rows flagged (steal or other "
              f"load over 10%): {flagged}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
