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

from peer_values import described, learned, uploaded, write_fixtures  # noqa: F401 (learned: a fixture)



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

    def order(ds):
        return [int(i) for b in ds for i in b["index"].tolist()]

    kw = dict(image_size=None, batch_size=3, shuffle=True, seed=5, cache_limit=None, boxes_column=None)
    full = order(ramjet.StreamingDataset(str(src), **kw))
    assert sorted(full) == list(range(23)) and full != sorted(full)
    ds = ramjet.StreamingDataset(str(src), **kw)
    it = iter(ds)
    head = [int(i) for _ in range(4) for i in next(it)["index"].tolist()]
    resumed = ramjet.StreamingDataset(str(src), **kw)
    resumed.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert head + order(resumed) == full
    # Two ranks split the epoch, every sample once (tail="uneven": no padding to even steps).
    ranks = [order(ramjet.StreamingDataset(str(src), **kw, rank=r, world_size=2, tail="uneven")) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == list(range(23))
    # Mixed with a ramjet dataset in one global order: every sample of each, interleaved.
    images = tmp_path / "synth"
    run("synth", str(images), "--samples", "6")
    run("pack", str(images), str(tmp_path / "packed"))
    out = tmp_path / "mixed.txt"
    run("stream", str(src), str(tmp_path / "packed"), "--shuffle", "global", "--seed", "1", "--out", str(out))
    sources = [line.split()[2] for line in out.read_text().splitlines()]
    assert (sources.count("0"), sources.count("1")) == (23, 6)
    assert sources != sorted(sources)
