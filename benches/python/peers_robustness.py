#!/usr/bin/env python3
"""Probes the peers (MosaicML Streaming, WebDataset) with the robustness rows of
docs/robustness.md that can be shown on one machine in seconds: a flipped byte in a shard, a
truncated shard, a bad argument, a tampered resume state, and an exactly-once audit. Each probe
records what the peer did (the exception, or what it yielded) as observed, not a verdict
copied from elsewhere.

Run with the peers' venv (tools/bench-venv.sh):
    $(tools/bench-venv.sh) benches/python/peers_robustness.py --out docs/robustness-peers.json
"""

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path

N = 64


def outcome(fn):
    try:
        return {"result": "no error", "detail": fn()}
    except Exception as e:  # the point: record whatever the peer raises
        return {"result": f"raised {type(e).__name__}", "detail": str(e)[:300]}


def payload(i):
    return (f"sample-{i:04d}-" + "x" * 200).encode()


def mosaic(work: Path):
    import streaming
    from streaming import MDSWriter, StreamingDataset

    out = {"peer": f"mosaicml-streaming {streaming.__version__}"}

    def write(d):
        with MDSWriter(out=str(d), columns={"data": "bytes", "i": "int"}, size_limit=4096) as w:
            for i in range(N):
                w.write({"data": payload(i), "i": i})

    def read(d, **kw):
        ds = StreamingDataset(local=str(d), batch_size=1, shuffle=False, **kw)
        return ds, [ds[j] for j in range(len(ds))]

    clean = work / "mds-clean"
    write(clean)

    def flipped():
        d = work / "mds-flip"
        write(d)
        shard = sorted(d.glob("shard.*.mds"))[0]
        b = bytearray(shard.read_bytes())
        at = b.find(b"sample-0001-") + 8  # inside sample 1's bytes
        b[at] ^= 0x01
        shard.write_bytes(bytes(b))
        _, got = read(d)
        wrong = [int(s["i"]) for s in got if s["data"] != payload(int(s["i"]))]
        return f"yielded {len(got)} samples, {len(wrong)} of them with changed bytes ({wrong[:3]}) and no error"

    def truncated():
        d = work / "mds-trunc"
        write(d)
        shard = sorted(d.glob("shard.*.mds"))[1]
        shard.write_bytes(shard.read_bytes()[:100])
        _, got = read(d)
        return f"yielded {len(got)} samples"

    def bad_argument():
        ds = StreamingDataset(local=str(clean), batch_size=-4, shuffle=False)
        return f"batch_size=-4 accepted; len={len(ds)}"

    def tampered_state():
        ds = StreamingDataset(local=str(clean), batch_size=1, shuffle=False)
        st = ds.state_dict(0, False)
        st["sample_in_epoch"] = 10**9
        ds.load_state_dict(st)
        got = list(iter(ds))
        return f"sample_in_epoch=10**9 accepted; the epoch then yielded {len(got)} samples"

    def audit():
        ds = StreamingDataset(local=str(clean), batch_size=1, shuffle=False)
        return "an audit API exists" if any(hasattr(ds, a) for a in ("audit", "verify_epoch")) else "no audit API"

    for name, fn in [
        ("flipped byte in a shard", flipped),
        ("truncated shard", truncated),
        ("bad argument", bad_argument),
        ("tampered resume state", tampered_state),
        ("exactly-once audit", audit),
    ]:
        out[name] = outcome(fn)
    return out


def wds(work: Path):
    import webdataset as wds_

    out = {"peer": f"webdataset {getattr(wds_, '__version__', '?')}"}

    def write(path):
        with tarfile.open(path, "w") as t:
            for i in range(N):
                data = payload(i)
                ti = tarfile.TarInfo(f"{i:06d}.bin")
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))

    def read(path):
        return [(s["__key__"], s["bin"]) for s in wds_.WebDataset(str(path), shardshuffle=False)]

    def flipped():
        p = work / "flip.tar"
        write(p)
        b = bytearray(p.read_bytes())
        b[b.find(b"sample-0001-") + 8] ^= 0x01
        p.write_bytes(bytes(b))
        got = read(p)
        wrong = [k for k, v in got if v != payload(int(k))]
        return f"yielded {len(got)} samples, {len(wrong)} with changed bytes ({wrong[:3]}) and no error"

    def truncated():
        p = work / "trunc.tar"
        write(p)
        p.write_bytes(p.read_bytes()[: 512 * 40])
        got = read(p)
        return f"yielded {len(got)} of {N} samples"

    def audit():
        return "no audit API"

    for name, fn in [("flipped byte in a shard", flipped), ("truncated shard", truncated), ("exactly-once audit", audit)]:
        out[name] = outcome(fn)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        work = Path(t)
        res = {"python": sys.version.split()[0]}
        for name, fn in [("mosaicml", mosaic), ("webdataset", wds)]:
            try:
                res[name] = fn(work)
            except ImportError as e:
                res[name] = {"error": f"not installed: {e}"}
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
