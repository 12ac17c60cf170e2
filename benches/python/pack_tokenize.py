#!/usr/bin/env python3
"""`ramjet pack --tokenizer` beside the `tokenizers` Python package's batch encoding, on the same
JSONL text and the same cores.

The input: JSONL lines `{"id": N, "text": "..."}`, documents of Zipf-distributed words (lengths
lognormal around 2 KB), `--mib` MiB in all (default 1,024). The tokenizer: a byte-level BPE of
16,384 ids trained on the first 16 MiB of it (once, with `tokenizers`).

  ramjet:    `ramjet pack docs.jsonl OUT --tokenizer tokenizer.json` to a local folder: JSON
             parsing, tokenizing (the Rust `tokenizers` crate on the pack's thread pool), shard
             writing with every checksum.
  tokenizers: Python reads the lines in batches of 1,000, `json.loads` each, and
             `Tokenizer.encode_batch_fast` (its Rust thread pool, every core), keeping each
             document's ids as a uint16 NumPy array until the batch is done (what a packer
             would then write).

Each contender runs in a fresh process per round, their order rotating. Reported: medians of
input MiB/s, CPU seconds per GiB, peak RSS, and every round's ratio ramjet/tokenizers.

    .venv/bin/python benches/python/pack_tokenize.py [--mib 1024] [--rounds 5] [--out F]
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")


def build(data, mib):
    stamp = data / "built.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("mib") == mib:
        return
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    rng = random.Random(0)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    vocab = ["".join(rng.choice(letters) for _ in range(max(1, int(rng.expovariate(0.25))))) for _ in range(50000)]
    weights = [1 / (i + 1) for i in range(len(vocab))]
    target, n, i = mib << 20, 0, 0
    with open(data / "docs.jsonl", "w") as f:
        while n < target:
            k = max(1, int(rng.lognormvariate(5.5, 0.8)))
            words = rng.choices(vocab, weights, k=k)
            line = json.dumps({"id": i, "text": " ".join(words).capitalize() + "."}) + "\n"
            f.write(line)
            n += len(line)
            i += 1
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample = []
    with open(data / "docs.jsonl") as f:
        size = 0
        for line in f:
            sample.append(json.loads(line)["text"])
            size += len(line)
            if size > 16 << 20:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=16384, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(data / "tokenizer.json"))
    stamp.write_text(json.dumps({"mib": mib, "documents": i}))


def python_contender(data):
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    docs = tokens = 0
    with open(data / "docs.jsonl") as f:
        while True:
            lines = [line for _, line in zip(range(1000), f)]
            if not lines:
                break
            texts = [json.loads(line)["text"] for line in lines]
            ids = [np.asarray(e.ids, dtype=np.uint16) for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
            docs += len(ids)
            tokens += sum(len(x) for x in ids)
    print(json.dumps({"docs": docs, "tokens": tokens}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--data", default=str(ROOT / ".ramjet/bench/pack-tokenize"))
    ap.add_argument("--python", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write every measurement here as JSON")
    a = ap.parse_args()
    data = Path(a.data)
    if a.python:
        python_contender(data)
        return
    build(data, a.mib)
    size_mib = (data / "docs.jsonl").stat().st_size / 2**20
    rounds = measure.Rounds("MiB")
    rss = {"ramjet": [], "tokenizers": []}
    for r in range(a.rounds):
        for c in measure.order(["ramjet", "tokenizers"], r):
            out_dir = data / "packed"
            shutil.rmtree(out_dir, ignore_errors=True)
            cmd = ([RAMJET, "pack", str(data / "docs.jsonl"), str(out_dir), "--tokenizer", str(data / "tokenizer.json")]
                   if c == "ramjet" else [sys.executable, __file__, "--python", "--data", str(data)])
            before, t0 = measure.proc_stat(), time.perf_counter()
            with open(data / "out.log", "w") as log:
                child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
                _, status, ru = os.wait4(child.pid, 0)  # this child's own CPU and peak RSS
            wall = time.perf_counter() - t0
            after = measure.proc_stat()
            if os.waitstatus_to_exitcode(status) != 0:
                sys.exit(f"{c}: {(data / 'out.log').read_text()[-3000:]}")
            cpu = ru.ru_utime + ru.ru_stime
            rss[c].append(ru.ru_maxrss / 1024)  # MiB
            rounds.add(r, c, wall_s=wall, units=size_mib, cpu_s=cpu, steal=measure.steal_share(before, after),
                       others=measure.others_share(before, after, cpu, wall))
        print(rounds.line(r), flush=True)
    ratios = rounds.ratios("ramjet", "tokenizers")
    print(f"ramjet/tokenizers MiB/s per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    for c in ("ramjet", "tokenizers"):
        print(f"{c}: {rounds.median(c):.1f} MiB/s, {rounds.median(c, 'cpu_per_1000') * 1.024:.1f} CPU s/GiB, "
              f"peak RSS {max(rss[c]):.0f} MiB")
    if a.out:
        Path(a.out).write_text(json.dumps({"mib": round(size_mib, 1), "rounds": a.rounds,
                                           "ramjet": rounds.summary("ramjet"), "tokenizers": rounds.summary("tokenizers"),
                                           "ramjet_over_tokenizers": [round(x, 2) for x in ratios],
                                           "peak_rss_mib": {k: [round(x) for x in v] for k, v in rss.items()},
                                           "flagged_rounds": rounds.flagged(), "rows": rounds.rows}, indent=1))


if __name__ == "__main__":
    main()
