"""The `ramjet` Python package against real datasets on local disk and the local S3 server."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py


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


def _tls_memsz(so):
    """The size of a shared object's PT_TLS segment (ELF64, little-endian), from its headers."""
    import struct

    b = Path(so).read_bytes()
    assert b[:4] == b"\x7fELF" and b[4] == 2, so
    phoff, = struct.unpack_from("<Q", b, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", b, 0x36)
    for i in range(phnum):
        p_type, = struct.unpack_from("<I", b, phoff + i * phentsize)
        if p_type == 7:  # PT_TLS
            return struct.unpack_from("<Q", b, phoff + i * phentsize + 0x28)[0]
    return 0


def test_the_extension_loads_after_torch_with_a_small_static_tls_block():
    # The extension's thread-locals sit in a static TLS block (mimalloc's TLS is initial-exec),
    # which glibc carves at dlopen from a small surplus that libraries loaded before it share:
    # at 1,624 bytes, `import ramjet` after torch failed with "cannot allocate memory in static
    # TLS block". Large thread-local state is boxed; this keeps the block well under that.
    so = next(Path(ramjet.__file__).parent.glob("_ramjet*.so"))
    assert _tls_memsz(so) <= 1280, f"{so}: {_tls_memsz(so)} bytes of TLS"
    code = "import torch, torchvision, ultralytics, ramjet; print(ramjet.__name__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    # The last line: on a fresh machine, Ultralytics' first import prints to stdout that it
    # wrote its settings file.
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["ramjet"], (r.stdout[-500:], r.stderr[-2000:])
