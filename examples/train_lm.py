"""Train a small GPT-style language model on a token dataset streamed by ramjet, and check that
it learns.

    python examples/train_lm.py --remote s3://ramjet/demo/lm --steps 300

It writes a text corpus (sentences of a small grammar, so a tiny model can learn it), trains a
byte-level BPE `tokenizer.json` on it with Hugging Face `tokenizers`, packs it with
`ramjet pack --tokenizer` into `--remote` (the local S3 server of tools/s3-server.sh, or any
URL), then trains a 2-layer causal transformer on `ramjet.TokenDataset` windows: attention stays
inside documents (`segment_ids`) and positions restart at each one (`position_ids`). Halfway it
saves the dataset's state, and a second dataset restored from it continues with the very next
window. It fails unless the loss falls to under half its start, and prints a sample decoded
with the tokenizer. `--tokenizer FILE` and `--jsonl FILE` (a `text` column) use your own.
"""

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ramjet

ROOT = Path(__file__).resolve().parents[1]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/debug/ramjet")


def corpus(path, docs, seed=0):
    rng = random.Random(seed)
    who = ["the cat", "a dog", "the engine", "my model", "the cluster", "a shard", "the cache"]
    verb = ["reads", "streams", "checks", "trains on", "fetches", "shuffles", "verifies"]
    what = ["the tokens", "every window", "a document", "the manifest", "its batch", "the epoch"]
    how = ["quickly", "exactly once", "from object storage", "without waiting", "in order"]
    with open(path, "w") as f:
        for i in range(docs):
            n = rng.randint(1, 12)
            text = " ".join(f"{rng.choice(who)} {rng.choice(verb)} {rng.choice(what)} {rng.choice(how)}."
                            for _ in range(n))
            f.write(json.dumps({"id": i, "text": text}) + "\n")


def train_tokenizer(jsonl, out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [json.loads(line)["text"] for line in open(jsonl)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq_len, d=96, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, positions, segments):
        b, t = ids.shape
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        same_doc = segments[:, :, None] == segments[:, None, :]
        allowed = causal & same_doc  # attention stays inside each document
        mask = (~allowed).repeat_interleave(self.heads, dim=0)
        x = self.tok(ids) + self.pos(positions.clamp(max=self.pos.num_embeddings - 1))
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--remote", required=True, help="where the packed corpus goes (an S3 prefix or a folder)")
    p.add_argument("--jsonl", help="your own corpus (one {\"text\": ...} a line); default: a generated one")
    p.add_argument("--tokenizer", help="your own tokenizer.json; default: trained on the corpus")
    p.add_argument("--docs", type=int, default=3000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="ramjet-lm-"))
    jsonl = Path(a.jsonl) if a.jsonl else work / "corpus.jsonl"
    if not a.jsonl:
        corpus(jsonl, a.docs)
    tok_path = Path(a.tokenizer) if a.tokenizer else work / "tokenizer.json"
    if not a.tokenizer:
        train_tokenizer(jsonl, tok_path)
    remote = f"{a.remote.rstrip('/')}/{int(time.time())}"
    subprocess.run([RAMJET, "pack", str(jsonl), remote, "--tokenizer", str(tok_path), "--shard-size", "256KiB"],
                   check=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    vocab = tok.get_vocab_size()

    def dataset():
        return ramjet.TokenDataset(remote, seq_len=a.seq_len, batch_size=a.batch_size, boundaries=True, seed=1)

    ds = dataset()
    print(f"corpus {remote}: vocabulary {vocab}, end-of-document token {ds.eos}, windows of {a.seq_len + 1}")
    model = GPT(vocab, a.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    losses, step, t0 = [], 0, time.perf_counter()
    saved, resumed_check = None, None
    while step < a.steps:
        for b in ds:
            logits = model(b["input_ids"], b["position_ids"], b["segment_ids"])
            loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), b["labels"].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if step == a.steps // 2 and saved is None:
                saved = ds.state_dict()
                # A new dataset restored from the state continues with the next window.
                other = dataset()
                other.load_state_dict(saved)
                resumed_check = next(iter(other))["window"][0].item()
                expected_next = saved["start"]["window"]
                assert resumed_check == expected_next, (resumed_check, expected_next)
            if step % 50 == 0 or step == 1:
                print(f"step {step}: loss {loss.item():.3f} (epoch {ds.epoch}, window {b['window'][0].item()}), "
                      f"{step / (time.perf_counter() - t0):.1f} steps/s", flush=True)
            if step >= a.steps:
                break
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"loss {first:.3f} -> {last:.3f} over {step} steps (uniform guess {math.log(vocab):.3f}); "
          f"resumed at window {resumed_check} as saved")
    # A short greedy sample.
    model.eval()
    ids = tok.encode("the cat", add_special_tokens=False).ids
    with torch.no_grad():
        for _ in range(24):
            x = torch.tensor([ids[-a.seq_len:]])
            pos = torch.arange(x.shape[1])[None]
            nxt = int(model(x, pos, torch.zeros_like(x))[0, -1].argmax())
            if nxt == ds.eos:
                break
            ids.append(nxt)
    print(f"sample: {tok.decode(ids)!r}")
    if not last < 0.5 * first:
        sys.exit(f"the loss did not fall enough: {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
    main()
