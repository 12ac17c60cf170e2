#!/usr/bin/env python3
"""How ramjet's CPU path scales with decode threads, beside a torch DataLoader over the same
JPEGs (issue 40, step 7 of the device check; on a 16-core GPU machine that is where it can be
seen, this VM has 2 cores).

Each measurement is a fresh process (the decode pool is sized once per process): one warm-up
epoch, then one measured epoch of RandomResizedCrop 224 + flip + normalise, batch 64, from a
local packed copy (no network). Contenders are interleaved round by round; medians over the
rounds, with each round's figures in the JSON.

  ramjet T   StreamingDataset(num_threads=T) for each T of --threads
  torch W    torch DataLoader, W workers (the largest T), PIL decode + torchvision transforms

Figures: img/s and CPU seconds per 1,000 images for each, the 16-over-1 (largest over
smallest) thread scaling, and ramjet at the largest T over the DataLoader.

Usage: RAMJET_BIN=... benches/python/cpu_scale.py [--threads 1,2,4,8,16] [--rounds 3]
                                                  [--samples 1024] [--out FILE.json] [--quick]
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")


def cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime + c.ru_utime + c.ru_stime


def child_ramjet(ds_dir: str, threads: int, batch: int) -> dict:
    import ramjet

    ds = ramjet.StreamingDataset(ds_dir, batch_size=batch, image_size=224, normalize=True, num_threads=threads,
                                 cache_limit=None)
    n = sum(b["image"].shape[0] for b in ds)  # warm-up epoch
    c0, t0 = cpu_s(), time.perf_counter()
    n = sum(b["image"].shape[0] for b in ds)
    return {"images": n, "wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0}


def child_torch(img_dir: str, workers: int, batch: int) -> dict:
    import torch
    from PIL import Image
    from torchvision import transforms

    tf = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    files = sorted(Path(img_dir).glob("*.jpg"))

    class Files(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            with Image.open(files[i]) as im:
                return tf(im.convert("RGB"))

    # Workers that end with each epoch: their CPU time is then counted (RUSAGE_CHILDREN counts
    # reaped children only), their start-up included, as a DataLoader pays it every epoch
    # without persistent_workers.
    dl = torch.utils.data.DataLoader(Files(), batch_size=batch, num_workers=workers, shuffle=True)
    n = sum(b.shape[0] for b in dl)  # warm-up epoch (page cache fills, imports done)
    c0, t0 = cpu_s(), time.perf_counter()
    n = sum(b.shape[0] for b in dl)
    return {"images": n, "wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0}


def measure(kind: str, arg: int, data: Path, batch: int) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", kind, str(arg), str(data), str(batch)],
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"cpu_scale: {kind} {arg} failed:\n{p.stdout}\n{p.stderr}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["img_s"] = r["images"] / r["wall_s"]
    r["cpu_s_per_1000"] = r["cpu_s"] / r["images"] * 1000
    return r


def write_out(a, rounds: list, threads: list) -> dict:
    """Medians over the rounds that measured each contender, the figures, and the file."""
    keys = sorted({k for r in rounds for k in r})
    med = {k: {f: statistics.median(r[k][f] for r in rounds if k in r) for f in ("img_s", "cpu_s_per_1000")}
           for k in keys}
    lo, hi = min(threads), max(threads)
    figures = {}
    for t in threads:
        if f"ramjet_{t}" in med:
            figures[f"ramjet_t{t}_img_s"] = round(med[f"ramjet_{t}"]["img_s"], 1)
            figures[f"ramjet_t{t}_cpu_s_per_1000_img"] = round(med[f"ramjet_{t}"]["cpu_s_per_1000"], 3)
    if f"torch_{hi}" in med:
        figures[f"torch_w{hi}_img_s"] = round(med[f"torch_{hi}"]["img_s"], 1)
        figures[f"torch_w{hi}_cpu_s_per_1000_img"] = round(med[f"torch_{hi}"]["cpu_s_per_1000"], 3)
    if f"ramjet_{hi}" in med and f"ramjet_{lo}" in med:
        figures[f"scaling_t{hi}_over_t{lo}"] = round(med[f"ramjet_{hi}"]["img_s"] / med[f"ramjet_{lo}"]["img_s"], 3)
    if f"ramjet_{hi}" in med and f"torch_{hi}" in med:
        figures[f"ramjet_t{hi}_over_torch_w{hi}"] = round(med[f"ramjet_{hi}"]["img_s"] / med[f"torch_{hi}"]["img_s"], 3)
    if a.out:
        tmp = Path(str(a.out) + ".tmp")
        tmp.write_text(json.dumps({"args": vars(a), "cores": os.cpu_count(), "rounds": rounds,
                                   "median": med, "figures": figures}, indent=1))
        tmp.replace(a.out)
    return figures


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, arg, data, batch = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        r = child_ramjet(data, arg, batch) if kind == "ramjet" else child_torch(data, arg, batch)
        print(json.dumps(r))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="CI: 1 round of 128 images")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.samples, a.batch_size = 1, 128, 32
    threads = [int(t) for t in a.threads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ramjet-cpu-scale-"))
    try:
        print(f"cpu_scale: {a.samples} synthetic 640x480 JPEGs in {work}", flush=True)
        subprocess.run([RAMJET, "synth", str(work / "synth"), "--samples", str(a.samples)], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run([RAMJET, "pack", str(work / "synth"), str(work / "ds")], check=True, stdout=subprocess.DEVNULL)
        contenders = [("ramjet", t) for t in threads] + [("torch", max(threads))]
        rounds = []
        for r in range(a.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            res = {}
            rounds.append(res)
            for kind, arg in order:
                data = work / "ds" if kind == "ramjet" else work / "synth/images"
                res[f"{kind}_{arg}"] = measure(kind, arg, data, a.batch_size)
                m = res[f"{kind}_{arg}"]
                print(f"round {r + 1}/{a.rounds}: {kind} {arg}: {m['img_s']:.0f} img/s, "
                      f"{m['cpu_s_per_1000']:.2f} CPU s per 1,000 images", flush=True)
                # Rewritten after every measurement: a run cut short keeps what it measured.
                write_out(a, rounds, threads)
        figures = write_out(a, rounds, threads)
        print(f"cpu_scale: {os.cpu_count()} cores; " + ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
