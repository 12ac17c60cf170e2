"""The benchmarks' measuring rules (benches/python/measure.py): CPU of a process tree with its
workers, the steal share, rotation of the contenders, and no verdict below three rounds."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches/python"
sys.path.insert(0, str(BENCHES))
import measure  # noqa: E402

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


TREE = r"""
import multiprocessing as mp, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import measure

def burn(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass

def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

# A process outside the tree: started by a shell that exits at once, so that it is reparented
# away from this process (a child, even a live one, would be in the tree). Waited for inside
# the measured window, so that all its burning falls in it.
sh = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" >/dev/null 2>&1 & echo $!', sys.argv[2]],
                    capture_output=True, text=True, check=True)
outsider = int(sh.stdout)
with measure.Meter() as m:
    ctx = mp.get_context("fork")
    done = ctx.Event()
    live = ctx.Process(target=lambda: (burn(0.4), done.set(), time.sleep(30)))
    live.start()
    reaped = ctx.Process(target=burn, args=(0.4,))
    reaped.start()
    reaped.join()
    assert done.wait(30)
    with_live = measure.tree_cpu_s(os.getpid()) - m._c
    deadline = time.monotonic() + 60
    while running(outsider):
        assert time.monotonic() < deadline, "the outsider did not end"
        time.sleep(0.01)
live.kill()
live.join()
print(with_live, m.cpu_s, m.steal, m.others * m.wall_s * (os.cpu_count() or 1))
"""


def test_tree_cpu_counts_live_and_reaped_workers():
    # A live worker (like a DataLoader's persistent one) and one that exits and is joined both
    # count; a process outside the tree does not, and its CPU is the other load. Run in a fresh
    # process, so that nothing of this test session (its threads, its other children) is in the
    # tree.
    out = subprocess.run([sys.executable, "-c", TREE, str(BENCHES), BURN.format(s=0.6)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with_live, total, steal, others_cpu_s = (float(x) for x in out.stdout.split())
    assert 0.75 <= with_live < 1.3, with_live
    assert 0.75 <= total < 1.3, total
    assert 0.0 <= steal <= 1.0
    # The outsider's 0.6 CPU s (less its start, before the window) are the load of another
    # process, not the tree's: the share times the machine's capacity (whatever its core count)
    # gives them back.
    assert others_cpu_s >= 0.4, others_cpu_s


def test_run_reports_the_child_cpu_and_fails_loudly():
    out, wall, cpu, steal, rss = measure.run([sys.executable, "-c", BURN.format(s=0.3) + "print('done')"])
    assert out.strip() == "done"
    assert cpu >= 0.3 and wall >= 0.3 and rss > 1 and 0.0 <= steal <= 1.0
    with pytest.raises(RuntimeError, match="exit 3.*boom"):
        measure.run([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])


def test_steal_share_reads_proc_stat():
    steal, total, busy = measure.proc_stat()
    assert 0 <= steal <= total and 0 <= busy <= total
    assert measure.steal_share((10, 1000), (30, 1100)) == pytest.approx(0.2)
    assert measure.fmt_steal(0.2) == "20%!" and measure.fmt_steal(0.05) == "5%"


def test_rounds_rotate_ratio_and_verdict_only_from_three():
    assert [measure.order("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    res = measure.Rounds("images")
    for r in range(2):
        res.add(r, "ramjet", wall_s=1.0, units=900, cpu_s=0.9, steal=0.0)
        res.add(r, "peer", wall_s=1.0, units=300, cpu_s=1.5, steal=0.2 * r)
    assert res.ratios("ramjet", "peer") == [3.0, 3.0]
    assert res.median("peer", "cpu_per_1000") == pytest.approx(5.0)
    assert res.flagged() == [1]
    assert res.verdict(True) is None
    assert measure.verdict_text(res.verdict(True), res.rounds()) == "no verdict (2 rounds; 3 needed)"
    res.add(2, "ramjet", wall_s=1.0, units=900, cpu_s=0.9, steal=0.0)
    assert res.rounds() == 2  # the peer has only two rounds: still no verdict
    res.add(2, "peer", wall_s=1.0, units=300, cpu_s=1.5, steal=0.0)
    # Round 1's steal share (20%) is above the flag: no verdict while a flagged round counts.
    assert res.verdict(True) is None
    assert "1 of 3 rounds under steal" in measure.verdict_text(None, 3, len(res.flagged()))
    clean = measure.Rounds("images")
    for r in range(3):
        clean.add(r, "ramjet", wall_s=1.0, units=900, cpu_s=0.9, steal=0.0)
        clean.add(r, "peer", wall_s=1.0, units=300, cpu_s=1.5, steal=0.0, others=0.05)
    assert clean.verdict(True) == "met" and clean.verdict(False) == "missed"
    clean.add(3, "peer", wall_s=1.0, units=300, cpu_s=1.5, steal=0.0, others=0.4)  # a build ran beside it
    assert clean.flagged() == [3] and clean.verdict(True) is None


def test_the_bench_counts_no_warm_up_round_but_shows_it():
    """ramjet-bench's cold check uses the counted cold rounds only; a warm-up round's ratio is
    printed beside them, and a bad one does not turn the verdict."""
    sys.path.insert(0, str(BENCHES))
    import ramjet_bench as rb

    def row(loader, phase, r, ttfb):
        return dict(link="wan", loader=loader, phase=phase, round=r, ttfb_s=ttfb, steal=0.0, others=0.0,
                    scenario="streaming, cold")

    rows = [row("ramjet", "warmup-cold", 0, 0.5), row("boto3", "warmup-cold", 0, 2.0)]
    rows += [row(lo, "cold", r, t) for r in range(3) for lo, t in (("ramjet", 0.1), ("boto3", 2.0))]
    (cold,) = [c for c in rb.checks(rows) if "cold time" in c["target"]]
    assert cold["verdict"] == "met" and cold["rounds"] == 3, cold
    assert "20.0x, 20.0x, 20.0x" in cold["measured"] and "warm-up round, not counted: 4.0x" in cold["measured"], cold
    # A counted round as slow as that warm-up round misses.
    rows[2]["ttfb_s"] = 0.5
    (cold,) = [c for c in rb.checks(rows) if "cold time" in c["target"]]
    assert cold["verdict"] == "missed", cold


def test_a_ramjet_window_holds_one_epochs_decodes_and_leaves_nothing_behind(tmp_path):
    """A real ramjet loader runs on into the next epoch after its last batch. A window ended by
    measure.run_on_end and read after measure.wait_idle holds exactly one epoch's decodes, and
    nothing of it is left to run in the next contender's window."""
    import os
    import resource
    import time

    import ramjet

    cli = os.environ.get("RAMJET_BIN") or str(BENCHES.parents[1] / "target/debug/ramjet")
    n = 96
    for args in (["synth", str(tmp_path / "synth"), "--samples", str(n)],
                 ["pack", str(tmp_path / "synth"), str(tmp_path / "packed"), "--shard-size", "1MiB"]):
        out = subprocess.run([cli, *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    # The run-on is the prefetch queue's depth: pinned here, so each epoch's run-on is the same
    # (tuned, it follows the machine's speed and can differ from one epoch to the next).
    ds = ramjet.StreamingDataset(str(tmp_path / "packed"), local=None, batch_size=8, shuffle=True, seed=0,
                                 image_size=64, augment="train", boxes_column=None, prefetch_batches=2,
                                 num_threads=2)

    def decoded():
        return int(ds.metrics()["images_decoded"])

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    ds.set_epoch(0)
    assert sum(b["image"].shape[0] for b in ds) == n
    measure.run_on_end(ds, quiet_s=0.3)
    # The run-on this is about: past the epoch's last image, the next epoch's first batches.
    assert decoded() - n >= 8, decoded()
    measure.wait_idle()
    for ep in (1, 2):
        ds.set_epoch(ep)
        before = decoded()
        with measure.Meter() as m:
            got = sum(b["image"].shape[0] for b in ds)
            loop_end = time.perf_counter()
            m.end = measure.run_on_end(ds, quiet_s=0.3)
            at_end = decoded()
            measure.wait_idle()
        # One epoch's decodes, all of them done when run_on_end returned.
        assert got == n and at_end - before == n and decoded() == at_end, (ep, at_end - before, decoded() - before)
        # The wall clock ends at the last decode: after the loop, before the quiet wait.
        assert loop_end <= m.end < loop_end + m.wall_s and m.wall_s < time.perf_counter() - m._t - 0.04
        c = cpu()
        time.sleep(0.3)
        # Idle after the window: a decode left running would spend most of the 0.3 s on a core.
        assert cpu() - c < 0.1, f"epoch {ep}: {cpu() - c:.3f} s of CPU after the window"
