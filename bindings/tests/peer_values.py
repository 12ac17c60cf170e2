"""What the peers' tests share: the peers' venv (where MosaicML's and LitData's writers run,
tools/bench-venv.sh, never the core venv), and how a decoded value is told from another (so
the fixture writers there and the tests here describe alike)."""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


def bench_python():
    """The peers' venv's python (made on first use)."""
    return os.environ.get("RAMJET_BENCH_PYTHON") or subprocess.run(
        ["bash", str(ROOT / "tools/bench-venv.sh")], capture_output=True, text=True, check=True).stdout.strip()


def write_fixtures(tmp_path_factory, script, record):
    """Runs `bindings/tests/<script> OUT` in the peers' venv, in a fresh folder; returns the
    folder and the JSON `record` it wrote there."""
    out = tmp_path_factory.mktemp(Path(script).stem)
    subprocess.run([bench_python(), str(ROOT / "bindings/tests" / script), str(out)], check=True, cwd=out)
    return out, json.loads((out / record).read_text())


@pytest.fixture(autouse=True)
def learned(tmp_path, monkeypatch):
    """This test's own folder of learned manifests (imported by a test module, it is its)."""
    monkeypatch.setenv("RAMJET_INDEX_DIR", str(tmp_path / "learned"))


def described(v):
    """A decoded value as JSON: an image as mode, size and a hash of its pixels; a tensor or
    NumPy array as dtype, shape and values; bytes as hex; a NumPy scalar as dtype and value;
    anything else as its type and value."""
    if isinstance(v, Image.Image):
        return {"mode": v.mode, "size": list(v.size), "sha": hashlib.sha256(v.tobytes()).hexdigest()}
    if hasattr(v, "numpy") and not isinstance(v, np.generic):  # a torch tensor
        v = v.numpy()
    if isinstance(v, np.ndarray):
        return {"dtype": str(v.dtype), "shape": list(v.shape), "list": v.tolist()}
    if isinstance(v, (bytes, memoryview)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, np.generic):
        return {"dtype": str(v.dtype), "value": v.item()}
    return {"type": type(v).__name__, "value": v}


def uploaded(src, name):
    """Uploads every file of the folder `src` to a fresh prefix of the local S3 server's bucket;
    returns its s3:// URL. Fails (never skips) when the server is not configured."""
    import uuid

    import boto3

    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    bucket = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
    prefix = f"pytest-{name}/{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3")
    for f in Path(src).iterdir():
        s3.upload_file(str(f), bucket, f"{prefix}/{f.name}")
    return f"s3://{bucket}/{prefix}"


def assert_order_resume_ranks_mixing(src, n, tmp_path):
    """A foreign dataset at `src`, of `n` samples with an `index` field 0 to n - 1, keeps the
    guarantees of ramjet's own shards: a shuffled epoch holds every sample once, a state
    resumes it exactly, two ranks split it (every sample once), and `ramjet stream` mixes it
    with a ramjet dataset in one global order."""
    import ramjet
    from ramjet_cli import run

    def order(ds):
        return [int(i) for b in ds for i in b["index"].tolist()]

    kw = dict(image_size=None, batch_size=3, shuffle=True, seed=5, cache_limit=None, boxes_column=None)
    full = order(ramjet.StreamingDataset(str(src), **kw))
    assert sorted(full) == list(range(n)) and full != sorted(full)
    ds = ramjet.StreamingDataset(str(src), **kw)
    it = iter(ds)
    head = [int(i) for _ in range(4) for i in next(it)["index"].tolist()]
    resumed = ramjet.StreamingDataset(str(src), **kw)
    resumed.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert head + order(resumed) == full
    # Two ranks split the epoch, every sample once (tail="uneven": no padding to even steps).
    ranks = [order(ramjet.StreamingDataset(str(src), **kw, rank=r, world_size=2, tail="uneven")) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == list(range(n))
    # Mixed with a ramjet dataset in one global order: every sample of each, interleaved.
    images = tmp_path / "synth"
    run("synth", str(images), "--samples", "6")
    run("pack", str(images), str(tmp_path / "packed"))
    out = tmp_path / "mixed.txt"
    run("stream", str(src), str(tmp_path / "packed"), "--shuffle", "global", "--seed", "1", "--out", str(out))
    sources = [line.split()[2] for line in out.read_text().splitlines()]
    assert (sources.count("0"), sources.count("1")) == (n, 6)
    assert sources != sorted(sources)
