"""`ramjet pack --dedupe KEY|content` (issue 69, item 3): later duplicates are dropped and
counted, by a column or by the image bytes, with the same manifest for one machine and for a
pack split into tasks; every reader leaves the dropped samples out."""

import hashlib
import json
import shutil
import subprocess

import pytest

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py


def pack_both(src, tmp_path, *args):
    """`src` packed on one machine and split into 3 tasks then merged: the two manifests."""
    one, split = str(tmp_path / "one"), str(tmp_path / "split")
    out = run("pack", src, one, *args)
    for t in range(3):
        run("pack", src, split, *args, "--tasks", "3", "--task", str(t))
    run("pack", src, split, *args, "--tasks", "3", "--merge")
    return out, one, split


def manifest(url):
    with open(f"{url}/manifest.json") as f:
        return json.load(f)


def delivered(url, column):
    ds = ramjet.StreamingDataset(url, image_size=None, batch_size=7, seed=2)
    got = [v for b in ds for v in b[column]]
    return ds, got


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An image folder of 80 JPEGs, some byte copies of earlier ones (`synth
    --duplicate-per-mille`), in two classes; and the paths of each content's first copy."""
    d = tmp_path_factory.mktemp("dup")
    run("synth", str(d / "s"), "--samples", "80", "--profile", "imagenet", "--duplicate-per-mille", "250")
    files = sorted((d / "s" / "images").iterdir())
    first = {}
    for k, f in enumerate(files):
        cls = f"c{k % 2}"
        (d / "f" / cls).mkdir(parents=True, exist_ok=True)
        shutil.copy(f, d / "f" / cls / f.name)
    for cls in ("c0", "c1"):
        for f in sorted((d / "f" / cls).iterdir()):
            first.setdefault(hashlib.sha256(f.read_bytes()).digest(), f"{cls}/{f.name}")
    assert 10 < 80 - len(first) < 40, "the synth set should hold a fair share of duplicates"
    return str(d / "f"), set(first.values())


def test_dedupe_by_content_drops_later_copies_the_same_split_or_not(folder, tmp_path):
    src, keep = folder
    out, one, split = pack_both(src, tmp_path, "--dedupe", "content", "--group-size", "16", "--shard-size", "200000")
    m1, m2 = manifest(one), manifest(split)
    assert m1["version"] == m2["version"] and m1["meta"]["dedupe"] == m2["meta"]["dedupe"]
    assert m1["meta"]["dedupe"]["by"] == "content" and m1["meta"]["dedupe"]["dropped"] == 80 - len(keep)
    assert f"{80 - len(keep)} duplicates" in out, out
    for url in (one, split):
        ds, paths = delivered(url, "path")
        assert sorted(paths) == sorted(keep)
        assert len(ds) == -(-len(keep) // 7)
    # Two ranks split the kept samples between them, evenly.
    r = [delivered_rank(one, k) for k in range(2)]
    assert len(r[0]) == len(r[1]) and set(r[0]) | set(r[1]) == keep


def delivered_rank(url, rank):
    ds = ramjet.StreamingDataset(url, image_size=None, batch_size=4, seed=2, rank=rank, world_size=2)
    return [v for b in ds for v in b["path"]]


def test_dedupe_by_a_column_keeps_each_first_row(tmp_path):
    rows = []
    for i in range(300):
        sid = i if i % 4 else i // 2  # every fourth row repeats an earlier (or its own) id
        rows.append({"sample_id": sid, "caption": f"row {i}", "label": i % 3})
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(r["sample_id"], r["caption"])
    _, one, split = pack_both(str(tmp_path / "r.jsonl"), tmp_path, "--dedupe", "sample_id", "--group-size", "64",
                              "--shard-size", "4096")
    assert manifest(one)["version"] == manifest(split)["version"]
    assert manifest(one)["meta"]["dedupe"] == {**manifest(one)["meta"]["dedupe"], "by": "sample_id",
                                               "dropped": 300 - len(first)}
    for url in (one, split):
        _, caps = delivered(url, "caption")
        assert sorted(caps) == sorted(first.values())


def test_a_bad_dedupe_key_is_refused_naming_it(tmp_path):
    (tmp_path / "r.jsonl").write_text('{"a": 1}\n')
    p = subprocess.run([RAMJET, "pack", str(tmp_path / "r.jsonl"), str(tmp_path / "p"), "--dedupe", "nope"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "--dedupe" in p.stderr and "no column \"nope\"" in p.stderr, p.stderr


def test_a_tampered_dropped_list_is_refused_naming_it(folder, tmp_path):
    src, _ = folder
    run("pack", src, str(tmp_path / "p"), "--dedupe", "content")
    m = manifest(str(tmp_path / "p"))
    obj = tmp_path / "p" / m["meta"]["dedupe"]["key"]
    b = bytearray(obj.read_bytes())
    b[0] ^= 1
    obj.write_bytes(bytes(b))
    with pytest.raises(ramjet.CorruptError, match="excluded/"):
        list(ramjet.StreamingDataset(str(tmp_path / "p"), image_size=None, batch_size=8))
