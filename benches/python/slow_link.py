#!/usr/bin/env python3
"""Issue 14, item 3: no stall while the first shard downloads over a slow link.

A throttling TCP proxy in front of the local S3 server sends the server's answers at --rate
bytes a second (each chunk sent, then the link held busy for its time), so a whole shard takes
seconds while a small ranged GET comes at once: a stand-in for a slow WAN link (no latency is
added). A dataset of tiny JSONL rows in shards of --shard-size is packed once. Each round runs
`ramjet stream --shuffle none --limit N` through the proxy twice, in alternating order: with
samples read one by one only for the first 64 (`--ranged-bytes 0`, the behaviour before) and
with the default (one by one until the first shard arrives, within 32 MiB). Reports the time
to the N-th sample, CPU seconds and the steal share, every round and the medians.

Usage (tools/env.sh sourced, local S3 running):
  benches/python/slow_link.py --ramjet target/release/ramjet [--rounds 5] [--limit 1000]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (steal share, CPU of a run)


def pipe(src, dst, rate):
    try:
        while True:
            b = src.recv(16384)
            if not b:
                break
            dst.sendall(b)
            if rate:
                time.sleep(len(b) / rate)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def proxy(upstream, rate):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)

    def serve():
        while True:
            c, _ = ls.accept()
            s = socket.create_connection(upstream)
            threading.Thread(target=pipe, args=(c, s, 0), daemon=True).start()
            threading.Thread(target=pipe, args=(s, c, rate), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{ls.getsockname()[1]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ramjet", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=40000)
    ap.add_argument("--shard-size", default="512KiB")
    ap.add_argument("--rate", type=int, default=256 << 10)
    a = ap.parse_args()
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    host, port = endpoint.split("://")[1].split(":")
    bucket = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
    url = f"s3://{bucket}/bench/slow-link-{a.rows}-{a.shard_size}"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "rows.jsonl")
        with open(src, "w") as f:
            for i in range(a.rows):
                f.write('{"id": %d, "text": "row %d"}\n' % (i, i))
        subprocess.run([a.ramjet, "pack", src, url, "--shard-size", a.shard_size], check=True, capture_output=True)
    env = dict(os.environ, AWS_ENDPOINT_URL=proxy((host, int(port)), a.rate))
    cs = [("first 64 only (before)", "0"), ("until the first shard (now)", "32MiB")]
    rows = {c[0]: [] for c in cs}
    for r in range(a.rounds):
        for name, rb in (cs if r % 2 == 0 else cs[::-1]):
            out, _, cpu, steal, _ = measure.run([a.ramjet, "stream", url, "--shuffle", "none", "--limit",
                                                 str(a.limit), "--ranged-bytes", rb, "--json"], env=env)
            m = json.loads(out[out.index("{"):])
            rows[name].append((m["elapsed_s"], m["ranged_samples"], cpu, steal))
        print(f"round {r}: " + ", ".join(f"{n}: {rows[n][-1][0]:.2f} s to sample {a.limit} "
                                         f"({rows[n][-1][1]} read one by one, {rows[n][-1][2]:.2f} CPU s, "
                                         f"steal {measure.fmt_steal(rows[n][-1][3])})" for n, _ in cs), flush=True)
    before, now = rows[cs[0][0]], rows[cs[1][0]]
    for n, _ in cs:
        print(f"{n}: median {statistics.median(x[0] for x in rows[n]):.2f} s to sample {a.limit}, "
              f"{statistics.median(x[2] for x in rows[n]):.2f} CPU s")
    ratios = [b[0] / n[0] for b, n in zip(before, now)]
    print(f"time to sample {a.limit}, before / now, per round: {', '.join('%.1f' % x for x in ratios)}; "
          f"median {statistics.median(ratios):.1f}x")


if __name__ == "__main__":
    main()
