#!/usr/bin/env python3
"""Epochs of one ramjet dataset in one process, each with its rate and its user and system CPU
per image (getrusage), and the page faults it took: what a process's first epochs cost against
its later ones. The bench's settings: batch 8, 224x224 RandomResizedCrop, shard-block shuffle.

Usage (tools/env.sh sourced, the dataset's S3 server running):
  benches/python/epoch_cpu.py s3://ramjet/bench/ramjet-bench/1000-16m/ramjet-rst32 CACHE_DIR [EPOCHS]

An empty CACHE_DIR makes epoch 0 the cold fill; RAMJET_CACHE_FILL=buffered fills it through the
page cache instead of around it.
"""
import resource
import sys
import time

import torch  # noqa: F401 - as in the bench's loader processes
import ramjet


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    url, cache = sys.argv[1], sys.argv[2]
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    ds = ramjet.StreamingDataset(url, local=cache, cache_limit="64GiB", batch_size=8, shuffle=True, seed=0,
                                 image_size=224, augment="train", image_column="image", boxes_column="boxes")
    for ep in range(epochs):
        ds.set_epoch(ep)
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        n = sum(b["image"].shape[0] for b in ds)
        r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t
        print(f"epoch {ep}: {n / wall:,.0f}/s, user {(r1.ru_utime - r0.ru_utime) / n * 1e3:.3f} and system "
              f"{(r1.ru_stime - r0.ru_stime) / n * 1e3:.3f} CPU ms per image, {r1.ru_majflt - r0.ru_majflt} major "
              f"and {r1.ru_minflt - r0.ru_minflt} minor faults", flush=True)


if __name__ == "__main__":
    main()
