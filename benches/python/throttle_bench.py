#!/usr/bin/env python3
"""A throttling origin (issue 45): `ramjet stream` reads a dataset cold through
`throttle_proxy.py`, which answers 503 SlowDown past `--rps` requests a second, once with the
origin control (the default) and once with today's fixed settings (`RAMJET_ORIGIN_TUNE=off`:
every ranged GET the stream issues goes out at once, each retried on its own with its own
backoff). Rounds interleave the two, order rotated.

Per run: the stream's exit (an error surfaced to the consumer fails the run), its wall time,
the requests the proxy forwarded per second against the allowed rate (the whole run, and the
converged part: from the 3rd second to the second before the last), and the share of requests
throttled (the whole run and converged). Medians over rounds, with every round's figures.

Targets: tuned throughput within 10% of the allowed rate, no error, at most 5% of requests
throttled once converged.

    benches/python/throttle_bench.py --remote s3://ramjet/bench/stream-5315 --rps 40
        [--range-size 1MiB] [--rounds 5] [--delay-ms 0] [--out target/bench/throttle.json]
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


def one_run(a, mode, work):
    stats = work / f"proxy-{mode}.json"
    upstream = os.environ["AWS_ENDPOINT_URL"].split("://", 1)[1].rstrip("/")
    proxy = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "throttle_proxy.py"),
                              "--upstream", upstream, "--rps", str(a.rps), "--delay-ms", str(a.delay_ms),
                              "--stats", str(stats)], stdout=subprocess.PIPE, text=True)
    line = proxy.stdout.readline().split()
    addr = line[1]
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://{addr}", RAMJET_PRECONNECT="0")
    if mode == "fixed":
        env["RAMJET_ORIGIN_TUNE"] = "off"
    t = time.perf_counter()
    r = subprocess.run([RAMJET, "stream", a.remote, "--range-size", a.range_size, "--shuffle", "none", "--json"],
                       env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    time.sleep(0.3)
    proxy.terminate()
    proxy.wait(timeout=10)
    doc = json.loads(stats.read_text())
    series = doc["series"]
    conv = [s for s in series if 3 <= s[0] < int(wall) - 1] or series
    f_conv = sum(s[1] for s in conv) / max(1, len(conv))
    t_conv = sum(s[2] for s in conv)
    tuned = {}
    if r.returncode == 0:
        try:
            m = measure.stream_json(r.stdout)
            tuned = {k: v for k, v in m.items() if k.startswith("tune_origin")}
        except (ValueError, IndexError):
            pass
    return {
        "mode": mode, "ok": r.returncode == 0, "error": r.stderr.strip()[-300:] if r.returncode else "",
        "wall_s": wall, "requests": doc["requests"], "forwarded": doc["forwarded"], "throttled": doc["throttled"],
        "forwarded_per_s": doc["forwarded"] / wall, "of_allowed": doc["forwarded"] / wall / a.rps,
        "throttled_share": doc["throttled"] / max(1, doc["requests"]),
        "conv_of_allowed": f_conv / a.rps,
        "conv_throttled_share": t_conv / max(1, t_conv + sum(s[1] for s in conv)),
        "tune": tuned,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--remote", required=True)
    ap.add_argument("--rps", type=float, default=40)
    ap.add_argument("--range-size", default="1MiB")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "target/bench/throttle.json"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ramjet-throttle-"))
    rows = []
    for r in range(a.rounds):
        for mode in measure.order(["tuned", "fixed"], r):
            x = one_run(a, mode, work)
            x["round"] = r
            rows.append(x)
            print(f"round {r} {mode}: {'ok' if x['ok'] else 'ERROR ' + x['error']}; {x['wall_s']:.1f} s, "
                  f"{x['forwarded_per_s']:.1f} req/s forwarded ({x['of_allowed']:.2f}x allowed; converged "
                  f"{x['conv_of_allowed']:.2f}x), throttled {x['throttled_share']:.1%} (converged "
                  f"{x['conv_throttled_share']:.1%}) of {x['requests']} {x['tune']}", flush=True)

    def med(mode, k):
        return statistics.median(x[k] for x in rows if x["mode"] == mode)

    summary = {"rps": a.rps, "range_size": a.range_size, "delay_ms": a.delay_ms, "rounds": a.rounds,
               "medians": {m: {k: med(m, k) for k in ("wall_s", "of_allowed", "conv_of_allowed", "throttled_share",
                                                       "conv_throttled_share")} for m in ("tuned", "fixed")},
               "errors": {m: sum(1 for x in rows if x["mode"] == m and not x["ok"]) for m in ("tuned", "fixed")},
               "rows": rows}
    for m in ("tuned", "fixed"):
        d = summary["medians"][m]
        print(f"{m}: medians of {a.rounds}: {d['wall_s']:.1f} s, {d['of_allowed']:.3f}x allowed (converged "
              f"{d['conv_of_allowed']:.3f}x), throttled {d['throttled_share']:.1%} (converged "
              f"{d['conv_throttled_share']:.1%}); errors {summary['errors'][m]} of {a.rounds}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
