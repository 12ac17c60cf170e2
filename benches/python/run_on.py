#!/usr/bin/env python3
"""What a ramjet loader does after an epoch's last batch: the images it decodes past it (its
run-on into the next epoch), the CPU its threads use in the second after, and which threads.
The bench's settings: batch 8, 224x224 RandomResizedCrop, shard-block shuffle.

Usage (tools/env.sh sourced, the dataset's S3 server running):
  benches/python/run_on.py s3://ramjet/bench/ramjet-bench/1000-16m/ramjet-rst32 [EPOCHS]

Epoch 0 starts from an empty cache (a cold epoch); the later ones are warm. Each line: the
epoch's rate and CPU per 1,000 images up to its last batch, then over the 1 s after it: the
images decoded past the epoch's last, the process's CPU, and the threads that used it (clock
ticks of 10 ms, from /proc/self/task). This is why measure.run_on_end and measure.wait_idle
end a ramjet window (docs/benchmarks.md, "How we measure").
"""
import glob
import resource
import shutil
import sys
import tempfile
import time

import torch  # noqa: F401 - as in the bench's loader processes
import ramjet


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_ticks():
    out = {}
    for t in glob.glob("/proc/self/task/*"):
        try:
            with open(t + "/stat") as f:
                s = f.read()
            with open(t + "/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        v = s[s.rindex(")") + 2:].split()
        out[(t.rsplit("/", 1)[1], name)] = int(v[11]) + int(v[12])
    return out


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    url, epochs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    cache = tempfile.mkdtemp(prefix="ramjet-run-on-")
    try:
        ds = ramjet.StreamingDataset(url, local=cache, cache_limit="64GiB", batch_size=8, shuffle=True, seed=0,
                                     image_size=224, augment="train", image_column="image", boxes_column=None)
        total = 0
        for ep in range(epochs):
            ds.set_epoch(ep)
            c0, t0 = cpu(), time.perf_counter()
            n = sum(b["image"].shape[0] for b in ds)
            wall, c1 = time.perf_counter() - t0, cpu()
            total += n
            ticks = thread_ticks()
            time.sleep(1.0)
            c2, after = cpu(), thread_ticks()
            past = int(ds.metrics()["images_decoded"]) - total
            busy = {}
            for (tid, name), v in after.items():
                d = v - ticks.get((tid, name), v)
                if d:
                    busy[name] = busy.get(name, 0) + d
            print(f"epoch {ep} ({'cold' if ep == 0 else 'warm'}): {n / wall:,.0f}/s, {(c1 - c0) / n * 1e3:.2f} CPU s "
                  f"per 1,000 up to its last batch; in the 1 s after: {past} images decoded past it, "
                  f"{(c2 - c1) * 1e3:.0f} ms of CPU, by thread (ticks) {dict(sorted(busy.items()))}", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
