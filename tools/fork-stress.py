#!/usr/bin/env python3
"""Runs the forked-workers scenario of bindings/tests/test_hardening.py (a parent whose
embedded daemon fetches while persistent DataLoader workers are forked and read through it)
many times, with both cores kept busy by spinning processes, and catches a hang.

Each run gets a fresh cache and socket and a deadline; a run past it has every thread of the
parent and its workers dumped (py-spy --native, then gdb) into the log, and is killed. A line
of progress is printed after every run; the summary says runs, hangs, failures and the run
times (median, max).

Usage (from the repository root, the local S3 server running, tools/env.sh sourced):
    .venv/bin/python tools/fork-stress.py --runs 300 --log /tmp/fork-stress.log
"""

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "tests"))
from test_hardening import FORKED  # noqa: E402  (the scenario itself, not a copy)

RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")


def spin() -> None:
    while True:
        pass


def tree(pid: int) -> list:
    """`pid` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        todo.extend(int(k) for k in kids)
    return out


def dump(pid: int, log) -> None:
    for p in tree(pid):
        log.write(f"\n===== pid {p}: {Path(f'/proc/{p}/cmdline').read_bytes()[:200]!r}\n")
        for cmd in (
            [str(ROOT / ".venv/bin/py-spy"), "dump", "--native", "--pid", str(p)],
            ["gdb", "-p", str(p), "-batch", "-ex", "thread apply all bt"],
        ):
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                log.write(r.stdout[-200_000:] + r.stderr[-5_000:])
            except (OSError, subprocess.TimeoutExpired) as e:
                log.write(f"{cmd[0]}: {e}\n")
        log.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds before a run counts as hung")
    ap.add_argument("--spinners", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--log", default="/tmp/fork-stress.log")
    a = ap.parse_args()
    if "AWS_ENDPOINT_URL" not in os.environ:
        sys.exit("the local S3 server is not configured: source tools/env.sh and start tools/s3-server.sh")
    work = Path(tempfile.mkdtemp(prefix="fork-stress-"))
    subprocess.run([RAMJET, "synth", str(work / "synth"), "--samples", "48"], check=True, capture_output=True)
    urls = []
    for name in "abc":
        u = f"s3://{BUCKET}/fork-stress/{name}-{uuid.uuid4().hex[:8]}"
        subprocess.run([RAMJET, "pack", str(work / "synth"), u, "--shard-size", "200KiB"], check=True, capture_output=True)
        urls.append(u)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(a.spinners)]
    for s in spinners:
        s.start()
    times, hangs, failures = [], 0, 0
    t_start = time.monotonic()
    with open(a.log, "w") as log:
        try:
            for i in range(a.runs):
                run_dir = work / f"run{i}"
                (run_dir / "reports").mkdir(parents=True)
                t0 = time.monotonic()
                p = subprocess.Popen(
                    [sys.executable, "-c", FORKED, *urls, str(run_dir / "cache"), str(run_dir / "d.sock"), str(run_dir / "reports")],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                try:
                    out, err = p.communicate(timeout=a.deadline)
                    took = time.monotonic() - t0
                    times.append(took)
                    ok = p.returncode == 0 and json.loads(out.strip().splitlines()[-1]) == {
                        "a": 48,
                        "b": 48,
                        "c": 48,
                        "b2": 48,
                    }
                    if not ok:
                        failures += 1
                        log.write(f"\n##### run {i} failed (exit {p.returncode})\n{out[-2000:]}\n{err[-8000:]}\n")
                    verdict = "ok" if ok else "FAILED"
                except subprocess.TimeoutExpired:
                    hangs += 1
                    log.write(f"\n##### run {i} hung past {a.deadline} s\n")
                    dump(p.pid, log)
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
                    verdict = "HUNG (stacks in the log)"
                    took = time.monotonic() - t0
                shutil.rmtree(run_dir, ignore_errors=True)
                print(
                    f"run {i + 1}/{a.runs}: {verdict} in {took:.1f} s "
                    f"(elapsed {time.monotonic() - t_start:.0f} s, hangs {hangs}, failures {failures})",
                    flush=True,
                )
        finally:
            for s in spinners:
                s.kill()
    summary = {
        "runs": len(times) + hangs,
        "hangs": hangs,
        "failures": failures,
        "spinners": a.spinners,
        "median_s": round(statistics.median(times), 2) if times else None,
        "max_s": round(max(times), 2) if times else None,
    }
    print(json.dumps(summary))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if hangs or failures else 0


if __name__ == "__main__":
    sys.exit(main())
