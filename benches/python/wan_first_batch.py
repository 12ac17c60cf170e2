#!/usr/bin/env python3
"""Issue 14: where a cold first batch's time goes over tools/ramjet-bench's WAN-like link, for
one or more builds of the `ramjet` package, interleaved round by round.

Brings the link up (network namespace, veth, tbf, delay relay, a SeaweedFS started in the
namespace: root), warms the origin as the bench does, then in each round runs, for every build
in turn, one fresh Python process that times the first batch of `ramjet.StreamingDataset` with
the bench's settings (batch 8, 224x224 RandomResizedCrop, the default shard-block shuffle, an
empty cache). The engine's debug events (RAMJET_LOG) give each stage, in ms after the loader
started:

  manifest   the manifest read (a connection, then one GET: two round trips)
  read       the first batch's samples all read (index entries, then records: two more)
  decode     how long its decode took, and when it was handed out
  CPU        the process's CPU seconds from the dataset's creation to the first batch
  (builds from 2026-11-25 afternoon on also give the decode thread's own CPU ms and page faults
  during the first batch's decode: a decode that waited for a core, or one that faulted)

  hedges     the small ranged reads that ran late and were hedged with a second request

Usage (tools/env.sh sourced, as root; the dataset of a `tools/ramjet-bench --link wan` run):
  benches/python/wan_first_batch.py [--rounds 12] [--pkg NAME=DIR ...] [--set NAME:VAR=VALUE ...]
                                    [--out FILE.json] [--logs DIR]

Each --pkg puts DIR first on the child's PYTHONPATH (a build installed there with
`pip install --no-deps --target DIR ramjet-*.whl`); without any, the installed package runs.
Each --set gives the child of build NAME an environment variable (a build named only there
runs the installed package): `--set off:RAMJET_HEDGE_BYTES=0 --set on:RAMJET_HEDGE_BYTES=1048576`
compares one setting, interleaved. --logs keeps each child's events (DIR/ROUND-NAME.log).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
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
t0, c0 = time.perf_counter(), time.process_time()
ds = ramjet.StreamingDataset(sys.argv[1], local=sys.argv[2], cache_limit="64GiB", batch_size=8, shuffle=True, seed=0,
                             image_size=224, augment="train", image_column="image", boxes_column="boxes")
next(iter(ds))
print(json.dumps({"ttfb_ms": (time.perf_counter() - t0) * 1e3, "cpu_s": time.process_time() - c0,
                  "package": ramjet.__file__}))
"""
EVENT = re.compile(r"^\s*([\d.]+)s\s+\w+ \S+: (.*)$")
STAGES = {
    "manifest": "stream: manifests read",
    "read": "loader: first batch read",
    "decoded": "loader: first batch decoded",
    "out": "loader: first batch handed out",
}


def first_batch(link, cache, pkg_dir, extra_env, log=None):
    shutil.rmtree(cache, ignore_errors=True)
    env = link.env() | {"RAMJET_LOG": "ramjet_engine=debug"} | extra_env
    if pkg_dir:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_dir, env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", FIRST_BATCH, URL, str(cache)], env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"the first batch failed:\n{out.stderr[-3000:]}")
    if log:
        log.write_text(out.stderr)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["hedges"] = out.stderr.count("hedged with a second request")
    for line in out.stderr.splitlines():
        m = EVENT.match(line)
        if not m:
            continue
        for name, text in STAGES.items():
            if text in m.group(2):
                got[name] = float(re.search(r"\bms=([\d.]+)", m.group(2)).group(1))
                for key, field in (("decode", "decode_ms"), ("decode_cpu", "cpu_ms"), ("decode_minflt", "minflt")):
                    d = re.search(rf"\b{field}=([\d.]+)", m.group(2))
                    if d:
                        got[key] = float(d.group(1))
    return got


def med(rows, key, fmt):
    got = [x[key] for x in rows if key in x]
    return format(statistics.median(got), fmt) if got else "-"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--pkg", action="append", default=[], help="NAME=DIR: a build of the package in DIR")
    p.add_argument("--set", action="append", default=[], help="NAME:VAR=VALUE: an environment variable for NAME")
    p.add_argument("--out", type=Path)
    p.add_argument("--logs", type=Path, help="a folder for each child's events")
    a = p.parse_args()
    if a.logs:
        a.logs.mkdir(parents=True, exist_ok=True)
    builds = [tuple(x.split("=", 1)) for x in a.pkg]
    envs = {}
    for x in a.set:
        name, _, kv = x.partition(":")
        var, eq, value = kv.partition("=")
        if not (name and var and eq):
            raise SystemExit(f"--set {x!r}: expected NAME:VAR=VALUE")
        if name not in (b[0] for b in builds):
            builds.append((name, ""))
        envs.setdefault(name, {})[var] = value
    builds = builds or [("installed", "")]
    data = rb.Data(5315, 64)
    rows = []
    link = rb.wan_up("200mbit", 20.0)
    try:
        data.warm_origin(link)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(a.rounds):
                for name, pkg in builds:
                    log = a.logs / f"{r + 1:02d}-{name}.log" if a.logs else None
                    got = first_batch(link, Path(tmp) / "cache", pkg, envs.get(name, {}), log)
                    rows.append({"round": r, "build": name, **got})
                    stages = " ".join(f"{k} {got[k]:.0f}" for k in ("manifest", "read", "decode", "out") if k in got)
                    stages += f" ms, {got['hedges']} hedged"
                    if "decode_cpu" in got:
                        stages += f"; decode thread {got['decode_cpu']:.1f} CPU ms, {got['decode_minflt']:.0f} faults"
                    print(f"round {r + 1} {name}: first batch {got['ttfb_ms']:.0f} ms, {got['cpu_s']:.3f} CPU s "
                          f"({stages})", flush=True)
    finally:
        rb.wan_down(link)
    print()
    print("| build | first batch, median (ms) | slowest (ms) | decode, median (ms) | decodes over 15 ms | "
          "CPU s per first batch, median | decode thread CPU ms, median | its page faults, median | hedged reads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, _ in builds:
        mine = [x for x in rows if x["build"] == name]
        ttfb = [x["ttfb_ms"] for x in mine]
        dec = [x["decode"] for x in mine if "decode" in x]
        print(f"| {name} | {statistics.median(ttfb):.0f} | {max(ttfb):.0f} | "
              f"{statistics.median(dec):.1f} | {sum(d > 15 for d in dec)} of {len(dec)} | "
              f"{statistics.median(x['cpu_s'] for x in mine):.3f} | {med(mine, 'decode_cpu', '.1f')} | "
              f"{med(mine, 'decode_minflt', '.0f')} | {sum(x['hedges'] for x in mine)} |")
    if len(builds) > 1:
        base = builds[0][0]
        for name, _ in builds[1:]:
            per = []
            for r in range(a.rounds):
                x = next(x["ttfb_ms"] for x in rows if x["round"] == r and x["build"] == base)
                y = next(x["ttfb_ms"] for x in rows if x["round"] == r and x["build"] == name)
                per.append(x / y)
            print(f"\n{base} / {name}, first batch, per round: " + ", ".join(f"{v:.2f}" for v in per) +
                  f" (median {statistics.median(per):.2f})")
    if a.out:
        a.out.write_text(json.dumps({"builds": dict(builds), "env": envs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
