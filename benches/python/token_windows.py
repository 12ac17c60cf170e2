#!/usr/bin/env python3
"""Token windows per second at seq_len 2048 from a warm cache: ramjet's TokenDataset beside
LitData's TokensLoader and MosaicML Streaming, on the same tokens.

The corpus: documents of random uint16 token ids (vocabulary 50,257, lengths lognormal around
700 tokens), an end-of-document id (50,256) after each. Each system reads it from local disk
(warm in the page cache, the state of a warm node-local cache), shuffled, in batches of 8
windows of 2,049 int32 tokens (inputs and targets shifted by one), one process, the way its
documentation builds a language-model loader:

  ramjet:   `ramjet pack` of the documents (`tokens: uint16[]`), `TokenDataset(seq_len=2048,
            eos=50256, dtype="int32")`; windows cut at read time, iterated directly. Alone:
            each process reads the shard files into its own memory.
  ramjet-serve: the same with the host's daemon running (`ramjet serve`, its own cache
            folder, started before the rounds and warmed by one unmeasured process), as a
            training host runs it: shards read again get sealed in-memory copies, which each
            new process maps instead of copying. The daemon's CPU during a process is added to
            that process's first epoch.
  litdata:  `litdata.optimize(..., item_loader=TokensLoader())` of the documents (int32, the
            end-of-document id appended), `StreamingDataset(item_loader=TokensLoader(block_size=2049),
            shuffle=True)` in a `StreamingDataLoader`.
  mosaicml: an MDS of pre-cut windows (llm-foundry's `concat_tokens`: each sample one window
            of 2,049 tokens as int32 bytes), `StreamingDataset(shuffle=True)` in a DataLoader.

Each contender reads `--epochs` (2) epochs in a fresh process per round, their order rotating
round by round. Two figures each: the first epoch (the clock starts at the loader's creation,
after the interpreter and the imports, so the loader's start-up and a fresh process's first
allocations are in it) and the last epoch (steady state: what every later epoch of a training
job costs). Reported for both: medians of windows/s and CPU seconds per 1,000 windows (the
process and its DataLoader workers), every round's ratios ramjet/peer.

    .ramjet/bench-venv/bin/python benches/python/token_windows.py [--tokens 120e6] [--rounds 5]
        [--workers 0] [--epochs 2] [--out F] [--plot PNG]
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
CONTENDERS = ("ramjet", "ramjet-serve", "litdata", "mosaicml")
PEERS = ("litdata", "mosaicml")


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


def one(name, data, workers, epochs):
    """Reads `epochs` epochs with contender `name` in this process; prints one JSON line with
    each epoch's {windows, wall_s, cpu_s} (the first from the loader's creation on)."""
    import torch

    def cpu():
        r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    # The contender's modules are imported before the clock starts (the docstring's rule).
    if name.startswith("ramjet"):
        import ramjet
    elif name == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import TokensLoader
    else:
        import numpy as np
        from streaming import StreamingDataset
    t0, cpu0 = time.perf_counter(), cpu()
    if name.startswith("ramjet"):
        loader = ramjet.TokenDataset(str(data / "ramjet"), seq_len=SEQ, batch_size=BATCH, eos=EOS, dtype="int32")

        def batches():
            for b in loader:
                yield b["input_ids"], b["labels"]
    elif name == "litdata":
        ds = StreamingDataset(input_dir=str(data / "litdata"), item_loader=TokensLoader(block_size=SEQ + 1),
                              shuffle=True, drop_last=True)
        loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)

        def batches():
            for b in loader:
                yield b[:, :-1], b[:, 1:]
    else:

        class Windows(StreamingDataset):
            def __getitem__(self, i):
                s = super().__getitem__(i)
                return torch.from_numpy(np.frombuffer(s["tokens"], dtype=np.int32).copy())

        ds = Windows(local=str(data / "mosaicml"), shuffle=True, batch_size=BATCH)
        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers)

        def batches():
            for b in loader:
                yield b[:, :-1], b[:, 1:]
    out = []
    for _ in range(epochs):
        n = 0
        for x, y in batches():
            n += x.shape[0]
        t, c = time.perf_counter(), cpu()
        # CPU from the loader's creation (then the epoch's start) on, imports left out as from
        # the wall clock; DataLoader workers are counted once they have exited.
        out.append({"windows": n, "wall_s": t - t0, "cpu_s": c - cpu0})
        t0, cpu0 = t, c
    del loader
    print(json.dumps({"epochs": out, "cpu_total_s": cpu()}))


def one_process(name, data, workers, epochs, env=None):
    """Runs contender `name` in a fresh process: its JSON line (`one`)."""
    out = subprocess.run([sys.executable, __file__, "--one", name, "--data", str(data), "--workers", str(workers),
                          "--epochs", str(epochs)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"{name}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Serve:
    """`ramjet serve` for the ramjet-serve contender: its socket and cache in a fresh folder
    under the data folder (removed at the end), an HTTP port for /stats."""

    def __init__(self, data):
        import socket
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="serve-", dir=data))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.http = f"127.0.0.1:{s.getsockname()[1]}"
        self.sock = self.dir / "d.sock"
        self.proc = subprocess.Popen([RAMJET, "serve", "--socket", str(self.sock), "--cache-dir", str(self.dir / "cache"),
                                      "--http", self.http], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() - t0 > 30:
                self.stop()
                sys.exit("ramjet serve did not start")
            time.sleep(0.05)

    def cpu_s(self):
        f = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def one(self, data, workers, epochs):
        """One ramjet reader through the daemon: its JSON line and the daemon's CPU meanwhile."""
        c0 = self.cpu_s()
        m = one_process("ramjet-serve", data, workers, epochs, env=dict(os.environ, RAMJET_SOCKET=str(self.sock)))
        return m, self.cpu_s() - c0

    def stats(self):
        import urllib.request

        with urllib.request.urlopen(f"http://{self.http}/stats", timeout=10) as r:
            return json.loads(r.read().decode())

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=120e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers of the peers")
    ap.add_argument("--data", default=str(ROOT / ".ramjet/bench/tokens"))
    ap.add_argument("--epochs", type=int, default=2,
                    help="epochs each contender reads in its process: the first (a fresh process, the "
                         "loader's start-up in it) and the last (steady state) are reported")
    ap.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write every measurement here as JSON")
    ap.add_argument("--plot", help="draw windows/s and CPU per 1,000 windows, round by round, into this PNG")
    a = ap.parse_args()
    data = Path(a.data)
    if a.one:
        one(a.one, data, a.workers, max(1, a.epochs))
        return
    build(data, int(a.tokens))
    epochs = max(1, a.epochs)
    first, steady = measure.Rounds("windows"), measure.Rounds("windows")
    serve = Serve(data)
    try:
        # The daemon's warm-up: one unmeasured reader (its second epoch asks for every shard
        # again, and the daemon keeps sealed copies of them).
        serve.one(data, a.workers, 2)
        warm = serve.stats()
        print(f"ramjet serve warmed: {warm['shared_copies']} sealed copies", flush=True)
        for r in range(a.rounds):
            for c in measure.order(list(CONTENDERS), r):
                before, t = measure.proc_stat(), time.perf_counter()
                if c == "ramjet-serve":
                    m, daemon_cpu = serve.one(data, a.workers, epochs)
                else:
                    m, daemon_cpu = one_process(c, data, a.workers, epochs), 0.0
                after = measure.proc_stat()
                steal = measure.steal_share(before, after)
                # The whole process's CPU (its imports too) is its own, not other load.
                others = measure.others_share(before, after, m["cpu_total_s"] + daemon_cpu, time.perf_counter() - t)
                e0, last = m["epochs"][0], m["epochs"][-1]
                first.add(r, c, wall_s=e0["wall_s"], units=e0["windows"], cpu_s=e0["cpu_s"] + daemon_cpu, steal=steal,
                          others=others)
                steady.add(r, c, wall_s=last["wall_s"], units=last["windows"], cpu_s=last["cpu_s"], steal=steal,
                           others=others)
            print(f"first epoch  {first.line(r)}", flush=True)
            print(f"steady state {steady.line(r)}", flush=True)
        served = serve.stats()
    finally:
        serve.stop()
    out = {"tokens": int(a.tokens), "seq_len": SEQ, "batch": BATCH, "workers": a.workers, "rounds": a.rounds,
           "epochs": epochs, "serve": {k: served[k] for k in ("shared_copies", "shared_hits", "reads")}}
    print(f"ramjet serve: {served['shared_copies']} sealed copies, {served['shared_hits']} requests mapped them",
          flush=True)
    for label, rounds in (("first_epoch", first), ("steady_state", steady)):
        part = {"flagged_rounds": rounds.flagged()}
        for c in CONTENDERS:
            part[c] = rounds.summary(c)
        for ours in ("ramjet", "ramjet-serve"):
            for p in PEERS:
                ratios = rounds.ratios(ours, p)
                part[f"{ours.replace('-', '_')}_over_{p}"] = [round(x, 2) for x in ratios]
                print(f"{label}: {ours}/{p} windows/s per round: {', '.join(f'{x:.2f}' for x in ratios)}")
        for c in CONTENDERS:
            print(f"{label}: {c}: {rounds.median(c):.0f} windows/s, "
                  f"{rounds.median(c, 'cpu_per_1000'):.3f} CPU s/1000 windows")
        out[label] = {**part, "rows": rounds.rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    if a.plot:
        plot(first, steady, a.plot, int(a.tokens))


def plot(first, steady, path, tokens):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for c, colour in zip(CONTENDERS, ("tab:red", "tab:orange", "tab:blue", "tab:green")):
        for ax, rounds, key in ((axes[0], first, "rate"), (axes[1], steady, "rate"), (axes[2], steady, "cpu_per_1000")):
            rows = sorted(rounds.of(c), key=lambda row: row["round"])
            ax.plot([row["round"] for row in rows], [row[key] for row in rows], "o-", color=colour, label=c)
    axes[0].set(title=f"first epoch, fresh process: windows/s\n(seq_len {SEQ}, batch {BATCH}, {tokens / 1e6:.0f}M tokens)",
                xlabel="round", yscale="log")
    axes[1].set(title="steady state (next epoch, same process): windows/s", xlabel="round", yscale="log")
    axes[2].set(title="steady state: CPU s per 1,000 windows", xlabel="round", yscale="log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
