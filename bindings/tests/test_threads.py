"""The process's thread set is fixed: four datasets alive at once share one network runtime,
one decode pool, one I/O core and one cache writer, and every thread ramjet starts carries a
`ramjet-` name."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RAMJET = os.environ.get("RAMJET_BIN") or str(Path(__file__).resolve().parents[2] / "target/debug/ramjet")

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch  # its own threads are made before the baseline
    torch.zeros(4) + 1

    def threads():
        out = {}
        for t in os.listdir("/proc/self/task"):
            try:
                out[t] = open(f"/proc/self/task/{t}/comm").read().strip()
            except OSError:
                pass
        return out

    before = threads()
    import ramjet
    cache = sys.argv[1]
    urls = sys.argv[2:]
    alive, counts = [], []
    for u in urls:
        ds = ramjet.StreamingDataset(u, cache, batch_size=4, image_size=32, shuffle=False)
        it = iter(ds)
        next(it)
        alive.append((ds, it))
        counts.append(sum(1 for n in threads().values() if n.startswith("ramjet-")))
    # Used in turn, all alive.
    for _ in range(2):
        for _, it in alive:
            next(it)
    now = threads()
    new = {t: n for t, n in now.items() if t not in before}
    print(json.dumps({
        "cores": len(os.sched_getaffinity(0)),
        "ramjet": sorted(n for n in now.values() if n.startswith("ramjet-")),
        "unnamed_new": sorted(n for n in new.values() if not n.startswith("ramjet-")),
        "after_each": counts,
    }))
    """
)


def run(*args):
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_four_datasets_alive_hold_at_most_two_per_core_plus_eight_named_threads(tmp_path):
    run("synth", str(tmp_path / "synth"), "--samples", "64")
    urls = []
    for i in range(4):
        d = tmp_path / f"packed{i}"
        run("pack", str(tmp_path / "synth"), str(d), "--shard-size", "100KiB")
        urls.append(str(d))
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "cache"), *urls],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    cores = got["cores"]
    assert len(got["ramjet"]) <= 2 * cores + 8, got
    # Every thread ramjet started is named; the kernel's io_uring workers (`iou-wrk-*`, which
    # the kernel names) are capped at one per operation a ring has in flight (8 per I/O-core
    # ring, one per core), and at 2 for each of the 2 cache writers' own rings.
    kernel = [n for n in got["unnamed_new"] if n.startswith("iou-wrk-")]
    assert [n for n in got["unnamed_new"] if not n.startswith("iou-wrk-")] == [], got
    assert len(kernel) <= 8 * cores + 2 * 2, got
    # The set does not grow with the datasets: the fourth adds no thread of its own beyond
    # what the shared runtime's blocking pool may still start.
    first, last = got["after_each"][0], got["after_each"][-1]
    assert last - first <= 4, got
    names = set(n.rsplit("-", 1)[0] if n[-1].isdigit() else n for n in got["ramjet"])
    assert {"ramjet-net", "ramjet-decode"} <= names, got
