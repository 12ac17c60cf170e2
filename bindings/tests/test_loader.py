"""ramjet.StreamingDataset against the real local S3 server and real torch (CPU)."""

import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
CLASSES = 3
N = 96


def s3_url(name):
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    return f"s3://{BUCKET}/pytest-loader/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth") / "ds"
    run("synth", str(d), "--samples", str(N))
    return d


@pytest.fixture(scope="session")
def classes(synth, tmp_path_factory):
    """An image-classification folder (JPEG and a few PNG) packed to S3 in several shards.
    Returns (url, {relative path: (label, encoded bytes)})."""
    root = tmp_path_factory.mktemp("classes") / "folder"
    truth = {}
    for i, src in enumerate(sorted((synth / "images").iterdir())):
        label = i % CLASSES
        d = root / f"c{label}"
        d.mkdir(parents=True, exist_ok=True)
        if i % 16 == 5:
            dst = d / f"{src.stem}.png"
            Image.open(src).convert("RGB").save(dst)
        else:
            dst = d / src.name
            shutil.copy(src, dst)
        truth[f"c{label}/{dst.name}"] = (label, dst.read_bytes())
    url = s3_url("classes")
    run("pack", str(root), url, "--shard-size", "1MiB")
    return url, truth


def dataset(url, **kw):
    kw.setdefault("batch_size", 8)
    kw.setdefault("image_size", 64)
    return ramjet.StreamingDataset(url, **kw)


def epoch(ds):
    return [b for b in ds]


def indices(batches):
    return [int(i) for b in batches for i in b["_index"]]


def test_batches_match_what_pack_wrote(classes):
    url, truth = classes
    ds = dataset(url, shuffle=False, augment="resize", image_size=(48, 64))
    batches = epoch(ds)
    assert len(batches) == len(ds) == -(-N // 8)
    seen = 0
    for b in batches:
        img, label = b["image"], b["label"]
        assert img.dtype == torch.uint8 and tuple(img.shape[1:]) == (3, 48, 64)
        assert label.dtype == torch.int64
        for k, path in enumerate(b["path"]):
            want_label, encoded = truth[path]
            assert int(label[k]) == want_label, path
            ref = Image.open(io.BytesIO(encoded)).convert("RGB").resize((64, 48), Image.BILINEAR)
            ref = torch.from_numpy(np.array(ref)).permute(2, 0, 1).to(torch.float32)
            diff = (img[k].to(torch.float32) - ref).abs()
            assert diff.mean() < 2.5, f"{path}: mean abs difference {diff.mean():.2f} against Pillow"
            seen += 1
    assert seen == N


def test_tensors_are_zero_copy_through_dlpack(classes):
    url, _ = classes
    ds = dataset(url)
    it = iter(ds)
    b = next(it)
    assert isinstance(b["image"], torch.Tensor)
    # The raw export: torch and numpy both use ramjet's memory.
    loader = ds._loader
    cols, _ = loader.next_batch()
    t = cols["image"]
    assert torch.from_dlpack(t).data_ptr() == t.data_ptr
    assert np.from_dlpack(t).ctypes.data == t.data_ptr
    assert t.data_ptr % 64 == 0, "batch buffers are 64-byte aligned"


def test_float_output_is_normalised(classes):
    url, _ = classes
    ds = dataset(url, shuffle=False, augment="resize", normalize=True, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    raw = dataset(url, shuffle=False, augment="resize")
    a, b = next(iter(ds)), next(iter(raw))
    assert a["image"].dtype == torch.float32
    torch.testing.assert_close(a["image"], b["image"].to(torch.float32) / 127.5 - 1.0, atol=1e-5, rtol=0)


def test_yolo_boxes_are_flat_with_offsets(synth):
    url = s3_url("yolo")
    run("pack", str(synth), url)
    ds = dataset(url, shuffle=False)
    b = next(iter(ds))
    boxes, off = b["boxes"], b["boxes_offsets"]
    assert boxes.shape[1] == 5 and off.shape == (9,) and int(off[0]) == 0 and int(off[-1]) == boxes.shape[0]
    first = sorted((synth / "labels").iterdir())[0].read_text().split()
    assert abs(float(boxes[0, 1]) - float(first[1])) < 1e-6 and int(boxes[0, 0]) == int(first[0])


def test_resume_replays_the_same_batches(classes, tmp_path):
    url, _ = classes
    make = lambda: dataset(url, seed=11, local=str(tmp_path / "cache"))  # noqa: E731
    full = epoch(make())
    ds = make()
    it = iter(ds)
    head = [next(it) for _ in range(5)]
    state = json.loads(json.dumps(ds.state_dict()))
    del it, ds
    resumed = make()
    resumed.load_state_dict(state)
    tail = epoch(resumed)
    got = head + tail
    assert indices(got) == indices(full)
    for a, b in zip(got, full):
        assert torch.equal(a["image"], b["image"]), "augmentations replay identically"
    # The next epoch follows on, reshuffled, and again covers every sample once.
    nxt = epoch(resumed)
    assert sorted(indices(nxt)) == list(range(N)) and indices(nxt) != indices(full)


def test_close_stops_the_loader_and_keeps_the_position(classes, tmp_path):
    """close() (and leaving a with block) stops the running loader: its counters are gone
    with it. The position stays: state_dict is the same before and after, and iterating again
    goes on with the rest of the epoch, the same batches an uninterrupted epoch yields. The
    repr names the dataset."""
    url, _ = classes
    make = lambda: dataset(url, seed=11, local=str(tmp_path / "cache"))  # noqa: E731
    full = epoch(make())
    with make() as ds:
        assert url in repr(ds) and "batch_size=8" in repr(ds) and "epoch=0" in repr(ds), repr(ds)
        it = iter(ds)
        head = [next(it) for _ in range(5)]
        state = json.loads(json.dumps(ds.state_dict()))
        assert ds.metrics(), "a loader runs"
    assert ds.metrics() == {}, "leaving the with block stopped the loader"
    assert json.loads(json.dumps(ds.state_dict())) == state
    tail = epoch(ds)
    assert indices(head + tail) == indices(full)
    for a, b in zip(head + tail, full):
        assert torch.equal(a["image"], b["image"])
    ds.close()
    ds.close()  # twice is harmless
    reader = ramjet.Reader(url, image_size=32)
    with reader:
        one = reader.get(3)
        assert "open=True" in repr(reader)
    assert "open=False" in repr(reader) and url in repr(reader)
    assert torch.equal(reader.get(3)["image"], one["image"]), "a closed reader opens again"


def test_order_is_the_same_for_any_batch_size_and_thread_count(classes):
    url, _ = classes
    a = indices(epoch(dataset(url, seed=3, batch_size=8, num_threads=1)))
    b = indices(epoch(dataset(url, seed=3, batch_size=5, num_threads=3)))
    assert a == b and sorted(a) == list(range(N))


def test_two_ranks_see_disjoint_samples(classes):
    url, _ = classes
    r0 = indices(epoch(dataset(url, rank=0, world_size=2)))
    r1 = indices(epoch(dataset(url, rank=1, world_size=2)))
    assert not set(r0) & set(r1)
    assert sorted(r0 + r1) == list(range(N))
    assert len(r0) == dataset(url, rank=0, world_size=2).samples_per_rank
    # Position by position: with one partition (the two nodes' deal is test_nodes.py's), the
    # ranks take the one order's positions in turn.
    with pytest.warns(UserWarning, match="every node reads the whole dataset"):
        s0 = indices(epoch(dataset(url, rank=0, world_size=2, partitions=1)))
        s1 = indices(epoch(dataset(url, rank=1, world_size=2, partitions=1)))
    full = indices(epoch(dataset(url, partitions=1)))
    assert (s0, s1) == (full[0::2], full[1::2])


def test_dataloader_workers_cover_each_sample_once(classes):
    url, _ = classes
    ds = dataset(url, seed=5)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = []
    for b in dl:
        assert b["image"].shape[1:] == (3, 64, 64)
        got.append([int(i) for i in b["_index"]])
    assert sorted(i for b in got for i in b) == list(range(N))
    # Position by position: worker w reads positions w, w + 2, ... of the one order, in batches
    # of 8, and the DataLoader takes the workers' batches in turn.
    full = indices(epoch(dataset(url, seed=5)))
    mine = [[full[w::2][k:k + 8] for k in range(0, len(full[w::2]), 8)] for w in (0, 1)]
    want = [c[k] for k in range(max(map(len, mine))) for c in mine if k < len(c)]
    assert got == want


def test_getitem_is_random_access(classes):
    url, truth = classes
    ds = dataset(url, augment="resize")
    s = ds[17]
    assert s["_index"] == 17 and s["image"].shape == (3, 64, 64)
    assert s["label"] == truth[s["path"]][0]


def test_mixing_streams_by_proportion(classes, synth):
    url, _ = classes
    ds = ramjet.StreamingDataset(
        [ramjet.Source(url, repeat=2.0), ramjet.Source(url, count=10)],
        batch_size=16,
        image_size=32,
        boxes_column=None,
    )
    batches = epoch(ds)
    streams = torch.cat([b["_stream"] for b in batches])
    assert int((streams == 0).sum()) == 2 * N and int((streams == 1).sum()) == 10
    # `_source` is the column's name; `_stream`, its deprecated alias, is the same tensor.
    assert all(b["_stream"] is b["_source"] for b in batches)
    assert ds.num_samples == 2 * N + 10


def test_the_old_name_of_a_source_still_works_and_says_it_is_deprecated(classes):
    """ramjet.Stream was renamed ramjet.Source (a stream is a consumer's walk over an epoch):
    the old name is the same thing, with a DeprecationWarning, for one release."""
    url, _ = classes
    with pytest.warns(DeprecationWarning, match="ramjet.Source"):
        old = ramjet.Stream(url, repeat=2.0)
    assert isinstance(old, ramjet.Source) and old._arg() == ramjet.Source(url, repeat=2.0)._arg()
    ds = ramjet.StreamingDataset([old], batch_size=16, image_size=32, boxes_column=None)
    assert ds.num_samples == 2 * N


def test_missing_dataset_is_a_not_found_error():
    with pytest.raises(ramjet.NotFoundError, match="manifest.json"):
        next(iter(dataset(s3_url("absent"))))


def test_bad_arguments_are_invalid_input_errors(classes):
    url, _ = classes
    with pytest.raises(ramjet.InvalidInputError):
        dataset(url, on_corrupt="ignore")
    with pytest.raises(ramjet.InvalidInputError, match="image"):
        next(iter(dataset(url, image_column="nope")))


@pytest.fixture(scope="session")
def corrupt(synth, tmp_path_factory):
    """A folder whose 7th image cannot be decoded (though its structure is valid)."""
    root = tmp_path_factory.mktemp("corrupt") / "folder"
    (root / "a").mkdir(parents=True)
    bad_name = None
    for i, src in enumerate(sorted((synth / "images").iterdir())[:20]):
        data = src.read_bytes()
        if i == 6:
            # The first component names quantisation table 3, which the file never defines:
            # the headers' structure is valid (pack accepts it), but no decoder can read it.
            # (A zero sampling factor, used here before, is now refused by pack itself.)
            sof = data.index(b"\xff\xc0")
            data = data[: sof + 12] + b"\x03" + data[sof + 13 :]
            bad_name = src.name
        (root / "a" / src.name).write_bytes(data)
    url = s3_url("corrupt")
    run("pack", str(root), url)
    return url, bad_name


def test_corrupt_image_raises_naming_shard_and_sample(corrupt):
    url, _ = corrupt
    with pytest.raises(ramjet.CorruptError) as e:
        epoch(dataset(url, shuffle=False))
    msg = str(e.value)
    assert "shards/" in msg and "sample 6" in msg and "image" in msg, msg


def test_corrupt_image_can_be_skipped_and_counted(corrupt):
    url, bad = corrupt
    ds = dataset(url, shuffle=False, on_corrupt="skip")
    batches = epoch(ds)
    got = indices(batches)
    assert 6 not in got and sorted(got) == [i for i in range(20) if i != 6]
    skipped = [s for b in batches for s in b.get("_skipped", [])]
    assert len(skipped) == 1 and skipped[0][1] == 6
    assert ds.metrics()["samples_skipped"] == 1


INTERRUPT = textwrap.dedent(
    """
    import os, signal, socket, sys, threading, time
    import ramjet
    # Python's own handler, whatever this process inherited: a process started in the
    # background of a non-interactive shell (nohup ... &, as CI runners may do) ignores SIGINT,
    # Python then installs no handler, and the Ctrl-C this test sends would never arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    url, mode = sys.argv[1], sys.argv[2]
    threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    t = time.time()
    try:
        ds = ramjet.StreamingDataset(url, batch_size=4, image_size=32)
        for b in ds:
            pass
        print("finished")
    except KeyboardInterrupt:
        print(f"interrupted after {time.time() - t:.2f}s")
    """
)


class StallProxy:
    """Forwards requests whose path contains `allow` to the real S3 server (one per
    connection) and leaves every other request hanging forever."""

    def __init__(self, upstream, allow):
        self.upstream, self.allow = upstream, allow.encode()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            c, _ = self.sock.accept()
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = c.recv(65536)
            if not chunk:
                return
            head += chunk
        first = head.split(b"\r\n", 1)[0]
        if self.allow not in first:
            self.held.append(c)  # never answered
            return
        head = head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
        u = socket.create_connection(self.upstream)
        u.sendall(head)
        while True:
            data = u.recv(65536)
            if not data:
                break
            c.sendall(data)
        c.close()
        u.close()



CACHED_FLIP = textwrap.dedent("""
    import hashlib, pathlib, sys
    import ramjet
    url, cache = sys.argv[1:3]
    ds = ramjet.StreamingDataset(url, local=cache, batch_size=8, image_size=64, shuffle=False)
    h = hashlib.sha256()
    for _ in range(2):  # the second epoch reads the shards the first one cached
        for b in ds:
            h.update(bytes(memoryview(b["_index"].numpy())))
            h.update(bytes(memoryview(b["image"].numpy())))
    print(h.hexdigest(), int(ds.metrics()["cache_corrupt"]), int(ds.metrics()["cache_hits"]))
""")


def test_a_flipped_byte_in_a_cached_shard_is_warned_about_refetched_and_never_yielded(classes, tmp_path):
    """The engine's warnings reach a Python process's stderr: a cached shard with a flipped
    byte is named there, deleted and fetched again, and the batches are the same."""
    url, _ = classes
    cache = tmp_path / "cache"

    def run_epochs():
        out = subprocess.run([sys.executable, "-c", CACHED_FLIP, url, str(cache)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-4000:]
        digest, corrupt, hits = out.stdout.split()
        return digest, int(corrupt), int(hits), out.stderr

    sound, corrupt, hits, err = run_epochs()
    assert corrupt == 0 and hits > 0 and "failed its checksum" not in err, err
    shards = sorted((cache / "shards").iterdir())
    assert shards, "nothing was cached"
    victim = shards[len(shards) // 2]
    b = bytearray(victim.read_bytes())
    b[len(b) // 2] ^= 0x08
    victim.write_bytes(b)
    again, corrupt, _, err = run_epochs()
    assert again == sound, "a corrupted record was yielded"
    assert corrupt == 1, err
    assert "failed its checksum" in err and victim.name in err, err


@pytest.mark.parametrize("stall", ["everything", "shards"])
def test_ctrl_c_interrupts_a_blocking_iteration(classes, stall):
    url, _ = classes
    host, port = os.environ["AWS_ENDPOINT_URL"].rsplit("/", 1)[1].split(":")
    proxy = StallProxy((host, int(port)), "manifest.json" if stall == "shards" else "\x00never")
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}", RAMJET_REQUEST_TIMEOUT_MS="600000")
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPT, url, stall], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "interrupted after" in out.stdout, out.stdout + out.stderr
    assert float(out.stdout.split("after ")[1].rstrip("s\n")) < 5.0


def test_fork_after_use_restarts_cleanly(classes):
    url, _ = classes
    ds = dataset(url, seed=9)
    first = indices(epoch(ds))
    ds.set_epoch(0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the inherited loader has no threads; a new one must start
        code = 1
        try:
            got = indices(epoch(ds))
            os.write(w, json.dumps(got).encode())
            code = 0
        except BaseException as e:  # reported through the pipe and the exit status
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    # Bounded: a child that hangs is killed and the test fails, naming the wait.
    data, deadline = b"", time.monotonic() + 120
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child gave no result in 120 s (got {data[-200:]!r})")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    assert json.loads(data) == first


EMBEDDED = textwrap.dedent(
    """
    import json, os, sys, time, torch, ramjet
    url, cache, sock, reports = sys.argv[1:5]

    class Reporting(ramjet.StreamingDataset):
        # Each worker writes its loader's counters when its share ends.
        def __iter__(self):
            yield from super().__iter__()
            with open(os.path.join(reports, f"{os.getpid()}-{time.monotonic_ns()}.json"), "w") as f:
                json.dump(self.metrics(), f)

    path = ramjet.init(cache, socket=sock)
    assert path == sock, path
    def run(**kw):
        ds = ramjet.StreamingDataset(url, batch_size=8, image_size=32, shuffle=False, **kw)
        n = sum(len(b["_index"]) for b in ds)
        return n, ds.metrics()
    n1, cold = run()
    n2, warm = run()
    # DataLoader workers (forked) share the daemon of their parent.
    dl = torch.utils.data.DataLoader(
        Reporting(url, batch_size=8, image_size=32, shuffle=False), batch_size=None, num_workers=2,
        multiprocessing_context="fork", timeout=120,
    )
    n3 = sum(len(b["_index"]) for b in dl)
    print(json.dumps({"n": [n1, n2, n3], "cold": cold, "warm": warm}))
    """
)


def test_init_starts_an_embedded_daemon_that_every_dataset_and_worker_shares(classes, tmp_path):
    url, truth = classes
    shards = ramjet.inspect(url)["shards"]
    sock = str(tmp_path / "d.sock")
    reports = tmp_path / "reports"
    reports.mkdir()
    p = subprocess.run(
        [sys.executable, "-c", EMBEDDED, url, str(tmp_path / "cache"), sock, str(reports)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["n"] == [len(truth)] * 3
    # The workers read through their parent's daemon (its cache is warm by then): no fallback.
    workers = [json.loads(f.read_text()) for f in reports.iterdir()]
    assert len(workers) == 2, workers
    for m in workers:
        assert m["daemon_failures"] == 0 and m["origin_bytes"] == 0, m
        assert m["daemon_cache_local"] > 0, m
    assert r["cold"]["daemon_origin"] == shards and r["cold"]["origin_bytes"] == 0, r["cold"]
    # (The loader prefetches on into later epochs, so counts can exceed one epoch's shards.)
    warm = r["warm"]
    assert warm["daemon_cache_local"] >= shards and warm["daemon_origin"] == 0, warm
    assert warm["daemon_failures"] == 0 and warm["origin_bytes"] == 0, warm
    assert sorted(os.listdir(tmp_path / "cache" / "shards")), "the daemon filled its cache"


def _stateful(ds, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(ds, batch_size=None, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [1, 5, 12])
def test_stateful_dataloader_resumes_exactly_mid_epoch(classes, workers, stop_after):
    """torchdata's StatefulDataLoader: a state taken after `stop_after` batches, restored into
    a new loader (new worker processes), yields exactly the batches the first run went on to
    yield, pixels included, then the next epoch as usual."""
    url, _ = classes
    make = lambda: dataset(url, seed=21, batch_size=4)  # noqa: E731
    dl = _stateful(make(), workers)
    it = iter(dl)
    head = [next(it) for _ in range(stop_after)]
    state = dl.state_dict()
    rest = list(it)
    full = head + rest
    assert sorted(indices(full)) == list(range(N))

    dl2 = _stateful(make(), workers)
    dl2.load_state_dict(json.loads(json.dumps(state, default=str)) if workers == 0 else state)
    resumed = list(dl2)
    assert indices(resumed) == indices(rest)
    for a, b in zip(resumed, rest):
        assert torch.equal(a["image"], b["image"]), "augmentations replay identically"


def test_stateful_dataloader_worker_state_is_a_string_at_hand(classes):
    """Taking a worker's state runs every step: it must not gather, parse or call into the
    engine. It is the string the last batch came with."""
    url, _ = classes
    ds = dataset(url, seed=4, batch_size=4)
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(dl)
    next(it)
    next(it)
    st = dl.state_dict()
    ws = st["_snapshot"]["_worker_snapshots"]
    states = [w["dataset_state"] for w in ws.values()]
    assert len(states) == 2
    assert all(isinstance(s["consumer"], str) for s in states), states
    consumers = sorted(json.loads(s["consumer"])["consumer"] for s in states)
    assert consumers == [0, 1]


def test_stateful_resume_with_other_workers_is_refused_by_name(classes):
    url, _ = classes
    dl = _stateful(dataset(url, seed=2, batch_size=4), 2)
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = dl.state_dict()
    del it
    ws = next(iter(state["_snapshot"]["_worker_snapshots"].values()))["dataset_state"]
    ds = dataset(url, seed=2, batch_size=4)
    ds.load_state_dict(ws)  # a worker's state in a process that is the whole job
    with pytest.raises(ramjet.InvalidInputError, match="consumer 0 of 2"):
        next(iter(ds))


def test_every_state_carries_the_data_contract_and_another_transform_is_refused_by_field(classes):
    """state_dict() records the data contract (ramjet's version, the manifest versions, the
    order, the transform spec), before and after the first batch and in a worker's state; a
    state saved with augment="train" at 224 px is refused by a dataset at augment="eval",
    48 px, naming each field, and with strict=False it warns and goes on exactly."""
    import warnings

    url, _ = classes
    ds = dataset(url, seed=9, batch_size=4, image_size=224, augment="train")
    fresh = ds.state_dict()["contract"]
    it = iter(ds)
    head = [next(it) for _ in range(3)]
    state = ds.state_dict()
    c = state["contract"]
    assert c == fresh == ds.contract()
    assert c["ramjet"] == ramjet.__version__
    assert [s["manifest_version"] for s in c["sources"]] == [ramjet._ramjet.inspect(url)["version"]]
    img = c["transform"]["image"]
    assert (img["augment"], img["height"], img["width"], img["flip"]) == ("train", 224, 224, 0.5)
    assert c["order"]["seed"] == 9
    rest = [int(i) for b in it for i in b["_index"]]
    # The same transform: loaded without a word (the contract survives a JSON round trip).
    same = dataset(url, seed=9, batch_size=4, image_size=224, augment="train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(json.loads(json.dumps(state)))
    assert indices(list(same)) == rest
    other = lambda: dataset(url, seed=9, batch_size=4, image_size=48, augment="eval")  # noqa: E731
    with pytest.raises(ramjet.InvalidInputError) as e:
        other().load_state_dict(state)
    msg = str(e.value)
    for field in ("transform.image.augment", "transform.image.height", "transform.image.width"):
        assert field in msg, msg
    assert '"train" in the state, "eval" here' in msg and "strict=False" in msg, msg
    loose = other()
    with pytest.warns(RuntimeWarning, match="transform.image.augment"):
        loose.load_state_dict(state, strict=False)
    assert indices(list(loose)) == rest, "strict=False resumes exactly all the same"
    assert sorted(indices(head) + rest) == list(range(N))
    # A state from before contracts loads as it is; a contract that is not one is refused.
    old = {k: v for k, v in state.items() if k != "contract"}
    legacy = other()
    legacy.load_state_dict(old)
    assert indices(list(legacy)) == rest
    with pytest.raises(ramjet.InvalidInputError, match="not a data contract"):
        other().load_state_dict(dict(state, contract=[1]))


def test_a_stateful_dataloader_workers_state_carries_the_contract_and_is_checked(classes):
    url, _ = classes
    dl = _stateful(dataset(url, seed=2, batch_size=4, augment="train"), 2)
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = dl.state_dict()
    del it
    ws = [w["dataset_state"] for w in state["_snapshot"]["_worker_snapshots"].values()]
    assert all(w["contract"]["transform"]["image"]["augment"] == "train" for w in ws), ws
    with pytest.raises(ramjet.InvalidInputError, match="transform.image.augment"):
        dataset(url, seed=2, batch_size=4, augment="eval").load_state_dict(ws[0])


def test_columns_come_from_sidecars_without_reading_images(synth):
    url = s3_url("cols")
    run("pack", str(synth), url, "--shard-size", "1MiB")
    info = ramjet._ramjet.inspect(url)
    assert info["columns_sidecars"] and info["shards"] > 1
    cols = ramjet._ramjet.columns(url, ["path", "width", "height", "boxes"])
    assert len(cols["path"]) == N
    for i in (0, 7, N - 1):
        p = cols["path"][i]
        assert p == f"images/{i:06d}.jpg"
        label = (synth / "labels" / f"{i:06d}.txt").read_text().split()
        boxes = json.loads(cols["boxes"][i])
        assert [round(x, 6) for x in boxes[0][1:]] == [float(x) for x in label[1:5]]
    assert set(cols["width"]) == {640} and set(cols["height"]) == {480}
    with pytest.raises(ramjet.InvalidInputError, match="bytes column"):
        ramjet._ramjet.columns(url, ["image"])


def test_random_access_loads_each_shard_once_then_reads_locally(synth):
    """ramjet.Reader.get_bytes: the first sample of a shard is two ranged GETs, its whole shard then
    loads in the background, and the shard's other samples come from memory."""
    url = s3_url("random")
    run("pack", str(synth), url, "--shard-size", "1MiB")
    r = ramjet.Reader(url)
    truth = {i: (synth / "images" / f"{i:06d}.jpg").read_bytes() for i in range(N)}
    import time

    assert r.get_bytes(3, "image") == truth[3]
    deadline = time.monotonic() + 30
    got = {}
    while time.monotonic() < deadline and len(got) < N:
        for i in range(N):
            got[i] = r.get_bytes(i, "image")
        time.sleep(0.05)
    assert got == truth
    before = r.metrics()
    for i in range(N):
        assert r.get_bytes(i, "image") == truth[i]
    after = r.metrics()
    assert after["resident_samples"] - before["resident_samples"] == N
    assert after["ranged_samples"] == before["ranged_samples"]
    shards = ramjet._ramjet.inspect(url)["shards"]
    assert before["ranged_samples"] < N and after["origin_bytes"] < 2 * ramjet._ramjet.inspect(url)["bytes"], (
        shards,
        after,
    )
    with pytest.raises(ramjet.InvalidInputError, match="not a bytes column"):
        r.get_bytes(1, "path")


def test_the_public_reader_reads_what_the_dataset_holds_and_reopens_in_a_forked_child(synth):
    """ramjet.Reader: get(i) is the evaluation transform's sample i (the same as
    StreamingDataset's __getitem__), len() is the dataset's, a negative index is refused, and a
    forked child reads through a reader of its own (the parent's, inherited without threads,
    is never used there)."""
    url = s3_url("reader")
    run("pack", str(synth), url, "--shard-size", "1MiB")
    r = ramjet.Reader(url, image_size=64)
    assert len(r) == N
    ds = ramjet.StreamingDataset(url, image_size=64)
    for i in (0, 5, N - 1):
        a, b = r.get(i), ds[i]
        assert set(a) == set(b)
        assert torch.equal(a["image"], b["image"]), i
        assert r[i]["path"] == f"images/{i:06d}.jpg"
    # NumPy-style: -1 is the last sample; one past the end is an IndexError.
    assert r.get(-1)["path"] == r.get(len(r) - 1)["path"]
    with pytest.raises(IndexError):
        r.get(len(r))
    parent_native = r._native
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        ok = 0
        try:
            got = r.get_bytes(2, "image")
            ok = int(got == (synth / "images" / "000002.jpg").read_bytes() and r._native is not parent_native)
        finally:
            os.write(wr, bytes([ok]))
            os._exit(0)
    os.close(wr)
    got = os.read(rd, 1)
    os.waitpid(pid, 0)
    assert got == b"\x01", "the forked child's read failed or used the parent's reader"


def test_the_ultralytics_integration_uses_no_private_name():
    """It reads through the public API only: no ``ramjet._x`` attribute, no ``_ramjet`` import."""
    import ast

    src = (Path(ramjet.__file__).parent / "integrations" / "ultralytics.py").read_text()
    bad = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ramjet":
            if node.attr.startswith("_"):
                bad.append(f"ramjet.{node.attr} (line {node.lineno})")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ramjet"):
            bad += [f"from {node.module} import {a.name} (line {node.lineno})" for a in node.names if a.name.startswith("_")]
            if node.module.startswith("ramjet._"):
                bad.append(f"from {node.module} (line {node.lineno})")
    assert not bad, bad


def test_the_python_defaults_are_the_engines():
    """The loader's options and defaults are defined once, in the engine's LoaderConfig: the
    signature of StreamingDataset must say the same (regression: boxes_column disagreed)."""
    import inspect

    d = json.loads(ramjet._ramjet.loader_defaults())
    sig = {k: p.default for k, p in inspect.signature(ramjet.StreamingDataset.__init__).parameters.items()}
    for key in ("batch_size", "drop_last", "image_column", "boxes_column", "prefetch_batches", "on_corrupt"):
        assert sig[key] == d[key], (key, sig[key], d[key])
    img = d["image"]
    assert sig["image_size"] == img["width"] == img["height"]
    assert sig["augment"] == img["augment"]
    assert tuple(sig["scale"]) == pytest.approx(tuple(img["scale"]))
    assert tuple(sig["ratio"]) == pytest.approx(tuple(img["ratio"]))
    for key in ("flip", "crop_fraction", "dct_scaling", "exif_orientation"):
        assert sig[key] == pytest.approx(img[key]), key
    assert list(sig["mean"]) == pytest.approx(img["mean"])
    assert list(sig["std"]) == pytest.approx(img["std"])
    assert sig["normalize"] == img["float"]
    assert sig["seed"] == d["order"]["seed"]
    # No partitions given: the run's (docs/python.md), the engine's 1 on one node.
    assert sig["partitions"] is None and d["order"]["partitions"] == 1
    assert d["order"]["shuffle"] == {
        "kind": sig["shuffle_algo"],
        "window_shards": sig["shuffle_window"],
        "block_samples": sig["shuffle_block"],
    }
    # No tail given: the engine's "uneven" on one rank, "pad" under several (docs/order.md).
    assert d["order"]["tail"] == "uneven" and sig["tail"] is None


# ----- the DLPack protocol's arguments, and device= (the GPU path's parts without a GPU) ----


def test_dlpack_takes_only_stream_none_on_the_host_and_refuses_other_devices(classes):
    url, _ = classes
    ds = dataset(url)
    next(iter(ds))
    cols, _ = ds._loader.next_batch()
    t = cols["image"]
    assert t.__dlpack_device__() == (1, 0)
    t.__dlpack__()
    t.__dlpack__(stream=None, dl_device=(1, 0), max_version=(1, 0))
    for s in (-1, 0, 1, 2, 0x7F00DEADB000):
        with pytest.raises(ValueError, match="only stream=None"):
            t.__dlpack__(stream=s)
    with pytest.raises(ValueError, match="stream must be None or an integer"):
        t.__dlpack__(stream="1")
    with pytest.raises(BufferError, match=r"\(1, 0\).*\(2, 0\).*copy"):
        t.__dlpack__(dl_device=(2, 0))
    # After the refusals the tensor still exports without a copy.
    assert torch.from_dlpack(t).data_ptr() == t.data_ptr


def test_dlpack_versioned_capsule_when_the_consumer_accepts_it(classes):
    """Issue 40, item 8: a consumer whose max_version accepts DLPack 1.x gets the versioned
    capsule ("dltensor_versioned": DLManagedTensorVersioned, version 1.0, not read-only, not a
    copy); one that passes none, or only 0.x, gets the legacy "dltensor". Both are consumed
    without a copy, and a capsule nobody consumed frees its tensor."""
    import ctypes

    url, _ = classes
    ds = dataset(url)
    next(iter(ds))
    cols, _ = ds._loader.next_batch()
    t = cols["image"]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    assert get_name(t.__dlpack__()) == b"dltensor"
    assert get_name(t.__dlpack__(max_version=(0, 8))) == b"dltensor"
    cap = t.__dlpack__(max_version=(1, 3))
    assert get_name(cap) == b"dltensor_versioned"

    class Versioned(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("ctx", ctypes.c_void_p),
                    ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("data", ctypes.c_void_p)]

    v = Versioned.from_address(get_ptr(cap, b"dltensor_versioned"))
    assert (v.major, v.minor, v.flags) == (1, 0, 0)
    assert v.data == t.data_ptr and v.deleter
    del cap  # unconsumed: its destructor frees the tensor
    # torch asks with its own max_version and shares the memory either way.
    assert torch.from_dlpack(t).data_ptr() == t.data_ptr
    assert np.from_dlpack(t).ctypes.data == t.data_ptr


def test_device_resolution_covers_every_case():
    ok = {"driver": True, "devices": 2, "error": None}
    resolve = ramjet._resolve_device
    assert resolve("cpu", ok, True) == "cpu"
    assert resolve("cuda", ok, True) == "cuda:0"
    assert resolve("CUDA:1", ok, True) == "cuda:1"
    with pytest.raises(ramjet.InvalidInputError, match="sees 2 GPU"):
        resolve("cuda:2", ok, True)
    for bad in ("gpu", "cuda:x", "", 0):
        with pytest.raises(ramjet.InvalidInputError, match="device must be"):
            resolve(bad, ok, True)  # type: ignore[arg-type]
    # "cuda" follows LOCAL_RANK across the GPUs this process sees.
    os.environ["LOCAL_RANK"] = "3"
    try:
        assert resolve("cuda", ok, True) == "cuda:1"
        assert resolve("auto", ok, True) == "cuda:1"
    finally:
        del os.environ["LOCAL_RANK"]
    no_driver = {"driver": False, "devices": 0, "error": "no CUDA driver: libcuda.so cannot be loaded"}
    no_device = {"driver": True, "devices": 0, "error": "the CUDA driver sees no GPU"}
    for status, torch_cuda, why in (
        (no_driver, False, "libcuda"),
        (no_device, False, "sees no GPU"),
        (ok, False, "torch cannot use CUDA"),
    ):
        with pytest.raises(ramjet.Error, match=f'no usable GPU: .*{why}.*device="cpu"'):
            resolve("cuda", status, torch_cuda)
        with pytest.warns(RuntimeWarning, match=f'device="auto" runs on the CPU: .*{why}'):
            assert resolve("auto", status, torch_cuda) == "cpu"


def test_device_cuda_without_a_gpu_is_a_clear_error_and_auto_falls_back(classes):
    url, _ = classes
    info = ramjet.gpu_info()
    usable = info["error"] is None and info["devices"] > 0 and torch.cuda.is_available()
    if usable:
        ds = dataset(url, device="cuda")
        assert next(iter(ds))["image"].is_cuda
        return
    # This machine has no usable GPU: the error names why, and auto says it fell back.
    with pytest.raises(ramjet.Error, match="no usable GPU") as e:
        dataset(url, device="cuda")
    assert (info["error"] or "torch cannot use CUDA") in str(e.value)
    with pytest.warns(RuntimeWarning, match='device="auto" runs on the CPU'):
        ds = dataset(url, device="auto")
    assert ds.device == "cpu"
    b = next(iter(ds))
    assert b["image"].device.type == "cpu" and b["image"].shape[1:] == (3, 64, 64)


def test_pinned_batch_buffers_without_a_gpu_are_a_clear_error(classes):
    """The loader of a CUDA dataset allocates its batch buffers page-locked through the driver;
    without one, the loader refuses by name instead of falling back silently."""
    url, _ = classes
    info = ramjet.gpu_info()
    if info["error"] is None and info["devices"] > 0:
        loader = ramjet._ramjet.Loader(dataset(url)._config(epochs=1, pinned_gpu=0))
        assert loader.next_batch() is not None
        return
    with pytest.raises(ramjet.InvalidInputError, match=r"device cuda:0") as e:
        ramjet._ramjet.Loader(dataset(url)._config(epochs=1, pinned_gpu=0))
    assert info["error"] in str(e.value)


def _device_error_in_worker(ds, context):
    # Bounded: a worker that never answers fails the test in a minute, naming the wait.
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=1, multiprocessing_context=context, timeout=60
    )
    try:
        next(iter(loader))
    except Exception as e:  # the worker's exception, re-raised by the DataLoader
        return str(e)
    return None


def test_a_cuda_dataset_in_a_forked_worker_is_a_clear_error(classes):
    url, _ = classes
    ds = dataset(url)
    # As if device="cuda" had resolved (no GPU here): the check is about the process only.
    ds.device = "cuda:0"
    err = _device_error_in_worker(ds, "fork")
    assert err is not None and "forked process" in err and "not fork-safe" in err, err
    # A spawned worker unpickles its own copy in a fresh process: no fork error there (it then
    # fails at the copy to a GPU this machine does not have, or succeeds on one that has it).
    err = _device_error_in_worker(ds, "spawn")
    info = ramjet.gpu_info()
    if info["error"] is None and info["devices"] > 0:
        assert err is None, err
    else:  # exactly the no-GPU refusal of the page-locked batch buffers, naming the device
        assert err is not None and "device cuda:0" in err and info["error"] in err, err
        assert "forked process" not in err, err
    # The CPU device is fine in forked workers, as before.
    ds.device = "cpu"
    assert _device_error_in_worker(ds, "fork") is None


def test_every_ramjet_error_pickles_so_a_worker_s_error_reaches_the_trainer():
    import pickle

    for cls in (ramjet.Error, ramjet.CorruptError, ramjet.NotFoundError, ramjet.OriginError,
                ramjet.AuthError, ramjet.InvalidInputError):
        e = pickle.loads(pickle.dumps(cls("shard 7 of s3://b/d: checksum mismatch")))
        assert type(e) is cls and "shard 7" in str(e)


def test_the_python_signature_names_exactly_the_engines_options():
    """Options are checked once, by the engine (ramjet_engine::loader::options): every keyword
    of StreamingDataset but the process-side ones (daemon, device) is one of its options, with
    the same default, and it takes no other."""
    import inspect

    engine = json.loads(ramjet._ramjet.loader_option_defaults())
    params = inspect.signature(ramjet.StreamingDataset.__init__).parameters
    names = [k for k in params if k not in ("self", "daemon", "device")]
    assert sorted(names) == sorted(engine)
    for k in names:
        ours, theirs = params[k].default, engine[k]
        if k == "tail":  # None: the engine's "uneven" on one rank, "pad" under several
            assert ours is None and theirs == "uneven"
        elif ours is inspect.Parameter.empty:
            assert theirs is None, k
        elif isinstance(ours, (tuple, list)):
            assert list(ours) == pytest.approx(theirs), k
        else:
            assert ours == theirs, (k, ours, theirs)
    with pytest.raises(ramjet.InvalidInputError, match="batch_sise"):
        ramjet._ramjet.loader_options({"remote": "s3://b/d", "batch_sise": 8})


def test_numpy_and_torch_values_pass_as_the_numbers_they_hold(classes):
    """Options reach the engine unjudged: numpy scalars and arrays and torch tensors are the
    ints, floats and sequences they hold (as Python's own arithmetic reads them)."""
    url, _ = classes
    kw = dict(shuffle=False, augment="resize", normalize=True)
    plain = next(iter(dataset(url, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), **kw)))
    ds = dataset(
        url,
        batch_size=np.int64(8),
        image_size=(np.int32(64), np.int64(64)),
        mean=np.array([0.5, 0.5, 0.5]),
        std=torch.tensor([0.25, 0.25, 0.25]),
        flip=np.float32(0.5),
        **kw,
    )
    b = next(iter(ds))
    assert b["image"].shape == plain["image"].shape == (8, 3, 64, 64)
    torch.testing.assert_close(b["image"], plain["image"])
    with pytest.raises(ramjet.InvalidInputError, match="std"):
        dataset(url, std=np.array([0.2, 0.2]))


def test_metrics_split_the_loops_time_by_stage(classes):
    """Issue 44: `metrics()` says where the training loop's time went. A loop that sleeps
    between batches (the trainer the slower side) spends most of it not waiting; the six
    shares add up to 1 and the seconds to the loop's time."""
    import time

    url, _ = classes
    ds = dataset(url, batch_size=4, image_size=32)
    n = 0
    for _ in ds:
        n += 1
        time.sleep(0.03)
    m = ds.metrics()
    stages = ["origin", "peer", "daemon", "cache", "decode", "not_waiting"]
    shares = [m[f"wait_share_{s}"] for s in stages]
    assert abs(sum(shares) - 1) < 1e-6, m
    assert m["wait_share_not_waiting"] > 0.5, m
    assert abs(m["data_wait_share"] - (1 - m["wait_share_not_waiting"])) < 1e-6, m
    assert m["wait_not_waiting_s"] >= 0.03 * (n - 1) * 0.9, (n, m)
