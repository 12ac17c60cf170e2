#!/usr/bin/env python3
"""Issue 14: is the slower first cold round over the WAN-like link the server's first touch of
the records' data? For each mode named on the command line, brings tools/ramjet-bench's
WAN-like link up (root), warms the origin as the bench does (the first byte of every object),
with `every-mib` also reads one byte of every MiB of every object, then times the first 8
samples of `ramjet stream` (release build, empty cache, a fresh process each time) three
times for the global and the block shuffle, and takes the link down.

Usage (tools/env.sh sourced, as root; the dataset is ramjet-bench's, uploaded by a
`tools/ramjet-bench --link wan` run):
  benches/python/wan_cold_touch.py first-byte every-mib
"""
import concurrent.futures as cf
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benches/python"))
sys.path.insert(0, str(ROOT / "benches/python"))
import measure  # noqa: E402 - the shared measuring rules
import ramjet_bench as rb  # noqa: E402 - the WAN-like link

URL = "s3://ramjet/bench/ramjet-bench/5315-64m/ramjet-rst32"
cache = Path(tempfile.mkdtemp(prefix="wancold-"))


def first(link, shuffle):
    shutil.rmtree(cache, ignore_errors=True)
    out, wall, cpu, steal, _ = measure.run([str(ROOT / "target/release/ramjet"), "stream", URL, "--cache-dir", str(cache),
                                           "--limit", "8", "--json", "--shuffle", shuffle], env=link.env())
    return json.loads(out[out.index("{"):])["first_sample_s"]


def every_mib(link, data):
    c = rb.s3_client(link.endpoint)
    keys = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=rb.BUCKET, Prefix=data.prefix + "/"):
        keys += [(o["Key"], o["Size"]) for o in page.get("Contents", []) if o["Size"] > 0]
    jobs = [(k, off) for k, s in keys for off in range(0, s, 1 << 20)]

    def get(j):
        c.get_object(Bucket=rb.BUCKET, Key=j[0], Range=f"bytes={j[1]}-{j[1]}")["Body"].read()
    t = time.time()
    with cf.ThreadPoolExecutor(32) as ex:
        list(ex.map(get, jobs))
    return len(jobs), time.time() - t


data = rb.Data(5315, 64)
for mode in sys.argv[1:]:
    link = rb.wan_up("200mbit", 20.0)
    try:
        data.warm_origin(link)
        if mode == "every-mib":
            print("every MiB:", every_mib(link, data), flush=True)
        for shuffle in ("global", "block"):
            ts = [first(link, shuffle) for _ in range(3)]
            print(mode, shuffle, " ".join(f"{t*1e3:.0f} ms" for t in ts), flush=True)
    finally:
        rb.wan_down(link)
shutil.rmtree(cache, ignore_errors=True)
