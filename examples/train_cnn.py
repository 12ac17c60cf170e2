"""Train a small CNN from a ramjet dataset in S3, and check that the loss falls.

The synthetic YOLO set (`ramjet synth` + `ramjet pack`) has objects of 6 classes per image;
the network predicts which classes appear (multi-label, binary cross-entropy).

    python examples/train_cnn.py --remote s3://ramjet/demo/synth-5315 --steps 300

`--device auto` (the default) trains on the GPU when one is usable, with batches arriving on
it (`StreamingDataset(device=...)`), channels-last and bf16 autocast; otherwise on the CPU,
after ramjet's warning saying why.
"""

import argparse
import sys
import time

import torch
from torch import nn

import ramjet

CLASSES = 6


def targets(batch):
    """Multi-hot class presence from the flat boxes tensor and its per-sample offsets."""
    boxes, off = batch["boxes"], batch["boxes_offsets"]
    n = off.shape[0] - 1
    sample = torch.repeat_interleave(torch.arange(n, device=off.device), off[1:] - off[:-1])
    y = torch.zeros(n, CLASSES, device=off.device)
    y[sample, boxes[:, 0].long().clamp(0, CLASSES - 1)] = 1.0
    return y


def model():
    def block(i, o):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, CLASSES))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--remote", required=True)
    p.add_argument("--local", default=None, help="node-local cache directory")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--device", default="auto", help='"cpu", "cuda", "cuda:N" or "auto"')
    a = p.parse_args()
    torch.manual_seed(0)
    ds = ramjet.StreamingDataset(a.remote, local=a.local, batch_size=a.batch_size, image_size=a.size,
                                 normalize=True, scale=(0.5, 1.0), seed=0, device=a.device)
    dev = torch.device(ds.device)
    cuda = dev.type == "cuda"
    fmt = torch.channels_last if cuda else torch.contiguous_format
    net = model().to(dev, memory_format=fmt)
    print(f"device: {ds.device}", flush=True)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    losses, step, epoch, t0 = [], 0, 0, time.time()
    while step < a.steps:
        ds.set_epoch(epoch)
        for batch in ds:
            x = batch["image"]
            assert x.device == dev, f"the batch arrived on {x.device}, not {dev}"
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = loss_fn(net(x.contiguous(memory_format=fmt)).float(), targets(batch))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if step % 50 == 0:
                print(f"step {step:4d}  epoch {epoch}  loss {sum(losses[-50:]) / 50:.4f}  "
                      f"{step * a.batch_size / (time.time() - t0):.0f} img/s", flush=True)
            if step >= a.steps:
                break
        epoch += 1
    k = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-5 * k:]) / (5 * k)
    print(f"loss: first {k} steps {first:.4f}, last {5 * k} steps {last:.4f}")
    if not last < 0.95 * first:
        print("the loss did not fall", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
