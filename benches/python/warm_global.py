#!/usr/bin/env python3
"""Issue 20: a warm epoch of the global shuffle against the block shuffle's rate.

Contenders, interleaved round by round (order reversed every other round): `--shuffle block`
and `--shuffle global` of --ramjet, and optionally `--shuffle global` of --pread (a build that
reads every sample from the cache one by one, e.g. e0f1e90). The cache is filled by one epoch
first. Reports samples/s and CPU seconds per million samples per contender, medians of
--rounds rounds, and every round's ratio to the block shuffle.

Usage: benches/python/warm_global.py --ramjet target/release/ramjet --dataset file:///d1000000
         --cache /tmp/cache [--pread /tmp/e0f1e90-ramjet] [--rounds 5]
(the dataset: benches/python/order_scale.py writes tiny JSONL datasets under its --work dir)
"""
import argparse
import json
import os
import statistics
import subprocess


def run(binary, dataset, cache, shuffle):
    p = subprocess.Popen(
        [binary, "stream", dataset, "--cache-dir", cache, "--shuffle", shuffle, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit(f"{binary} --shuffle {shuffle} failed ({status})")
    m = json.loads(out[out.index("{"):])
    return m["samples_per_s"], (ru.ru_utime + ru.ru_stime) / m["samples"] * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ramjet", required=True)
    ap.add_argument("--pread")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    run(a.ramjet, a.dataset, a.cache, "block")  # fills the cache
    cs = [("block", a.ramjet, "block"), ("global", a.ramjet, "global")]
    if a.pread:
        cs.append(("global, read one by one", a.pread, "global"))
    rows = {c[0]: [] for c in cs}
    for r in range(a.rounds):
        for name, b, sh in (cs if r % 2 == 0 else cs[::-1]):
            rows[name].append(run(b, a.dataset, a.cache, sh))
        print(f"round {r}: " + ", ".join(
            f"{n} {rows[n][-1][0]:.0f}/s ({rows[n][-1][0] / rows['block'][-1][0]:.2f}x)" for n, _, _ in cs), flush=True)
    for n, _, _ in cs:
        ratios = [x[0] / b[0] for x, b in zip(rows[n], rows["block"])]
        print(f"{n}: median {statistics.median(x[0] for x in rows[n]):.0f} samples/s, "
              f"{statistics.median(x[1] for x in rows[n]):.2f} CPU s per million, "
              f"median ratio to block {statistics.median(ratios):.2f} (rounds {', '.join('%.2f' % x for x in ratios)})")


if __name__ == "__main__":
    main()
