"""`ramjet pack` from data people already have (issue 71, item 3): a folder of Parquet files
(pyarrow's `write_table`, Hugging Face's `to_parquet`), a Hugging Face `save_to_disk` folder
(Arrow IPC streams) and LitData's optimized chunks, each written by the peer's own writer, packed
into ramjet shards whose every value is the writer's input; on one machine and split into
tasks (byte-identical), with --dedupe, --check-decode (--skip-bad) and --image-column; from a
local folder and the local S3 server; an input changed after its plan, or not packable, is
refused by name."""

import io
import json
import shutil
import subprocess

import pytest
from PIL import Image

import ramjet
from peer_values import ROOT, bench_python, described, learned, uploaded, write_fixtures  # noqa: F401 (learned: a fixture)
from ramjet_cli import RAMJET, run
from test_parquet import as_written


@pytest.fixture(scope="module")
def pq(tmp_path_factory):
    return write_fixtures(tmp_path_factory, "parquet_fixtures.py", "expected.json")


@pytest.fixture(scope="module")
def lit(tmp_path_factory):
    return write_fixtures(tmp_path_factory, "litdata_fixtures.py", "expected.json")


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """40 ImageNet-like JPEGs, some damaged with their headers intact, saved by `datasets` as
    Parquet (damaged/) and with save_to_disk in many files (damaged-saved/); a DatasetDict
    (dict/); and the names of the images whose whole decode fails."""
    d = tmp_path_factory.mktemp("hfdmg")
    run("synth", str(d / "s"), "--samples", "40", "--profile", "imagenet", "--damaged-per-mille", "200")
    subprocess.run([bench_python(), str(ROOT / "bindings/tests/pack_from_fixtures.py"), str(d), str(d / "s/images")],
                   check=True, cwd=d)
    failing = set()
    for f in sorted((d / "s/images").iterdir()):
        try:
            ramjet.decode_image(f.read_bytes())
        except ramjet.CorruptError:
            failing.add(f.name)
    assert failing, "the synth set has no image that fails to decode"
    return d, failing


def rows(url):
    r = ramjet.Reader(url)
    return [r[i] for i in range(len(r))]


def shown_size(b):
    return list(Image.open(io.BytesIO(b)).size)


def test_a_parquet_folder_packs_to_every_value_written(pq, tmp_path):
    out, want = pq
    run("pack", str(out / "pa"), str(tmp_path / "p"))
    info = ramjet.inspect(str(tmp_path / "p"))
    assert info["source"] == "parquet" and info["samples"] == 35
    got = rows(str(tmp_path / "p"))
    assert {str(s["index"]): as_written(s) for s in got} == want["pa"]
    # The image column gains its shown size, as an image folder's does.
    assert all([s["width"], s["height"]] == shown_size(s["image"]) for s in got)
    meta = json.loads((tmp_path / "p/manifest.json").read_text())["meta"]
    assert meta["image_column"] == "image" and meta["packed_from"]["format"] == "parquet"


@pytest.mark.parametrize("folder", ["hf", "saved"])
def test_hugging_faces_to_parquet_and_save_to_disk_pack_byte_exact(pq, tmp_path, folder):
    out, want = pq
    for src in (str(out / folder), uploaded(out / folder, f"pack-{folder}")):
        dst = tmp_path / ("s3" if src.startswith("s3") else "local")
        run("pack", src, str(dst))
        got = {str(i): {"image": s["image"].hex(), "label": s["label"], "caption": s["caption"]}
               for i, s in enumerate(rows(str(dst)))}
        assert got == want["hf"], src
    assert ramjet.inspect(str(tmp_path / "local"))["source"] == ("parquet" if folder == "hf" else "arrow")


def test_litdata_chunks_pack_to_what_they_read_as_in_place(lit, tmp_path):
    out, want = lit
    for src in (str(out / "plain"), uploaded(out / "plain", "pack-litdata")):
        dst = tmp_path / ("s3" if src.startswith("s3") else "local")
        run("pack", src, str(dst))
        packed, in_place = rows(str(dst)), rows(str(out / "plain"))
        assert len(packed) == 23
        for p, q in zip(packed, in_place):
            assert {k: v for k, v in p.items() if k not in ("width", "height")}.keys() == q.keys()
            for k, v in q.items():
                assert described(p[k]) == described(v), (k, p["index"])
            # LitData's jpeg field is the image column: the JPEG file itself, with its size.
            assert p["photo"].hex() == want[str(p["index"])]["photo_hex"]
            assert [p["width"], p["height"]] == shown_size(p["photo"])


def test_split_into_tasks_gives_the_same_bytes(pq, damaged, tmp_path):
    out, _ = pq
    d, _ = damaged
    for src in (str(out / "pa"), str(d / "damaged-saved")):
        args = ["--group-size", "10", "--shard-samples", "4"]
        one, split = tmp_path / "one", tmp_path / "split"
        shutil.rmtree(one, ignore_errors=True), shutil.rmtree(split, ignore_errors=True)
        run("pack", src, str(one), *args)
        for t in range(3):
            run("pack", src, str(split), *args, "--tasks", "3", "--task", str(t))
        run("pack", src, str(split), *args, "--tasks", "3", "--merge")
        m1, m2 = (json.loads((p / "manifest.json").read_text()) for p in (one, split))
        assert m1["version"] == m2["version"] and len(m1["shards"]) >= 4
        for s in m1["shards"]:
            assert (one / s["key"]).read_bytes() == (split / s["key"]).read_bytes()


def test_dedupe_by_content_and_by_column(lit, pq, tmp_path):
    out, want = lit
    # LitData's photo i is the same JPEG as photo i + 10.
    log = run("pack", str(out / "plain"), str(tmp_path / "c"), "--dedupe", "content")
    assert "13 duplicates dropped" in log, log
    ds = ramjet.StreamingDataset(str(tmp_path / "c"), image_size=None, batch_size=4, shuffle=False,
                                 boxes_column=None)
    assert sorted(i for b in ds for i in b["index"].tolist()) == list(range(10))
    pout, pwant = pq
    run("pack", str(pout / "pa"), str(tmp_path / "t"), "--dedupe", "tag")
    first = {}
    for k in sorted(pwant["pa"], key=int):
        first.setdefault(pwant["pa"][k]["tag"], int(k))
    ds = ramjet.StreamingDataset(str(tmp_path / "t"), image_size=None, batch_size=4, shuffle=False,
                                 boxes_column=None)
    assert sorted(i for b in ds for i in b["index"].tolist()) == sorted(first.values())


@pytest.mark.parametrize("folder", ["damaged", "damaged-saved"])
def test_check_decode_names_each_damaged_image_and_skip_bad_lists_them(damaged, tmp_path, folder):
    d, failing = damaged
    src = str(d / folder)
    p = subprocess.run([RAMJET, "pack", src, str(tmp_path / "x"), "--check-decode"], capture_output=True, text=True)
    assert p.returncode != 0 and "does not decode" in p.stderr and src in p.stderr, p.stderr
    log = run("pack", src, str(tmp_path / "ok"), "--check-decode", "--skip-bad")
    assert sum("does not decode" in line for line in log.splitlines()) == len(failing), log
    kept = rows(str(tmp_path / "ok"))
    assert len(kept) == 40 - len(failing) and not {s["name"] for s in kept} & failing
    for s in kept:
        ramjet.decode_image(s["image"])
    # Without the check the damaged images are packed as they are, bytes and all.
    run("pack", src, str(tmp_path / "plain"))
    assert len(rows(str(tmp_path / "plain"))) == 40


def test_an_input_changed_after_its_plan_is_refused_by_the_task(damaged, tmp_path):
    d, _ = damaged
    src = tmp_path / "saved"
    shutil.copytree(d / "damaged-saved", src)
    run("pack", str(src), str(tmp_path / "dst"), "--tasks", "2", "--plan", "--group-size", "8")
    files = sorted(src.glob("data-*.arrow"))
    shutil.copy(files[1], files[0])  # same schema, other rows
    p = subprocess.run([RAMJET, "pack", str(src), str(tmp_path / "dst"), "--tasks", "2", "--task", "0",
                        "--group-size", "8"], capture_output=True, text=True)
    assert p.returncode != 0 and "the input changed since it was planned" in p.stderr, p.stderr


def test_what_cannot_be_packed_is_refused_by_name(pq, damaged, tmp_path):
    out, _ = pq
    d, _ = damaged
    cases = [
        ([str(d / "dict")], "a DatasetDict saved with save_to_disk: pack one split's folder"),
        ([str(out / "pa"), "--column", "label:int32"], "--column"),
        ([str(out / "pa"), "--tokenizer", str(out / "expected.json")], "not a tokenizer.json"),
        ([str(out / "pa"), "--image-column", "label"], 'column "label"'),
        ([str(out / "pa"), "--image-column", "nope"], 'no column "nope"'),
        ([str(out / "hf"), "--format", "litdata"], "--format litdata, but it reads as parquet"),
    ]
    for args, says in cases:
        p = subprocess.run([RAMJET, "pack", args[0], str(tmp_path / "x"), *args[1:]], capture_output=True,
                           text=True)
        assert p.returncode != 0 and says in p.stderr, (args, p.stderr)


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_fixtures(tmp_path_factory, "mosaicml_fixtures.py", "decoded.json")


def test_mosaicmls_mds_packs_to_what_it_reads_as_in_place(mds, tmp_path):
    out, _ = mds
    for name in ("quick", "typed"):
        run("pack", str(out / name), str(tmp_path / name))
        packed, in_place = rows(str(tmp_path / name)), rows(str(out / name))
        assert len(packed) == len(in_place) > 0
        for p, q in zip(packed, in_place):
            assert {k: described(v) for k, v in p.items() if k not in ("width", "height")} == {
                k: described(v) for k, v in q.items()}
    # The quick start's JPEG column is the image column: its shown size is added.
    meta = json.loads((tmp_path / "quick/manifest.json").read_text())["meta"]
    assert meta["image_column"] == "img" and meta["packed_from"]["format"] == "mds"
    assert all([s["width"], s["height"]] == [48, 32] for s in rows(str(tmp_path / "quick")))


@pytest.mark.parametrize("folder", ["hf", "saved"])
def test_a_text_column_is_tokenized_as_a_jsonl_one_is(pq, tmp_path, folder):
    """--tokenizer over a Parquet or save_to_disk text column: the tokens of each caption, in
    its place, as the tokenizer itself encodes it; the images beside them as written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out, want = pq
    captions = [v["caption"] for v in want["hf"].values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(captions, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    run("pack", str(out / folder), str(tmp_path / "t"), "--tokenizer", str(tmp_path / "tokenizer.json"),
        "--text-column", "caption")
    got = rows(str(tmp_path / "t"))
    assert len(got) == len(captions)
    for i, s in enumerate(got):
        assert s["tokens"].tolist() == tok.encode(want["hf"][str(i)]["caption"]).ids
        assert s["image"].hex() == want["hf"][str(i)]["image"] and "caption" not in s
    meta = json.loads((tmp_path / "t/manifest.json").read_text())["meta"]
    assert meta["tokenizer"]["text_column"] == "caption" and meta["tokenizer"]["eos_token"] == "<|endoftext|>"
