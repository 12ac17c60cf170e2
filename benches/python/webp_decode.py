#!/usr/bin/env python3
"""Issue 69: WebP decode on one core, ramjet against Pillow (the same libwebp underneath),
contenders interleaved round by round (the order rotated each round).

The images: every JPEG of --dir (an ImageNet-like synth set: `ramjet synth DIR --samples 300
--profile imagenet`) re-encoded by Pillow as WebP, lossy at quality 90 (--lossless: lossless).
Contenders, each over every image, in this one process pinned to one core:
- `pillow full`: `Image.open(...).convert("RGB")`, forced to load;
- `ramjet full`: `ramjet.decode_image(b)`, the whole image to RGB;
- `pillow rrc`: the full decode, then torchvision's `RandomResizedCrop(224)` on the PIL image
  (Pillow's crop and antialiased bilinear resize) and a flip, to a uint8 array;
- `ramjet rrc`: `decode_image(b, {"width": 224, "height": 224})`: the crop decoded (and scaled
  when it is at least twice the output) inside libwebp, resized, flipped, CHW;
- `ramjet rrc crop only`: the same with `dct_scaling` off (the crop decoded at full scale).
Reports each contender's images/s and CPU ms per image per round, their medians, and the
per-round ratios against Pillow (targets: rrc at least 1.2x, full at least 1.0x).
Usage: benches/python/webp_decode.py --dir DIR [--n 300] [--rounds 7] [--lossless] [--scale 2]
    [--json F]
"""
import argparse
import glob
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared measuring rules (rotated order, CPU and steal of a run)

import ramjet  # noqa: E402


def webps(d, n, lossless, scale):
    out = []
    for f in sorted(glob.glob(os.path.join(d, "*.jpg")))[:n]:
        b = io.BytesIO()
        im = Image.open(f).convert("RGB")
        if scale != 1:
            im = im.resize((round(im.width * scale), round(im.height * scale)), Image.BICUBIC)
        im.save(b, "WEBP", **({"lossless": True} if lossless else {"quality": 90}))
        out.append(b.getvalue())
    return out


def contenders():
    from torchvision import transforms

    rrc = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip()])
    train = {"width": 224, "height": 224}
    crop_only = {"width": 224, "height": 224, "dct_scaling": False}

    def pillow_full(b, i):
        im = Image.open(io.BytesIO(b)).convert("RGB")
        im.load()

    def pillow_rrc(b, i):
        np.asarray(rrc(Image.open(io.BytesIO(b)).convert("RGB")))

    return {
        "pillow full": pillow_full,
        "ramjet full": lambda b, i: ramjet.decode_image(b),
        "pillow rrc": pillow_rrc,
        "ramjet rrc": lambda b, i: ramjet.decode_image(b, train, sample=i),
        "ramjet rrc crop only": lambda b, i: ramjet.decode_image(b, crop_only, sample=i),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--lossless", action="store_true")
    ap.add_argument("--scale", type=float, default=1.0, help="resize the images by this factor before encoding")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    import torch

    torch.set_num_threads(1)
    imgs = webps(a.dir, a.n, a.lossless, a.scale)
    mb = sum(map(len, imgs)) / 1e6
    print(f"{len(imgs)} WebP ({'lossless' if a.lossless else 'lossy q90'}, scaled {a.scale}x), {mb:.1f} MB, one core",
          flush=True)
    fns = contenders()
    for name, fn in fns.items():  # warm every path once
        for i, b in enumerate(imgs[:5]):
            fn(b, i)
    res = measure.Rounds("images")
    for r in range(a.rounds):
        for name in measure.order(fns, r):
            fn = fns[name]
            with measure.Meter() as m:
                for i, b in enumerate(imgs):
                    fn(b, i)
            res.add_meter(r, name, m, len(imgs))
        print(res.line(r), flush=True)
    out = {c: res.summary(c) for c in res.contenders()}
    for ours, theirs, target in [("ramjet rrc", "pillow rrc", 1.2), ("ramjet rrc crop only", "pillow rrc", 1.2),
                                 ("ramjet full", "pillow full", 1.0)]:
        ratios = res.ratios(ours, theirs)
        med = statistics.median(ratios)
        v = res.verdict(med >= target)
        out[f"{ours} / {theirs}"] = {"ratios": [round(x, 3) for x in ratios], "median": med,
                                     "target": target, "verdict": measure.verdict_text(v, res.rounds(), len(res.flagged()))}
        print(f"{ours} / {theirs}: per round {[round(x, 2) for x in ratios]}, median {med:.2f} "
              f"(target {target}x: {out[f'{ours} / {theirs}']['verdict']})")
    for c in res.contenders():
        print(f"{c}: median {res.median(c):,.0f} images/s, {res.median(c, 'cpu_per_1000'):.2f} CPU s/1000 images")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
