"""Data-parallel training (gloo, CPU) fed by ramjet, under torchrun or Slurm.

    torchrun --nproc_per_node 2 examples/ddp_train.py --remote s3://ramjet/demo/synth-5315
    tools/slurm/ramjet-slurm run -- python examples/ddp_train.py --remote s3://...  (in sbatch)

Each rank reads its own share of every epoch (ramjet takes rank and world size from
torch.distributed) and trains a small CNN to predict each image's mean colour. The script checks
that the ranks' samples are disjoint and together cover every epoch, that a state_dict taken
mid-epoch agrees on every rank, that ramjet's exactly-once audit (``ds.audit()``, gathered over
the ranks) holds mid-epoch and at each epoch's end, and reports the loss of the first and the
last epoch. With
--out, rank 0 writes all of it as JSON.
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import ramjet


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--remote", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-ms", type=float, default=0, help="extra time per step (a slower model)")
    p.add_argument("--out", help="rank 0 writes the run's record here (JSON)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} on {socket.gethostname()}, daemon {os.environ.get('RAMJET_SOCKET', '-')}",
          flush=True)
    torch.manual_seed(0)
    ds = ramjet.StreamingDataset(a.remote, batch_size=a.batch_size, image_size=32, normalize=True, seed=1,
                                 tail="drop")
    net = nn.parallel.DistributedDataParallel(nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3)))
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=0.9)
    epochs = []
    for epoch in range(a.epochs):
        ds.set_epoch(epoch)
        seen, losses = [], []
        for step, batch in enumerate(ds):
            x = batch["image"]
            target = x.mean(dim=(2, 3))  # each image's mean colour
            loss = (net(x) - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += batch["_index"].tolist()
            losses.append(loss.item())
            if a.step_ms:
                time.sleep(a.step_ms / 1000)
            if rank == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if epoch == 0 and step == 2:
                sd = ds.state_dict()  # collective: every rank calls it at the same step
                states = [None] * world
                dist.all_gather_object(states, sd)
                assert all(s == sd for s in states), "ranks disagree on the job state"
                mid = ds.audit()  # collective too
                assert mid["exactly_once"] and not mid["complete"], mid
        # The exactly-once audit (collective, like state_dict): the ranks' counts and digests
        # against the epoch's order.
        report = ds.audit()
        if rank == 0:
            print(f"epoch {epoch} audit: {report['message']}", flush=True)
        assert report["exactly_once"] and report["complete"], report
        everyone = [None] * world
        dist.all_gather_object(everyone, (seen, losses))
        epochs.append(everyone)
    if rank == 0:
        record, ok = {"world": world, "num_samples": ds.num_samples, "epochs": []}, True
        for epoch, everyone in enumerate(epochs):
            flat = [i for s, _ in everyone for i in s]
            disjoint = len(flat) == len(set(flat))
            mean_loss = sum(sum(ls) for _, ls in everyone) / max(1, sum(len(ls) for _, ls in everyone))
            print(f"epoch {epoch}: ranks={world} samples per rank={[len(s) for s, _ in everyone]} "
                  f"disjoint={disjoint} covered={len(set(flat))}/{ds.num_samples} mean loss {mean_loss:.4f}")
            ok &= disjoint and len(set(flat)) == ds.num_samples
            record["epochs"].append({"indices": [s for s, _ in everyone], "losses": [ls for _, ls in everyone],
                                     "mean_loss": mean_loss})
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(a.out + ".tmp", a.out)
        if not ok:
            sys.exit(1)
    # Leave together, then skip the interpreter's teardown. Under Slurm, rank 0 hosts the
    # TCPStore, and a rank still tearing down when it vanished was seen to abort in C++
    # ("terminate called without an active exception") after a run that had succeeded.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
