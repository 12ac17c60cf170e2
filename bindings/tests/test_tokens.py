"""Token streams (ramjet.TokenDataset) and `ramjet pack --tokenizer`, on real packed datasets
(the local S3 server, and MosaicML's own MDSWriter in the peers' venv): the windows of an epoch,
put back in window order, are the epoch's documents concatenated with their end-of-document
tokens, for world sizes 1, 2, 3 and 8; a reader SIGKILLed mid-epoch resumes exactly; a
tokenizer-packed dataset decodes back to its text."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py

ROOT = Path(__file__).resolve().parents[2]
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
DOCS = 400
WORDS = ("the quick brown fox jumps over a lazy dog; ramjet streams tokens from object storage "
         "into training loops. Ünïcödé 日本語のテキスト emoji 🚀 tabs\tand\nnewlines").split(" ")


def fails(*args):
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True)
    assert out.returncode != 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def s3_url(name):
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    return f"s3://{BUCKET}/pytest-tokens/{name}-{uuid.uuid4().hex[:8]}"


def texts(n, seed):
    rng = random.Random(seed)
    # Lengths from empty to long (a document longer than a window spans several).
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 1, 3, 20, 90, 400]))) for _ in range(n)]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A JSONL of texts, a byte-level BPE tokenizer.json trained on it (with <|endoftext|>), and
    the JSONL packed to S3 with --tokenizer. Returns (url, texts, tokenizer path)."""
    d = tmp_path_factory.mktemp("tokens")
    docs = texts(DOCS, 1)
    with open(d / "docs.jsonl", "w") as f:
        for i, t in enumerate(docs):
            f.write(json.dumps({"id": i, "text": t, "source": "a"}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(str(d / "tokenizer.json"))
    url = s3_url("corpus")
    run("pack", str(d / "docs.jsonl"), url, "--tokenizer", str(d / "tokenizer.json"), "--shard-size", "8KiB")
    return url, docs, d / "tokenizer.json"


def doc_order(url, **order):
    """The epoch's document ids in order, read by the image loader's own path (world size 1)."""
    ds = ramjet.StreamingDataset(url, local=None, batch_size=7, image_size=None, boxes_column=None,
                                 rank=0, world_size=1, **order)
    return [int(i) for b in ds for i in b["id"]]


def token_lists(url):
    r = ramjet.Reader(url)
    return {int(s["id"]): s["tokens"].tolist() for s in r[:]}


def expected(url, eos, **order):
    toks = token_lists(url)
    out = []
    for i in doc_order(url, **order):
        out.extend(toks[i])
        if eos is not None:
            out.append(eos)
    return out


def windows_of(url, world, seq_len, **kw):
    """Every consumer of a job of `world` ranks, each drained; {window: row}."""
    got = {}
    for rank in range(world):
        ds = ramjet.TokenDataset(url, seq_len=seq_len, rank=rank, world_size=world, **kw)
        for b in ds:
            for w, row in zip(b["window"].tolist(), b["tokens"].tolist()):
                assert w not in got, f"window {w} twice"
                got[w] = row
    return got


def assert_concatenation(got, concat, seq_len):
    width = seq_len + 1
    n = len(concat) // width
    assert sorted(got) == list(range(n))
    for w in range(n):
        assert got[w] == concat[w * width:(w + 1) * width], f"window {w}"


def test_a_tokenizer_packed_dataset_decodes_back_to_its_text(corpus):
    url, docs, tok_path = corpus
    tok = Tokenizer.from_file(str(tok_path))
    info = ramjet.inspect(url)
    assert dict(info["schema"]) == {"id": "int64", "source": "str", "tokens": "uint16[?]"}
    meta = json.loads(info["meta_json"])["tokenizer"]
    assert meta["eos"] == tok.token_to_id("<|endoftext|>") and meta["eos_token"] == "<|endoftext|>"
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["text_column"] == "text"
    toks = token_lists(url)
    assert len(toks) == DOCS
    for i, t in enumerate(docs):
        assert toks[i] == tok.encode(t, add_special_tokens=False).ids, i
        assert tok.decode(toks[i]) == t, i


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_windows_of_an_epoch_are_its_documents_concatenated_for_every_world_size(corpus, world):
    url, _, _ = corpus
    eos = ramjet.TokenDataset(url).eos
    assert eos is not None, "eos='auto' takes the tokenizer's end-of-document token"
    order = dict(seed=5, shuffle_window=2)
    concat = expected(url, eos, **order)
    for seq_len in (16, 255):
        got = windows_of(url, world, seq_len, batch_size=3, **order)
        assert_concatenation(got, concat, seq_len)


def test_boundaries_give_positions_and_segments_that_restart_at_each_document(corpus):
    url, _, _ = corpus
    ds = ramjet.TokenDataset(url, seq_len=64, batch_size=4, boundaries=True, dtype="int32", shuffle=False)
    eos = ds.eos
    for b in ds:
        assert b["tokens"].dtype == torch.int32 and b["input_ids"].shape == b["position_ids"].shape
        for toks, pos, seg in zip(b["tokens"].tolist(), b["position_ids"].tolist(), b["segment_ids"].tolist()):
            for i in range(1, len(pos)):
                if toks[i - 1] == eos:
                    assert pos[i] == 0 and seg[i] == seg[i - 1] + 1
                else:
                    assert pos[i] == pos[i - 1] + 1 and seg[i] == seg[i - 1]
            assert seg[0] == 0


def test_pad_keeps_the_last_partial_window_and_says_how_long_it_is(corpus):
    url, _, _ = corpus
    ds = ramjet.TokenDataset(url, seq_len=100, batch_size=64, pad=65535, shuffle=False)
    concat = expected(url, ds.eos, shuffle=False)
    rows = [(w, t, n) for b in ds for w, t, n in zip(b["window"].tolist(), b["tokens"].tolist(), b["lengths"].tolist())]
    assert len(concat) % 101, "the corpus needs a partial window"
    w, t, n = rows[-1]
    assert w == len(concat) // 101 and n == len(concat) % 101
    assert t[:n] == concat[w * 101:] and set(t[n:]) == {65535}


def test_mixing_two_token_datasets_by_proportion(corpus, tmp_path):
    url, _, tok_path = corpus
    d = tmp_path / "b"
    d.mkdir()
    with open(d / "docs.jsonl", "w") as f:
        for i, t in enumerate(texts(150, 2)):
            f.write(json.dumps({"id": 10_000 + i, "text": t, "source": "b"}) + "\n")
    url_b = s3_url("mix-b")
    run("pack", str(d / "docs.jsonl"), url_b, "--tokenizer", str(tok_path), "--shard-size", "8KiB")
    mix = [ramjet.Source(url, proportion=3), ramjet.Source(url_b, proportion=1)]
    toks = {**token_lists(url), **token_lists(url_b)}
    eos = ramjet.TokenDataset(url).eos
    order = doc_order(mix, seed=3)
    assert 0.6 < sum(i < 10_000 for i in order) / len(order) < 0.9
    concat = [t for i in order for t in toks[i] + [eos]]
    got = windows_of(mix, 3, 50, batch_size=5, seed=3)
    assert_concatenation(got, concat, 50)


def test_resume_from_consumers_at_different_steps_on_another_world_size(corpus):
    url, _, _ = corpus
    seq_len = 40
    concat = expected(url, 0, seed=9)
    got = {}

    def take(ds, n):
        it = iter(ds)
        for _ in range(n):
            b = next(it, None)
            if b is None:
                break
            for w, row in zip(b["window"].tolist(), b["tokens"].tolist()):
                assert w not in got, f"window {w} twice"
                got[w] = row
        return ds.consumer_state()

    def job(world, steps, state=None):
        states = []
        for r in range(world):
            ds = ramjet.TokenDataset(url, seq_len=seq_len, batch_size=4, rank=r, world_size=world, seed=9, eos=0)
            if state is not None:
                ds.load_state_dict(state)
            states.append(take(ds, steps[r]))
        return ds.combine_states(states)

    s = job(4, [5, 0, 9, 2])
    assert s["ahead"], "consumers at different steps leave windows delivered ahead"
    s = job(2, [3, 7], s)
    s = job(8, [10**9] * 8, s)
    assert s["epoch"] == 1 and s["start"]["window"] == 0
    assert_concatenation(got, concat, seq_len)


READER = textwrap.dedent("""
    import json, os, sys
    import ramjet
    url, out, state_file = sys.argv[1:4]
    ds = ramjet.TokenDataset(url, seq_len=32, batch_size=2, seed=4, eos=0, prefetch_batches=2)
    if os.path.exists(state_file):
        ds.load_state_dict(json.load(open(state_file)))
    with open(out, "a") as f:
        for b in ds:
            for w, row in zip(b["window"].tolist(), b["tokens"].tolist()):
                f.write(json.dumps([w, row]) + "\\n")
            f.flush()
            tmp = state_file + ".tmp"
            with open(tmp, "w") as s:
                json.dump(ds.state_dict(), s)
            os.replace(tmp, state_file)
            os.fsync(f.fileno())
            print("batch", flush=True)
    print("done", flush=True)
""")


def test_a_reader_sigkilled_mid_epoch_resumes_exactly(corpus, tmp_path):
    """The reader writes each batch's windows, then its state; killed between any two batches
    (or between the two writes), a resumed reader yields exactly the windows not yet saved as
    delivered: the lines past the state's last batch are the replay, nothing else repeats."""
    url, _, _ = corpus
    concat = expected(url, 0, seed=4)
    script = tmp_path / "reader.py"
    script.write_text(READER)
    rng = random.Random(7)
    for attempt in range(3):
        out, state = tmp_path / f"out{attempt}.jsonl", tmp_path / f"state{attempt}.json"
        kills = 0
        while True:
            p = subprocess.Popen([sys.executable, str(script), url, str(out), str(state)],
                                 stdout=subprocess.PIPE, text=True)
            stop_after = rng.randint(1, 60)
            lines = 0
            for line in p.stdout:
                if line.startswith("done"):
                    break
                lines += 1
                if kills < 3 and lines >= stop_after:
                    p.send_signal(signal.SIGKILL)
                    kills += 1
                    break
            rc = p.wait(timeout=120)
            if rc == 0:
                break
            assert rc == -signal.SIGKILL, rc
        assert kills > 0
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        got = {}
        for w, row in rows:
            # A window written twice is one the killed reader wrote but had not yet saved as
            # delivered: the same window, the same tokens.
            assert got.setdefault(w, row) == row, w
        assert_concatenation(got, concat, 32)
        assert len(rows) - len(got) <= 3 * 2, "at most one batch replayed per kill"


def test_bad_arguments_and_states_are_refused_by_name(corpus):
    url, _, _ = corpus
    for kw, needle in [({"seq_len": 0}, "seq_len"), ({"batch_size": 0}, "batch_size"), ({"eos": -1}, "eos"),
                       ({"dtype": "float32"}, "float32"), ({"column": "source"}, "not a token array"),
                       ({"column": "nope"}, "no column"), ({"eos": "x"}, "eos"), ({"seq_len": 2.5}, "seq_len")]:
        with pytest.raises(ramjet.InvalidInputError, match=needle):
            ds = ramjet.TokenDataset(url, **kw)
            next(iter(ds))
    ds = ramjet.TokenDataset(url, seq_len=32, eos=0)
    next(iter(ds))
    good = ramjet.TokenDataset(url, seq_len=32, eos=0)
    state = ds.state_dict()
    for change, needle in [({"seq_len": 33}, "seq_len 33, not 32"), ({"kind": "images"}, "kind"),
                           ({"ahead": [0]}, "ahead"), ({"start": {"window": 0, "doc": 0, "offset": 10**9}}, "past document"),
                           ({"versions": ["0" * 32]}, "resume state"), ({"start": "x"}, "token resume state")]:
        bad = dict(state, **change)
        with pytest.raises(ramjet.InvalidInputError, match=needle):
            good.load_state_dict(bad)
            next(iter(good))


@pytest.mark.parametrize("column,needle", [("--text-column=id", "not text"), ("--text-column=nope", "no column")])
def test_pack_tokenizer_refuses_a_bad_text_column_by_name(corpus, tmp_path, column, needle):
    _, _, tok_path = corpus
    (tmp_path / "d.jsonl").write_text('{"id": 1, "text": "hello"}\n')
    assert needle in fails("pack", str(tmp_path / "d.jsonl"), str(tmp_path / "o"), "--tokenizer", str(tok_path), column)


def test_pack_tokenizer_refuses_a_file_that_is_not_a_tokenizer(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "t.json").write_text('{"not": "a tokenizer"}')
    assert "not a tokenizer.json" in fails("pack", str(tmp_path / "d.jsonl"), str(tmp_path / "o"), "--tokenizer",
                                           str(tmp_path / "t.json"))


MDS_WRITER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from streaming import MDSWriter
    out, kind = sys.argv[1:3]
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 50000, size=int(rng.choice([0 if kind == "bytes" else 1, 5, 100, 700]))).astype(np.int32) for _ in range(120)]
    cols = {"tokens": "bytes" if kind == "bytes" else "ndarray:int32", "id": "int"}
    with MDSWriter(out=out, columns=cols, size_limit=1 << 14) as w:
        for i, d in enumerate(docs):
            w.write({"tokens": d.tobytes() if kind == "bytes" else d, "id": i})
    json.dump([d.tolist() for d in docs], open(out + ".json", "w"))
""")


@pytest.mark.parametrize("kind", ["bytes", "ndarray"])
def test_mosaicml_token_mds_datasets_are_read_in_place(tmp_path, kind, bench_python, monkeypatch):
    monkeypatch.setenv("RAMJET_INDEX_DIR", str(tmp_path / "learned"))
    script = tmp_path / "w.py"
    script.write_text(MDS_WRITER)
    out = tmp_path / "mds"
    subprocess.run([bench_python, str(script), str(out), kind], check=True)
    docs = json.loads(Path(str(out) + ".json").read_text())
    kw = {"token_dtype": "int32"} if kind == "bytes" else {}
    if kind == "bytes":
        with pytest.raises(ramjet.InvalidInputError, match="token_dtype"):
            next(iter(ramjet.TokenDataset(str(out), seq_len=64, eos=None)))
    order = doc_order(str(out), seed=2)
    concat = [t for i in order for t in docs[i] + [7]]
    got = windows_of(str(out), 3, 64, batch_size=2, seed=2, eos=7, **kw)
    assert_concatenation(got, concat, 64)


@pytest.fixture(scope="session")
def bench_python():
    py = os.environ.get("RAMJET_BENCH_PYTHON")
    if not py:
        py = subprocess.run(["bash", str(ROOT / "tools/bench-venv.sh")], capture_output=True, text=True,
                            check=True).stdout.strip()
    return py


def test_a_split_tokenizer_pack_equals_one_pack_and_every_task_must_tokenize(corpus, tmp_path):
    _, docs, tok_path = corpus
    with open(tmp_path / "d.jsonl", "w") as f:
        for i, t in enumerate(docs[:120]):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    common = ["--tokenizer", str(tok_path), "--shard-size", "8KiB", "--group-size", "40"]
    one = run("pack", str(tmp_path / "d.jsonl"), str(tmp_path / "one"), *common)
    split = str(tmp_path / "split")
    for t in ("0", "1", "2"):
        run("pack", str(tmp_path / "d.jsonl"), split, *common, "--tasks", "3", "--task", t)
    merged = run("pack", str(tmp_path / "d.jsonl"), split, *common, "--tasks", "3", "--merge")
    version = [line for line in one.splitlines() if "manifest version" in line]
    assert version and version[0] in merged
    # A task of a plan made with --tokenizer, run without it, or with another file: refused.
    split = str(tmp_path / "split2")
    run("pack", str(tmp_path / "d.jsonl"), split, *common, "--tasks", "3", "--plan")
    out = fails("pack", str(tmp_path / "d.jsonl"), split, "--shard-size", "8KiB", "--group-size", "40",
                "--tasks", "3", "--task", "1")
    assert "no --tokenizer" in out
    # Another tokenizer file than the plan's is refused by its checksum.
    other = tmp_path / "other.json"
    tok = Tokenizer.from_file(str(tok_path))
    tok.add_special_tokens(["<|pad|>"])
    tok.save(str(other))
    out = fails("pack", str(tmp_path / "d.jsonl"), split, "--tokenizer", str(other), "--shard-size", "8KiB",
                "--group-size", "40", "--tasks", "3", "--task", "1")
    assert "checksum" in out


def test_close_stops_the_stream_and_keeps_the_position(corpus):
    """close() (and leaving a with block) lets the token stream go; state_dict is the same
    before and after, and iterating again yields the rest of the epoch: the same windows an
    uninterrupted epoch yields. After a whole epoch, close() keeps the next epoch's start."""
    url, _, _ = corpus
    make = lambda: ramjet.TokenDataset(url, seq_len=32, batch_size=4, seed=5, eos=0)  # noqa: E731
    full = [r for b in make() for r in b["tokens"].tolist()]
    with make() as ds:
        assert url in repr(ds) and "seq_len=32" in repr(ds) and "open=False" in repr(ds), repr(ds)
        it = iter(ds)
        head = [r for _ in range(3) for r in next(it)["tokens"].tolist()]
        state = ds.state_dict()
        assert "open=True" in repr(ds)
    assert "open=False" in repr(ds) and ds.state_dict() == state
    tail = [r for b in ds for r in b["tokens"].tolist()]
    assert head + tail == full
    ds.close()
    ds.close()  # twice is harmless
    assert ds.epoch == 1 and ds.state_dict() == {"kind": "tokens", "epoch": 1, "fresh": True}
