"""Real Ultralytics YOLO training streamed through ramjet, offline: the S3 server and the
trainer run inside a network namespace that has nothing but loopback, so a single attempt to
reach the network (weights, fonts, hub, pip checks) fails the run."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")
PORT = "8733"  # the namespace's own loopback: no clash with the host's S3 server
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".npy", ".cache"}

TRAIN = textwrap.dedent(
    """
    import json, socket, sys
    from ramjet.integrations.ultralytics import StepTimer, offline_environment, streaming_train
    offline_environment()
    # The namespace has no route out: prove it before training.
    try:
        socket.create_connection(("1.1.1.1", 443), timeout=2)
        sys.exit("the network is reachable from the test namespace")
    except OSError:
        pass
    from ultralytics import YOLO
    url, project = sys.argv[1], sys.argv[2]
    model = YOLO("yolov8n.yaml")
    timer = StepTimer().attach(model)
    streaming_train(model, data=url, epochs=3, batch=8, workers=0, imgsz=96, device="cpu", plots=False,
                    project=project, name="run", exist_ok=True, seed=0, deterministic=True, close_mosaic=0,
                    # A few steps from scratch: no warm-up and no mosaic, so the loss falls in 36 steps.
                    mosaic=0.0, warmup_epochs=0, optimizer="AdamW", lr0=0.002)
    t = model.trainer
    ds = t.validator.dataloader.dataset
    reads = ds._engine().metrics()
    print("RESULT " + json.dumps({
        "losses": [s["loss"] for s in timer.steps],
        "epochs": timer.epochs,
        "last": str(t.last),
        "save_dir": str(t.save_dir),
        "metrics": {k: float(v) for k, v in t.metrics.items()},
        "val_class": type(ds).__name__,
        "val_images": len(ds),
        "val_seen": int(t.validator.seen),
        "val_reads": reads.get("ranged_samples", 0) + reads.get("resident_samples", 0),
    }))
    """
)


def _sh(*cmd, env=None, ns=None, cwd=None, timeout=600):
    full = (["ip", "netns", "exec", ns] if ns else []) + [str(c) for c in cmd]
    out = subprocess.run(full, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{full} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


@pytest.fixture
def netns():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.fail("this test runs the trainer in a network namespace: it needs root and iproute2 (ip)")
    name = f"ramjet-yolo-{os.getpid()}"
    _sh("ip", "netns", "add", name)
    try:
        _sh("ip", "link", "set", "lo", "up", ns=name)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_streaming_train_offline_from_s3_in_a_network_namespace(netns, tmp_path):
    import ultralytics  # noqa: F401

    env = dict(
        os.environ,
        RAMJET_S3_NETNS=netns,
        RAMJET_S3_PORT=PORT,
        RAMJET_STATE=str(tmp_path / "state"),
        RAMJET_VENV=sys.prefix,
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{PORT}",
        HOME=str(tmp_path / "home"),
        RAMJET_CACHE_DIR=str(tmp_path / "ramjet-cache"),
        YOLO_CONFIG_DIR=str(tmp_path / "yolo-config"),
        RAMJET_SOCKET=str(tmp_path / "daemon.sock"),
    )
    env.pop("RAMJET_S3_HOST", None)
    (tmp_path / "home").mkdir()
    _sh("bash", ROOT / "tools/s3-server.sh", "start", env=env)
    try:
        src = tmp_path / "src"
        _sh(RAMJET, "synth", src / "train", "--samples", "96", env=env)
        _sh(RAMJET, "synth", src / "val", "--samples", "16", "--seed", "5", env=env)
        bucket = env.get("RAMJET_S3_BUCKET", "ramjet")
        url = f"s3://{bucket}/yolo"
        for split in ("train", "val"):
            _sh(RAMJET, "pack", src / split, f"{url}/{split}", "--shard-size", "1MiB", env=env, ns=netns)
        shutil.rmtree(src)  # from here on the dataset exists only in S3
        work = tmp_path / "work"
        work.mkdir()
        out = _sh(sys.executable, "-c", TRAIN, url, tmp_path / "runs", env=env, ns=netns, cwd=work, timeout=900)
    finally:
        subprocess.run(["bash", str(ROOT / "tools/s3-server.sh"), "stop"], env=env, check=False)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert line, out[-3000:]
    r = json.loads(line[-1][len("RESULT ") :])

    losses = r["losses"]
    assert len(losses) == 3 * 12 and all(map(lambda x: x == x and abs(x) < 1e6, losses)), losses
    first, last = sum(losses[:12]) / 12, sum(losses[-12:]) / 12
    assert last < first, f"the loss did not fall: first epoch {first:.3f}, last epoch {last:.3f}"
    assert Path(r["last"]).is_file(), "last.pt was not written"
    assert r["val_class"] == "RamjetYOLODataset" and r["val_images"] == 16
    assert r["val_seen"] == 16, "validation did not see every streamed val image"
    assert r["val_reads"] >= 16, "validation images were not read through ramjet"
    assert set(r["metrics"]) >= {"metrics/mAP50(B)", "metrics/mAP50-95(B)"}

    # No file of the dataset on local disk outside the ramjet cache (and the S3 server's store).
    allowed = (tmp_path / "ramjet-cache", tmp_path / "state")
    strays = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file()
        and not any(a in p.parents for a in allowed)
        and (p.suffix.lower() in IMAGE_SUFFIXES or p.parent.name == "labels")
    ]
    assert not strays, strays



@pytest.fixture
def host_daemon(tmp_path):
    """A real `ramjet serve` on this host, with its /stats page."""
    import time
    import urllib.request

    sock = tmp_path / "run" / "daemon.sock"
    sock.parent.mkdir(mode=0o700)
    port = free_port()
    p = subprocess.Popen(
        [RAMJET, "serve", "--socket", str(sock), "--cache-dir", str(tmp_path / "cache"), "--http", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def stats():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as r:
            return json.loads(r.read())

    deadline = time.monotonic() + 30
    while True:
        try:
            if sock.exists():
                stats()
                break
        except OSError:
            pass
        assert p.poll() is None, p.stderr.read().decode()
        assert time.monotonic() < deadline, "ramjet serve did not come up"
        time.sleep(0.1)
    try:
        yield str(sock), stats
    finally:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def small_yolo(tmp_path_factory):
    """48 train + 16 val images packed on the host's local S3 server."""
    import uuid

    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    src = tmp_path_factory.mktemp("yolo-src")
    url = f"s3://{os.environ.get('RAMJET_S3_BUCKET', 'ramjet')}/pytest-yolo/{uuid.uuid4().hex[:8]}"
    for split, n, seed in (("train", 48, 0), ("val", 16, 3)):
        _sh(RAMJET, "synth", src / split, "--samples", n, "--seed", seed)
        _sh(RAMJET, "pack", src / split, f"{url}/{split}", "--shard-size", "1MiB")
    shutil.rmtree(src)
    return url


def _train(url, tmp_path, model=None, **kw):
    from ramjet.integrations.ultralytics import offline_environment, streaming_train

    offline_environment(str(tmp_path / "yolo-config"))
    from ultralytics import YOLO

    m = model or YOLO("yolov8n.yaml")
    args = dict(epochs=1, batch=8, workers=0, imgsz=64, device="cpu", plots=False, val=False,
                project=str(tmp_path / "runs"), name="run", exist_ok=True, seed=0)
    args.update(kw)
    streaming_train(m, data=url, **args)
    return m


def test_the_ring_is_frozen_for_the_run_and_unfrozen_after_it_and_after_an_error(
    small_yolo, host_daemon, tmp_path, monkeypatch
):
    sock, stats = host_daemon
    monkeypatch.setenv("RAMJET_SOCKET", sock)
    from ultralytics import YOLO

    seen = []
    m = YOLO("yolov8n.yaml")
    m.add_callback("on_train_batch_end", lambda tr: seen.append(stats()["frozen"]))
    _train(small_yolo, tmp_path, model=m)
    assert seen and all(seen), seen
    assert stats()["frozen"] is False
    # The shards went through this daemon (its node cache), not around it.
    assert sum(stats()["reads"].values()) > 0, stats()

    def boom(trainer):
        raise RuntimeError("boom in step")

    m = YOLO("yolov8n.yaml")
    m.add_callback("on_train_batch_end", boom)
    with pytest.raises(RuntimeError, match="boom in step"):
        _train(small_yolo, tmp_path, model=m)
    assert stats()["frozen"] is False, "an error left the ring frozen"


def test_the_dataset_pickles_without_its_engine_handle_and_reopens(small_yolo, tmp_path):
    import pickle

    m = _train(small_yolo, tmp_path, daemon=False)
    ds = m.trainer.train_loader.dataset
    assert type(ds).__name__ == "RamjetYOLODataset"
    first = ds.read_bytes(0)
    assert ds._reader is not None
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._reader is None
    assert copy.read_bytes(0) == first and copy._reader is not None
    img, hw0, hw = copy.load_image(3)
    assert hw0 == (480, 640) and max(hw) == 64 and img.shape[2] == 3
    # Labels came from the columns sidecars: boxes and sizes for every image, no files.
    assert len(ds.labels) == 48 and all(lb["shape"] == (480, 640) for lb in ds.labels)
    assert all(lb["im_file"].startswith(small_yolo + "/train/images/") for lb in ds.labels)


def test_same_seed_trains_exactly_as_stock_ultralytics_on_exported_files(tmp_path):
    """P3 against P2 step by step: the same seed gives the same batches, augmentations and
    losses whether stock Ultralytics reads exported files or ramjet streams the shards."""
    import uuid

    from ramjet.integrations.ultralytics import StepTimer, offline_environment, streaming_train

    offline_environment(str(tmp_path / "yolo-config"))
    from ultralytics import YOLO

    src = tmp_path / "files"
    _sh(RAMJET, "synth", src / "train", "--samples", 40)
    _sh(RAMJET, "synth", src / "val", "--samples", 8, "--seed", 9)
    url = f"s3://{os.environ.get('RAMJET_S3_BUCKET', 'ramjet')}/pytest-yolo-parity/{uuid.uuid4().hex[:8]}"
    for split in ("train", "val"):
        _sh(RAMJET, "pack", src / split, f"{url}/{split}", "--shard-size", "1MiB")
    names = ["crate", "ball", "sign", "pole", "barrel", "panel", "cone", "car"]
    (src / "data.yaml").write_text(f"path: {src}\ntrain: train/images\nval: val/images\nnames: {names}\n")

    class Enough(Exception):
        pass

    def run(train):
        m = YOLO("yolov8n.yaml")
        t = StepTimer().attach(m)

        def stop(tr):
            if len(t.steps) >= 4:
                raise Enough()

        m.add_callback("on_train_batch_end", stop)
        args = dict(epochs=1, batch=8, workers=0, imgsz=96, device="cpu", seed=0, deterministic=True, amp=False,
                    plots=False, val=False, project=str(tmp_path / "runs"), name="r", exist_ok=True)
        with pytest.raises(Enough):
            train(m, args)
        return [s["loss"] for s in t.steps]

    stock = run(lambda m, a: m.train(data=str(src / "data.yaml"), **a))
    streamed = run(lambda m, a: streaming_train(m, data=url, daemon=False, **a))
    assert len(stock) == len(streamed) == 4
    assert stock == pytest.approx(streamed, rel=1e-5, abs=1e-6), (stock, streamed)


def test_ultralytics_ddp_relaunch_file_rebuilds_the_ramjet_trainer(small_yolo, tmp_path):
    """Ultralytics' DDP re-launch pickles the trainer (class, args, model, callbacks) and runs
    a generated script in new processes. That script, run here as one CPU process (no GPUs on
    this machine), must rebuild RamjetDetectionTrainer by import and train from the URL."""
    from ramjet.integrations.ultralytics import RamjetDetectionTrainer, offline_environment

    offline_environment(str(tmp_path / "yolo-config"))
    from ultralytics.utils.dist import generate_ddp_file

    t = RamjetDetectionTrainer(overrides=dict(
        model="yolov8n.yaml", data=small_yolo, epochs=1, batch=8, workers=0, imgsz=64, device="cpu", plots=False,
        val=False, amp=False, project=str(tmp_path / "runs"), name="ddp", exist_ok=True))
    t.model = t.get_model(cfg="yolov8n.yaml", verbose=False)
    script = generate_ddp_file(t)
    env = dict(os.environ, YOLO_OFFLINE="1", YOLO_CONFIG_DIR=str(tmp_path / "yolo-config"))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    _sh(sys.executable, script, env=env, cwd=tmp_path)
    assert (tmp_path / "runs" / "ddp" / "weights" / "last.pt").is_file()


def test_data_resolves_from_a_url_with_splits_a_single_url_or_a_yaml_of_urls(small_yolo, tmp_path):
    from ramjet import InvalidInputError
    from ramjet.integrations.ultralytics import resolve_data

    d = resolve_data(small_yolo)
    assert (d["train"], d["val"]) == (small_yolo + "/train", small_yolo + "/val")
    assert d["nc"] == 8 and d["names"][0] == "crate" and d["channels"] == 3
    one = resolve_data(small_yolo + "/train")  # no splits below it: the dataset serves both
    assert one["train"] == one["val"] == small_yolo + "/train"
    y = tmp_path / "data.yaml"
    y.write_text(f"train: {small_yolo}/train\nval: {small_yolo}/val\nnames: [a, b, c, d, e, f, g, h]\n")
    d = resolve_data(str(y))
    assert d["names"][7] == "h" and d["val"] == small_yolo + "/val"
    y.write_text(f"train: {small_yolo}/train\nval: images/val\n")
    with pytest.raises(InvalidInputError, match="val is 'images/val', not a ramjet dataset URL"):
        resolve_data(str(y))
