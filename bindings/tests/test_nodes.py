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


def test_without_partitions_a_job_deals_by_its_nodes_and_keeps_them_across_a_resume(classes, monkeypatch):
    """No `partitions` given: a fresh job of 2 nodes reads as `partitions=2` would (no warning,
    each node its share); its state keeps 2, so a resume on 1 node goes on exactly."""
    import warnings

    url, _ = classes

    def reads(world, local_world, state=None, take=None, **kw):
        states, seen = [], []
        for rank in range(world):
            as_rank(monkeypatch, rank, world, local_world)
            ds = dataset(url, seed=5, batch_size=4, **kw)
            if state is not None:
                ds.load_state_dict(state)
            got = []
            for b in ds:
                got += indices([b])
                if take is not None and len(got) >= take[rank] * 4:
                    break
            seen.append(got)
            states.append(ds._state)
        return states, seen

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "every node reads the whole dataset"
        _, default = reads(4, 2)
    _, two = reads(4, 2, partitions=2)
    _, one = reads(4, 2, partitions=1)
    assert default == two, "no partitions on 2 nodes: the deal of partitions=2"
    assert default != one
    # Stopped part way on 2 nodes, resumed on 1 node of 2 ranks with no partitions either.
    states, before = reads(4, 2, take=[2, 1, 3, 2])
    state = json.loads(ramjet._ramjet.job_state(states))
    assert state["partitions"] == 2
    _, after = reads(2, 2, state=state)
    seen = sorted(i for r in before + after for i in r)
    assert seen == list(range(N)), "every sample exactly once across the resume"
    # A fresh job on one node keeps the single-node order.
    _, alone = reads(1, 1)
    _, p1 = reads(1, 1, partitions=1)
    assert alone == p1


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


PACE_RANK = r"""
import json, sys, time
import ramjet
cfg = json.loads(sys.argv[1])
ds = ramjet.StreamingDataset(cfg["url"], batch_size=4, image_size=32, augment="eval", shuffle=True, seed=3,
                             rank=cfg["rank"], world_size=2)
t0, epoch, m = time.monotonic(), 0, {}
while time.monotonic() - t0 < cfg["seconds"]:
    ds.set_epoch(epoch)
    for b in ds:
        time.sleep(cfg["step"])
        if time.monotonic() - t0 >= cfg["seconds"]:
            break
    epoch += 1
m = ds.metrics()
print(json.dumps({k: v for k, v in m.items() if k.startswith("job_") or k in ("step_s", "step_vs_median")}), flush=True)
"""


@pytest.mark.timeout(120)
def test_each_ranks_metrics_show_its_jobs_pace_across_ranks(tmp_path):
    """Two ranks of one job on one host daemon, the second stepping four times slower: each
    rank's metrics() carry the job's pace from the daemon's answer to its heartbeat (both
    ranks seen, the slow one named, the skew), and its own step against the job's median.
    Across nodes: tests/tests/cluster.rs (a_ranks_heartbeat_brings_back_its_jobs_pace_...)."""
    import os
    import subprocess
    import sys

    from ramjet_cli import run
    from test_tune import serve

    run("synth", str(tmp_path / "synth"), "--samples", "64")
    run("pack", str(tmp_path / "synth"), str(tmp_path / "packed"), "--shard-size", "200KiB")
    daemon, sock, _ = serve(tmp_path)
    try:
        env = dict(os.environ, RAMJET_SOCKET=str(sock), RAMJET_JOB="pace-test")
        procs = [subprocess.Popen([sys.executable, "-c", PACE_RANK,
                                   json.dumps({"url": str(tmp_path / "packed"), "seconds": 8, "rank": r, "step": s})],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r, s in [(0, 0.02), (1, 0.08)]]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=100)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        daemon.terminate()
        daemon.wait(timeout=20)
    for m in outs:
        assert m["job_scope"] == "host" and m["job_ranks_seen"] == 2, m
        assert m["job_slowest_rank"] == 1 and m["job_skew"] > 0.3, m
        assert [r["rank"] for r in m["job_ranks"]] == [0, 1], m
        assert 0 < m["job_step_s_min"] < m["job_step_s_max"], m
    assert outs[0]["step_vs_median"] < 0.7 and abs(outs[1]["step_vs_median"] - 1.0) < 1e-9, outs
    assert outs[0]["job_rank_step_s"] < outs[1]["job_rank_step_s"], outs


@pytest.mark.parametrize("workers", [2, 3])
def test_len_of_a_dataloader_with_workers_is_the_batches_it_yields(classes, workers):
    """Each DataLoader worker is a consumer with its own share and its own last batch, so a
    rank yields more (or, dropping, fewer) batches than its samples over the batch size.
    len(loader) asks len(dataset) from the main process: it is the sum of the workers'."""
    url, _ = classes
    for drop_last in (False, True):
        for rank, world in [(0, 1), (1, 3)]:
            ds = dataset(url, batch_size=7, seed=1, rank=rank, world_size=world, drop_last=drop_last)
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
            got = sum(1 for _ in loader)
            assert len(loader) == got, (workers, drop_last, rank, world, len(loader), got)
            alone = len(ds)  # asked directly: the rank iterated without workers
            assert alone == sum(1 for _ in ds), (drop_last, rank, world)
