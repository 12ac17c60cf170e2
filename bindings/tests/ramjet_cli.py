"""The ramjet CLI as the Python tests run it: the binary (`RAMJET_BIN`, else the debug build)
and `run`, which fails the test with the command's output when it exits non-zero or runs past
its timeout."""

import os
import subprocess
from pathlib import Path

RAMJET = os.environ.get("RAMJET_BIN") or str(Path(__file__).resolve().parents[2] / "target/debug/ramjet")


def run(*args, timeout=600):
    # Bounded on its own: a CLI that hangs fails its test (TimeoutExpired names the command
    # line) and the run goes on, where pytest's timeout would end the run.
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
