"""Warm loader over Parquet and LitData's chunks (issue 71): ramjet reading a Hugging Face
dataset's Parquet files in place, against Hugging Face `datasets` streaming the same files
(`load_dataset("parquet", streaming=True)`, an `IterableDataset` in a torch DataLoader with 2
workers); ramjet reading `litdata.optimize`'s chunks of the same images in place, against
LitData's own `StreamingDataset` + `StreamingDataLoader` (2 workers); and ramjet on its own
shards of the same images. The same output for all (RandomResizedCrop 224 + flip, uint8,
batch 8).

    .ramjet/bench-venv/bin/python benches/python/parquet_loader.py [--n 2000] [--rounds 5]

The dataset is written once under target/bench/parquet (N synthetic 640x480 JPEGs through
`Dataset.from_dict(...).cast_column("image", Image())` and `to_parquet`, four files; the same
JPEGs through `litdata.optimize` as a JPEG field; the same JPEGs packed with `ramjet pack`).
Every ramjet contender reads through a warm node-local cache.
The contenders run interleaved round by round, the order rotated each round (measure.py):
medians, every round's ratios, CPU seconds per 1,000 images (the process and its DataLoader
workers). Targets: ramjet over Parquet at least 3x `datasets` streaming, over LitData's
chunks at least 3x LitData's own loader, each within 10% of ramjet on its own shards. Prints one JSON object and writes target/bench/parquet-loader.json.
"""

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

import ramjet

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - benches/python/measure.py, the shared measuring rules
from bench_loader import interleaved, ramjet_rate  # noqa: E402

OUT = 224
BATCH = 8
FILES = 4


def jpeg(i, rng):
    """A 640x480 JPEG with some structure (so it compresses like a photo, not like noise)."""
    y, x = np.mgrid[0:480, 0:640]
    base = np.stack([(x + 3 * i) % 256, (y + 5 * i) % 256, ((x * y) // 97 + i) % 256], -1)
    noise = rng.integers(0, 40, (480, 640, 3))
    b = io.BytesIO()
    Image.fromarray((base + noise).clip(0, 255).astype(np.uint8)).save(b, format="JPEG", quality=88)
    return b.getvalue()


def build(root, n):
    """The Parquet files, the LitData chunks and the ramjet shards of the same N JPEGs, once."""
    pq_dir, images, shards, lit = root / "hf", root / "images", root / "shards", root / "lit"
    done = root / "done"
    if done.exists() and done.read_text().strip() == f"{n} with litdata":
        return pq_dir, shards, lit
    from datasets import Dataset, Image as HfImage

    rng = np.random.default_rng(0)
    blobs = [jpeg(i, rng) for i in range(n)]
    (images / "a").mkdir(parents=True, exist_ok=True)
    for i, b in enumerate(blobs):
        (images / "a" / f"{i:06d}.jpg").write_bytes(b)
    pq_dir.mkdir(parents=True, exist_ok=True)
    per = -(-n // FILES)
    for f in range(FILES):
        part = range(f * per, min(n, (f + 1) * per))
        ds = Dataset.from_dict({"image": [{"bytes": blobs[i], "path": None} for i in part],
                                "label": [i % 10 for i in part]}).cast_column("image", HfImage())
        ds.to_parquet(str(pq_dir / f"train-{f:05d}-of-{FILES:05d}.parquet"))
    exe = os.environ.get("RAMJET_BIN", "target/release/ramjet")
    subprocess.run([exe, "pack", str(images), str(shards)], check=True, stdout=subprocess.DEVNULL)
    import litdata as ld

    ld.optimize(fn=LitSample(images), inputs=list(range(n)), output_dir=str(lit), chunk_bytes="64MB", num_workers=1)
    (root / "done").write_text(f"{n} with litdata")
    return pq_dir, shards, lit


class LitSample:
    """`litdata.optimize`'s fn: image `i` as a JPEG file (LitData's `jpeg` serializer keeps its
    bytes) and a label."""

    def __init__(self, images):
        self.images = images

    def __call__(self, i):
        return {"image": Image.open(self.images / "a" / f"{i:06d}.jpg"), "label": i % 10}


class Transform:
    """The peer's per-sample work: the decoded PIL image to a RandomResizedCrop + flip tensor."""

    def __init__(self):
        self.tf = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(OUT, antialias=True), v2.RandomHorizontalFlip()])

    def __call__(self, s):
        return {"image": self.tf(s["image"].convert("RGB")), "label": s["label"]}


def hf_rate(pq_dir, workers):
    from datasets import load_dataset

    files = sorted(str(p) for p in Path(pq_dir).glob("*.parquet"))
    ds = load_dataset("parquet", data_files=files, split="train", streaming=True).map(Transform())
    dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers)
    return sum(b["image"].shape[0] for b in dl)


class LitTransform:
    """The same work for LitData's loader: its decoded `(3, H, W)` uint8 tensor cropped."""

    def __init__(self):
        self.tf = v2.Compose([v2.RandomResizedCrop(OUT, antialias=True), v2.RandomHorizontalFlip()])

    def __call__(self, s):
        return {"image": self.tf(s["image"]), "label": s["label"]}


def lit_rate(lit, workers):
    import litdata as ld

    ds = ld.StreamingDataset(str(lit), transform=LitTransform())
    dl = ld.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)
    return sum(b["image"].shape[0] for b in dl)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--root", default="target/bench/parquet")
    a = p.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    pq_dir, shards, lit = build(root, a.n)
    os.environ.setdefault("RAMJET_INDEX_DIR", str(root / "learned"))
    kw = dict(batch_size=BATCH, image_size=OUT, boxes_column=None)
    on_pq = ramjet.StreamingDataset(str(pq_dir), local=str(root / "cache-pq"), **kw)
    on_rj = ramjet.StreamingDataset(str(shards), local=str(root / "cache-rj"), **kw)
    on_lit = ramjet.StreamingDataset(str(lit), local=str(root / "cache-lit"), **kw)
    for u in (pq_dir, shards, lit):
        assert ramjet.inspect(str(u))["samples"] == a.n, u
    for ds in (on_pq, on_rj, on_lit):
        ramjet_rate(ds, 0)  # learn the indexes, warm the node-local caches
    hf_rate(pq_dir, 2)  # the peers' first reads (their page caches warm too)
    lit_rate(lit, 2)
    res = interleaved([("ramjet_parquet", lambda r: ramjet_rate(on_pq, r + 1)),
                       ("ramjet_litdata", lambda r: ramjet_rate(on_lit, r + 1)),
                       ("ramjet_shards", lambda r: ramjet_rate(on_rj, r + 1)),
                       ("hf_datasets_streaming", lambda r: hf_rate(pq_dir, 2)),
                       ("litdata_streaming", lambda r: lit_rate(lit, 2))], a.rounds, "")
    med = {c: res.median(c) for c in res.contenders()}
    cpu = {c: res.median(c, "cpu_per_1000") for c in res.contenders()}
    vs_hf = med["ramjet_parquet"] / med["hf_datasets_streaming"]
    vs_own = med["ramjet_parquet"] / med["ramjet_shards"]
    out = {
        "images": a.n,
        "median_img_per_s": {k: round(v, 1) for k, v in med.items()},
        "median_cpu_s_per_1000_img": {k: round(v, 3) for k, v in cpu.items()},
        "ratio_vs_hf_datasets_streaming": round(vs_hf, 2),
        "per_round_ratio_vs_hf_datasets_streaming": [
            round(x, 2) for x in res.ratios("ramjet_parquet", "hf_datasets_streaming")],
        "ratio_vs_ramjet_shards": round(vs_own, 2),
        "per_round_ratio_vs_ramjet_shards": [round(x, 2) for x in res.ratios("ramjet_parquet", "ramjet_shards")],
        "rounds": {c: res.summary(c) for c in res.contenders()},
        "steal_flagged_rounds": res.flagged(),
    }
    v = res.verdict(vs_hf >= 3)
    out["target_vs_hf"] = f"at least 3x datasets streaming: {measure.verdict_text(v, res.rounds(), len(res.flagged()))}"
    v = res.verdict(vs_own >= 0.9)
    out["target_vs_own"] = f"within 10% of ramjet's own shards: {measure.verdict_text(v, res.rounds(), len(res.flagged()))}"
    lit_vs_peer = med["ramjet_litdata"] / med["litdata_streaming"]
    lit_vs_own = med["ramjet_litdata"] / med["ramjet_shards"]
    out["litdata_ratio_vs_litdata_streaming"] = round(lit_vs_peer, 2)
    out["litdata_per_round_ratio_vs_litdata_streaming"] = [
        round(x, 2) for x in res.ratios("ramjet_litdata", "litdata_streaming")]
    out["litdata_ratio_vs_ramjet_shards"] = round(lit_vs_own, 2)
    out["litdata_per_round_ratio_vs_ramjet_shards"] = [
        round(x, 2) for x in res.ratios("ramjet_litdata", "ramjet_shards")]
    v = res.verdict(lit_vs_peer >= 3)
    out["litdata_target_vs_peer"] = (f"over LitData's chunks, at least 3x LitData's own loader: "
                                     f"{measure.verdict_text(v, res.rounds(), len(res.flagged()))}")
    v = res.verdict(lit_vs_own >= 0.9)
    out["litdata_target_vs_own"] = (f"over LitData's chunks, within 10% of ramjet's own shards: "
                                    f"{measure.verdict_text(v, res.rounds(), len(res.flagged()))}")
    Path("target/bench").mkdir(parents=True, exist_ok=True)
    Path("target/bench/parquet-loader.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
