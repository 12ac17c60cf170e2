"""The ramjet CLI as the Python tests run it: the binary (`RAMJET_BIN`, else the debug build)
and `run`, which fails the test with the command's output when it exits non-zero."""

import os
import subprocess
from pathlib import Path

RAMJET = os.environ.get("RAMJET_BIN") or str(Path(__file__).resolve().parents[2] / "target/debug/ramjet")


def run(*args):
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
