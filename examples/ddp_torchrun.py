"""Two-process data-parallel training under torchrun (gloo, CPU), fed by ramjet.

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --remote s3://ramjet/demo/synth-5315

Each rank reads its own share of every epoch (ramjet takes rank and world size from
torch.distributed). The script checks that the ranks' samples are disjoint and together cover
the epoch, and that a state_dict taken mid-epoch on every rank agrees.
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn

import ramjet


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--remote", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = ramjet.StreamingDataset(a.remote, batch_size=a.batch_size, image_size=32, normalize=True, seed=1,
                                 tail="drop")
    net = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1),
                                                            nn.Flatten(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    seen = []
    for step, batch in enumerate(ds):
        loss = net(batch["image"]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += batch["_index"].tolist()
        if step == 2:
            sd = ds.state_dict()  # collective: every rank calls it at the same step
            states = [None] * world
            dist.all_gather_object(states, sd)
            assert all(s == sd for s in states), "ranks disagree on the job state"
    everyone = [None] * world
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        flat = [i for s in everyone for i in s]
        disjoint = len(flat) == len(set(flat))
        print(f"ranks={world} samples per rank={[len(s) for s in everyone]} disjoint={disjoint} "
              f"covered={len(set(flat))}/{ds.num_samples}")
        if not disjoint or len(set(flat)) != ds.num_samples:
            sys.exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
