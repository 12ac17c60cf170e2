"""MosaicML Streaming's API over ramjet (ramjet.compat.mosaicml, issue 70): its quick start's
and fast-resumption page's snippets with only the import line changed, against MDS written by
MosaicML's own MDSWriter (in the peers' venv); each column decoded as MosaicML's own
StreamingDataset decodes it; and each argument doing what theirs does or refused by name."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from PIL import Image

import ramjet
from ramjet.compat.mosaicml import Stream, StreamingDataLoader, StreamingDataset

from peer_values import described, learned, uploaded, write_fixtures  # noqa: F401 (learned: a fixture)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_fixtures(tmp_path_factory, "mosaicml_fixtures.py", "decoded.json")


def test_the_quick_start_runs_with_the_import_changed(mds, tmp_path):
    out, want = mds
    remote, local = str(out / "quick"), str(tmp_path / "cache")
    # The quick start's second step, as its page gives it (paths and the batch size filled in).
    from torch.utils.data import DataLoader
    dataset = StreamingDataset(local=local, remote=remote, shuffle=True, batch_size=4)
    sample = dataset[337]
    img = sample['img']
    cls = sample['clf']
    dataloader = DataLoader(dataset)
    assert isinstance(img, Image.Image) and isinstance(cls, int) and dataloader is not None
    assert described(img) == want["quick"][sample["uuid"]]["img"]
    # Every sample once an epoch, each column as MosaicML decodes it.
    seen = [{k: described(v) for k, v in s.items()} for s in dataset]
    assert len(seen) == len(dataset) == 1000
    assert {s["uuid"]["value"]: s for s in seen} == want["quick"]


def test_every_encoding_decodes_as_mosaicml_decodes_it(mds):
    out, want = mds
    ds = StreamingDataset(local=str(out / "typed"))
    got = {str(s["id"]): {k: described(v) for k, v in s.items()} for s in ds}
    assert got == want["typed"]


def _resumption(remote, tmp_path, workers):
    # The fast-resumption page's snippet, as it gives it (paths filled in, prints dropped).
    dataset = StreamingDataset(local=str(tmp_path / "c"), remote=remote, batch_size=1)
    dataloader = StreamingDataLoader(dataset, batch_size=1, num_workers=workers)
    state_dict = None
    seen = []
    for i, batch in enumerate(dataloader):
        seen.append((batch['x'].tolist(), batch['y']))
        if i == 4:
            state_dict = dataloader.state_dict()
        if i == 6:
            break
    dataset = StreamingDataset(local=str(tmp_path / "c"), remote=remote, batch_size=1)
    dataloader = StreamingDataLoader(dataset, batch_size=1, num_workers=workers)
    dataloader.load_state_dict(state_dict)
    resumed = [(b['x'].tolist(), b['y']) for b in dataloader]
    return seen, resumed


@pytest.mark.parametrize("workers", [0, 2])
def test_fast_resumption_goes_on_from_batch_five_as_an_uninterrupted_run(mds, tmp_path, workers):
    remote = str(mds[0] / "xy")
    seen, resumed = _resumption(remote, tmp_path, workers)
    whole = StreamingDataLoader(StreamingDataset(local=str(tmp_path / "c"), remote=remote, batch_size=1),
                                batch_size=1, num_workers=workers)
    full = [(b['x'].tolist(), b['y']) for b in whole]
    assert seen == full[:7]
    assert resumed == full[5:]
    assert sorted(x for (x,), _ in full) == list(range(40))


def test_len_counts_samples_per_rank_and_epoch_size_sets_them(mds):
    remote = str(mds[0] / "xy")
    assert len(StreamingDataset(remote=remote)) == 40
    ds = StreamingDataset(remote=remote, epoch_size="1k")
    assert len(ds) == 1000 and len(list(ds)) == 1000
    assert len(StreamingDataset(remote=remote, epoch_size=25)) == 25


def test_streams_mix_with_choose_and_local_alone_reads_in_place(mds):
    out = mds[0]
    ds = StreamingDataset(streams=[Stream(local=str(out / "xy"), choose=10),
                                   Stream(remote=str(out / "typed"), repeat=2)])
    assert len(ds) == 10 + 24
    with pytest.raises(ramjet.InvalidInputError, match="not both"):
        StreamingDataset(streams=[Stream(local=str(out / "xy"))], split="train")
    with pytest.raises(ramjet.InvalidInputError, match="at most one"):
        Stream(remote=str(out / "xy"), choose=3, repeat=2)
    ds = StreamingDataset(remote=str(out), split="xy")
    assert sorted(s["x"] for s in ds) == list(range(40))


def test_the_shuffle_arguments_shuffle_and_seed_it(mds):
    remote = str(mds[0] / "xy")
    order = lambda **kw: [s["x"] for s in StreamingDataset(remote=remote, **kw)]  # noqa: E731
    assert order() == order() and sorted(order()) == list(range(40))
    a, b = order(shuffle=True, shuffle_seed=1), order(shuffle=True, shuffle_seed=2)
    assert a != b and sorted(a) == sorted(b) == list(range(40))
    assert order(shuffle=True, shuffle_algo="naive", shuffle_seed=1) != a
    assert sorted(order(shuffle=True, shuffle_block_size=20, predownload=8, cache_limit="1gb",
                        num_canonical_nodes=2)) == list(range(40))


@pytest.mark.parametrize("arg, value, says", [
    ("sampling_method", "fixed", "balanced"),
    ("sampling_granularity", 4, "whole samples"),
    ("partition_algo", "orig", "global order"),
    ("batching_method", "per_stream", "mixes streams"),
    ("allow_unsafe_types", True, "never unpickles"),
    ("replication", 2, "replication"),
    ("download_retry", 5, "retries"),
    ("download_timeout", 10.0, "times reads out"),
    ("validate_hash", "sha1", "xxh64"),
    ("keep_zip", True, "cache keeps"),
    ("shuffle_algo", "py9", "must be one of"),
    ("batch_size", 0, "positive"),
    ("epoch_size", "lots", "suffix"),
    ("cache_limit", "9 parsecs", "kb, mb"),
])
def test_an_argument_ramjet_does_otherwise_is_refused_saying_so(mds, arg, value, says):
    with pytest.raises(ramjet.InvalidInputError, match=f"{arg}=.*{says}"):
        StreamingDataset(remote=str(mds[0] / "xy"), **{arg: value})


def test_a_state_inside_a_batch_or_from_another_loader_is_refused(mds):
    ds = StreamingDataset(remote=str(mds[0] / "xy"), batch_size=4)
    it = iter(ds)
    next(it)
    with pytest.raises(ramjet.InvalidInputError, match="3 samples of a batch of 4"):
        ds.state_dict()
    with pytest.raises(ramjet.InvalidInputError, match="no 'ramjet' key"):
        ds.load_state_dict({"epoch": 0, "sample_in_epoch": 4})
    with pytest.raises(ramjet.InvalidInputError, match="give both the same"):
        StreamingDataLoader(ds, batch_size=8)
    for _ in range(3):
        next(it)
    assert ds.state_dict()["sample_in_epoch"] == 4


def test_the_quick_start_reads_mds_on_s3_and_ramjets_own_datasets(mds, tmp_path):
    out, want = mds
    remote = uploaded(out / "quick", "compat")
    dataset = StreamingDataset(local=str(tmp_path / "cache"), remote=remote, shuffle=True,
                               batch_size=4)
    seen = {s["uuid"]: {k: described(v) for k, v in s.items()} for s in dataset}
    assert seen == want["quick"]
    # A dataset ramjet packed: its image column a PIL image, its other columns NumPy values.
    ds_dir = tmp_path / "synth"
    rj = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")
    subprocess.run([rj, "synth", str(ds_dir), "--samples", "12"], check=True, capture_output=True)
    subprocess.run([rj, "pack", str(ds_dir), str(tmp_path / "packed")], check=True, capture_output=True)
    own = list(StreamingDataset(local=str(tmp_path / "packed")))
    assert len(own) == 12 and all(isinstance(s["image"], Image.Image) for s in own)
    assert own[0]["image"].size[0] > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_fast_resumption_on_a_ramjet_dataset_on_s3(tmp_path, workers):
    import uuid

    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"x": i, "y": f"y{i}" + "-" * 200}) + "\n" for i in range(40)))
    url = f"s3://{os.environ.get('RAMJET_S3_BUCKET', 'ramjet')}/pytest-compat-xy/{uuid.uuid4().hex[:8]}"
    rj = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")
    subprocess.run([rj, "pack", str(rows), url, "--column", "x:int64", "--column", "y:str", "--shard-size", "4KiB"],
                   check=True, capture_output=True)
    seen, resumed = _resumption(url, tmp_path, workers)
    whole = StreamingDataLoader(StreamingDataset(local=str(tmp_path / "c"), remote=url, batch_size=1),
                                batch_size=1, num_workers=workers)
    full = [(b['x'].tolist(), b['y']) for b in whole]
    assert seen == full[:7] and resumed == full[5:]
    assert sorted(x for (x,), _ in full) == list(range(40))


def test_the_arguments_ramjet_maps_reach_its_engine_as_stated(mds, tmp_path):
    remote = str(mds[0] / "quick")
    ds = StreamingDataset(remote=remote, local=str(tmp_path / "c"), batch_size=4, predownload=10,
                          cache_limit="2gb", num_canonical_nodes=8, shuffle=True, shuffle_block_size=100,
                          shuffle_seed=5, validate_hash="xxh64")
    o = ds._options()
    per_shard = 1000 / ramjet.inspect(remote)["shards"]
    assert o["prefetch_batches"] == 3 and o["cache_limit"] == 2 * 1024 ** 3 and o["partitions"] == 8
    assert o["shuffle_window"] == -(-100 // per_shard) and o["seed"] == 5 and o["local"] == str(tmp_path / "c")
    assert o["shuffle_algo"] == "shard_block" and o["batch_size"] == 4
    assert StreamingDataset(remote=remote, shuffle_algo="naive")._options()["shuffle_algo"] == "global"
    # A local dataset alone is read in place, with no cache.
    assert StreamingDataset(local=remote)._options()["local"] is None
