#!/usr/bin/env python3
"""Token windows per second at seq_len 2048 from a warm cache: ramjet's TokenDataset beside
LitData's TokensLoader and MosaicML Streaming, on the same tokens.

The corpus: documents of random uint16 token ids (vocabulary 50,257, lengths lognormal around
700 tokens), an end-of-document id (50,256) after each. Each system reads it from local disk
(warm in the page cache, the state of a warm node-local cache), shuffled, in batches of 8
windows of 2,049 int32 tokens (inputs and targets shifted by one), one process, the way its
documentation builds a language-model loader:

  ramjet:   `ramjet pack` of the documents (`tokens: uint16[]`), `TokenDataset(seq_len=2048,
            eos=50256, dtype="int32")`; windows cut at read time, iterated directly.
  litdata:  `litdata.optimize(..., item_loader=TokensLoader())` of the documents (int32, the
            end-of-document id appended), `StreamingDataset(item_loader=TokensLoader(block_size=2049),
            shuffle=True)` in a `StreamingDataLoader`.
  mosaicml: an MDS of pre-cut windows (llm-foundry's `concat_tokens`: each sample one window
            of 2,049 tokens as int32 bytes), `StreamingDataset(shuffle=True)` in a DataLoader.

Each contender reads one whole epoch in a fresh process per round (interpreter and imports not
timed: the clock starts at the loader's creation, so the loader's start-up is in it), their
order rotating round by round. Reported: medians of windows/s and CPU seconds per 1,000
windows (the process and its DataLoader workers, from the loader's creation), every round's ratios ramjet/peer.

    .ramjet/bench-venv/bin/python benches/python/token_windows.py [--tokens 120e6] [--rounds 5]
        [--workers 0] [--out F]
"""

import argparse
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")
SEQ = 2048
BATCH = 8
EOS = 50256
CONTENDERS = ("ramjet", "litdata", "mosaicml")


def docs(tokens, seed=0):
    """The corpus: a list of uint16 arrays summing to about `tokens` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out, n = [], 0
    while n < tokens:
        k = int(min(20000, max(1, rng.lognormal(6.2, 0.9))))
        out.append(rng.integers(0, EOS, size=k, dtype=np.uint16))
        n += k
    return out


def build(data, tokens):
    """Writes the three copies of the corpus under `data` (once)."""
    import numpy as np

    stamp = data / "built.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("tokens") == tokens:
        return
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    ds = docs(tokens)
    print(f"corpus: {len(ds)} documents, {sum(len(d) for d in ds)} tokens", flush=True)
    # ramjet: JSONL of the token lists, packed as uint16 arrays.
    with open(data / "docs.jsonl", "w") as f:
        for d in ds:
            f.write('{"tokens":[' + ",".join(map(str, d.tolist())) + "]}\n")
    subprocess.run([RAMJET, "pack", str(data / "docs.jsonl"), str(data / "ramjet"), "--column", "tokens:uint16[]"],
                   check=True, stdout=subprocess.DEVNULL)
    (data / "docs.jsonl").unlink()
    # litdata: one int32 tensor a document, EOS appended, in its token chunks.
    import torch
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    np.save(data / "offsets.npy", np.cumsum([0] + [len(d) for d in ds]))
    np.save(data / "flat.npy", np.concatenate(ds))
    optimize(fn=functools.partial(_lit_doc, data=str(data)), inputs=list(range(len(ds))), output_dir=str(data / "litdata"), chunk_bytes="64MB",
             item_loader=TokensLoader(), num_workers=1, mode="overwrite")
    # mosaicml: the windows pre-cut, as llm-foundry's concat_tokens writes them.
    from streaming import MDSWriter

    cat = np.concatenate([np.append(d.astype(np.int32), np.int32(EOS)) for d in ds])
    with MDSWriter(out=str(data / "mosaicml"), columns={"tokens": "bytes"}, size_limit=1 << 26) as w:
        for i in range(len(cat) // (SEQ + 1)):
            w.write({"tokens": cat[i * (SEQ + 1):(i + 1) * (SEQ + 1)].tobytes()})
    del torch
    stamp.write_text(json.dumps({"tokens": tokens, "documents": len(ds), "windows": len(cat) // (SEQ + 1)}))


_FLAT = None


def _lit_doc(i, data):
    """Document `i` for litdata.optimize: its tokens as int32, EOS appended."""
    import numpy as np
    import torch

    global _FLAT
    if _FLAT is None:
        _FLAT = (np.load(Path(data) / "offsets.npy"), np.load(Path(data) / "flat.npy", mmap_mode="r"))
    offsets, flat = _FLAT
    d = np.asarray(flat[offsets[i]:offsets[i + 1]], dtype=np.int32)
    yield torch.from_numpy(np.append(d, np.int32(EOS)))


def one(name, data, workers):
    """Reads one epoch with contender `name`; prints {windows, wall_s, cpu_s}."""
    import torch

    def cpu():
        r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    t0, cpu0 = time.perf_counter(), cpu()
    n = 0
    if name == "ramjet":
        import ramjet

        ds = ramjet.TokenDataset(str(data / "ramjet"), seq_len=SEQ, batch_size=BATCH, eos=EOS, dtype="int32")
        for b in ds:
            x, y = b["input_ids"], b["labels"]
            n += x.shape[0]
    elif name == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        ds = StreamingDataset(input_dir=str(data / "litdata"), item_loader=TokensLoader(block_size=SEQ + 1),
                              shuffle=True, drop_last=True)
        for b in StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers):
            x, y = b[:, :-1], b[:, 1:]
            n += x.shape[0]
    else:
        import numpy as np
        from streaming import StreamingDataset

        class Windows(StreamingDataset):
            def __getitem__(self, i):
                s = super().__getitem__(i)
                return torch.from_numpy(np.frombuffer(s["tokens"], dtype=np.int32).copy())

        ds = Windows(local=str(data / "mosaicml"), shuffle=True, batch_size=BATCH)
        for b in torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers):
            x, y = b[:, :-1], b[:, 1:]
            n += x.shape[0]
    wall = time.perf_counter() - t0
    del ds
    # CPU from the loader's creation on (imports left out, as from the wall clock); DataLoader
    # workers are counted once they have exited.
    print(json.dumps({"windows": n, "wall_s": wall, "cpu_s": cpu() - cpu0, "cpu_total_s": cpu()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=120e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers of the peers")
    ap.add_argument("--data", default=str(ROOT / ".ramjet/bench/tokens"))
    ap.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write every measurement here as JSON")
    ap.add_argument("--plot", help="draw windows/s and CPU per 1,000 windows, round by round, into this PNG")
    a = ap.parse_args()
    data = Path(a.data)
    if a.one:
        one(a.one, data, a.workers)
        return
    build(data, int(a.tokens))
    rounds = measure.Rounds("windows")
    for r in range(a.rounds):
        for c in measure.order(list(CONTENDERS), r):
            before, t = measure.proc_stat(), time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--one", c, "--data", str(data), "--workers",
                                  str(a.workers)], capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"{c}: {out.stderr[-3000:]}")
            after = measure.proc_stat()
            m = json.loads(out.stdout.strip().splitlines()[-1])
            steal = measure.steal_share(before, after)
            # The whole process's CPU (its imports too) is its own, not other load.
            others = measure.others_share(before, after, m["cpu_total_s"], time.perf_counter() - t)
            rounds.add(r, c, wall_s=m["wall_s"], units=m["windows"], cpu_s=m["cpu_s"], steal=steal, others=others)
        print(rounds.line(r), flush=True)
    out = {"tokens": int(a.tokens), "seq_len": SEQ, "batch": BATCH, "workers": a.workers, "rounds": a.rounds,
           "flagged_rounds": rounds.flagged()}
    for c in CONTENDERS:
        out[c] = rounds.summary(c)
    for p in ("litdata", "mosaicml"):
        ratios = rounds.ratios("ramjet", p)
        out[f"ramjet_over_{p}"] = [round(x, 2) for x in ratios]
        print(f"ramjet/{p} windows/s per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    for c in CONTENDERS:
        print(f"{c}: {rounds.median(c):.0f} windows/s, {rounds.median(c, 'cpu_per_1000'):.3f} CPU s/1000 windows")
    if a.out:
        Path(a.out).write_text(json.dumps({**out, "rows": rounds.rows}, indent=1))
    if a.plot:
        plot(rounds, a.plot, int(a.tokens))


def plot(rounds, path, tokens):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for c, colour in zip(CONTENDERS, ("tab:red", "tab:blue", "tab:green")):
        rows = sorted(rounds.of(c), key=lambda row: row["round"])
        xs = [row["round"] for row in rows]
        ax1.plot(xs, [row["rate"] for row in rows], "o-", color=colour, label=c)
        ax2.plot(xs, [row["cpu_per_1000"] for row in rows], "o-", color=colour, label=c)
    ax1.set(title=f"windows/s (seq_len {SEQ}, batch {BATCH}, {tokens / 1e6:.0f}M tokens, warm)", xlabel="round",
            yscale="log")
    ax2.set(title="CPU s per 1,000 windows", xlabel="round", yscale="log")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
