"""Real full disks: a 2 MiB tmpfs (mounted here; root) under the stream's cache, a pack's
output, a saved state and the host daemon's cache, so the kernel's own ENOSPC meets each write
(the Rust suite injects one into `Cache::insert`; this is the filesystem's). Each is a clear
error naming the path, or the data served uncached; and nothing corrupt is left, checked after:
no partial shard under a cache's `shards/`, no manifest of a pack that did not finish, the last
good state intact."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from ramjet_cli import RAMJET, run

SAMPLES = 80  # about 6 MB of JPEGs: three times the disk


@pytest.fixture
def small(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("the full-disk tests mount a tmpfs and need root")
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], check=True, timeout=30)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False, timeout=30)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("fulldisk")
    run("synth", str(d / "raw"), "--samples", str(SAMPLES))
    run("pack", str(d / "raw"), str(d / "packed"), "--shard-size", "512KiB")
    return d


def ramjet(*args, timeout=300):
    return subprocess.run([RAMJET, *args], capture_output=True, text=True, timeout=timeout)


def fill(d):
    """Fills the filesystem of `d` to its last byte (unbuffered writes, smaller and smaller)."""
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for n in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * n)
            except OSError:
                pass
    finally:
        os.close(fd)


def whole_shards_only(cache):
    """Every file under a cache's `shards/` is whole: its size is the one its name gives."""
    files = list((cache / "shards").glob("*")) if (cache / "shards").exists() else []
    for f in files:
        m = re.fullmatch(r"[0-9a-f]{16}-(\d+)\.rjs", f.name)
        assert m, f"a file that is not a whole shard under shards/: {f.name}"
        assert f.stat().st_size == int(m.group(1)), f"a partial shard: {f}"
    return len(files)


def lines(p):
    return Path(p).read_text().splitlines()


def test_a_pack_onto_a_full_disk_fails_naming_the_path_and_leaves_no_dataset(data, small):
    out = small / "out"
    o = ramjet("pack", str(data / "raw"), str(out), "--shard-size", "512KiB")
    assert o.returncode != 0, o.stdout + o.stderr
    assert "No space left on device" in o.stderr and str(out) in o.stderr, o.stderr
    assert not (out / "manifest.json").exists(), "a pack that did not finish left a manifest"
    v = ramjet("verify", str(out))
    assert v.returncode != 0


def test_a_stream_whose_cache_disk_fills_serves_the_rest_uncached(data, small, tmp_path):
    clean, full = tmp_path / "clean.txt", tmp_path / "full.txt"
    run("stream", str(data / "packed"), "--seed", "4", "--out", str(clean))
    cache = small / "cache"
    o = ramjet("stream", str(data / "packed"), "--seed", "4", "--out", str(full), "--cache-dir", str(cache))
    assert o.returncode == 0, o.stderr
    assert lines(full) == lines(clean) and len(lines(clean)) == SAMPLES
    kept = whole_shards_only(cache)
    assert 0 < kept < 12, f"{kept} shards cached on a 2 MiB disk"
    # Warm: the cached shards serve, the others stream again; the same samples.
    warm = tmp_path / "warm.txt"
    run("stream", str(data / "packed"), "--seed", "4", "--out", str(warm), "--cache-dir", str(cache))
    assert lines(warm) == lines(clean)
    whole_shards_only(cache)


def test_a_state_that_cannot_be_saved_is_an_error_naming_it_and_the_last_one_stays(data, small, tmp_path):
    state, out = small / "state.json", tmp_path / "out.txt"
    run("stream", str(data / "packed"), "--out", str(out), "--state", str(state), "--limit", "7")
    saved = json.loads(state.read_text())
    fill(small)
    o = ramjet("stream", str(data / "packed"), "--out", str(out), "--state", str(state), "--resume", "--limit", "20")
    assert o.returncode != 0, o.stdout + o.stderr
    assert "No space left on device" in o.stderr and str(state) in o.stderr, o.stderr
    assert json.loads(state.read_text()) == saved, "the last good state was damaged"
    os.remove(small / "filler")
    # With room again, the run resumes from that state and ends as an uninterrupted one.
    run("stream", str(data / "packed"), "--out", str(out), "--state", str(state), "--resume")
    whole = tmp_path / "whole.txt"
    run("stream", str(data / "packed"), "--out", str(whole))
    assert lines(out) == lines(whole)


def test_the_host_daemons_full_cache_disk_serves_uncached(data, small, tmp_path):
    sock = tmp_path / "d.sock"
    cache = small / "dcache"
    d = subprocess.Popen([RAMJET, "serve", "--socket", str(sock), "--cache-dir", str(cache)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert d.poll() is None and time.monotonic() < deadline, d.stderr.read() if d.poll() is not None else "no socket"
            time.sleep(0.05)
        clean, got = tmp_path / "clean.txt", tmp_path / "got.txt"
        run("stream", str(data / "packed"), "--seed", "2", "--out", str(clean))
        for _ in range(2):  # cold, then warm from what the daemon could keep
            run("stream", str(data / "packed"), "--seed", "2", "--out", str(got), "--daemon", str(sock))
            assert lines(got) == lines(clean)
        assert d.poll() is None, "the daemon died on its full disk"
    finally:
        d.terminate()
        d.wait(timeout=30)
    assert 0 < whole_shards_only(cache) < 12
