"""Loader benchmark: ramjet vs a torch DataLoader (Pillow + torchvision) vs libjpeg-turbo's
full-decode rate, on the same JPEGs and the same output (224x224 uint8, batch 8), side by
side in one run; then ramjet's RSS over repeated epochs.

    python benches/python/bench_loader.py --images DIR --remote URL [--n 1000] [--rounds 5]

The contenders run interleaved round by round, each round in a rotated order (measure.py):
medians, every round's ratios, CPU seconds per 1,000 images (the process and its DataLoader
workers), the machine's steal share and other processes' load per measurement. The targets
(ramjet at least 3x the torch DataLoader by rate and by CPU per image; ramjet's decode at least
1.3x the cores times Pillow's single-core full decode) get a verdict only from 3 rounds or
more, none of them flagged.

DIR holds the JPEGs; URL is the same images packed with `ramjet pack` (read through a warm
node-local cache). A third ramjet contender, `ramjet_restarts`, reads URL-rst: the same images
packed with `ramjet pack --jpeg-restarts` (packed by this script when absent), whose crops
decode without the entropy decoding of the rest of the image. Prints one JSON object and
writes it to target/bench/loader.json.

With `--large N`, a second part measures where DCT-domain downscaling pays: the first N images
upscaled 2.5x (1600x1200, the size of a phone photo), packed with `ramjet pack` to
URL-large, and decoded to the same 224x224 output by ramjet with and without DCT scaling,
against Pillow's single-core full decode of the same large JPEGs times the cores.
"""

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image
from torchvision.transforms import v2

import ramjet

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - benches/python/measure.py, the shared measuring rules

OUT = 224
BATCH = 8


def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Files(torch.utils.data.Dataset):
    """The PyTorch baseline: Pillow decode + torchvision RandomResizedCrop + flip."""

    def __init__(self, paths):
        self.paths = paths
        self.tf = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(OUT, antialias=True), v2.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB"))


def torch_rate(paths, workers):
    dl = torch.utils.data.DataLoader(Files(paths), batch_size=BATCH, num_workers=workers, shuffle=True,
                                     persistent_workers=False)
    return sum(b.shape[0] for b in dl)


def pillow_single_core(blobs):
    """libjpeg-turbo's full decode through Pillow, one core (no conversion copy for RGB JPEGs)."""
    for b in blobs:
        im = Image.open(io.BytesIO(b))
        im.load()
        if im.mode != "RGB":
            im.convert("RGB")
    return len(blobs)


def ramjet_rate(ds, epoch):
    """One epoch: (images, the time its run-on into the next epoch ended), once the process is
    idle (measure.run_on_end, measure.wait_idle)."""
    ds.set_epoch(epoch)
    n = 0
    for b in ds:
        n += b["image"].shape[0]
    end = measure.run_on_end(ds)
    measure.wait_idle()
    return n, end


def interleaved(contenders, rounds, label):
    """Runs every contender once a round, the order rotated each round; returns measure.Rounds."""
    res = measure.Rounds("images")
    for r in range(rounds):
        for name, fn in measure.order(contenders, r):
            with measure.Meter() as m:
                n = fn(r)
                if isinstance(n, tuple):  # a ramjet epoch: its window ends with its run-on
                    n, m.end = n
            res.add_meter(r, name, m, n)
        print(f"{label}{res.line(r)}", flush=True)
    return res


def verdicts(res, cores, vs_torch=True):
    """The figures, the per-round ratios and the verdicts (none below measure.VERDICT_ROUNDS)."""
    med = {c: res.median(c) for c in res.contenders()}
    cpu = {c: res.median(c, "cpu_per_1000") for c in res.contenders()}
    turbo = cores * med["pillow_1core"]
    out = {
        "median_img_per_s": {k: round(v, 1) for k, v in med.items()},
        "median_cpu_s_per_1000_img": {k: round(v, 3) for k, v in cpu.items()},
        "libjpeg_turbo_full_decode_x_cores": round(turbo, 1),
        "ratio_vs_libjpeg_turbo_x_cores": round(med["ramjet"] / turbo, 2),
        "ratio_no_dct_vs_libjpeg_turbo_x_cores": round(med["ramjet_no_dct"] / turbo, 2),
        "rounds": {c: res.summary(c) for c in res.contenders()},
        "steal_flagged_rounds": res.flagged(),
    }
    # Pillow runs on one core; per round, ramjet against that round's Pillow times the cores.
    decode = [x / (cores * y) for x, y in zip([r["rate"] for r in res.of("ramjet")],
                                               [r["rate"] for r in res.of("pillow_1core")])]
    out["per_round_ratio_vs_libjpeg_turbo_x_cores"] = [round(x, 2) for x in decode]
    v = res.verdict(out["ratio_vs_libjpeg_turbo_x_cores"] >= 1.3)
    out["decode_target"] = f"ramjet at least 1.3x cores x Pillow's full decode: {measure.verdict_text(v, res.rounds(), len(res.flagged()))}"
    if "ramjet_restarts" in med:
        out["ratio_restarts_vs_libjpeg_turbo_x_cores"] = round(med["ramjet_restarts"] / turbo, 2)
        out["per_round_ratio_restarts_vs_libjpeg_turbo_x_cores"] = [
            round(x / (cores * y), 2) for x, y in zip([r["rate"] for r in res.of("ramjet_restarts")],
                                                      [r["rate"] for r in res.of("pillow_1core")])]
        out["per_round_ratio_restarts_vs_ramjet"] = [round(x, 2) for x in res.ratios("ramjet_restarts", "ramjet")]
        v = res.verdict(out["ratio_restarts_vs_libjpeg_turbo_x_cores"] >= 1.3)
        out["decode_target_restarts"] = (f"ramjet (--jpeg-restarts) at least 1.3x cores x Pillow's full decode: "
                                         f"{measure.verdict_text(v, res.rounds(), len(res.flagged()))}")
    if vs_torch:
        rate = med["ramjet"] / med["torch_dataloader"]
        by_cpu = cpu["torch_dataloader"] / cpu["ramjet"]
        out["ratio_vs_torch_dataloader"] = round(rate, 2)
        out["cpu_ratio_vs_torch_dataloader"] = round(by_cpu, 2)
        out["per_round_ratio_vs_torch_dataloader"] = [round(x, 2) for x in res.ratios("ramjet", "torch_dataloader")]
        v = res.verdict(rate >= 3 and by_cpu >= 3)
        out["loader_target"] = (f"ramjet at least 3x the torch DataLoader by rate and CPU per image: "
                                f"{measure.verdict_text(v, res.rounds(), len(res.flagged()))}")
        if "ramjet_restarts" in med:
            rate = med["ramjet_restarts"] / med["torch_dataloader"]
            by_cpu = cpu["torch_dataloader"] / cpu["ramjet_restarts"]
            out["ratio_restarts_vs_torch_dataloader"] = round(rate, 2)
            out["cpu_ratio_restarts_vs_torch_dataloader"] = round(by_cpu, 2)
            out["per_round_ratio_restarts_vs_torch_dataloader"] = [
                round(x, 2) for x in res.ratios("ramjet_restarts", "torch_dataloader")]
            v = res.verdict(rate >= 3 and by_cpu >= 3)
            out["loader_target_restarts"] = (
                f"ramjet (--jpeg-restarts) at least 3x the torch DataLoader by rate and CPU per image: "
                f"{measure.verdict_text(v, res.rounds(), len(res.flagged()))}")
    return out


def large_set(paths, n, images_dir, remote):
    """The first `n` images upscaled 2.5x and re-encoded (quality 90), packed to remote-large."""
    d = Path(str(images_dir).rstrip("/") + "-large") / "a"
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for p in paths[:n]:
        q = d / Path(p).name
        if not q.exists():
            im = Image.open(p).convert("RGB")
            im.resize((im.width * 5 // 2, im.height * 5 // 2), Image.LANCZOS).save(q, quality=90)
        out.append(str(q))
    url = remote.rstrip("/") + "-large"
    try:
        ok = ramjet.inspect(url)["samples"] == len(out)
    except ramjet.Error:
        ok = False
    if not ok:
        exe = os.environ.get("RAMJET_BIN", "target/release/ramjet")
        subprocess.run([exe, "pack", str(d.parent), url], check=True, stdout=subprocess.DEVNULL)
    return out, url


def bench_large(paths, n, a, kw, cores):
    files, url = large_set(paths, n, a.images, a.remote)
    blobs = [open(x, "rb").read() for x in files]
    kw = dict(kw, local=a.local + "-large")
    rj = ramjet.StreamingDataset(url, **kw)
    rj_nodct = ramjet.StreamingDataset(url, dct_scaling=False, **kw)
    ramjet_rate(rj, 0)
    res = interleaved([("ramjet", lambda r: ramjet_rate(rj, r + 1)),
                       ("ramjet_no_dct", lambda r: ramjet_rate(rj_nodct, r + 1)),
                       ("pillow_1core", lambda r: pillow_single_core(blobs))], a.rounds, "large ")
    w, h = Image.open(files[0]).size
    return {"images": len(files), "source_size": f"{w}x{h}", **verdicts(res, cores, vs_torch=False)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--images", required=True)
    p.add_argument("--remote", required=True)
    p.add_argument("--local", default="target/bench/loader-cache")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rss-epochs", type=int, default=10)
    p.add_argument("--large", type=int, default=0, help="images in the large-source (DCT scaling) part")
    a = p.parse_args()
    cores = os.cpu_count() or 2
    paths = sorted(str(x) for x in Path(a.images).rglob("*") if x.suffix.lower() in (".jpg", ".jpeg"))[: a.n]
    blobs = [open(x, "rb").read() for x in paths]
    info = ramjet.inspect(a.remote)
    assert info["samples"] == len(paths), f"{a.remote} has {info['samples']} samples, {a.images} {len(paths)}"
    kw = dict(local=a.local, batch_size=BATCH, image_size=OUT, boxes_column=None)
    rj = ramjet.StreamingDataset(a.remote, **kw)
    rj_nodct = ramjet.StreamingDataset(a.remote, dct_scaling=False, **kw)
    rst_url = a.remote.rstrip("/") + "-rst"
    try:
        packed = ramjet.inspect(rst_url)["samples"] == len(paths)
    except ramjet.Error:
        packed = False
    if not packed:
        # The very files measured, as an image folder of one class (linked, else copied).
        stage = Path(a.local + "-rst-images")
        shutil.rmtree(stage, ignore_errors=True)
        (stage / "a").mkdir(parents=True)
        for i, src in enumerate(paths):
            dst = stage / "a" / f"{i:06d}{Path(src).suffix}"
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        exe = os.environ.get("RAMJET_BIN", "target/release/ramjet")
        subprocess.run([exe, "pack", str(stage), rst_url, "--jpeg-restarts"], check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(stage, ignore_errors=True)
    rj_rst = ramjet.StreamingDataset(rst_url, **dict(kw, local=a.local + "-rst"))
    ramjet_rate(rj, 0)  # warm the node-local cache
    ramjet_rate(rj_rst, 0)
    res = interleaved([("ramjet", lambda r: ramjet_rate(rj, r + 1)),
                       ("ramjet_restarts", lambda r: ramjet_rate(rj_rst, r + 1)),
                       ("ramjet_no_dct", lambda r: ramjet_rate(rj_nodct, r + 1)),
                       ("torch_dataloader", lambda r: torch_rate(paths, cores)),
                       ("pillow_1core", lambda r: pillow_single_core(blobs))], a.rounds, "")
    del rj, rj_nodct, rj_rst
    # RSS over epochs: one dataset, epoch after epoch.
    ds = ramjet.StreamingDataset(a.remote, **kw)
    rss = []
    for e in range(a.rss_epochs):
        ramjet_rate(ds, e)
        rss.append(round(rss_mib(), 1))
    steady = rss[1:] or rss
    out = {
        "images": len(paths),
        "cores": cores,
        **verdicts(res, cores),
        "rss_mib_per_epoch": rss,
        "rss_growth_after_first_epoch": round(max(steady) / min(steady) - 1, 3),
    }
    if a.large:
        out["large_sources"] = bench_large(paths, a.large, a, kw, cores)
    Path("target/bench").mkdir(parents=True, exist_ok=True)
    Path("target/bench/loader.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
