"""Shuffle quality of the one global order: ramjet's deals beside MosaicML Streaming's py1e.

The same dataset for all: N samples in shards of equal size, class-sorted (the samples of a
class are consecutive, a few shards a class: the worst case for a shard-local shuffle). Each
contender's global batches over one epoch (all ranks' batch t together) are scored by:

- ``same_shard``: the share of a global batch's sample pairs that come from one shard
  (uniform shuffling: about 1 / shards);
- ``classes``: distinct classes in a global batch over ``min(batch, classes)`` (1.0: every
  batch as mixed as it can be);
- ``repeat_mates``: the share of a batch's sample pairs in epoch 1 that were also in one
  batch in epoch 0 (uniform shuffling: about batch / N; sticky shares pay here).

Contenders: ramjet's default order (1 partition; what every deal reads today), ramjet with
16 partitions (the node-affine deal of 2 or 16 nodes), rotating and sticky, and MosaicML
Streaming's ``py1e`` with 16 canonical nodes and a shuffle block of the same 4 shards. The
order is a pure function, so each contender is computed once; the figures do not depend on
the machine. Run::

    $RAMJET_BENCH_PYTHON benches/python/shuffle_quality.py [--out target/bench/shuffle_quality.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Callable, Dict, List, Sequence

import numpy as np

import ramjet._ramjet as rj

SHARDS = 400
SHARD_SAMPLES = 250
CLASSES = 100
WORLD, RANKS_PER_NODE = 16, 8
BATCH = 512  # the global batch: 32 a rank
WINDOW = 4
PARTITIONS = 16


def labels(n: int) -> np.ndarray:
    return (np.arange(n) * CLASSES) // n


def ramjet_batches(partitions: int, shares: str, epoch: int) -> List[np.ndarray]:
    order = {
        "seed": 7,
        "shuffle": {"kind": "shard_block", "window_shards": WINDOW, "block_samples": 1},
        "partitions": partitions,
        "tail": "drop_last",
        "shares": shares,
    }
    g = np.asarray(rj.global_order([SHARD_SAMPLES] * SHARDS, json.dumps(order), epoch), dtype=np.int64)
    # Every deal in the one-order family steps through G's consecutive global batches.
    return [g[i : i + BATCH] for i in range(0, len(g) - BATCH + 1, BATCH)]


def mosaic_batches(epoch: int) -> List[np.ndarray]:
    from streaming.base.partition import get_partitions
    from streaming.base.shuffle import get_shuffle

    sizes = np.full(SHARDS, SHARD_SAMPLES, dtype=np.int64)
    ids = get_shuffle("py1e", sizes, PARTITIONS, 7, epoch, WINDOW * SHARD_SAMPLES)
    n = int(sizes.sum())
    parts = get_partitions(
        "orig", n, PARTITIONS, WORLD // RANKS_PER_NODE, RANKS_PER_NODE, 1, BATCH // WORLD, 0
    )  # [nodes, ranks, workers, batches, per-rank batch] of positions in the shuffled order
    nodes, ranks, workers, steps, per = parts.shape
    out = []
    for t in range(steps):
        pos = parts[:, :, :, t, :].reshape(-1)
        pos = pos[pos >= 0]
        if len(pos) == BATCH:
            out.append(np.asarray(ids)[pos])
    return out


def score(epoch0: Sequence[np.ndarray], epoch1: Sequence[np.ndarray]) -> Dict[str, float]:
    n = SHARDS * SHARD_SAMPLES
    lab = labels(n)
    pairs = BATCH * (BATCH - 1) / 2

    def pair_share(keys: np.ndarray) -> float:
        return sum(c * (c - 1) / 2 for c in Counter(keys.tolist()).values()) / pairs

    same_shard = float(np.mean([pair_share(b // SHARD_SAMPLES) for b in epoch0]))
    classes = float(np.mean([len(set(lab[b].tolist())) / min(BATCH, CLASSES) for b in epoch0]))
    where = np.full(n, -1, dtype=np.int64)
    for i, b in enumerate(epoch0):
        where[b] = i
    repeat = float(np.mean([pair_share(where[b][where[b] >= 0]) for b in epoch1]))
    return {"same_shard": same_shard, "classes": classes, "repeat_mates": repeat, "batches": len(epoch0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="target/bench/shuffle_quality.json")
    a = ap.parse_args()
    contenders: Dict[str, Callable[[int], List[np.ndarray]]] = {
        "ramjet, 1 partition (today)": lambda e: ramjet_batches(1, "rotate", e),
        f"ramjet, {PARTITIONS} partitions, rotate": lambda e: ramjet_batches(PARTITIONS, "rotate", e),
        f"ramjet, {PARTITIONS} partitions, sticky": lambda e: ramjet_batches(PARTITIONS, "sticky", e),
        f"MosaicML py1e, {PARTITIONS} canonical nodes": mosaic_batches,
    }
    n = SHARDS * SHARD_SAMPLES
    print(
        f"shuffle quality: {n} samples, {SHARDS} shards of {SHARD_SAMPLES}, {CLASSES} classes in order, "
        f"global batch {BATCH}, window {WINDOW} shards"
    )
    print(f"uniform shuffle: same_shard ~{1 / SHARDS:.4f}, repeat_mates ~{BATCH / n:.4f}")
    print("| order | same-shard pairs | classes / batch | batch-mates again next epoch |")
    print("|---|---|---|---|")
    results = {}
    for name, f in contenders.items():
        s = score(f(0), f(1))
        results[name] = s
        print(f"| {name} | {s['same_shard']:.4f} | {s['classes']:.3f} | {s['repeat_mates']:.4f} |")
    with open(a.out, "w") as fh:
        json.dump({"samples": n, "shards": SHARDS, "classes": CLASSES, "batch": BATCH, "results": results}, fh, indent=1)
    print(f"results written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
