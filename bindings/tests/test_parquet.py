"""Parquet read in place (issue 71, item 1): files written by the peers' own writers
(`pyarrow.parquet.write_table` with three codecs and row-group sizes, page CRCs in one; Hugging
Face `datasets`' `to_parquet` of an `Image()` column), every sample's every value read by
ramjet against what was written, from a local folder and the local S3 server; a damaged page
or a replaced file is named and never yields a wrong sample; a random read fetches only its row
group and the file's footer (counted behind a proxy); what is not read is refused by name."""

import json
import os
import shutil

import pytest

import ramjet
from counting_proxy import CountingProxy
from peer_values import assert_order_resume_ranks_mixing, learned, uploaded, write_fixtures  # noqa: F401
from ramjet_cli import run


@pytest.fixture(scope="module")
def pq(tmp_path_factory):
    return write_fixtures(tmp_path_factory, "parquet_fixtures.py", "expected.json")


def as_written(s):
    """A pa/ sample as ramjet gives it, in the fixture's JSON terms."""
    out = {
        "index": s["index"],
        "label": s["label"] if s["label_valid"] else None,
        "score": s["score"] if s["score_valid"] else None,
        "name": json.loads(s["name"]),  # strings with nulls: a JSON string or null
        "tag": s["tag"],
        "raw": s["raw"].hex(),
        "flag": s["flag"],
        "when": s["when"],
        "vec": s["vec"].tolist(),
        "ids": s["ids"].tolist(),
        "image": s["image"].hex(),
    }
    return out


def read_pa(url):
    r = ramjet.Reader(url)
    return {str(s["index"]): as_written(s) for s in r[list(range(len(r)))]}


def test_pyarrows_files_read_as_written_every_codec_and_row_group(pq):
    out, want = pq
    assert read_pa(str(out / "pa")) == want["pa"]
    info = ramjet.inspect(str(out / "pa"))
    # One shard a row group: 3 + 2 + 3.
    assert (info["source"], info["shards"], info["samples"]) == ("parquet", 8, 35)
    assert dict(info["schema"])["label"] == "int64?" and dict(info["schema"])["vec"] == "float32[?]"
    assert dict(info["schema"])["tag"] == "str" and dict(info["schema"])["name"] == "json"


def test_from_s3_too(pq):
    out, want = pq
    assert read_pa(uploaded(out / "pa", "parquet")) == want["pa"]


def test_hugging_face_images_decode_in_the_loader(pq):
    out, want = pq
    r = ramjet.Reader(str(out / "hf"))
    got = {str(s["_index"]): {"image": s["image"].hex(), "label": s["label"], "caption": s["caption"]}
           for s in r[list(range(len(r)))]}
    assert got == want["hf"]
    ds = ramjet.StreamingDataset(str(out / "hf"), image_size=8, batch_size=5, shuffle=False, cache_limit=None,
                                 boxes_column=None)
    seen = {}
    for b in ds:
        assert tuple(b["image"].shape[1:]) == (3, 8, 8)
        for i, label, caption in zip(b["_index"].tolist(), b["label"].tolist(), b["caption"]):
            seen[str(i)] = (label, caption)
    assert seen == {k: (v["label"], v["caption"]) for k, v in want["hf"].items()}


def test_ramjet_index_writes_the_manifest_beside_the_files(pq, tmp_path):
    src = tmp_path / "pa"
    shutil.copytree(pq[0] / "pa", src)
    run("index", str(src))
    assert (src / "manifest.json").exists()
    assert read_pa(str(src)) == pq[1]["pa"]
    assert not any((tmp_path / "learned").glob("*/manifest.json"))  # read through the index, not learned


def flip(path, offset):
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x5A
    path.write_bytes(bytes(b))


def test_a_damaged_page_is_named_and_yields_no_wrong_sample(pq, tmp_path):
    src = tmp_path / "pa"
    shutil.copytree(pq[0] / "pa", src)
    assert len(read_pa(str(src))) == 35  # learned: each row group's checksum kept
    flip(src / "b.parquet", pq[1]["pages"]["b.parquet"]["offset"])
    r = ramjet.Reader(str(src))
    first = pq[1]["pages"]["b.parquet"]["first_rows"][1]
    with pytest.raises(ramjet.Error, match=r"b\.parquet#rg=1"):
        r[first]
    # The other row groups still read, each as written.
    assert as_written(r[first - 1]) == pq[1]["pa"][str(first - 1)]


def test_a_page_crc_the_writer_wrote_is_checked(pq, tmp_path):
    src = tmp_path / "pa"
    shutil.copytree(pq[0] / "pa", src)
    flip(src / "c.parquet", pq[1]["pages"]["c.parquet"]["offset"])
    # Never read before: learning it meets the damaged page, which its CRC-32 names.
    with pytest.raises(ramjet.Error, match=r"c\.parquet#rg=1.*CRC"):
        ramjet.inspect(str(src))


def test_a_replaced_file_is_caught(pq, tmp_path):
    src = tmp_path / "pa"
    shutil.copytree(pq[0] / "pa", src)
    one = str(src / "{a,b}.parquet")
    assert len(ramjet.Reader(one)) == 24
    ramjet.Reader(one)[0]
    shutil.copy(src / "c.parquet", src / "a.parquet")
    with pytest.raises(ramjet.Error, match=r"a\.parquet"):
        ramjet.Reader(one)[1]


def test_a_random_read_fetches_only_its_row_group_and_footer(pq, tmp_path, monkeypatch):
    url = uploaded(pq[0] / "pa", "parquet-ranged")
    assert len(ramjet.Reader(url)) == 35  # learned once, directly
    host, port = os.environ["AWS_ENDPOINT_URL"].split("//")[1].split(":")
    proxy = CountingProxy("127.0.0.1", (host, int(port)))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{proxy.address}")
        r = ramjet.Reader(url, local=str(tmp_path / "cache"))
        assert as_written(r[12]) == pq[1]["pa"]["12"]  # b.parquet, row group 0 (rows 10-16)
        gets = [(p.rsplit("/", 1)[-1], rng) for m, p, rng in proxy.requests() if m == "GET" and ".parquet" in p]
        # The row group, and the footer unless this process read it already (while learning).
        assert {f for f, _ in gets} == {"b.parquet"} and 1 <= len(gets) <= 2, gets
        assert all(rng for _, rng in gets), gets  # each a ranged GET, never the whole file
        size = (pq[0] / "pa" / "b.parquet").stat().st_size
        spans = [tuple(int(x) for x in rng.split("=")[1].split("-")) for _, rng in gets]
        assert sum(hi - lo + 1 for lo, hi in spans) < size, (spans, size)
    finally:
        proxy.close()


def test_what_ramjet_does_not_read_is_refused_by_name(pq):
    with pytest.raises(ramjet.Error, match=r'"price".*decimals'):
        ramjet.inspect(str(pq[0] / "refused" / "decimal.parquet"))
    with pytest.raises(ramjet.Error, match=r"path-only\.parquet#rg=0 sample 1.*only a path"):
        ramjet.inspect(str(pq[0] / "refused" / "path-only.parquet"))
    with pytest.raises(ramjet.Error, match=r"save_to_disk.*to_parquet"):
        ramjet.inspect(str(pq[0] / "saved"))


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "learned"])
def test_order_exact_resume_ranks_and_mixing_as_for_ramjets_own_shards(pq, tmp_path, indexed):
    src = tmp_path / "pa"
    shutil.copytree(pq[0] / "pa", src)
    if indexed:
        run("index", str(src))

    assert_order_resume_ranks_mixing(src, 35, tmp_path)
