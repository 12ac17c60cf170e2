"""LitData's optimized datasets read in place (issue 71, item 2): data written by
`litdata.optimize` itself (in the peers' venv) read by ramjet, every sample's every field
against what LitData's own StreamingDataset reads, from a local folder and the local S3
server; a changed chunk is named and never yields a wrong sample; what is not read is
refused by name."""

import json
import shutil

import numpy as np
import pytest
from PIL import Image

import ramjet
from ramjet.compat.mosaicml import StreamingDataset as ByField

from peer_values import assert_order_resume_ranks_mixing, described, learned, uploaded, write_fixtures  # noqa: F401



@pytest.fixture(scope="module")
def lit(tmp_path_factory):
    return write_fixtures(tmp_path_factory, "litdata_fixtures.py", "expected.json")


def read_all(url):
    """Every sample, each field as MosaicML's compat decodes it; the JPEG file as its size."""
    out = {}
    for s in ByField(remote=url):
        photo = s.pop("photo")
        assert isinstance(photo, Image.Image) and photo.size == (9, 6)
        # LitData reads int and float fields as Python numbers; the compat, as MosaicML, as
        # NumPy scalars of the same value.
        out[str(s["index"])] = {k: described(v.item() if isinstance(v, np.generic) else v) for k, v in s.items()}
    return out


def strip(want):
    return {k: {f: x for f, x in v.items() if f != "photo_hex"} for k, v in want.items()}


def test_every_field_reads_as_litdata_reads_it(lit):
    out, want = lit
    assert read_all(str(out / "plain")) == strip(want)
    info = ramjet.inspect(str(out / "plain"))
    assert info["samples"] == 23 and info["shards"] == len(list((out / "plain").glob("chunk-*.bin")))


def test_from_s3_too(lit):
    out, want = lit
    assert read_all(uploaded(out / "plain", "litdata")) == strip(want)


def test_the_engines_own_batches_hold_the_same_values(lit):
    out, want = lit
    ds = ramjet.StreamingDataset(str(out / "plain"), image_size=None, shuffle=False, batch_size=5, cache_limit=None,
                                 boxes_column=None)
    got = {}
    for b in ds:
        for i in range(len(b["_index"])):
            got[str(int(b["index"][i]))] = (bytes(b["raw"][i]).hex(), bytes(b["photo"][i]).hex(), b["name"][i],
                                            float(b["score"][i]))
    # The JPEG file's bytes exactly as written, beside the other fields.
    assert got == {k: (v["raw"]["hex"], v["photo_hex"], v["name"]["value"], v["score"]["value"])
                   for k, v in want.items()}


def test_a_changed_chunk_is_named_and_yields_no_wrong_sample(lit, tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(lit[0] / "plain", src)
    assert len(read_all(str(src))) == 23  # learned, each chunk's checksum kept
    chunk = sorted(src.glob("chunk-*.bin"))[1]
    b = bytearray(chunk.read_bytes())
    b[-3] ^= 0xFF
    chunk.write_bytes(bytes(b))
    with pytest.raises(ramjet.Error, match=chunk.name):
        read_all(str(src))


def test_what_ramjet_does_not_read_is_refused_by_name(lit, tmp_path):
    with pytest.raises(ramjet.Error, match="compressed LitData chunks"):
        ramjet.inspect(str(lit[0] / "zstd"))
    src = tmp_path / "pkl"
    shutil.copytree(lit[0] / "plain", src)
    ix = json.loads((src / "index.json").read_text())
    ix["config"]["data_format"][5] = "pickle"
    (src / "index.json").write_text(json.dumps(ix))
    with pytest.raises(ramjet.Error, match="pickle.*refused"):
        ramjet.inspect(str(src))


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "learned"])
def test_order_exact_resume_ranks_and_mixing_as_for_ramjets_own_shards(lit, tmp_path, indexed):
    from ramjet_cli import run

    src = tmp_path / "plain"
    shutil.copytree(lit[0] / "plain", src)
    if indexed:
        run("index", str(src))
        assert (src / "manifest.json").exists()

    assert_order_resume_ranks_mixing(src, 23, tmp_path)
