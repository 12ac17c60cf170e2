"""Aspect-ratio buckets (issue 69, item 5): `buckets=[(h, w), ...]` puts each sample in the
bucket nearest its aspect ratio by the manifest's width and height, every batch is one bucket's
shape and full, every rank yields the same number of batches, and a saved state resumes
exactly (docs/order.md, "Aspect-ratio buckets")."""

import json
import math

import pytest
from PIL import Image

import ramjet

from ramjet_cli import run  # noqa: E402,F401 - bindings/tests/ramjet_cli.py

BUCKETS = [(32, 32), (24, 48), (48, 24)]  # (height, width): square, wide, tall
SIZES = {"sq": (40, 40), "wide": (80, 36), "tall": (30, 70), "four3": (44, 33)}  # (w, h)
N = 150
BS = 4


def kind(i):
    return ["sq", "sq", "wide", "tall", "sq", "wide", "four3"][i % 7]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """An image folder of N JPEGs in four shapes (three of them nearest one bucket each, and
    4:3, nearest the square one), packed in many shards."""
    root = tmp_path_factory.mktemp("buckets")
    for i in range(N):
        d = root / "folder" / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", SIZES[kind(i)], (i % 256, 80, 160)).save(d / f"{i:03d}_{kind(i)}.jpg", quality=85)
    run("pack", str(root / "folder"), str(root / "p"), "--shard-size", "16KiB")
    assert ramjet.inspect(str(root / "p"))["shards"] > 4
    return str(root / "p")


def nearest(w, h):
    return min(range(len(BUCKETS)), key=lambda b: abs(math.log(w / h) - math.log(BUCKETS[b][1] / BUCKETS[b][0])))


def make(url, **kw):
    kw.setdefault("batch_size", BS)
    return ramjet.StreamingDataset(url, image_size=32, augment="resize", buckets=BUCKETS, seed=3, **kw)


def paths(batches):
    return [p for b in batches for p in b["path"]]


def test_every_batch_is_one_bucket_and_each_sample_its_nearest(packed):
    ds = make(packed)
    batches = list(ds)
    assert len(batches) == len(ds) > 0
    shapes = set()
    for b in batches:
        assert len(b["path"]) == BS, "every batch is full"
        h, w = b["image"].shape[2:]
        shapes.add((h, w))
        for p, sw, sh in zip(b["path"], b["width"], b["height"]):
            assert BUCKETS[nearest(int(sw), int(sh))] == (h, w), p
            assert (int(sw), int(sh)) == SIZES[p.split("_")[1][:-4]], p
    assert shapes == set(BUCKETS)
    # No sample twice; what the buckets left out is counted.
    got = paths(batches)
    assert len(got) == len(set(got))
    assert ds.metrics()["samples_left_out"] == N - len(got)
    assert N - len(got) <= len(BUCKETS) * (BS - 1) + BS
    # 4:3 goes to the square bucket (nearer than 2:1 on a log scale).
    assert any("four3" in p for p in got)


def test_the_order_is_deterministic_and_follows_the_seed(packed):
    a, b = paths(list(make(packed))), paths(list(make(packed)))
    assert a == b
    ds = make(packed)
    ds.set_epoch(1)
    assert paths(list(ds)) != a


def test_every_rank_yields_the_same_number_of_batches(packed):
    for world in (2, 3):
        counts, seen = [], []
        for r in range(world):
            ds = make(packed, rank=r, world_size=world, shuffle_algo="global")
            batches = list(ds)
            counts.append(len(batches))
            assert len(batches) == len(ds), (world, r)
            assert all(len(b["path"]) == BS for b in batches)
            seen += paths(batches)
        assert len(set(counts)) == 1 and counts[0] > 0, (world, counts)
        # The default tail under several ranks pads with repeats; none past one repeat each.
        assert len(set(seen)) >= len(seen) - world


def test_a_bucketed_epoch_resumes_exactly(packed):
    full = paths(list(make(packed)))
    for k in (1, 5, len(full) // BS - 1):
        ds = make(packed)
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(ds.state_dict()))
        del it, ds
        again = make(packed)
        again.load_state_dict(state)
        assert paths(head) + paths(list(again)) == full, k
        assert state["contract"]["transform"]["buckets"] == [list(b) for b in BUCKETS]


def test_a_finished_epoch_s_state_starts_the_next(packed):
    ds = make(packed)
    list(ds)
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["epoch"] == 1 and "consumers" not in state
    nxt = make(packed)
    nxt.set_epoch(1)
    again = make(packed)
    again.load_state_dict(state)
    assert paths(list(again)) == paths(list(nxt))


def test_a_state_resumed_on_more_ranks_yields_each_waiting_sample_once(packed):
    ds = make(packed, shuffle_algo="global")
    it = iter(ds)
    head = paths([next(it) for _ in range(6)])
    state = json.loads(json.dumps(ds.state_dict()))
    del it, ds
    assert "buckets" in json.loads(state["consumers"][0])
    rest = []
    for r in range(2):
        ds = make(packed, rank=r, world_size=2, tail="uneven", shuffle_algo="global")
        ds.load_state_dict(state)
        rest += paths(list(ds))
    assert not set(head) & set(rest), "nothing yielded before is yielded again"
    assert len(rest) == len(set(rest))


def test_a_tampered_bucket_state_is_refused_naming_the_field(packed):
    ds = make(packed)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    own = json.loads(state["consumers"][0])
    own["buckets"]["emitted"] = own["buckets"]["batches"] + 1
    state["consumers"][0] = json.dumps(own)
    again = make(packed)
    again.load_state_dict(state)
    with pytest.raises(ramjet.InvalidInputError, match="buckets.emitted"):
        list(again)


def test_a_state_under_other_buckets_is_refused(packed):
    ds = make(packed)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    other = ramjet.StreamingDataset(packed, image_size=32, augment="resize", buckets=[(32, 32)], seed=3, batch_size=BS)
    with pytest.raises(ramjet.InvalidInputError, match="buckets"):
        other.load_state_dict(state)


@pytest.mark.parametrize("kw,why", [
    ({"buckets": [(32, 32)], "image_size": None}, "image_size"),
    ({"buckets": [(32, 0)]}, "buckets\\[0\\]"),
    ({"buckets": [(32, 32), (32, 32)]}, "twice"),
    ({"buckets": []}, "buckets"),
    ({"buckets": [32]}, "pair"),
])
def test_absurd_buckets_are_refused_naming_them(packed, kw, why):
    with pytest.raises(ramjet.InvalidInputError, match=why):
        ramjet.StreamingDataset(packed, **kw)


def test_dataloader_workers_each_yield_the_same_count(packed):
    """Each DataLoader worker is a consumer: each yields the epoch's N, and len(loader) says so."""
    import torch

    ds = make(packed)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader) > 0
    assert len(loader) % 2 == 0
    assert all(len(b["path"]) == BS for b in batches)
    got = paths(batches)
    assert len(got) == len(set(got))
