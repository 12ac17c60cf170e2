#!/usr/bin/env python3
"""Issue 14: why is the first cold round over tools/ramjet-bench's WAN-like link slower for
every loader? Each test brings the link up afresh (network namespace, veth, tbf, delay relay,
a SeaweedFS started in the namespace: root), warms the origin as the bench does (the first byte
of every object), and times the first batch of `ramjet.StreamingDataset` (the bench's settings:
batch 8, 224x224 RandomResizedCrop, the default shard-block shuffle, an empty cache) in fresh Python processes.

  page-cache   the origin's volume files evicted from the page cache (posix_fadvise) before a
               run, against read into memory, interleaved round by round
  tcp-metrics  the namespace's TCP metrics cache flushed before a run, against kept
  idle-cpu     the origin's and the relay's CPU seconds per 10 s while idle after the start

Every test prints each run in order, so the first runs after the link came up show.

Usage (tools/env.sh sourced, as root; the dataset of a `tools/ramjet-bench --link wan` run):
  benches/python/wan_first_round.py page-cache tcp-metrics idle-cpu [--rounds 6]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches/python"))
sys.path.insert(0, str(ROOT / "benches/python"))
import ramjet_bench as rb  # noqa: E402 - the WAN-like link and the dataset

URL = "s3://ramjet/bench/ramjet-bench/5315-64m/ramjet-rst32"
FIRST_BATCH = """
import json, sys, time
import torch  # noqa: F401 - imported before the clock starts, as in the bench's loader processes
import ramjet
t0 = time.perf_counter()
ds = ramjet.StreamingDataset(sys.argv[1], local=sys.argv[2], cache_limit="64GiB", batch_size=8, shuffle=True, seed=0,
                             image_size=224, augment="train", image_column="image", boxes_column="boxes")
next(iter(ds))
print(json.dumps({"ttfb_s": time.perf_counter() - t0}))
"""


def first_batch(link, cache):
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", FIRST_BATCH, URL, str(cache)], env=link.env(), capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"the first batch failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ttfb_s"]


def origin_files(link):
    return [f for f in (rb.STATE / f"s3-{link.port}" / "data").rglob("*") if f.is_file()]


def evict(link):
    for f in origin_files(link):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def into_memory(link):
    for f in origin_files(link):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass


def flush_tcp_metrics(_link):
    subprocess.run(["ip", "netns", "exec", rb.NETNS, "ip", "tcp_metrics", "flush", "all"], check=False)


def keep(_link):
    pass


def versus(link, cache, rounds, a, b):
    """Two conditions, interleaved (order alternating), each set up right before its run."""
    (na, fa), (nb, fb) = a, b
    got = {na: [], nb: []}
    n = 0
    for r in range(rounds):
        for name, setup in ([(na, fa), (nb, fb)] if r % 2 == 0 else [(nb, fb), (na, fa)]):
            setup(link)
            t = first_batch(link, cache)
            got[name].append(t)
            n += 1
            print(f"  run {n}, round {r + 1}, {name}: {t * 1e3:.0f} ms", flush=True)
    for name, ts in got.items():
        print(f"  {name}: median {statistics.median(ts) * 1e3:.0f} ms ({', '.join(f'{t * 1e3:.0f}' for t in ts)})")
    print(f"  {na} / {nb} per round: {', '.join(f'{x / y:.2f}' for x, y in zip(got[na], got[nb]))}")


def idle_cpu(link, samples=12):
    def cpu(pid):
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    pids = link.origin_pids()
    last = [cpu(p) for p in pids]
    for k in range(samples):
        time.sleep(10)
        now = [cpu(p) for p in pids]
        print(f"  {10 * (k + 1):3d} s after the warm-up: origin {now[0] - last[0]:.2f} CPU s, relay "
              f"{now[-1] - last[-1]:.2f} CPU s in 10 s", flush=True)
        last = now


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tests", nargs="+", choices=["page-cache", "tcp-metrics", "idle-cpu"])
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    data = rb.Data(5315, 64)
    cache = Path(tempfile.mkdtemp(prefix="wan-first-round-"))
    try:
        for test in a.tests:
            link = rb.wan_up("200mbit", 20.0)
            try:
                data.warm_origin(link)
                print(f"{test} ({time.strftime('%H:%M', time.gmtime())} UTC), the link just up:", flush=True)
                if test == "page-cache":
                    versus(link, cache, a.rounds, ("evicted", evict), ("in memory", into_memory))
                elif test == "tcp-metrics":
                    versus(link, cache, a.rounds, ("flushed", flush_tcp_metrics), ("kept", keep))
                else:
                    idle_cpu(link)
            finally:
                rb.wan_down(link)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
