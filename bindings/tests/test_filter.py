"""Nullable JSONL columns and filters in the order (issue 69, items 3 and 4): a null label
packs with `--column label:int64?` and arrives as the stored sentinel beside a `label_valid`
mask; `filter=` keeps the samples it passes before the order is dealt, so every rank agrees,
`len()` is right and resume is exact."""

import json

import pytest
import torch

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402,F401 - bindings/tests/ramjet_cli.py

N = 240
NULL = -(2**63)


def flags(i):
    return (i * 7) % 8


def label(i):
    return None if i % 5 == 0 else i % 10


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """A JSONL dataset of N rows in several shards: `sample_id`, `quality_flags` (0..7),
    `label` (int or null), `score` (float or null) and a caption."""
    d = tmp_path_factory.mktemp("flt")
    lines = []
    for i in range(N):
        lines.append({"sample_id": i, "quality_flags": flags(i), "label": label(i),
                      "score": None if i % 3 == 0 else i / N, "caption": "x" * (200 + i % 50)})
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run("pack", str(d / "rows.jsonl"), str(d / "p"), "--column", "label:int64?", "--column", "score:float64?",
        "--shard-size", "8192")
    assert ramjet.inspect(str(d / "p"))["shards"] > 4
    return str(d / "p")


def read(url, **kw):
    kw.setdefault("batch_size", 16)
    ds = ramjet.StreamingDataset(url, image_size=None, **kw)
    return ds, [b for b in ds]


def ids(batches):
    return [int(i) for b in batches for i in b["sample_id"]]


def test_a_null_without_a_nullable_type_is_refused_with_the_fix(tmp_path):
    (tmp_path / "r.jsonl").write_text('{"a": 1, "label": 3}\n{"a": 2, "label": null}\n')
    p = __import__("subprocess").run([RAMJET, "pack", str(tmp_path / "r.jsonl"), str(tmp_path / "p")],
                                     capture_output=True, text=True)
    assert p.returncode != 0 and "--column label:int64?" in p.stderr, p.stderr


def test_nullable_columns_arrive_as_values_plus_a_mask(rows):
    _, batches = read(rows, shuffle=False)
    got_l, got_v, got_s, got_sv = {}, {}, {}, {}
    for b in batches:
        assert b["label_valid"].dtype == torch.bool and b["label"].dtype == torch.int64
        for i, lv, v, s, sv in zip(b["sample_id"].tolist(), b["label"].tolist(), b["label_valid"].tolist(),
                                   b["score"].tolist(), b["score_valid"].tolist()):
            got_l[i], got_v[i], got_s[i], got_sv[i] = lv, v, s, sv
    assert sorted(got_l) == list(range(N))
    for i in range(N):
        assert got_v[i] == (label(i) is not None)
        assert got_l[i] == (NULL if label(i) is None else label(i))
        assert got_sv[i] == (i % 3 != 0)
        if i % 3:
            assert got_s[i] == pytest.approx(i / N)
    schema = dict(ramjet.inspect(rows)["schema"])
    assert (schema["label"], schema["score"], schema["sample_id"]) == ("int64?", "float64?", "int64")


@pytest.mark.parametrize("text,keep", [
    ("quality_flags & 0b101 == 0", lambda i: flags(i) & 0b101 == 0),
    ("label is not null", lambda i: label(i) is not None),
    ("label is null or (quality_flags | 1) == 7", lambda i: label(i) is None or (flags(i) | 1) == 7),
    # A comparison with a null is false, so its negation keeps the nulls.
    ("not (label >= 5) and sample_id < 200", lambda i: (label(i) is None or label(i) < 5) and i < 200),
])
def test_a_filter_keeps_exactly_its_samples_and_len_counts_them(rows, text, keep):
    want = sorted(i for i in range(N) if keep(i))
    ds, batches = read(rows, filter=text, seed=3)
    assert sorted(ids(batches)) == want
    assert len(ds) == -(-len(want) // 16)
    # Another epoch reshuffles the same kept samples.
    ds.set_epoch(1)
    again = ids(list(ds))
    assert sorted(again) == want and again != ids(batches)


def test_every_rank_agrees_and_steps_the_same_count(rows):
    text = "quality_flags & 0b101 == 0"
    want = sorted(i for i in range(N) if flags(i) & 0b101 == 0)
    for world in (2, 3):
        seen, counts = [], []
        for r in range(world):
            ds, batches = read(rows, filter=text, seed=5, batch_size=4, rank=r, world_size=world)
            counts.append(len(batches))
            assert len(batches) == len(ds)
            seen += ids(batches)
        assert len(set(counts)) == 1, (world, counts)
        # Padding may repeat samples to even the ranks out; never one the filter drops.
        assert set(seen) == set(want), world


def test_a_filtered_epoch_resumes_exactly(rows):
    text = "label is not null"
    full = ids(read(rows, filter=text, seed=8, batch_size=8)[1])
    ds = ramjet.StreamingDataset(rows, image_size=None, filter=text, seed=8, batch_size=8)
    it = iter(ds)
    head = [next(it) for _ in range(7)]
    state = json.loads(json.dumps(ds.state_dict()))
    del it, ds
    again = ramjet.StreamingDataset(rows, image_size=None, filter=text, seed=8, batch_size=8)
    again.load_state_dict(state)
    assert ids(head) + ids(list(again)) == full
    # A state saved under one filter does not resume under another (the order's samples differ).
    other = ramjet.StreamingDataset(rows, image_size=None, filter="label is null", seed=8, batch_size=8)
    with pytest.raises(ramjet.InvalidInputError, match="filter"):
        other.load_state_dict(state)
    assert state["contract"]["transform"]["filter"] == text


@pytest.mark.parametrize("text,why", [
    ("nope == 1", "no column"),
    ("caption & 1 == 0", "not an integer"),
    ("label ==", "expected a column"),
])
def test_a_bad_filter_is_refused_naming_it(rows, text, why):
    with pytest.raises(ramjet.InvalidInputError, match=why):
        read(rows, filter=text)
