#!/usr/bin/env python3
"""What reading a foreign dataset without `ramjet index` costs: the first open on a host, which
learns the index, and every later open, which reads it from the host's learned-index folder.

Contenders, each a fresh `ramjet` process, their order rotating round by round, for the MDS and
the WebDataset copy of ramjet-bench's synthetic set:

  index:   `ramjet index SRC` (writes the manifest beside the data);
  learn:   `ramjet inspect SRC` with an empty RAMJET_INDEX_DIR (learns the index);
  reopen:  `ramjet inspect SRC` with the index learned (reads it from RAMJET_INDEX_DIR);
  open:    `ramjet inspect` of the manifest `ramjet index` wrote (the indexed dataset's open).

index and learn are rated in MiB of foreign shards read per second, with CPU seconds per
1,000 MiB; reopen and open in opens per second, with CPU seconds per 1,000 opens. Reported:
medians, every round's ratios learn/index and reopen/open, the steal share of each run.

    benches/python/learned_index.py [--data .ramjet/bench/data-5315-64m] [--rounds 5] [--out F]

The data folder is ramjet-bench's (`tools/ramjet-bench` makes it): `mds/` and `wds/` copies.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / ".ramjet/bench/data-5315-64m"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="write every measurement here as JSON")
    a = ap.parse_args()
    data = Path(a.data)
    if not (data / "mds/index.json").exists() or not list((data / "wds").glob("*.tar")):
        sys.exit(f"{data}: no mds/ and wds/ copies (run tools/ramjet-bench once)")
    tars = sorted((data / "wds").glob("*.tar"))
    stem, width = tars[0].name.rsplit("-", 1)[0], len(tars[0].stem.rsplit("-", 1)[1])
    sources = {
        "mds": dict(index=str(data / "mds"), learned=str(data / "mds/index.json"), indexed=str(data / "mds"),
                    mib=sum(p.stat().st_size for p in (data / "mds").glob("*.mds")) / 2**20),
        "wds": dict(index=str(data / "wds" / f"{stem}-{{{0:0{width}}..{len(tars) - 1:0{width}}}}.tar"),
                    learned=None, indexed=str(data / "wds"),
                    mib=sum(p.stat().st_size for p in tars) / 2**20),
    }
    sources["wds"]["learned"] = sources["wds"]["index"]
    read, opens = measure.Rounds("MiB"), measure.Rounds("opens")
    warm = Path(tempfile.mkdtemp(prefix="ramjet-learned-"))
    env_warm = {**os.environ, "RAMJET_INDEX_DIR": str(warm)}
    for s in sources.values():
        measure.run([RAMJET, "index", s["index"]])
        measure.run([RAMJET, "inspect", s["learned"]], env=env_warm)
    contenders = [(f, c) for f in sources for c in ("index", "learn", "reopen", "open")]
    for r in range(a.rounds):
        for f, c in measure.order(contenders, r):
            s = sources[f]
            if c == "learn":
                cold = Path(tempfile.mkdtemp(prefix="ramjet-learn-"))
                _, wall, cpu, steal, _ = measure.run([RAMJET, "inspect", s["learned"]], env={**os.environ, "RAMJET_INDEX_DIR": str(cold)})
                shutil.rmtree(cold)
            elif c == "index":
                _, wall, cpu, steal, _ = measure.run([RAMJET, "index", s["index"]])
            elif c == "reopen":
                _, wall, cpu, steal, _ = measure.run([RAMJET, "inspect", s["learned"]], env=env_warm)
            else:
                _, wall, cpu, steal, _ = measure.run([RAMJET, "inspect", s["indexed"]])
            rounds = read if c in ("index", "learn") else opens
            rounds.add(r, f"{f} {c}", wall_s=wall, units=s["mib"] if rounds is read else 1, cpu_s=cpu, steal=steal)
        print(read.line(r))
        print(opens.line(r))
    shutil.rmtree(warm)
    out = {"rounds": a.rounds, "flagged_rounds": sorted(set(read.flagged()) | set(opens.flagged()))}
    for f, s in sources.items():
        learn_over_index = read.ratios(f"{f} learn", f"{f} index", "wall_s")
        reopen_over_open = opens.ratios(f"{f} reopen", f"{f} open", "wall_s")
        out[f] = {
            "mib": round(s["mib"], 1),
            "index": read.summary(f"{f} index"),
            "learn": read.summary(f"{f} learn"),
            "reopen": opens.summary(f"{f} reopen"),
            "open": opens.summary(f"{f} open"),
            "learn_over_index_wall": [round(x, 3) for x in learn_over_index],
            "reopen_over_open_wall": [round(x, 3) for x in reopen_over_open],
        }
        print(
            f"{f} ({s['mib']:.0f} MiB): index {read.median(f'{f} index', 'wall_s'):.2f} s, "
            f"learn {read.median(f'{f} learn', 'wall_s'):.2f} s "
            f"({read.median(f'{f} learn', 'cpu_per_1000'):.2f} CPU s/1000 MiB; learn/index per round "
            f"{', '.join(f'{x:.2f}' for x in learn_over_index)}); "
            f"reopen {1000 * opens.median(f'{f} reopen', 'wall_s'):.0f} ms "
            f"({1000 * opens.median(f'{f} reopen', 'cpu_per_1000') / 1000:.0f} ms CPU), "
            f"open of the indexed manifest {1000 * opens.median(f'{f} open', 'wall_s'):.0f} ms; reopen/open per round "
            f"{', '.join(f'{x:.2f}' for x in reopen_over_open)}"
        )
    if a.out:
        Path(a.out).write_text(json.dumps({**out, "rows": read.rows + opens.rows}, indent=1))


if __name__ == "__main__":
    main()
