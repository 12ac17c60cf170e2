#!/usr/bin/env python3
"""The device check's rehearsal (issue 68): run.py over a CPU bundle with steps made to fail
or hang in turn, as a GPU's first contact might make them, and checks that the run keeps
every other step's figures and ends under its deadline.

  python3 tools/device-check/rehearse.py --bundle B --out DIR [--python PY]

Four runs (about 4 minutes on 2 cores):
  A, B  every step fails or hangs in one of the two runs (a hang where the step's limit in the
        dry run is short): the injected steps record an rc and an error, and every other step
        has rc 0 (or is skipped for want of a GPU) and its figures
  C     a hang with a 20 s deadline: the run ends within the deadline, the hang killed with
        the child it started, the later steps "skipped: no time left"
  D     SIGTERM while a step hangs: the step's whole process group is killed (its child
        too), the step is recorded as interrupted, summary.json is complete
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import STEPS  # noqa: E402  (the step list of the script under rehearsal)

#: Two runs; every step is injected in exactly one of them.
ROUNDS = [
    {"env": "fail", "nvjpeg": "hang", "py_gpu": "fail", "feed": "fail"},
    {"rust_gpu": "fail", "kernel": "fail", "cpu_scale": "fail", "sanitizer": "hang"},
]
#: Figures each step must keep in the CPU dry run when it is not the one failing.
FIGURES = {
    "env": "devices",
    "rust_gpu": "rust_tests_passed",
    "py_gpu": "py_tests_passed",
    "kernel": "kernel_rrc_u8_img_s",
    "feed": "small_fed_ratio",
    "cpu_scale": "ramjet_t2_img_s",
}
HANG_MARK = "time.sleep(3600)"


def run(a, out: Path, *extra, deadline=400, term_after=None) -> tuple:
    argv = [a.python, str(HERE / "run.py"), "--bundle", str(a.bundle), "--out", str(out), "--cpu",
            "--python", a.python, "--deadline", str(deadline), *extra]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if term_after is not None:
        time.sleep(term_after)
        p.send_signal(signal.SIGTERM)
    text, _ = p.communicate(timeout=deadline + 60)
    return p.returncode, time.monotonic() - t0, json.loads((out / "summary.json").read_text()), text


def hangs_left() -> list:
    """Processes still running the rehearsal's hang."""
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if HANG_MARK in cmd and "rehearse.py" not in cmd:
                left.append(f"{d.name}: {cmd[:120]}")
    return left


def check(cond: bool, what: str, doc=None) -> None:
    if not cond:
        raise SystemExit(f"rehearsal: {what}\n{json.dumps(doc, indent=1)[:4000] if doc else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args()
    names = [n for n, _, _ in STEPS]
    check(sorted(k for r in ROUNDS for k in r) == sorted(names), f"the rounds inject {ROUNDS}, the steps are {names}")
    for i, inject in enumerate(ROUNDS):
        out = a.out / f"round-{'AB'[i]}"
        extra = [x for step, mode in inject.items() for x in ("--inject", f"{step}={mode}")]
        rc, wall, doc, _ = run(a, out, *extra)
        steps = doc["steps"]
        check(rc == 1 and set(steps) == set(names), f"run {'AB'[i]}: rc {rc}, steps {list(steps)}", doc)
        check(wall < doc["deadline_s"], f"run {'AB'[i]} took {wall:.0f} s", doc)
        for name, s in steps.items():
            if name in inject:
                check(s["rc"] not in (0, None) and s.get("error"), f"injected {name} has no rc and error", s)
                if inject[name] == "hang":
                    check(s["rc"] == 124 and "overran" in s["error"], f"the hang in {name} was not cut", s)
            else:
                check(s["rc"] == 0 or s.get("skipped") == "no GPU", f"{name} beside a failing step: {s}", doc)
                if name in FIGURES:
                    check(FIGURES[name] in s["figures"], f"{name} lost its figure {FIGURES[name]}", s)
        check(not hangs_left(), f"run {'AB'[i]} left a hang running: {hangs_left()}")
        print(f"rehearsal {'AB'[i]}: injected {inject}: {wall:.0f} s, every other step kept its figures", flush=True)
    rc, wall, doc, _ = run(a, a.out / "round-C", "--inject", "env=hang", deadline=20)
    check(wall < 20 + 10, f"run C took {wall:.0f} s against a 20 s deadline", doc)
    check(doc["steps"]["env"]["rc"] == 124, "run C: the hang was not cut at the deadline", doc)
    rest = [s.get("skipped") for n, s in doc["steps"].items() if n != "env"]
    check(all(r in ("no time left", "no GPU") for r in rest), f"run C: later steps ran past the deadline: {rest}", doc)
    check(not hangs_left(), f"run C left a hang running: {hangs_left()}")
    print(f"rehearsal C: a hang under a 20 s deadline: ended in {wall:.0f} s", flush=True)
    rc, wall, doc, _ = run(a, a.out / "round-D", "--inject", "env=hang", term_after=8)
    check(rc == 128 + signal.SIGTERM, f"run D: rc {rc} after SIGTERM", doc)
    check(doc["steps"].get("env", {}).get("interrupted") == "SIGTERM", "run D: the step is not marked interrupted", doc)
    time.sleep(0.5)
    check(not hangs_left(), f"run D: SIGTERM left the step's processes running: {hangs_left()}")
    print(f"rehearsal D: SIGTERM during a hang: the step's group killed, summary kept ({wall:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
