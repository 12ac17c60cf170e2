"""The `ramjet` Python package against real datasets on local disk and the local S3 server."""

import os
import subprocess
import uuid
from pathlib import Path

import pytest

import ramjet

RAMJET = os.environ.get("RAMJET_BIN") or str(Path(__file__).resolve().parents[2] / "target/debug/ramjet")


def run(*args):
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth") / "ds"
    run("synth", str(d), "--samples", "12")
    return d


@pytest.fixture()
def local_ds(synth, tmp_path):
    out = tmp_path / "packed"
    run("pack", str(synth), str(out), "--shard-size", "256KiB")
    return out


def test_exceptions_form_one_tree():
    for cls in (ramjet.NotFoundError, ramjet.CorruptError, ramjet.OriginError, ramjet.AuthError, ramjet.InvalidInputError):
        assert issubclass(cls, ramjet.Error)
    assert ramjet.__version__


def test_inspect_local(local_ds):
    info = ramjet.inspect(str(local_ds))
    assert info["samples"] == 12
    assert info["source"] == "yolo"
    assert ("image", "bytes") in info["schema"]
    assert info["shards"] > 1
    assert len(info["version"]) == 32


def test_verify_finds_a_flipped_byte(local_ds):
    assert ramjet.verify(str(local_ds))["ok"]
    shard = sorted((local_ds / "shards").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = ramjet.verify(str(local_ds))
    assert not res["ok"]
    assert any(shard.name in p and "checksum mismatch" in p for p in res["problems"]), res["problems"]


def test_missing_dataset_raises_not_found(tmp_path):
    with pytest.raises(ramjet.NotFoundError, match="manifest.json"):
        ramjet.inspect(str(tmp_path))


def test_bad_url_raises_invalid_input():
    with pytest.raises(ramjet.InvalidInputError, match="unsupported scheme"):
        ramjet.inspect("ftp://example/x")


def test_s3_round_trip(synth):
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    url = f"s3://{os.environ.get('RAMJET_S3_BUCKET', 'ramjet')}/pytest/{uuid.uuid4().hex}"
    run("pack", str(synth), url)
    info = ramjet.inspect(url)
    assert info["url"] == f"{url}/manifest.json"
    assert ramjet.verify(url)["ok"]
    with pytest.raises(ramjet.NotFoundError):
        ramjet.inspect(url + "-absent")
