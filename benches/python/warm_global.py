#!/usr/bin/env python3
"""Issue 20: a warm epoch of the global shuffle against the block shuffle's rate.

Contenders, interleaved round by round (order reversed every other round): `--shuffle block`
and `--shuffle global` of --ramjet, and optionally `--shuffle global` of --pread (a build that
reads every sample from the cache one by one, e.g. e0f1e90). The cache is filled by one epoch
first. Reports samples/s and CPU seconds per million samples per contender, medians of
--rounds rounds, every round's ratio to the block shuffle, and each run's steal share
(flagged above measure.STEAL_FLAG).

Usage: benches/python/warm_global.py --ramjet target/release/ramjet --dataset file:///d1000000
         --cache /tmp/cache [--beyond] [--pread /tmp/e0f1e90-ramjet] [--rounds 5]
(the dataset: benches/python/order_scale.py writes tiny JSONL datasets under its --work dir)
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (steal share, CPU of a run)


def run(binary, dataset, cache, shuffle):
    """(samples/s, CPU s per million samples, the machine's steal share) of one warm epoch."""
    out, _, cpu, steal, _ = measure.run(
        [binary, "stream", dataset, "--cache-dir", cache, "--shuffle", *shuffle.split(), "--json"])
    m = json.loads(out[out.index("{"):])
    return m["samples_per_s"], cpu / m["samples"] * 1e6, steal


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ramjet", required=True)
    ap.add_argument("--pread")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--beyond", action="store_true",
                    help="add --ramjet's global shuffle with --resident 0: no shard held, every sample read "
                         "from the cache one by one (a dataset larger than resident_bytes_max), with the "
                         "shards' indexes held (one read a sample) and without (--index-bytes 0, two reads)")
    a = ap.parse_args()
    run(a.ramjet, a.dataset, a.cache, "block")  # fills the cache
    cs = [("block", a.ramjet, "block"), ("global", a.ramjet, "global")]
    if a.beyond:
        cs.append(("global, nothing held", a.ramjet, "global --resident 0"))
        cs.append(("global, nothing held, no index", a.ramjet, "global --resident 0 --index-bytes 0"))
    if a.pread:
        cs.append(("global, read one by one", a.pread, "global"))
    rows = {c[0]: [] for c in cs}
    for r in range(a.rounds):
        for name, b, sh in (cs if r % 2 == 0 else cs[::-1]):
            rows[name].append(run(b, a.dataset, a.cache, sh))
        print(f"round {r}: " + ", ".join(
            f"{n} {rows[n][-1][0]:.0f}/s ({rows[n][-1][0] / rows['block'][-1][0]:.2f}x, "
            f"steal {measure.fmt_steal(rows[n][-1][2])})" for n, _, _ in cs), flush=True)
    for n, _, _ in cs:
        ratios = [x[0] / b[0] for x, b in zip(rows[n], rows["block"])]
        print(f"{n}: median {statistics.median(x[0] for x in rows[n]):.0f} samples/s, "
              f"{statistics.median(x[1] for x in rows[n]):.2f} CPU s per million, "
              f"median ratio to block {statistics.median(ratios):.2f} (rounds {', '.join('%.2f' % x for x in ratios)})")
    flagged = [r for r in range(a.rounds) if any(rows[n][r][2] > measure.STEAL_FLAG for n, _, _ in cs)]
    print(f"rounds with steal above {measure.STEAL_FLAG:.0%}: {flagged or 'none'}")


if __name__ == "__main__":
    main()
