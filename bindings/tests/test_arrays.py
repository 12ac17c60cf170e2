"""Typed array columns packed from JSONL (`ramjet pack --column NAME:DTYPE[DIMS]`): every value
comes back with its dtype, shape and elements, as one `(N, *shape)` tensor when a batch's shapes
agree and as values, offsets and shapes when they do not; a value that does not fit its column
is an error naming the line and the column."""

import json
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

import ramjet
from ramjet_cli import RAMJET, run


def fails(*args):
    """The CLI run that must fail: its output."""
    out = subprocess.run([RAMJET, *args], capture_output=True, text=True)
    assert out.returncode != 0, out.stdout
    return out.stdout + out.stderr

TYPES = ["tokens:int32[]", "emb:float32[3]", "boxes:float32[?,4]", "big:uint64[2]", "h:float16[?]", "b:bfloat16[2]", "grid:int8[?,?]"]


def row(i, rng):
    return {
        "id": i,
        "tokens": [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(0, 30))],
        "emb": [i * 0.5, 1.0, -2.25],
        "boxes": [[rng.random() for _ in range(4)] for _ in range(i % 3)],
        "big": [2**64 - 1 - i, i],
        "h": [0.5 * k for k in range(i % 5)],
        "b": [1.0, -0.5],
        "grid": [[(i + r + c) % 100 - 50 for c in range(i % 2 + 1)] for r in range(i % 3 + 1)],
    }


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("arrays")
    rng = random.Random(5)
    rows = [row(i, rng) for i in range(203)]
    src = d / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["pack", str(src), str(d / "ds"), "--shard-size", "8KiB"]
    for t in TYPES:
        args += ["--column", t]
    run(*args)
    return d / "ds", rows


def want(name, value):
    dt = {"tokens": np.int32, "emb": np.float32, "boxes": np.float32, "big": np.uint64, "h": np.float16, "grid": np.int8}
    shape = {"boxes": (-1, 4)}.get(name)
    a = np.array(value, dtype=dt[name])
    return a.reshape(shape) if shape and a.size == 0 else a


def value_of(b, name, j):
    if f"{name}_offsets" in b:
        o = b[f"{name}_offsets"]
        return b[name][o[j] : o[j + 1]].reshape(b[f"{name}_shapes"][j].tolist())
    return b[name][j]


def test_every_value_round_trips_with_its_dtype_and_shape(packed):
    url, rows = packed
    assert "tokens:int32[?]" in run("inspect", str(url))
    ds = ramjet.StreamingDataset(str(url), image_size=None, batch_size=16, shuffle=True, seed=3)
    seen = 0
    for b in ds:
        # Fixed shapes make one tensor; the others are ragged.
        assert b["emb"].shape == (len(b["_index"]), 3) and b["emb"].dtype == torch.float32
        assert b["big"].dtype == torch.uint64 and b["b"].dtype == torch.bfloat16
        assert b["tokens"].dtype == torch.int32 and b["tokens"].dim() == 1
        assert b["tokens_offsets"].shape == (len(b["_index"]) + 1,)
        assert b["grid_shapes"].shape == (len(b["_index"]), 2)
        for j, i in enumerate(b["_index"].tolist()):
            r = rows[i]
            for name in ("tokens", "emb", "boxes", "big", "h", "grid"):
                got = value_of(b, name, j)
                w = want(name, r[name])
                assert tuple(got.shape) == w.shape, (i, name, got.shape, w.shape)
                assert got.contiguous().view(torch.uint8).numpy().tobytes() == w.tobytes(), (i, name)
            assert value_of(b, "b", j).tolist() == r["b"]
            seen += 1
    assert seen == len(rows)


def test_a_batch_of_one_shape_is_one_tensor_shared_with_torch(packed):
    url, rows = packed
    ds = ramjet.StreamingDataset(str(url), image_size=None, batch_size=8, shuffle=False)
    b = next(iter(ds))
    assert b["emb"].shape == (8, 3) and "emb_offsets" not in b
    assert b["emb"].tolist() == [rows[i]["emb"] for i in range(8)]
    assert b["emb"].data_ptr() % 64 == 0, "an array batch is aligned for any element type"


def test_random_access_gives_each_value_its_own_shape(packed):
    url, rows = packed
    r = ramjet.Reader(str(url))
    for i in (0, 1, 2, 100, 202):
        s = r[i]
        assert s["tokens"].tolist() == rows[i]["tokens"]
        assert tuple(s["boxes"].shape) == want("boxes", rows[i]["boxes"]).shape
        assert s["grid"].tolist() == rows[i]["grid"]
        assert s["big"].tolist() == rows[i]["big"]


@pytest.mark.parametrize(
    "column, value, why",
    [
        ("emb:float32[?]", [1, 2], None),
        ("emb:float32[1]", [1, 2], "shape is [2]"),
        ("emb:float32[?]", [1, "x", 3], "is not a number"),
        ("emb:uint8[?]", [1, 256], "out of range for uint8"),
        ("emb:int32[?]", [1.5], "not an integer"),
        ("emb:float32[*]", [[1, 2], [3]], "ragged"),
        ("emb:float32[?]", 7, "shape is []"),
        ("emb:float32[*]", [1, "x"], "is not a number"),
        ("emb:int33[?]", [1], "unknown dtype"),
        ("nope:int32[?]", [1], "no column"),
    ],
)
def test_a_value_that_does_not_fit_its_column_names_line_and_column(tmp_path, column, value, why):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"id": 0, "emb": [1.0]}) + "\n" + json.dumps({"id": 1, "emb": value}) + "\n")
    if why is None:  # the control: the same input with a fitting value packs
        run("pack", str(src), str(tmp_path / "ds"), "--column", column)
        return
    msg = fails("pack", str(src), str(tmp_path / "ds"), "--column", column)
    assert why in msg, msg
    if "column" not in why and "dtype" not in why:
        assert "rows.jsonl:2" in msg and '"emb"' in msg, msg


def test_a_flipped_byte_in_an_array_shard_is_caught(packed, tmp_path):
    url, _ = packed
    d = tmp_path / "ds"
    shutil.copytree(url, d)
    shard = sorted((d / "shards").iterdir())[0]
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0x40
    shard.write_bytes(bytes(b))
    assert shard.name in fails("verify", str(d))


def test_npy_and_npz_files_named_by_a_column_round_trip_exactly(tmp_path):
    """Arrays written by numpy.save, savez and savez_compressed (C and Fortran order,
    big-endian) packed through a JSONL column naming them: bytes, dtype and shape as NumPy
    has them, row-major and little-endian."""
    arrays = []
    lines = []
    for i in range(12):
        a = (np.arange((i % 4 + 1) * 3, dtype=np.float32).reshape(i % 4 + 1, 3) - i) / 3
        if i % 3 == 1:
            a = np.asfortranarray(a)
        if i % 5 == 2:
            a = a.astype(">f4")
        arrays.append(a)
        if i % 3 == 0:
            np.save(tmp_path / f"a{i}.npy", a)
            ref = f"a{i}.npy"
        elif i % 3 == 1:
            np.savez(tmp_path / f"z{i}.npz", emb=a, other=np.zeros(2))
            ref = f"z{i}.npz#emb"
        else:
            np.savez_compressed(tmp_path / f"c{i}.npz", emb=a)
            ref = f"c{i}.npz#emb"
        lines.append(json.dumps({"id": i, "emb": ref}))
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    run("pack", str(tmp_path / "rows.jsonl"), str(tmp_path / "ds"), "--column", "emb:float32[?,3]")
    r = ramjet.Reader(str(tmp_path / "ds"))
    for i, a in enumerate(arrays):
        got = r[i]["emb"]
        want = np.ascontiguousarray(a.astype("<f4"))
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, (i, got.shape)
        assert got.numpy().tobytes() == want.tobytes(), i
    # A file of another dtype, a missing member, a missing file: errors naming line and file.
    np.save(tmp_path / "d.npy", np.zeros((2, 3), dtype=np.float64))
    z = (tmp_path / "z1.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(z[: len(z) // 2])
    at = z.index(b"\x93NUMPY") + 140  # in the first member's elements
    (tmp_path / "flip.npz").write_bytes(z[:at] + bytes([z[at] ^ 0x10]) + z[at + 1 :])
    cases = [("d.npy", "float64"), ("z1.npz#nope", "no array"), ("gone.npy", "gone.npy"), ("cut.npz#emb", "npz")]
    for ref, why in cases + [("flip.npz#emb", "CRC-32")]:
        (tmp_path / "bad.jsonl").write_text(json.dumps({"id": 0, "emb": ref}) + "\n")
        msg = fails("pack", str(tmp_path / "bad.jsonl"), str(tmp_path / "bad"), "--column", "emb:float32[?,3]")
        assert why in msg and "bad.jsonl:1" in msg and ref.split("#")[0] in msg, msg
