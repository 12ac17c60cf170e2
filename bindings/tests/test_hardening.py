"""Hardening of the Python package on real files and processes: Ctrl-C interrupts every
blocking call (dataset index, inspect, verify, init), and a cache shared by a process and its
forked DataLoader workers under ramjet.init() never deadlocks."""

import _thread
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("hard")
    run("synth", str(root / "synth"), "--samples", "24")
    run("pack", str(root / "synth"), str(root / "packed"), "--shard-size", "400KiB")
    return root / "packed"


def blocked_copy(packed, tmp_path, what):
    """A copy of the packed set whose manifest or first shard is a FIFO: reading it blocks."""
    d = tmp_path / f"blocked-{what}"
    shutil.copytree(packed, d)
    if what == "manifest":
        target = d / "manifest.json"
    else:
        target = sorted((d / "shards").iterdir())[0]
    target.unlink()
    os.mkfifo(target)
    return d, target


def unblock(fifo, original):
    """Lets every reader blocked opening `fifo` go (they then read end of file) and puts the
    original file back in its place, so a read that starts later (a retry, a second range of
    the same shard) finds a file rather than blocking a thread of the process for good. A
    writer is held open while the file is swapped in, so no opener falls between the two."""
    try:
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return
    try:
        tmp = fifo.with_name(fifo.name + ".restore")
        shutil.copy(original, tmp)
        os.replace(tmp, fifo)
    finally:
        os.close(fd)


def assert_interrupts(call, release):
    """`call` blocks; a Ctrl-C (SIGINT to the main thread) after 1 s must end it at once.

    Python's own SIGINT handler is in place for the test (a library imported by an earlier test
    may have installed another, and `interrupt_main` does nothing under SIG_DFL or SIG_IGN).
    The wait is bounded: if the Ctrl-C has not ended the call after 20 s, `release()` lets the
    data through, so the call returns and the test fails, naming the handler, instead of
    hanging the suite."""
    handler = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, _thread.interrupt_main)
    backstop = threading.Timer(20.0, release)
    t0 = time.monotonic()
    timer.start()
    backstop.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    except pytest.fail.Exception:
        raise AssertionError(f"Ctrl-C did not end the call within 20 s (SIGINT's handler before the test: {handler!r})")
    finally:
        timer.cancel()
        backstop.cancel()
        signal.signal(signal.SIGINT, handler)
    took = time.monotonic() - t0
    assert took < 8, f"Ctrl-C took {took:.1f} s to interrupt"


@pytest.mark.parametrize(
    "call, blocked",
    [
        ("inspect", "manifest"),
        ("verify", "shard"),
        ("index", "shard"),
    ],
)
def test_ctrl_c_interrupts_a_call_blocked_on_its_data(packed, tmp_path, call, blocked):
    """Regression: inspect, verify and ds[i] waited with the GIL released but never let Python
    deliver signals: Ctrl-C did nothing until the data arrived."""
    d, fifo = blocked_copy(packed, tmp_path, blocked)
    original = packed / fifo.relative_to(d)
    calls = {
        "inspect": lambda: ramjet.inspect(str(d)),
        "verify": lambda: ramjet.verify(str(d)),
        "index": lambda: ramjet.StreamingDataset(str(d), batch_size=4, image_size=32, shuffle=False)[0],
    }
    try:
        assert_interrupts(calls[call], lambda: unblock(fifo, original))
    finally:
        unblock(fifo, original)


def test_ctrl_c_interrupts_init(tmp_path):
    # Another process holds the cache's admission lock: the embedded daemon cannot open it.
    cache = tmp_path / "cache"
    cache.mkdir()
    holder = open(cache / "lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        assert_interrupts(
            lambda: ramjet.init(str(cache), socket=str(tmp_path / "d.sock")),
            lambda: fcntl.flock(holder, fcntl.LOCK_UN),
        )
    finally:
        fcntl.flock(holder, fcntl.LOCK_UN)
        holder.close()


FORKED = textwrap.dedent(
    """
    import json, os, sys, threading, time, torch, ramjet
    urls, (cache, sock, reports) = sys.argv[1:4], sys.argv[4:7]

    class Reporting(ramjet.StreamingDataset):
        # Each worker writes its loader's counters when its share ends: the parent then knows
        # whether the workers read through the daemon or fell back to the origin.
        def __iter__(self):
            yield from super().__iter__()
            with open(os.path.join(reports, f"{os.getpid()}-{time.monotonic_ns()}.json"), "w") as f:
                json.dump(self.metrics(), f)

    ramjet.init(cache, socket=sock)
    count = lambda url: sum(len(b["_index"]) for b in ramjet.StreamingDataset(url, batch_size=4, image_size=32, shuffle=False))
    # The parent's daemon fetches A (taking the cache's fetch and admission locks over and over)
    # while persistent DataLoader workers are forked (explicitly: Python 3.14 defaults to
    # forkserver), reading B.
    got = {}
    t = threading.Thread(target=lambda: got.__setitem__("a", count(urls[0])))
    t.start()
    dl = torch.utils.data.DataLoader(
        Reporting(urls[1], batch_size=4, image_size=32, shuffle=False),
        batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="fork",
        timeout=120,
    )
    got["b"] = sum(len(b["_index"]) for b in dl)
    t.join()
    # The workers are still alive: the parent's daemon must still take every lock (C is cold).
    got["c"] = count(urls[2])
    got["b2"] = sum(len(b["_index"]) for b in dl)
    print(json.dumps(got))
    """
)


def run_bounded(args, timeout):
    """Runs `args` in a session of its own; past `timeout` the whole process group is killed
    and the test fails with the group's stacks (py-spy, when installed) and its output."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        stacks = ""
        spy = Path(sys.executable).with_name("py-spy")
        if spy.exists():
            d = subprocess.run([str(spy), "dump", "--native", "--pid", str(p.pid)], capture_output=True, text=True)
            stacks = d.stdout[-20000:]
        os.killpg(p.pid, 9)
        out, err = p.communicate()
        pytest.fail(f"{args[:3]} hung past {timeout} s\nstacks:\n{stacks}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}")


def test_a_cache_shared_with_forked_workers_under_init_never_deadlocks(tmp_path):
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    run("synth", str(tmp_path / "synth"), "--samples", "48")
    urls = []
    for name in "abc":
        u = f"s3://{BUCKET}/pytest-hard/{name}-{uuid.uuid4().hex[:8]}"
        run("pack", str(tmp_path / "synth"), u, "--shard-size", "200KiB")
        urls.append(u)
    reports = tmp_path / "reports"
    reports.mkdir()
    rc, out, err = run_bounded(
        [sys.executable, "-c", FORKED, *urls, str(tmp_path / "cache"), str(tmp_path / "d.sock"), str(reports)],
        timeout=240,
    )
    assert rc == 0, err[-4000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"a": 48, "b": 48, "c": 48, "b2": 48}, got
    # The workers read through the parent's daemon: none fell back to the origin.
    workers = [json.loads(f.read_text()) for f in reports.iterdir()]
    assert len(workers) == 4, f"expected 2 workers x 2 epochs of reports, got {len(workers)}"
    for m in workers:
        assert m["daemon_failures"] == 0 and m["origin_bytes"] == 0, m
    assert sum(m["daemon_origin"] + m["daemon_cache_local"] for m in workers) > 0, workers


def test_tampered_resume_state_raises_invalid_input_not_a_panic(packed):
    """Regression: resume state with a bad consumer index, duplicate consumers or
    consumed > len panicked in Rust (index out of bounds) or ended the epoch short."""
    ds = ramjet.StreamingDataset(str(packed), batch_size=4, image_size=32, shuffle=False)
    next(iter(ds))
    st = ds.state_dict()
    r = json.loads(st["resume"])
    r["progress"]["consumed"] = 10**9
    bad = ramjet.StreamingDataset(str(packed), batch_size=4, image_size=32, shuffle=False)
    bad.load_state_dict({**st, "resume": json.dumps(r)})
    with pytest.raises(ramjet.InvalidInputError, match="exceeds"):
        next(iter(bad))
    one = json.loads(ds._state)
    for edit, needle in [({"consumer": 7}, "consumer 7"), ({"delivered": 10**6}, "delivered")]:
        with pytest.raises(ramjet.InvalidInputError, match=needle):
            ramjet._ramjet.job_progress([json.dumps({**one, **edit})])
    two = {**one, "consumers": 2}
    with pytest.raises(ramjet.InvalidInputError, match="twice"):
        ramjet._ramjet.job_progress([json.dumps(two), json.dumps(two)])
