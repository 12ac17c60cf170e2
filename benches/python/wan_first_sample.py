#!/usr/bin/env python3
"""Issue 14: time to the first sample over the WAN-like link of tools/ramjet-bench, with and
without the connections a stream opens while it reads the manifest (RAMJET_PRECONNECT).

Brings the link up (network namespace, veth, tbf rate, delay relay: root), then runs
`ramjet stream URL --limit 8 --json` in a fresh process with an empty cache, RAMJET_PRECONNECT=0
and the default (8) interleaved round by round (order rotated), and reports the medians, every
round's figures and ratio, CPU seconds and the steal share (benches/python/measure.py). A first
untimed run wakes the freshly started server. The dataset is ramjet-bench's (run
`tools/ramjet-bench --link wan` once to upload it).

Usage (tools/env.sh sourced, as root):
  benches/python/wan_first_sample.py --ramjet target/release/ramjet [--rounds 7]
      [--url s3://ramjet/bench/ramjet-bench/5315-64m/ramjet]
"""
import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules
import ramjet_bench as rb  # noqa: E402 - the WAN-like link


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ramjet", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--url", default="s3://ramjet/bench/ramjet-bench/5315-64m/ramjet")
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    a = ap.parse_args()
    link = rb.wan_up(a.rate, a.rtt_ms)
    cache = Path(tempfile.mkdtemp(prefix="ramjet-wan-first-"))
    try:
        def first_sample(preconnect):
            shutil.rmtree(cache, ignore_errors=True)
            env = link.env() | {"RAMJET_PRECONNECT": preconnect}
            out, wall, cpu, steal, _ = measure.run(
                [a.ramjet, "stream", a.url, "--cache-dir", str(cache), "--limit", "8", "--json"], env=env)
            return json.loads(out[out.index("{"):])["first_sample_s"], cpu, steal

        first_sample("8")  # wakes the server started with the link
        cs = [("no preconnect", "0"), ("preconnect 8", "8")]
        rows = {n: [] for n, _ in cs}
        for r in range(a.rounds):
            for name, p in measure.order(cs, r):
                rows[name].append(first_sample(p))
            print(f"round {r}: " + "; ".join(
                f"{n} {rows[n][-1][0] * 1e3:.0f} ms ({rows[n][-1][1]:.2f} CPU s, steal "
                f"{measure.fmt_steal(rows[n][-1][2])})" for n, _ in cs), flush=True)
        for n, _ in cs:
            print(f"{n}: median {statistics.median(x[0] for x in rows[n]) * 1e3:.0f} ms to the first sample, "
                  f"{statistics.median(x[1] for x in rows[n]):.2f} CPU s")
        ratios = [x[0] / y[0] for x, y in zip(rows["no preconnect"], rows["preconnect 8"])]
        print(f"no preconnect / preconnect 8, per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.2f}x")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        rb.wan_down(link)


if __name__ == "__main__":
    main()
