"""Issue 42's defects, pinned on real files and processes: a shard swapped at the origin never
yields a wrong sample (iteration and ``ds[i]``), every bad argument and bad resume state is an
``InvalidInputError`` naming it (never a panic, an abort or a raw Python error), the documented
``load_state_dict`` + ``set_epoch`` loop keeps its resume, and a plain path is the same dataset
to the host daemon as its ``file://`` URL."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ramjet
from ports import free_port

RAMJET = os.environ.get("RAMJET_BIN") or str(Path(__file__).resolve().parents[2] / "target/debug/ramjet")
N = 40


def run(*args):
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("robust")
    run("synth", str(root / "synth"), "--samples", str(N))
    run("pack", str(root / "synth"), str(root / "packed"), "--shard-size", "300KiB")
    return root / "packed"


def dataset(url, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("image_size", 32)
    kw.setdefault("shuffle", False)
    return ramjet.StreamingDataset(str(url), **kw)


def paths_by_index(url):
    """Every sample's `path` column by global index, from an untouched copy."""
    out = {}
    for b in dataset(url, image_size=None):
        for i, p in zip(b["_index"], b["path"]):
            out[int(i)] = p
    assert sorted(out) == list(range(N))
    return out


@pytest.mark.parametrize("donor", [2, "other"])
def test_a_swapped_shard_never_yields_a_wrong_sample(packed, tmp_path, donor):
    clean = paths_by_index(packed)
    d = tmp_path / "swapped"
    shutil.copytree(packed, d)
    m = json.loads((d / "manifest.json").read_text())
    assert len(m["shards"]) >= 3, m["shards"]
    victim = m["shards"][1]["key"]
    if donor == "other":
        # A shard of another dataset (other images, other labels).
        other = tmp_path / "other"
        run("synth", str(tmp_path / "osynth"), "--samples", "30", "--seed", "7")
        run("pack", str(tmp_path / "osynth"), str(other), "--shard-size", "300KiB")
        src = other / json.loads((other / "manifest.json").read_text())["shards"][0]["key"]
    else:
        src = d / m["shards"][donor]["key"]
    shutil.copy(src, d / victim)
    start = m["shards"][0]["samples"]
    bad = range(start, start + m["shards"][1]["samples"])

    # Random access: the victim's samples raise CorruptError naming it; every other is right.
    ds = dataset(d, image_size=None)
    for g in range(N):
        if g in bad:
            with pytest.raises(ramjet.CorruptError, match=victim.split("/")[-1]):
                ds[g]
        else:
            assert ds[g]["path"] == clean[g], g
    # Iteration: what is yielded before the error is right, and nothing of the victim.
    seen = []
    with pytest.raises(ramjet.CorruptError, match=victim.split("/")[-1]):
        for b in dataset(d, image_size=None):
            for i, p in zip(b["_index"], b["path"]):
                assert int(i) not in bad and p == clean[int(i)], (int(i), p)
                seen.append(int(i))
    assert len(seen) < N


def test_a_flipped_header_byte_ends_iteration_the_same_way_every_run(packed, tmp_path):
    d = tmp_path / "flipped"
    shutil.copytree(packed, d)
    key = json.loads((d / "manifest.json").read_text())["shards"][1]["key"]
    b = bytearray((d / key).read_bytes())
    b[16] ^= 0xFF
    (d / key).write_bytes(bytes(b))
    outcomes = []
    for _ in range(5):
        seen = []
        with pytest.raises(ramjet.CorruptError) as e:
            for batch in dataset(d, image_size=None):
                seen.extend(int(i) for i in batch["_index"])
        assert key.split("/")[-1] in str(e.value)
        outcomes.append(tuple(seen))
    assert len(set(outcomes)) == 1, [len(o) for o in outcomes]


BAD_ARGUMENTS = [
    ({"world_size": 0}, "world_size"),
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"rank": -1, "world_size": 2}, "rank"),
    ({"crop_fraction": -1}, "crop_fraction"),
    ({"crop_fraction": 0}, "crop_fraction"),
    ({"image_size": 100000}, "image_size"),
    ({"image_size": 0}, "image_size"),
    ({"image_size": (0, 32)}, "image_size"),
    ({"batch_size": 2**40}, "batch_size"),
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": "8"}, "batch_size"),
    ({"batch_size": 4096, "image_size": 4096}, "batch_size"),
    ({"normalize": True, "std": (0.2, 0.0, 0.2)}, "std"),
    ({"std": (0.2, float("nan"), 0.2)}, "std"),
    ({"mean": (0.5, 0.5)}, "mean"),
    ({"cache_limit": "abc", "local": "/tmp/ramjet-never-made"}, "cache_limit"),
    ({"cache_limit": 0, "local": "/tmp/ramjet-never-made"}, "cache_limit"),
    ({"cache_limit": -5, "local": "/tmp/ramjet-never-made"}, "cache_limit"),
    ({"scale": (0.5, 0.1)}, "scale"),
    ({"scale": (0.0, 1.0)}, "scale"),
    ({"ratio": (1.0, float("inf"))}, "ratio"),
    ({"flip": 2}, "flip"),
    ({"shuffle_window": 0}, "shuffle_window"),
    ({"shuffle_block": 0}, "shuffle_block"),
    ({"partitions": 0}, "partitions"),
    ({"seed": -1}, "seed"),
    ({"num_threads": 0}, "num_threads"),
    ({"prefetch_batches": -1}, "prefetch_batches"),
]


@pytest.mark.parametrize("kw, name", BAD_ARGUMENTS, ids=[f"{k}" for k, _ in BAD_ARGUMENTS])
def test_every_bad_argument_is_an_invalid_input_error_naming_it(packed, kw, name):
    with pytest.raises(ramjet.InvalidInputError, match=name):
        ds = dataset(packed, **kw)
        next(iter(ds))


ENGINE_CHECKS = textwrap.dedent(
    """
    import json, sys, ramjet
    from ramjet import _ramjet
    url = sys.argv[1]
    base = {"sources": [{"url": url}], "batch_size": 4,
            "image": {"width": 32, "height": 32, "augment": "eval", "crop_fraction": 0.875}}
    cases = {
        "world": {"topology": {"rank": 0, "world": 0, "worker": 0, "workers": 1, "local_rank": 0, "local_world": 1}},
        "rank": {"topology": {"rank": 3, "world": 2, "worker": 0, "workers": 1, "local_rank": 0, "local_world": 1}},
        "crop_fraction": {"image": {"width": 32, "height": 32, "augment": "eval", "crop_fraction": -1.0}},
        "image_size": {"image": {"width": 100000, "height": 32}},
        "batch_size": {"batch_size": 2**40},
        "std": {"image": {"width": 32, "height": 32, "float": True, "std": [0.2, 0.0, 0.2]}},
    }
    out = {}
    for name, change in cases.items():
        cfg = dict(base, **change)
        for make in (_ramjet.Loader, _ramjet.Reader):
            try:
                make(json.dumps(cfg))
                out[name] = "accepted"
            except ramjet.InvalidInputError as e:
                out[name] = "InvalidInputError: " + str(e)
    print(json.dumps(out))
    """
)


def test_the_engine_refuses_the_same_arguments_by_name_without_a_crash(packed):
    # Past the Python checks (a caller of the native classes, or a future option), the engine's
    # own check refuses them: no panic in a thread, no abort of the process.
    p = subprocess.run([sys.executable, "-c", ENGINE_CHECKS, str(packed)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name, outcome in got.items():
        assert outcome.startswith("InvalidInputError") and name.split("_")[0] in outcome, (name, outcome)


BAD_STATES = [
    ([1, 2], "dict"),
    ({"version": 1}, "epoch"),
    ({"version": 1, "epoch": "x"}, "epoch"),
    ({"version": 1, "epoch": -1}, "epoch"),
    ({"version": 1, "epoch": 0, "resume": "{not json"}, "resume"),
    ({"version": 1, "epoch": 0, "resume": 5}, "resume"),
    ({"version": 1, "epoch": 0, "resume": "{}"}, "resume"),
    ({"version": 1, "epoch": 0, "consumer": "[]"}, "consumer"),
    ({"version": 2, "epoch": 0}, "version"),
]


@pytest.mark.parametrize("state, name", BAD_STATES, ids=[str(i) for i in range(len(BAD_STATES))])
def test_every_bad_resume_state_is_an_invalid_input_error_naming_it(packed, state, name):
    ds = dataset(packed)
    with pytest.raises(ramjet.InvalidInputError, match=name):
        ds.load_state_dict(state)
    assert ds.epoch == 0 and len([b for b in ds]) == N // 4, "a refused state changes nothing"


def test_a_state_whose_epoch_disagrees_with_its_resume_is_refused(packed):
    ds = dataset(packed, shuffle=True)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    del it
    state["epoch"] += 1
    with pytest.raises(ramjet.InvalidInputError, match="epoch"):
        dataset(packed, shuffle=True).load_state_dict(state)


def test_load_state_dict_then_set_epoch_of_that_epoch_keeps_the_resume(packed):
    make = lambda: dataset(packed, shuffle=True, seed=3)  # noqa: E731
    full = [int(i) for b in make() for i in b["_index"]]
    ds = make()
    ds.set_epoch(0)
    it = iter(ds)
    head = [int(i) for _ in range(3) for i in next(it)["_index"]]
    state = ds.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    tail = []
    for epoch in range(state["epoch"], state["epoch"] + 1):  # the loop docs/python.md shows
        resumed.set_epoch(epoch)
        tail = [int(i) for b in resumed for i in b["_index"]]
    assert head + tail == full, "the resumed epoch repeats or drops samples"
    # Setting another epoch drops the resume: that epoch starts from its beginning.
    again = make()
    again.load_state_dict(state)
    again.set_epoch(1)
    assert sorted(int(i) for b in again for i in b["_index"]) == list(range(N))


SAME_DATASET = textwrap.dedent(
    """
    import json, sys, ramjet
    path, cache, sock = sys.argv[1:4]
    ramjet.init(cache, socket=sock)
    out = {}
    for name in (path, "file://" + path):
        ds = ramjet.StreamingDataset(name, batch_size=4, image_size=None, shuffle=False)
        n = sum(len(b["_index"]) for b in ds)
        out[name] = [n, ds.metrics()]
    print(json.dumps(out))
    """
)


def test_a_plain_path_and_its_file_url_are_one_dataset_to_the_daemon(packed, tmp_path):
    shards = len(json.loads((packed / "manifest.json").read_text())["shards"])
    p = subprocess.run(
        [sys.executable, "-c", SAME_DATASET, str(packed), str(tmp_path / "cache"), str(tmp_path / "d.sock")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    (n1, plain), (n2, url) = got.values()
    assert n1 == n2 == N
    # Through the daemon, not around it: no failure, no direct origin read, and the second
    # name finds the shards the first put in the daemon's cache.
    assert plain["daemon_failures"] == 0 and plain["origin_bytes"] == 0, plain
    assert plain["daemon_origin"] >= shards, plain
    assert url["daemon_failures"] == 0 and url["origin_bytes"] == 0 and url["daemon_origin"] == 0, url


# ----- the exactly-once audit ----------------------------------------------------------------


def test_the_audit_says_exactly_once_for_a_whole_epoch_and_catches_a_replayed_batch(packed):
    ds = dataset(packed, shuffle=True, seed=11)
    with pytest.raises(ramjet.InvalidInputError, match="nothing was read"):
        ds.audit()
    seen = [int(i) for b in ds for i in b["_index"]]
    assert sorted(seen) == list(range(N))
    r = ds.audit()
    assert r["exactly_once"] and r["complete"] and r["delivered"] == r["len"] == N, r
    # A job state whose progress was set back by one batch (4 samples) while the record of what
    # was yielded is kept: the resumed run yields that batch again, and the audit names it.
    part = dataset(packed, shuffle=True, seed=11)
    it = iter(part)
    for _ in range(3):
        next(it)
    mid = part.audit()
    assert mid["exactly_once"] and not mid["complete"] and mid["delivered"] == 12, mid
    state = part.state_dict()
    del it
    resume = json.loads(state["resume"])
    resume["progress"]["consumed"] -= 4
    replay = dataset(packed, shuffle=True, seed=11)
    replay.load_state_dict({**state, "resume": json.dumps(resume)})
    assert not replay.audit()["exactly_once"]  # the loaded state alone already disagrees
    again = [int(i) for b in replay for i in b["_index"]]
    assert len(again) == N - 8
    r = replay.audit()
    assert not r["exactly_once"] and r["delivered"] == N + 4, r
    assert "4 delivered more than once" in r["message"], r


KILLED = textwrap.dedent(
    """
    import json, os, sys, time, ramjet
    url, state_file, seen_file = sys.argv[1:4]
    ds = ramjet.StreamingDataset(url, batch_size=4, image_size=32, shuffle=True, seed=5)
    if os.path.exists(state_file):
        ds.load_state_dict(json.load(open(state_file)))
    for b in ds:
        with open(seen_file, "a") as f:
            f.write("".join(f"{int(i)}\\n" for i in b["_index"]))
        tmp = state_file + ".tmp"
        json.dump(ds.state_dict(), open(tmp, "w"))
        os.replace(tmp, state_file)
        time.sleep(float(os.environ.get("STEP_S", "0")))
    print(json.dumps(ds.audit()))
    """
)


def test_the_audit_holds_across_a_sigkill_and_resume(packed, tmp_path):
    """A trainer SIGKILLed mid-epoch (its state saved after each batch, as a checkpoint would)
    resumes in a new process: the audit there says each sample exactly once for the whole
    epoch, `ramjet audit` says the same of the state saved at the kill, and the samples really
    were each yielded once (the batch in flight at the kill is yielded again only if its state
    was not saved, which the audit would then report)."""
    state, seen = tmp_path / "state.json", tmp_path / "seen.txt"
    args = [sys.executable, "-c", KILLED, str(packed), str(state), str(seen)]
    p = subprocess.Popen(args, env={**os.environ, "STEP_S": "0.2"}, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not state.exists() or len(seen.read_text().split()) < 12:
        assert time.monotonic() < deadline and p.poll() is None, "the trainer made no progress"
        time.sleep(0.02)
    p.kill()
    p.wait()
    at_kill = json.loads(state.read_text())
    o = subprocess.run([RAMJET, "audit", str(packed), "--state", str(state)], capture_output=True, text=True)
    assert o.returncode == 0 and "exactly once" in o.stdout, o.stdout + o.stderr
    covered = json.loads(at_kill["resume"])["progress"]["consumed"]
    # Keep exactly what the saved state covers (a batch written after its state was not saved
    # is read again, which is correct: it was never checkpointed).
    lines = seen.read_text().split()[:covered]
    seen.write_text("".join(f"{x}\n" for x in lines))
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["exactly_once"] and r["complete"] and r["delivered"] == N, r
    # Position by position, the killed and resumed run is the uninterrupted one.
    full = tmp_path / "full.txt"
    whole = subprocess.run([sys.executable, "-c", KILLED, str(packed), str(tmp_path / "none.json"), str(full)],
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert sorted(int(x) for x in full.read_text().split()) == list(range(N))
    assert seen.read_text().split() == full.read_text().split()


# ----- freezes are leases --------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time, ramjet._ramjet as r
    lease = r.freeze(sys.argv[1])
    print("frozen", flush=True)
    time.sleep(600)
    """
)



def http_json(addr, path):
    import urllib.request

    with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
        return json.loads(r.read())


def test_a_freeze_is_released_when_its_holder_is_sigkilled(tmp_path):
    """Regression (issue 42, defect 4): `freeze` then SIGKILL left the ring frozen for good and a
    pending member never joined. A freeze is a lease on its connection: the daemon releases it
    when the holder dies, and the member waiting in the peers file joins within the file's
    re-read period (1 s)."""
    me, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    sock, peers = tmp_path / "d.sock", tmp_path / "peers.txt"
    peers.write_text(me + "\n")
    daemon = subprocess.Popen(
        [RAMJET, "serve", "--socket", str(sock), "--cache-dir", str(tmp_path / "cache"), "--listen", me]
        + ["--advertise", me, "--http", http, "--peers-file", str(peers)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    holder = None
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                http_json(http, "/stats")
                break
            except OSError:
                assert time.monotonic() < deadline, "the daemon did not come up"
                time.sleep(0.05)
        # In-process: a context manager, and release() twice is harmless.
        with ramjet._ramjet.freeze(str(sock)) as lease:
            assert lease.held and http_json(http, "/stats")["frozen"]
        assert not lease.held and not http_json(http, "/stats")["frozen"]
        lease.release()
        # Another process holds a freeze; a member is proposed while frozen and waits.
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(sock)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "frozen"
        newcomer = "127.0.0.99:7341"
        peers.write_text(f"{me}\n{newcomer}\n")
        deadline = time.monotonic() + 10
        while http_json(http, "/stats")["pending_members"] is None:
            assert time.monotonic() < deadline, "the peers file change was not seen"
            time.sleep(0.1)
        s = http_json(http, "/stats")
        assert s["frozen"] and newcomer not in s["members"], s
        holder.kill()
        holder.wait()
        t0 = time.monotonic()
        while True:
            s = http_json(http, "/stats")
            if newcomer in s["members"]:
                break
            assert time.monotonic() - t0 < 5, f"the killed holder's freeze still holds the ring: {s}"
            time.sleep(0.05)
        assert not s["frozen"] and s["pending_members"] is None, s
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        daemon.kill()
        daemon.wait()
