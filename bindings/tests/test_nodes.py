"""Each node reads only its share (docs/order.md, "Dealing the order to consumers"): the same
global batches, pixel for pixel, for 1, 2, 4 and 8 ranks on 1, 2 and 4 nodes; exact resume
across a change of nodes; and even steps by default under several ranks."""

import json

import pytest
import torch

import ramjet
from test_loader import N, classes, dataset, indices, synth  # noqa: F401 - shared fixtures

PARTITIONS = 8
GLOBAL_BATCH = 16


def as_rank(monkeypatch, rank, world, local_world):
    """This process as `rank` of a torchrun job of `world` ranks, `local_world` a host."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank % local_world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))


def steps(monkeypatch, url, world, local_world, **kw):
    """Per step, the job's samples: {index: image} over every rank's batch of that step."""
    out = []
    for rank in range(world):
        as_rank(monkeypatch, rank, world, local_world)
        ds = dataset(url, seed=9, partitions=PARTITIONS, batch_size=GLOBAL_BATCH // world, tail="uneven", **kw)
        for t, b in enumerate(ds):
            if t == len(out):
                out.append({})
            for i, img in zip(b["_index"].tolist(), b["image"]):
                out[t][int(i)] = img
    return out


def test_every_world_size_of_the_family_steps_through_the_same_global_batches(classes, monkeypatch):
    url, _ = classes
    want = steps(monkeypatch, url, 1, 1)
    assert sorted(i for s in want for i in s) == list(range(N))
    for world, local in [(2, 2), (2, 1), (4, 2), (8, 2)]:
        got = steps(monkeypatch, url, world, local)
        assert len(got) == len(want), (world, local)
        for t, (g, w) in enumerate(zip(got, want)):
            assert sorted(g) == sorted(w), f"world {world}, {local} a node: step {t} holds other samples"
            for i in w:
                assert torch.equal(g[i], w[i]), f"world {world}: sample {i} decoded to other pixels"


def consumer_states(monkeypatch, url, world, local_world, take, state=None):
    """Each rank reads `take` batches (from `state`); returns their consumer states and indices."""
    states, seen = [], []
    for rank in range(world):
        as_rank(monkeypatch, rank, world, local_world)
        ds = dataset(url, seed=4, partitions=PARTITIONS, batch_size=4)
        if state is not None:
            ds.load_state_dict(state)
        it = iter(ds)
        for _ in range(take[rank] if take is not None else 10**9):
            try:
                seen += indices([next(it)])
            except StopIteration:
                break
        states.append(ds._state)
        del it
    return states, seen


def test_resume_from_two_nodes_to_one_and_back_is_exact(classes, monkeypatch):
    url, _ = classes
    # 4 ranks on 2 nodes read a different number of batches each, then the job stops.
    states, seen = consumer_states(monkeypatch, url, 4, 2, [2, 1, 3, 2])
    state = json.loads(ramjet._ramjet.job_state(states))
    # 2 ranks on 1 node go on for a while, stop again.
    states, more = consumer_states(monkeypatch, url, 2, 2, [3, 2], state)
    seen += more
    state = json.loads(ramjet._ramjet.job_state(states))
    # Back to 4 ranks on 2 nodes, to the epoch's end.
    _, rest = consumer_states(monkeypatch, url, 4, 2, None, state)
    seen += rest
    assert sorted(seen) == list(range(N)), "every sample exactly once across both changes"


@pytest.mark.parametrize("batch_size", [8, 67])
def test_every_rank_of_a_three_rank_job_steps_the_same_number_of_batches(classes, monkeypatch, batch_size):
    url, _ = classes
    src = ramjet.Source(url, count=N - 1)  # 95 samples: 32, 32 and 31 a rank when uneven
    counts, lens, seen = [], [], []
    for rank in range(3):
        as_rank(monkeypatch, rank, 3, 1)
        ds = dataset(src, batch_size=batch_size)
        batches = list(ds)
        counts.append(len(batches))
        lens.append(len(ds))
        seen += indices(batches)
    assert counts[0] > 0 and counts == [counts[0]] * 3, f"batches per rank {counts}"
    assert lens == counts, "len(ds) is what the iteration yields"
    assert len(seen) == 96 and len(set(seen)) == N - 1, "padding repeats one sample, loses none"
    # Asked for, the tail stays uneven: the last rank has one sample fewer.
    as_rank(monkeypatch, 2, 3, 1)
    assert len(indices(list(dataset(src, batch_size=batch_size, tail="uneven")))) == 31


def test_a_job_whose_nodes_do_not_divide_the_partitions_warns(classes, monkeypatch):
    url, _ = classes
    as_rank(monkeypatch, 0, 6, 2)
    with pytest.warns(UserWarning, match="do not divide partitions=8"):
        list(dataset(url, partitions=PARTITIONS, batch_size=8))


def test_sticky_shares_keep_each_nodes_samples_from_epoch_to_epoch(classes, monkeypatch):
    """`shares="sticky"`: node 0 of a 2-node job reads the same shards, so nearly the same
    samples, in its second epoch as in its first (but for the split shard at a cut), in another
    order; rotating shares move them."""
    url, _ = classes

    def node_reads(shares, epoch):
        order = []
        for rank in range(2):  # node 0 of a 4-rank job on 2 nodes
            as_rank(monkeypatch, rank, 4, 2)
            ds = dataset(url, seed=3, partitions=4, shuffle_window=2, batch_size=4, shares=shares)
            ds.set_epoch(epoch)
            order += indices(list(ds))
        return order

    for shares, stays in [("sticky", True), ("rotate", False)]:
        a, b = node_reads(shares, 0), node_reads(shares, 1)
        moved = len(set(a) ^ set(b))
        assert (moved <= len(a) // 4) == stays, (shares, moved, len(a))
        assert a != b, f"{shares}: the second epoch is in another order"


def test_metrics_give_each_ranks_step_time_and_rate(classes):
    """metrics(): the batches handed out and the mean step time between them (the training
    step's time included), the rank's figures for the evenness view."""
    import time

    url, _ = classes
    ds = dataset(url, batch_size=16, shuffle=False)
    n = 0
    for _ in ds:
        n += 1
        time.sleep(0.05)
    m = ds.metrics()
    assert m["batches"] == n == len(ds)
    assert m["step_s"] >= 0.05, m["step_s"]
    assert m["samples_per_s"] > 0
