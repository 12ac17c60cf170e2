"""Trust nothing, round two: the hostile probe's findings as a suite, on real processes, real
signals, real files and the real S3 server (docs/robustness.md has one row per case).

- an epoch with nothing to read for a consumer ends at once, for any consumer count, tail and
  DataLoader worker count (it spun two cores forever);
- rank and world from the environment are checked like the arguments (they were clamped, so
  ranks read each other's samples);
- `pack --tokenizer` stores ids in a type that holds the tokenizer's largest id (they were cut
  mod 65,536), and a token stream refuses an eos above the vocabulary;
- a stopped host daemon costs one timeout, not one per shard;
- a cache directory deleted under a running loader or daemon is made again (reads failed);
- reads of local paths are bounded (`/dev/zero` as an image read until memory ran out), and so
  is `ramjet stats` against a hostile server;
- the lesser ones: `ds[range(3)]`, the open interval of `std`, a dashboard URL for IPv6, a token
  state of another dataset, a weak key off loopback, `Host` on an unguarded port, `HEAD`, a
  symbolic link out of an `--allow`ed folder, and a shard replaced by a smaller valid one.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import ramjet

from ramjet_cli import RAMJET, run  # noqa: E402 - bindings/tests/ramjet_cli.py
from test_tune import serve  # noqa: E402 - `ramjet serve` under tmp_path: (process, socket, HTTP address)
from ports import free_port


def fails(*args, env=None, timeout=120):
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode != 0, out.stdout + out.stderr
    return out.stdout + out.stderr



@pytest.fixture(scope="module")
def five(tmp_path_factory):
    """A dataset of 5 images in 2 shards."""
    root = tmp_path_factory.mktemp("five")
    run("synth", str(root / "synth"), "--samples", "5")
    run("pack", str(root / "synth"), str(root / "packed"), "--shard-size", "8KiB")
    return root / "packed"


@pytest.fixture(scope="module")
def fifteen(tmp_path_factory):
    """A dataset of 60 images in about 15 shards."""
    root = tmp_path_factory.mktemp("fifteen")
    run("synth", str(root / "synth"), "--samples", "60")
    run("pack", str(root / "synth"), str(root / "packed"), "--shard-size", "20KiB")
    shards = len(json.loads((root / "packed/manifest.json").read_text())["shards"])
    assert shards >= 12, shards
    return root / "packed"


# ----- 1. an empty share ends at once ---------------------------------------------------------

EMPTY_SHARES = textwrap.dedent(
    """
    import json, sys, torch, ramjet
    url = sys.argv[1]
    out = {}
    def epochs(name, make, n=2):
        ds = make()
        got = []
        for epoch in range(n):
            ds.set_epoch(epoch)
            got.append(sum(len(b["_index"]) for b in ds))
        out[name] = {"len": len(ds), "samples": got}
    epochs("world8_rank6", lambda: ramjet.StreamingDataset(url, batch_size=2, world_size=8, rank=6, tail="uneven"))
    epochs("drop_world8", lambda: ramjet.StreamingDataset(url, batch_size=1, world_size=8, rank=0, tail="drop"))
    epochs("drop_last_share_short", lambda: ramjet.StreamingDataset(url, batch_size=8, drop_last=True))
    epochs("pad_world8", lambda: ramjet.StreamingDataset(url, batch_size=1, world_size=8, rank=7, tail="pad"))
    ds = ramjet.StreamingDataset(url, batch_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=8)
    out["dataloader_8_workers"] = {"samples": [sorted(int(i) for b in loader for i in b["_index"]) for _ in range(2)]}
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def empty_shares(five, tmp_path_factory):
    script = tmp_path_factory.mktemp("empty") / "empty.py"
    script.write_text(EMPTY_SHARES)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script), str(five)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), time.monotonic() - t0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case, want_len, want",
    [
        ("world8_rank6", 0, [0, 0]),  # more consumers than samples
        ("drop_world8", 0, [0, 0]),  # tail="drop" with a world larger than the dataset
        ("drop_last_share_short", 0, [0, 0]),  # a share shorter than a batch, drop_last
        ("pad_world8", 1, [1, 1]),  # the padded tail: one each
    ],
)
def test_an_epoch_with_nothing_to_read_ends_at_once(empty_shares, case, want_len, want):
    got, _ = empty_shares
    assert got[case] == {"len": want_len, "samples": want}, got


@pytest.mark.timeout(300)
def test_dataloader_workers_with_empty_shares_end_and_every_sample_comes_once(empty_shares):
    got, _ = empty_shares
    assert got["dataloader_8_workers"]["samples"] == [[0, 1, 2, 3, 4]] * 2, got


# ----- 2. rank and world from the environment -------------------------------------------------


@pytest.mark.parametrize(
    "env, needles",
    [
        ({"RANK": "3", "WORLD_SIZE": "2"}, ["RANK=3", "WORLD_SIZE=2"]),
        ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK=2", "WORLD_SIZE=2"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE=0"]),
        ({"RANK": "1"}, ["WORLD_SIZE", "RANK=1"]),
        ({"WORLD_SIZE": "2"}, ["RANK", "WORLD_SIZE=2"]),
        ({"RANK": "one", "WORLD_SIZE": "2"}, ["RANK", "one"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK", "LOCAL_WORLD_SIZE"]),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "0", "WORLD_SIZE": "2"}, ["RANK=0", "SLURM_PROCID=1"]),
    ],
)
def test_rank_and_world_from_the_environment_are_checked_not_clamped(five, monkeypatch, env, needles):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ds = ramjet.StreamingDataset(str(five), batch_size=1)
    with pytest.raises(ramjet.InvalidInputError) as e:
        len(ds)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_an_argument_that_contradicts_the_environment_names_both(five, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ramjet.InvalidInputError) as e:
        len(ramjet.StreamingDataset(str(five), batch_size=1, rank=3))
    assert "rank=3 (argument)" in str(e.value) and "WORLD_SIZE=2" in str(e.value), str(e.value)


def test_ranks_from_the_environment_read_disjoint_shares(five, monkeypatch):
    seen = []
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = ramjet.StreamingDataset(str(five), batch_size=1, tail="uneven")
        seen.append({int(i) for b in ds for i in b["_index"]})
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(5)), seen


# ----- 3. tokenizer ids ------------------------------------------------------------------------


def sparse_tokenizer(path):
    """A word-level tokenizer.json of 300 entries whose ids reach 1,000,000,266 (ids need not be
    dense: merged or pruned vocabularies), with <|endoftext|> at 1,000,000,000. Written as JSON:
    the tokenizers package's own save prints every hole of such a vocabulary (gigabytes)."""
    vocab = {"[UNK]": 0, "<|endoftext|>": 1_000_000_000}
    vocab.update({f"w{i}": 1_000_000_000 + i for i in range(1, 267)})
    vocab.update({f"v{i}": 70_000 + i for i in range(32)})
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    }
    Path(path).write_text(json.dumps(doc))
    return vocab


def test_pack_tokenizer_stores_ids_in_a_type_that_holds_the_largest_id(tmp_path):
    vocab = sparse_tokenizer(tmp_path / "tok.json")
    docs = [" ".join(f"w{1 + (i * 7 + j) % 266}" for j in range(5)) + " v3" for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    run("pack", str(tmp_path / "d.jsonl"), str(tmp_path / "packed"), "--tokenizer", str(tmp_path / "tok.json"))
    meta = json.loads(ramjet.inspect(str(tmp_path / "packed"))["meta_json"])["tokenizer"]
    assert meta["dtype"] == "uint32" and meta["max_id"] == 1_000_000_266 and meta["eos"] == 1_000_000_000, meta
    ds = ramjet.TokenDataset(str(tmp_path / "packed"), seq_len=7, batch_size=1, shuffle=False)
    got = [t for b in ds for t in b["tokens"].flatten().tolist()]
    want = [vocab[w] for t in docs for w in (t.split() + ["<|endoftext|>"])]
    assert got == want[: len(got)] and len(got) >= len(want) - 8, (got[:12], want[:12])


def test_an_eos_above_the_vocabulary_is_refused_naming_the_bound(tmp_path):
    sparse_tokenizer(tmp_path / "tok.json")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "w1 w2 w3"}) + "\n")
    run("pack", str(tmp_path / "d.jsonl"), str(tmp_path / "packed"), "--tokenizer", str(tmp_path / "tok.json"))
    ds = ramjet.TokenDataset(str(tmp_path / "packed"), seq_len=2, batch_size=1, eos=2**40)
    with pytest.raises(ramjet.InvalidInputError) as e:
        list(ds)
    assert "eos" in str(e.value) and "1000000266" in str(e.value), str(e.value)


# ----- 4. a stopped daemon ---------------------------------------------------------------------


def stop(d):
    d.send_signal(signal.SIGCONT)
    d.terminate()
    try:
        d.wait(timeout=20)
    except subprocess.TimeoutExpired:
        d.kill()


@pytest.mark.timeout(240)
def test_a_stopped_daemon_costs_one_timeout_not_one_per_shard(fifteen, tmp_path):
    d, sock, _ = serve(tmp_path)
    timeout_s = 4
    env = dict(os.environ, RAMJET_DAEMON_TIMEOUT_MS=str(timeout_s * 1000))
    try:
        d.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        out = subprocess.run([RAMJET, "stream", str(fifteen), "--daemon", str(sock), "--shuffle", "none", "--json"],
                             capture_output=True, text=True, env=env, timeout=200)
        took = time.monotonic() - t0
    finally:
        stop(d)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout)
    assert m["samples"] == 60, m
    # One request waited the timeout; before, every one of the 12+ shards did (48 s and more).
    assert took < 4 * timeout_s, f"{took:.1f} s for {m['samples']} samples"


# ----- 5. the cache directory deleted under a running reader -----------------------------------


@pytest.mark.timeout(240)
def test_a_cache_directory_deleted_under_a_running_loader_loses_no_epoch(fifteen, tmp_path):
    cache = tmp_path / "cache"
    ds = ramjet.StreamingDataset(str(fifteen), local=str(cache), batch_size=4, shuffle=True, seed=3)
    for epoch in range(6):
        ds.set_epoch(epoch)
        got = []
        for i, b in enumerate(ds):
            got += [int(x) for x in b["_index"]]
            if i == 1 and epoch % 2 == 0:
                shutil.rmtree(cache, ignore_errors=True)
        assert sorted(got) == list(range(60)), (epoch, sorted(got))
    assert (cache / "shards").is_dir()


@pytest.mark.timeout(240)
def test_a_daemon_whose_cache_directory_is_deleted_makes_it_again_and_caches(fifteen, tmp_path):
    d, sock, http = serve(tmp_path)
    try:
        for i in range(2):
            m = json.loads(run("stream", str(fifteen), "--daemon", str(sock), "--shuffle", "none", "--json"))
            assert m["samples"] == 60 and m["daemon_failures"] == 0, m
            if i == 0:
                shutil.rmtree(tmp_path / "cache")
        shards = list((tmp_path / "cache/shards").iterdir())
    finally:
        stop(d)
    assert len(shards) >= 12, shards


# ----- 8. bounded reads ------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_an_image_column_naming_a_device_or_a_fifo_is_refused_at_once(tmp_path, target):
    if target == "fifo":
        target = str(tmp_path / "fifo")
        os.mkfifo(target)
    (tmp_path / "d.jsonl").write_text(json.dumps({"image": target, "label": 1}) + "\n")
    t0 = time.monotonic()
    out = fails("pack", str(tmp_path / "d.jsonl"), str(tmp_path / "o"), "--image-column", "image", timeout=60)
    assert target in out and ("a device" in out or "a FIFO" in out), out
    assert time.monotonic() - t0 < 30


class Flood(threading.Thread):
    """An HTTP server that answers every request with an endless body."""

    def __init__(self):
        super().__init__(daemon=True)
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen(4)
        self.addr = f"127.0.0.1:{self.s.getsockname()[1]}"
        self.stop = False

    def run(self):
        c, _ = self.s.accept()
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        chunk = b"x" * (1 << 20)
        sent = 0
        try:
            while not self.stop and sent < (256 << 20):
                c.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        c.close()


@pytest.mark.timeout(120)
def test_ramjet_stats_refuses_an_endless_answer(tmp_path):
    f = Flood()
    f.start()
    try:
        out = fails("stats", f.addr, timeout=100)
    finally:
        f.stop = True
    assert "larger than" in out and f.addr in out, out


# ----- 9. the lesser ones ----------------------------------------------------------------------


def test_a_range_indexes_like_a_list(five):
    ds = ramjet.StreamingDataset(str(five), batch_size=1)
    assert [int(s["_index"]) for s in ds[range(3)]] == [0, 1, 2]


def test_an_open_interval_prints_as_one(five):
    with pytest.raises(ramjet.InvalidInputError) as e:
        ramjet.StreamingDataset(str(five), image_size=8, normalize=True, std=[0.0, 1.0, 1.0])
    assert "(0, inf)" in str(e.value) and len(str(e.value)) < 300, str(e.value)


def test_a_token_state_of_another_dataset_is_refused_naming_the_sources(tmp_path):
    rows = lambda n: "".join(json.dumps({"tokens": list(range(i, i + 9))}) + "\n" for i in range(n))
    for name, n in (("a", 20), ("b", 30)):
        (tmp_path / f"{name}.jsonl").write_text(rows(n))
        run("pack", str(tmp_path / f"{name}.jsonl"), str(tmp_path / name), "--column", "tokens:int32[?]")
    a = ramjet.TokenDataset(str(tmp_path / "a"), seq_len=4, batch_size=1, eos=70000)
    next(iter(a))
    state = a.state_dict()
    b = ramjet.TokenDataset(str(tmp_path / "b"), seq_len=4, batch_size=1, eos=0)
    b.load_state_dict(state)
    with pytest.raises(ramjet.InvalidInputError) as e:
        next(iter(b))
    assert "manifest versions" in str(e.value) and "eos" not in str(e.value), str(e.value)


def test_a_weak_key_is_refused_off_loopback(tmp_path):
    sock = tmp_path / "w.sock"
    for key, port in ((" ", "--listen"), ("a", "--listen"), ("short-key", "--listen"), ("a", "--http")):
        env = dict(os.environ, RAMJET_API_KEY=key)
        out = fails("serve", "--socket", str(sock), "--cache-dir", str(tmp_path / "c"), port, "0.0.0.0:0",
                    env=env, timeout=60)
        assert "weak RAMJET_API_KEY" in out and "16 bytes" in out, out


def test_an_unguarded_port_serves_addresses_not_names_and_answers_head(tmp_path):
    d, _, http = serve(tmp_path)
    try:
        req = urllib.request.Request(f"http://{http}/stats", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 403 and "DNS rebinding" in e.value.read().decode()
        with urllib.request.urlopen(f"http://{http}/stats", timeout=10) as r:
            assert r.status == 200
        head = urllib.request.Request(f"http://{http}/stats", method="HEAD")
        with urllib.request.urlopen(head, timeout=10) as r:
            assert r.status == 200 and r.read() == b""
        for host in ("localhost", f"localhost:{http.split(':')[1]}", "[::1]:80"):
            req = urllib.request.Request(f"http://{http}/health", headers={"Host": host})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200
    finally:
        stop(d)


def test_the_dashboard_url_of_an_ipv6_port_has_brackets(tmp_path):
    sock = tmp_path / "v6.sock"
    port = free_port()
    d = subprocess.Popen([RAMJET, "serve", "--socket", str(sock), "--cache-dir", str(tmp_path / "c"), "--http", f"[::1]:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        t0, err = time.monotonic(), ""
        while "serve: dashboard" not in err and time.monotonic() - t0 < 30 and d.poll() is None:
            err += d.stderr.readline()
    finally:
        stop(d)
    assert f"http://[::1]:{port}/" in err, err


def test_a_symbolic_link_out_of_an_allowed_folder_is_not_served(five, tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(five)
    d, sock, _ = serve(tmp_path, "--allow", f"file://{allowed}")
    try:
        out = subprocess.run([RAMJET, "stream", str(allowed / "link"), "--daemon", str(sock), "--json"],
                             capture_output=True, text=True, timeout=120)
    finally:
        stop(d)
    assert "outside the allowed prefixes" in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("which", ["largest", "first"])
def test_a_shard_replaced_by_a_smaller_valid_one_is_not_the_manifests(tmp_path, which):
    # "first": the order's first shard, whose first samples are read by ranges (its footer
    # read past the smaller object's end) while the whole shard downloads; either read may
    # fail first, and both must name the object as replaced, not as torn.
    run("synth", str(tmp_path / "s"), "--samples", "20")
    run("pack", str(tmp_path / "s"), str(tmp_path / "p"), "--shard-size", "40KiB")
    shards = sorted((tmp_path / "p/shards").iterdir(), key=lambda p: p.stat().st_size)
    target = shards[-1] if which == "largest" else sorted(shards)[0]
    assert shards[0].stat().st_size < target.stat().st_size
    shutil.copy(shards[0], target)
    for _ in range(3):
        out = fails("stream", str(tmp_path / "p"), "--shuffle", "none")
        assert "not the manifest's" in out and "replaced" in out, out
