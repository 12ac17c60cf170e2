"""NumPy-style indexing of `StreamingDataset` and `Reader`: an integer (negative too), a slice, a
list, array or tensor of integers, a boolean mask; results in the order asked, each against the
dataset read whole once; out of range an `IndexError`; on a cold cache each shard touched is
fetched once per call (counted at a proxy in front of the S3 server, not by ramjet)."""

import json
import os
import uuid

import numpy as np
import pytest
import torch

import ramjet
from counting_proxy import CountingProxy
from ramjet_cli import run

N = 97


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("indexing")
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps({"id": i, "tokens": list(range(i % 7)), "name": f"s{i}"}) + "\n" for i in range(N)))
    run("pack", str(src), str(d / "ds"), "--shard-size", "4KiB", "--column", "tokens:int32[?]")
    return d, src


def whole(url):
    """Every sample, read once in order: {id: (tokens, name)}."""
    ds = ramjet.StreamingDataset(url, image_size=None, batch_size=10, shuffle=False)
    out = {}
    for b in ds:
        o = b["tokens_offsets"]
        for j, i in enumerate(b["_index"].tolist()):
            out[i] = (b["tokens"][o[j] : o[j + 1]].tolist(), b["name"][j])
    return [out[i] for i in range(N)]


def key(s):
    return (s["tokens"].tolist(), s["name"])


FORMS = [
    (5, [5]),
    (-1, [N - 1]),
    (-N, [0]),
    (slice(None, 10, 3), [0, 3, 6, 9]),
    (slice(-3, None), [N - 3, N - 2, N - 1]),
    (slice(None, None, -40), [N - 1, N - 41, N - 81]),
    ([50, 3, 50, 96], [50, 3, 50, 96]),
    ((7, -2), [7, N - 2]),
    (np.array([9, 1], dtype=np.int32), [9, 1]),
    (torch.tensor([4, 0]), [4, 0]),
    (np.int64(11), [11]),
    (torch.tensor(12), [12]),
    (np.arange(N) % 30 == 0, [0, 30, 60, 90]),
    ([i % 45 == 1 for i in range(N)], [1, 46, 91]),
    ([], []),
]


@pytest.mark.parametrize("index, want", FORMS, ids=[str(i) for i in range(len(FORMS))])
def test_every_form_gives_the_samples_asked_in_order(packed, index, want):
    url = str(packed[0] / "ds")
    ref = whole(url)
    for src in (ramjet.StreamingDataset(url, image_size=None, batch_size=4), ramjet.Reader(url)):
        got = src[index]
        if isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.dim() == 0):
            assert isinstance(got, dict) and key(got) == ref[want[0]] and got["_index"] == want[0]
        else:
            assert isinstance(got, list)
            assert [key(g) for g in got] == [ref[i] for i in want]
            assert [g["_index"] for g in got] == want


@pytest.mark.parametrize(
    "index, error",
    [
        (N, IndexError),
        (-N - 1, IndexError),
        ([0, N], IndexError),
        (np.array([True, False]), IndexError),
        (np.zeros((2, 2), dtype=np.int64), IndexError),
        (1.5, TypeError),
        (3.0, TypeError),
        ([1, 2.0], TypeError),
        ("3", TypeError),
        ([True, 1], TypeError),
        (np.array([0.5]), TypeError),
    ],
)
def test_a_bad_index_is_a_clear_error_before_any_read(packed, index, error):
    url = str(packed[0] / "ds")
    for src in (ramjet.StreamingDataset(url, image_size=None, batch_size=4), ramjet.Reader(url)):
        with pytest.raises(error) as e:
            src[index]
        if error is IndexError and not isinstance(index, np.ndarray):
            assert str(N) in str(e.value), e.value


@pytest.fixture
def on_s3(packed, tmp_path):
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the S3 server is not running (tools/s3-server.sh; tools/test.sh starts it)")
    url = f"s3://{os.environ.get('RAMJET_S3_BUCKET', 'ramjet')}/pytest-index/{uuid.uuid4().hex[:8]}"
    run("pack", str(packed[1]), url, "--shard-size", "4KiB", "--column", "tokens:int32[?]")
    return url


def test_a_cold_read_of_many_fetches_each_shard_touched_once(on_s3, packed, tmp_path, monkeypatch):
    host, port = os.environ["AWS_ENDPOINT_URL"].split("//")[1].split(":")
    proxy = CountingProxy("127.0.0.1", (host, int(port)))
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{proxy.address}")
        r = ramjet.Reader(on_s3, local=str(tmp_path / "cache"))
        ref = whole(str(packed[0] / "ds"))
        want = [0, 1, 2, N - 1, N - 2, 1]
        got = r[want]
        assert [key(g) for g in got] == [ref[i] for i in want]
        shard_gets = [p for m, p, _ in proxy.requests() if m == "GET" and "/shards/" in p]
        assert len(shard_gets) == len(set(shard_gets)) == 2, shard_gets
        # Held now: the same samples again fetch nothing.
        before = len(proxy.requests())
        assert [key(g) for g in r[[N - 1, 0]]] == [ref[N - 1], ref[0]]
        assert [p for m, p, _ in proxy.requests()[before:] if "/shards/" in p] == []
    finally:
        proxy.close()
