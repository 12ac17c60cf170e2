"""MosaicML (MDS) and WebDataset datasets read in place: through `ramjet index`, or as they
are, with the index learned on first read and kept in the host's index folder.

The golden fixtures are written at test time by the real writers, MosaicML Streaming's
MDSWriter and webdataset's TarWriter, in the peers' venv (tools/bench-venv.sh), never in the
core venv; ramjet must yield byte-identical samples."""

import base64
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch

import ramjet

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
N = 10
MDS_SHAPES = ("mds-plain", "mds-zstd", "mds-gz")
WDS_SOURCES = ("wds/train-{000..002}.tar", "wds/shards.txt", "wds-gz/train-{000..002}.tar.gz")


def run(*args, ok=True):
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True)
    if ok:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.fixture(scope="session")
def bench_python():
    py = os.environ.get("RAMJET_BENCH_PYTHON")
    if not py:
        py = subprocess.run(
            ["bash", str(ROOT / "tools/bench-venv.sh")], capture_output=True, text=True, check=True
        ).stdout.strip()
    return py


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory, bench_python):
    """The writers' datasets (each test copies what it changes), and what they stored."""
    images = tmp_path_factory.mktemp("synth") / "ds"
    run("synth", str(images), "--samples", str(N))
    out = tmp_path_factory.mktemp("foreign") / "fx"
    subprocess.run([bench_python, str(ROOT / "bindings/tests/foreign_fixtures.py"), str(images), str(out), str(N)], check=True)
    return out, json.loads((out / "expected.json").read_text())


def copy_of(fixtures, tmp_path, name):
    src = fixtures[0] / name
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def rows(url, **kw):
    """Every sample of one epoch, in order, as {column: value} with bytes as bytes."""
    ds = ramjet.StreamingDataset(url, image_size=None, batch_size=4, shuffle=False, cache_limit=None, **kw)
    out = []
    for b in ds:
        n = len(b["_index"])
        for i in range(n):
            r = {}
            for k, v in b.items():
                if k.endswith(("_offsets", "_shapes")) and k.rsplit("_", 1)[0] in b:
                    continue
                if f"{k}_offsets" in b:  # a ragged array column: this value's slice, reshaped
                    o = b[f"{k}_offsets"]
                    x = v[o[i] : o[i + 1]].reshape(b[f"{k}_shapes"][i].tolist())
                else:
                    x = v[i]
                r[k] = x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x
            out.append(r)
    return out


def same_array(got, want):
    """A yielded tensor against the writer's array: dtype, shape and every byte."""
    assert isinstance(got, torch.Tensor), type(got)
    assert str(got.dtype) == f"torch.{want['dtype']}", (got.dtype, want["dtype"])
    assert list(got.shape) == want["shape"], (list(got.shape), want["shape"])
    assert got.contiguous().numpy().tobytes() == base64.b64decode(want["b64"])
    return True


def expect(v):
    return base64.b64decode(v["b64"]) if isinstance(v, dict) and "b64" in v else v


@pytest.fixture
def index_dir(tmp_path, monkeypatch):
    """This test's folder of learned manifests (for this process and the `ramjet` it runs)."""
    d = tmp_path / "learned-manifestes"
    monkeypatch.setenv("RAMJET_INDEX_DIR", str(d))
    return d


def assert_mds_rows(got, want):
    assert len(got) == N
    for i, (g, w) in enumerate(zip(got, want)):
        for col, v in w.items():
            if isinstance(v, dict) and "dtype" in v:
                assert same_array(g[col], v), (i, col)
                continue
            v = expect(v)
            if col == "meta":
                assert json.loads(g[col]) == v, (i, col)
            elif isinstance(v, float):
                assert g[col] == pytest.approx(v, rel=1e-6), (i, col)
            else:
                assert g[col] == v, (i, col, g[col][:20] if isinstance(g[col], bytes) else g[col])


def assert_wds_rows(got, want):
    assert [g["__key__"] for g in got] == [w["__key__"] for w in want]
    for g, w in zip(got, want):
        for ext in ("jpg", "cls", "json"):
            assert g[ext] == expect(w[ext]), (w["__key__"], ext)
        assert same_array(g["npy"], w["npy"]), w["__key__"]


@pytest.mark.parametrize("shape", MDS_SHAPES)
def test_mds_samples_are_the_writer_s_bytes(fixtures, tmp_path, shape):
    d = copy_of(fixtures, tmp_path, shape)
    out = run("index", str(d)).stdout
    assert f"index: {N} samples" in out and "hashes checked" in out, out
    assert_mds_rows(rows(str(d)), fixtures[1]["mds"])
    assert run("verify", str(d)).returncode == 0


@pytest.mark.parametrize("src", WDS_SOURCES)
def test_webdataset_samples_are_the_writer_s_bytes(fixtures, tmp_path, src):
    top = src.split("/")[0]
    d = copy_of(fixtures, tmp_path, top)
    run("index", str(tmp_path / src))
    assert_wds_rows(rows(str(d)), fixtures[1]["wds"])


@pytest.mark.parametrize("src", [*MDS_SHAPES, "mds-plain/index.json", *WDS_SOURCES])
def test_read_as_it_is_without_ramjet_index(fixtures, tmp_path, index_dir, src):
    """No `ramjet index`: the first open learns the index into this host's index folder, and
    writes nothing beside the data."""
    top = src.split("/")[0]
    d = copy_of(fixtures, tmp_path, top)
    before = sorted(p.name for p in d.iterdir())
    got = rows(str(tmp_path / src))
    if top.startswith("mds"):
        assert_mds_rows(got, fixtures[1]["mds"])
    else:
        assert_wds_rows(got, fixtures[1]["wds"])
    assert sorted(p.name for p in d.iterdir()) == before, "something was written beside the data"
    assert len(list(index_dir.iterdir())) == 1
    assert run("verify", str(tmp_path / src)).returncode == 0


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "learned"])
def test_mds_from_s3_decodes_and_augments_in_rust(fixtures, tmp_path, index_dir, indexed):
    if "AWS_ENDPOINT_URL" not in os.environ:
        pytest.fail("the local S3 server is not configured: run tools/test.sh")
    d = fixtures[0] / "mds-zstd"
    url = f"s3://{BUCKET}/pytest-foreign/{uuid.uuid4().hex[:8]}"
    for f in d.iterdir():
        if f.name != "manifest.json" and f.is_file():
            subprocess.run(
                [str(ROOT / ".venv/bin/python"), "-c", "import boto3,sys; boto3.client('s3').upload_file(sys.argv[1], sys.argv[2], sys.argv[3])",
                 str(f), BUCKET, url.split(f"s3://{BUCKET}/")[1] + "/" + f.name],
                check=True,
            )
    if indexed:
        run("index", url)
    ds = ramjet.StreamingDataset(url, image_column="image", image_size=32, batch_size=5, boxes_column=None, cache_limit=None)
    batches = list(ds)
    assert sum(b["image"].shape[0] for b in batches) == N
    assert batches[0]["image"].shape[1:] == (3, 32, 32)
    assert sorted(int(x) for b in batches for x in b["label"]) == sorted(w["label"] for w in fixtures[1]["mds"])


def test_buckets_over_a_dataset_without_sizes_are_refused_naming_the_columns(fixtures, tmp_path):
    """MosaicML's writer records no width or height: aspect-ratio buckets have nothing to choose
    by, and say so instead of decoding every image to find out (issue 69, item 5)."""
    url = str(copy_of(fixtures, tmp_path, "mds-plain"))
    ds = ramjet.StreamingDataset(url, image_column="image", image_size=32, buckets=[(32, 32), (24, 48)],
                                 batch_size=2, boxes_column=None, cache_limit=None)
    with pytest.raises(ramjet.InvalidInputError, match="width and height"):
        list(ds)


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "learned"])
@pytest.mark.parametrize("name,src", [("mds-plain", "mds-plain"), ("wds", "wds/train-{000..002}.tar")])
def test_order_and_exact_resume(fixtures, tmp_path, index_dir, name, src, indexed):
    copy_of(fixtures, tmp_path, name)
    if indexed:
        run("index", str(tmp_path / src))
        url = str(tmp_path / name)
    else:
        url = str(tmp_path / src)
    key = "__key__" if name == "wds" else "name"

    def order(ds):
        return [k for b in ds for k in b[key]]

    kw = dict(image_size=None, batch_size=2, shuffle=True, seed=3, cache_limit=None)
    full = order(ramjet.StreamingDataset(url, **kw))
    assert sorted(full) == sorted(order(ramjet.StreamingDataset(url, **{**kw, "shuffle": False})))
    assert full != sorted(full)
    ds = ramjet.StreamingDataset(url, **kw)
    it = iter(ds)
    head = [k for _ in range(2) for k in next(it)[key]]
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = ramjet.StreamingDataset(url, **kw)
    resumed.load_state_dict(state)
    assert head + order(resumed) == full
    # Rank 0 and 1 of 2 split the epoch, every sample once.
    ranks = [order(ramjet.StreamingDataset(url, **kw, rank=r, world_size=2)) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == sorted(full)


def test_pickled_columns_are_refused(fixtures, tmp_path):
    d = copy_of(fixtures, tmp_path, "mds-pkl")
    out = run("index", str(d), ok=False)
    assert out.returncode != 0
    assert '"pkl" is refused' in out.stderr and "arbitrary code" in out.stderr, out.stderr
    assert not (d / "manifest.json").exists()


def test_a_flipped_byte_in_a_foreign_shard_is_named(fixtures, tmp_path):
    d = copy_of(fixtures, tmp_path, "mds-plain")
    run("index", str(d))
    shard = d / "shard.00001.mds"
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0x10
    shard.write_bytes(bytes(b))
    v = run("verify", str(d), ok=False)
    assert v.returncode == 1 and "shard.00001.mds" in v.stdout and "since it was indexed" in v.stdout, v.stdout
    with pytest.raises(ramjet.CorruptError, match="shard.00001.mds"):
        rows(str(d))


def test_a_damaged_foreign_shard_is_refused_at_index_time_naming_shard_and_sample(fixtures, tmp_path):
    # MDS: an offset past the end (a truncated shard).
    d = copy_of(fixtures, tmp_path, "mds-plain")
    shard = d / "shard.00002.mds"
    shard.write_bytes(shard.read_bytes()[:-7])
    out = run("index", str(d), ok=False)
    assert out.returncode != 0 and "shard.00002.mds" in out.stderr, out.stderr
    # MDS, same length: a sample's variable-column size points past its end (in a dataset
    # written without hashes, so that ramjet's own structural checks are what find it).
    d = copy_of(fixtures, tmp_path / "b", "mds-plain")
    ix = json.loads((d / "index.json").read_text())
    for s in ix["shards"]:
        s["raw_data"]["hashes"] = {}
    (d / "index.json").write_text(json.dumps(ix))
    shard = d / "shard.00000.mds"
    b = bytearray(shard.read_bytes())
    n = int.from_bytes(b[0:4], "little")
    first = int.from_bytes(b[4:8], "little")
    b[first : first + 4] = (10**8).to_bytes(4, "little")
    shard.write_bytes(bytes(b))
    out = run("index", str(d), ok=False)
    assert n >= 1 and "shard.00000.mds" in out.stderr and "sample 0" in out.stderr, out.stderr
    # WebDataset: a truncated tar.
    d = copy_of(fixtures, tmp_path, "wds")
    tar = d / "train-001.tar"
    tar.write_bytes(tar.read_bytes()[:3000])
    out = run("index", str(d / "train-{000..002}.tar"), ok=False)
    assert out.returncode != 0 and "train-001.tar" in out.stderr and "truncated" in out.stderr, out.stderr


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "learned"])
def test_mixing_a_foreign_dataset_with_a_ramjet_one(fixtures, tmp_path, index_dir, indexed):
    copy_of(fixtures, tmp_path, "wds")
    if indexed:
        run("index", str(tmp_path / "wds/shards.txt"))
    packed = tmp_path / "packed"
    images = tmp_path / "synth"
    run("synth", str(images), "--samples", "6")
    run("pack", str(images), str(packed))
    foreign = str(tmp_path / "wds") if indexed else str(tmp_path / "wds/shards.txt")
    orders = []
    # Three seeds: one order in about 8,000 puts each dataset's samples together by chance
    # (the writer's tar headers carry the time, so the foreign manifest's version, and with it
    # the order, differ from run to run); three such in a row do not happen.
    for seed in ("0", "1", "2"):
        out = tmp_path / f"mixed-{seed}.txt"
        run("stream", foreign, str(packed), "--shuffle", "global", "--seed", seed, "--out", str(out))
        streams = [line.split()[2] for line in out.read_text().splitlines()]
        assert (streams.count("0"), streams.count("1")) == (N, 6)
        orders.append(streams)
    assert any(s != sorted(s) for s in orders), "the two datasets were not interleaved"


def flip_a_byte_in_a_sample_and_see_it_named(folder, url):
    """Flips a byte inside a sample of the second shard in `folder`: reading it alone, and
    `verify`, name the shard."""
    f = sorted(p for p in folder.iterdir() if p.suffix in (".mds", ".tar"))[1]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    out = run("stream", url, "--shuffle", "global", ok=False)
    assert out.returncode != 0 and f.name in out.stderr and "sample index" in out.stderr, out.stderr
    v = run("verify", url, ok=False)
    assert v.returncode == 1 and f.name in v.stdout, v.stdout


def stream_json(*args):
    return json.loads(run("stream", *args, "--json").stdout)


@pytest.mark.parametrize("name,src", [("mds-plain", "mds-plain"), ("wds", "wds/train-{000..002}.tar")])
def test_a_plain_foreign_shard_is_read_one_sample_at_a_time_by_its_sample_index(fixtures, tmp_path, name, src):
    copy_of(fixtures, tmp_path, name)
    run("index", str(tmp_path / src))
    url = str(tmp_path / name)
    assert len(list((tmp_path / name / "ramjet-index").iterdir())) == ramjet.inspect(url)["shards"]
    # The global shuffle without a cache reads every sample alone: two ranged reads each (its
    # sample index entry, then its bytes), merged where close; never a whole shard.
    m = stream_json(url, "--shuffle", "global")
    assert m["samples"] == N and m["ranged_samples"] == N and m["cache_misses"] == 0, m
    # Each sample read alone is the one the whole shard holds.
    a, b = tmp_path / "alone.txt", tmp_path / "whole.txt"
    run("stream", url, "--shuffle", "global", "--out", str(a))
    run("stream", url, "--shuffle", "global", "--cache-dir", str(tmp_path / "c"), "--resident", "1GiB", "--out", str(b))
    assert a.read_text() == b.read_text()
    # A flipped byte inside a sample is found by that sample's own checksum, naming it.
    flip_a_byte_in_a_sample_and_see_it_named(tmp_path / name, url)


def test_a_compressed_foreign_shard_has_no_sample_index_and_is_read_whole(fixtures, tmp_path):
    copy_of(fixtures, tmp_path, "mds-zstd")
    run("index", str(tmp_path / "mds-zstd"))
    assert not (tmp_path / "mds-zstd" / "ramjet-index").exists()
    m = stream_json(str(tmp_path / "mds-zstd"), "--shuffle", "none")
    assert m["samples"] == N and m["cache_misses"] >= 1, m


@pytest.mark.parametrize(
    "name,src,column",
    [("mds-plain", "mds-plain", "image"), ("mds-zstd", "mds-zstd", "image"), ("wds", "wds/train-{000..002}.tar", "jpg")],
)
def test_index_with_jpeg_restarts_keeps_the_files_and_every_pixel(fixtures, tmp_path, name, src, column):
    """`ramjet index --jpeg-restarts`: the shards ramjet reads hold each JPEG transcoded with
    restart markers, read whole or one sample at a time; the foreign files stay as the writer
    left them; the decoded and augmented tensors are those of the JPEGs as given."""
    plain, rst = tmp_path / "plain", tmp_path / "rst"
    copy_of(fixtures, plain, name)
    d = copy_of(fixtures, rst, name)
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    run("index", str(plain / src))
    out = run("index", "--jpeg-restarts", str(rst / src)).stdout
    assert "restart marker every 32 px" in out, out
    assert ramjet.inspect(str(d))["jpeg_restart_px"] == 32 and ramjet.inspect(str(plain / name))["jpeg_restart_px"] is None
    assert "restart marker every 32 px" in run("inspect", str(d)).stdout
    assert all((d / n).read_bytes() == b for n, b in before.items()), "a foreign file changed"
    assert run("verify", str(d)).returncode == 0

    given = [r[column] for r in rows(str(plain / name))]
    stored = [r[column] for r in rows(str(d))]
    assert len(stored) == N and all(s != g for s, g in zip(stored, given)), "the JPEGs were not transcoded"
    # A restart interval (DRI, FF DD) before the entropy-coded data, and restart markers in it.
    assert all(b"\xff\xdd" in s[: s.index(b"\xff\xda")] and b"\xff\xd0" in s for s in stored)

    def tensors(url):
        kw = dict(image_column=column, image_size=48, batch_size=5, boxes_column=None, shuffle=False, seed=7, cache_limit=None)
        return torch.cat([b[column] for b in ramjet.StreamingDataset(url, **kw)])

    a, b = tensors(str(plain / name)), tensors(str(d))
    assert a.shape == (N, 3, 48, 48) and torch.equal(a, b)
    if name != "mds-zstd":
        # Read one sample at a time (sample index): each transcodes alone to the record the
        # whole shard holds, its checksum checked.
        m = stream_json(str(d), "--shuffle", "global")
        assert m["samples"] == N and m["ranged_samples"] == N, m
        whole, alone = tmp_path / "whole.txt", tmp_path / "alone.txt"
        run("stream", str(d), "--shuffle", "global", "--out", str(alone))
        run("stream", str(d), "--shuffle", "global", "--cache-dir", str(tmp_path / "c"), "--resident", "1GiB", "--out", str(whole))
        assert alone.read_text() == whole.read_text()


def test_a_damaged_sample_index_is_named_by_verify(fixtures, tmp_path):
    copy_of(fixtures, tmp_path, "mds-plain")
    run("index", str(tmp_path / "mds-plain"))
    ix = sorted((tmp_path / "mds-plain" / "ramjet-index").iterdir())[0]
    b = bytearray(ix.read_bytes())
    b[3] ^= 1
    ix.write_bytes(bytes(b))
    v = run("verify", str(tmp_path / "mds-plain"), ok=False)
    assert v.returncode == 1 and ix.name in v.stdout and "sample index" in v.stdout, v.stdout


def test_an_index_naming_a_file_outside_its_folder_is_refused(fixtures, tmp_path):
    d = copy_of(fixtures, tmp_path, "mds-plain")
    ix = json.loads((d / "index.json").read_text())
    ix["shards"][0]["raw_data"]["basename"] = "../outside.mds"
    (d / "index.json").write_text(json.dumps(ix))
    out = run("index", str(d), ok=False)
    assert out.returncode != 0 and "outside.mds" in out.stderr and "shard key" in out.stderr, out.stderr
    assert not (d / "manifest.json").exists()


@pytest.mark.parametrize("name,src", [("mds-plain", "mds-plain"), ("wds", "wds/train-{000..002}.tar")])
def test_a_learned_index_is_kept_and_reads_sample_by_sample_verified(fixtures, tmp_path, index_dir, name, src):
    copy_of(fixtures, tmp_path, name)
    url = str(tmp_path / src)
    first = run("inspect", url)
    assert "ramjet: learned" in first.stderr and "learned on this host" in first.stdout, first
    # Kept: later opens read no shard to learn it again.
    again = run("inspect", url)
    assert "ramjet: learned" not in again.stderr, again.stderr
    # Random access needs no sequential scan: the global shuffle without a cache reads every
    # sample alone through the learned sample index, never a whole shard.
    m = stream_json(url, "--shuffle", "global")
    assert m["samples"] == N and m["ranged_samples"] == N and m["cache_misses"] == 0, m
    # Every read is checked against the checksums learned: a byte flipped since is named.
    flip_a_byte_in_a_sample_and_see_it_named(tmp_path / name, url)


def test_processes_opening_one_source_at_once_learn_it_once(fixtures, tmp_path, index_dir):
    copy_of(fixtures, tmp_path, "wds")
    url = str(tmp_path / "wds/shards.txt")
    procs = [subprocess.Popen([RAMJET, "inspect", url, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [(p.communicate(), p.returncode) for p in procs]
    assert all(rc == 0 for _, rc in outs), outs
    assert sum("ramjet: learned" in err for (_, err), _ in outs) == 1, outs
    assert {json.loads(o)["version"] for (o, _), _ in outs} == {json.loads(outs[0][0][0])["version"]}
    # A rewritten shard list is another source: learned again, with its own shards.
    (tmp_path / "wds/shards.txt").write_text("train-000.tar\ntrain-001.tar\n")
    r = run("inspect", url, "--json")
    assert "ramjet: learned" in r.stderr and 0 < json.loads(r.stdout)["samples"] < N, r
    assert len(list(index_dir.iterdir())) == 2


def test_a_tampered_learned_index_is_refused_naming_it(fixtures, tmp_path, index_dir):
    d = copy_of(fixtures, tmp_path, "mds-plain")
    run("inspect", str(d))
    [folder] = list(index_dir.iterdir())
    # Its sample index: verify names the shard whose index it is.
    rjx = sorted((folder / "ramjet-index").iterdir())[2]
    b = bytearray(rjx.read_bytes())
    b[5] ^= 0x01
    rjx.write_bytes(bytes(b))
    v = run("verify", str(d), ok=False)
    assert v.returncode == 1 and "shard.00002.mds" in v.stdout and "sample index" in v.stdout, v.stdout
    # Its manifest: refused naming the file and what to do, never used.
    m = folder / "manifest.json"
    m.write_text(m.read_text().replace('"samples": 2', '"samples": 3', 1))
    out = run("inspect", str(d), ok=False)
    assert out.returncode != 0 and str(m) in out.stderr and f"delete {folder}" in out.stderr, out.stderr
    shutil.rmtree(folder)
    assert_mds_rows(rows(str(d)), fixtures[1]["mds"])


def test_a_learner_killed_half_way_leaves_nothing_that_is_used(fixtures, tmp_path, index_dir):
    """What a learner killed before it wrote its manifest leaves (sample indexes, damaged ones
    too, and its lock file) is never read: the next open waits for any learner holding the
    lock, then learns again."""
    import fcntl
    import signal
    import time

    copy_of(fixtures, tmp_path, "wds")
    url = str(tmp_path / "wds/train-{000..002}.tar")
    run("inspect", url)
    [folder] = list(index_dir.iterdir())
    (folder / "manifest.json").unlink()
    for rjx in (folder / "ramjet-index").iterdir():
        rjx.write_bytes(b"\0" * 7)
    with open(folder / ".learning", "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # A learner holds the lock: an open waits for it, and one killed while waiting leaves
        # nothing either.
        waiting = [subprocess.Popen([RAMJET, "inspect", url, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        # Wait for both to be blocked on the learner's lock (an event: /proc/locks lists each
        # blocked flock waiter with "->"), not for a pause after which they may simply not have
        # reached it yet.
        deadline = time.monotonic() + 60
        while True:
            with open("/proc/locks") as f:
                blocked = {int(line.split()[5]) for line in f if " -> FLOCK " in line}
            if all(p.pid in blocked for p in waiting):
                break
            assert all(p.poll() is None for p in waiting), [p.communicate() for p in waiting]
            assert time.monotonic() < deadline, f"the opens never waited on the lock: blocked={blocked}"
            time.sleep(0.02)
        waiting[0].send_signal(signal.SIGKILL)
        waiting[0].wait()
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = waiting[1].communicate(timeout=60)
    assert waiting[1].returncode == 0 and "ramjet: learned" in err, err
    assert json.loads(out)["samples"] == N
    assert_wds_rows(rows(url), fixtures[1]["wds"])
    assert run("verify", url).returncode == 0
