#!/usr/bin/env python3
"""Packing at scale (issue 46), two measurements in one run.

1. **Rate** (`--src DIR`, a local YOLO or image folder): the same pack of DIR read from local
   disk and read in place from the local S3 server (DIR uploaded once under `--raw`), both
   into a fresh local folder, and the plan (`ramjet pack --plan`: the one listing a split pack
   makes) of the S3 copy. Rounds interleave the contenders, order rotated. Per run: wall
   time, input MiB/s and objects/s, CPU seconds per GiB (the pack process's own; the S3
   server's CPU is not counted, but it runs on the same cores), peak RSS. Target: from S3 at
   least 0.8x the rate from disk.
2. **Merge** (`--parts 100,1000,10000,100000`): `ramjet merge-sim` writes the plan and parts of
   a split pack of 10,000 samples a part (at 100,000 parts: 10^9 samples in 2.3 million
   shards of 64 MiB of 150 KB images), then `ramjet pack merge-sim DIR --merge
   --no-check-shards` is timed, interleaved by size. Target at 10^5 parts: under 60 s and
   under 1 GB.

Medians over rounds, every round's figures in the JSON; a PNG of the merge's time and memory
against the number of parts.

    benches/python/pack_split.py --src target/bench/synth-5315 --raw s3://ramjet/bench/raw-5315 \\
        [--rounds 5] [--parts 100,1000,10000,100000] [--out target/bench/pack_split.json]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RAMJET = os.environ.get("RAMJET_BIN") or str(ROOT / "target/release/ramjet")
SAMPLES_PER_PART = 10_000


def upload_once(url, files):
    """Uploads `files` ((local path, key under `url`) pairs) once: a marker object says the
    upload is complete."""
    import boto3
    from concurrent.futures import ThreadPoolExecutor

    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    marker = f"{prefix}/.uploaded"
    try:
        s3.head_object(Bucket=bucket, Key=marker)
        return
    except Exception:
        pass
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda pk: s3.upload_file(str(pk[0]), bucket, f"{prefix}/{pk[1]}"), files))
    s3.put_object(Bucket=bucket, Key=marker, Body=b"")
    print(f"uploaded {len(files)} files to {url}", flush=True)


def upload(src, raw):
    """DIR as it is, under `raw`."""
    files = sorted(p for p in Path(src).rglob("*") if p.is_file())
    upload_once(raw, [(p, p.relative_to(src)) for p in files])


def upload_classes(src, url, classes=100):
    """The images of DIR as an image folder of `classes` classes under `url`."""
    files = sorted(p for p in Path(src).rglob("*") if p.is_file() and p.suffix == ".jpg")
    upload_once(url, [(p, f"c{i % classes:03}/{p.name}") for i, p in enumerate(files)])


def input_stats(src):
    files = [p for p in Path(src).rglob("*") if p.is_file() and p.suffix.lower() in (".jpg", ".jpeg", ".png")]
    return len(files), sum(p.stat().st_size for p in files)


def s3_server_pids():
    """The local S3 server's processes (its CPU per run is reported beside the pack's)."""
    port = os.environ.get("RAMJET_S3_PORT", "8333")
    out = measure.subprocess.run(["pgrep", "-f", f"weed server .*-s3.port={port}"], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def rate_rounds(a, work):
    objects, in_bytes = input_stats(a.src)
    server = s3_server_pids()
    r = measure.Rounds(unit="objects")
    for rnd in range(a.rounds):
        for c in measure.order(["disk", "s3", "plan", "plan-classes"], rnd):
            dst = work / f"dst-{c}"
            shutil.rmtree(dst, ignore_errors=True)
            if c == "plan":
                cmd = [RAMJET, "pack", a.raw, str(dst), "--plan"]
            elif c == "plan-classes":
                cmd = [RAMJET, "pack", a.raw_classes, str(dst), "--plan"]
            else:
                cmd = [RAMJET, "pack", a.src if c == "disk" else a.raw, str(dst), "--shard-size", a.shard_size]
            s0 = sum(measure.tree_cpu_s(p) for p in server)
            out, wall, cpu, steal, rss = measure.run(cmd)
            server_cpu = sum(measure.tree_cpu_s(p) for p in server) - s0
            if not c.startswith("plan"):
                v = re.search(r"manifest version (\w+)", out).group(1)
            else:
                v = None
                m = re.search(r"(\d+) inputs in", out)
                assert m and int(m.group(1)) == objects, out
            row = r.add(rnd, c, wall_s=wall, units=objects, cpu_s=cpu, steal=steal,
                        mib_s=in_bytes / 2**20 / wall, cpu_s_per_gib=cpu / (in_bytes / 2**30), rss_mib=rss,
                        server_cpu_s=server_cpu, server_cpu_s_per_gib=server_cpu / (in_bytes / 2**30), version=v)
            print(f"round {rnd} {c}: {wall:.2f} s, {row['rate']:,.0f} objects/s, {row['mib_s']:.0f} MiB/s, "
                  f"{row['cpu_s_per_gib']:.2f} CPU s/GiB (S3 server {row['server_cpu_s_per_gib']:.2f}), "
                  f"{rss:.0f} MiB RSS, steal {measure.fmt_steal(steal)}", flush=True)
        shutil.rmtree(work / "dst-disk", ignore_errors=True)
        shutil.rmtree(work / "dst-s3", ignore_errors=True)
    versions = {x["version"] for x in r.rows if x["version"]}
    ratios = r.ratios("s3", "disk")
    med = statistics.median(ratios)
    return {
        "objects": objects,
        "input_bytes": in_bytes,
        "same_manifest_from_s3_and_disk": len(versions) == 1,
        "disk": r.summary("disk"),
        "s3": r.summary("s3"),
        "plan": r.summary("plan"),
        "plan_classes": r.summary("plan-classes"),
        "median_mib_s": {c: r.median(c, "mib_s") for c in ("disk", "s3")},
        "median_cpu_s_per_gib": {c: r.median(c, "cpu_s_per_gib") for c in ("disk", "s3", "plan")},
        "median_server_cpu_s_per_gib": {c: r.median(c, "server_cpu_s_per_gib") for c in ("disk", "s3", "plan")},
        "median_listed_keys_per_s": r.median("plan"),
        "median_listed_keys_per_s_100_classes": r.median("plan-classes"),
        "s3_over_disk_per_round": [round(x, 3) for x in ratios],
        "median_s3_over_disk": med,
        "target": "from S3 at least 0.8x the rate from disk",
        "verdict": r.verdict(med >= 0.8),
        "flagged_rounds": r.flagged(),
        "rows": r.rows,
    }


def merge_rounds(a, work):
    sizes = [int(x) for x in a.parts.split(",")]
    dirs = {}
    for n in sizes:
        d = work / f"merge-{n}"
        out, wall, _, _, _ = measure.run([RAMJET, "merge-sim", str(d), "--parts", str(n),
                                          "--samples", str(n * SAMPLES_PER_PART)])
        print(f"{n} parts written in {wall:.1f} s", flush=True)
        dirs[n] = d
    rows = []
    for rnd in range(a.rounds):
        for n in measure.order(sizes, rnd):
            out, wall, cpu, steal, rss = measure.run([RAMJET, "pack", "merge-sim", str(dirs[n]), "--merge",
                                                     "--no-check-shards"])
            shards = int(re.search(r"samples in (\d+) shards", out).group(1))
            rows.append(dict(round=rnd, parts=n, samples=n * SAMPLES_PER_PART, shards=shards, wall_s=wall,
                             cpu_s=cpu, rss_mib=rss, steal=steal))
            print(f"round {rnd} merge of {n:,} parts ({shards:,} shards): {wall:.2f} s, {cpu:.2f} CPU s, "
                  f"{rss:.0f} MiB RSS, steal {measure.fmt_steal(steal)}", flush=True)
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    per = {}
    for n in sizes:
        xs = [x for x in rows if x["parts"] == n]
        per[n] = dict(parts=n, samples=n * SAMPLES_PER_PART, shards=xs[0]["shards"],
                      median_wall_s=statistics.median(x["wall_s"] for x in xs),
                      median_cpu_s=statistics.median(x["cpu_s"] for x in xs),
                      max_rss_mib=max(x["rss_mib"] for x in xs),
                      walls=[round(x["wall_s"], 2) for x in xs])
    top = per[max(sizes)]
    met = top["median_wall_s"] < 60 and top["max_rss_mib"] < 1000
    flagged = sorted({x["round"] for x in rows if measure.flagged_row(x)})
    verdict = None if len({x["round"] for x in rows}) < measure.VERDICT_ROUNDS or flagged else (
        "met" if met else "missed")
    return {"sizes": per, "target": "10^5 parts: under 60 s and under 1 GB", "verdict": verdict,
            "flagged_rounds": flagged, "rows": rows}


def plot(res, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot", flush=True)
        return
    per = sorted(res["merge"]["sizes"].values(), key=lambda x: x["parts"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [x["parts"] for x in per]
    ax.loglog(xs, [x["median_wall_s"] for x in per], "o-", label="merge wall time (s, median)")
    ax.loglog(xs, [x["max_rss_mib"] / 1000 for x in per], "s--", label="peak memory (GB)")
    ax.axhline(60, color="grey", lw=0.8, ls=":")
    ax.text(xs[0], 60 * 1.1, "target: 60 s", fontsize=8)
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.text(xs[0], 1.1, "target: 1 GB", fontsize=8)
    ax.set_xlabel("parts (10,000 samples each)")
    ax.set_title("ramjet pack --merge, simulated parts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(ROOT / "target/bench/synth-5315"))
    ap.add_argument("--raw", default="s3://ramjet/bench/raw-5315")
    ap.add_argument("--raw-classes", default="s3://ramjet/bench/classes-5315")
    ap.add_argument("--shard-size", default="64MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="100,1000,10000,100000")
    ap.add_argument("--skip", choices=["rate", "merge"], default=None)
    ap.add_argument("--out", default=str(ROOT / "target/bench/pack_split.json"))
    ap.add_argument("--plot", default=str(ROOT / "docs/img/pack_merge.png"))
    a = ap.parse_args()
    res = {"ramjet": RAMJET, "rounds": a.rounds}
    with tempfile.TemporaryDirectory(dir=os.environ.get("RAMJET_BENCH_TMP")) as t:
        work = Path(t)
        if a.skip != "rate":
            upload(a.src, a.raw)
            upload_classes(a.src, a.raw_classes)
            res["rate"] = rate_rounds(a, work)
            x = res["rate"]
            print(f"rate: from S3 {x['median_s3_over_disk']:.3f}x from disk (per round "
                  f"{x['s3_over_disk_per_round']}), {x['median_mib_s']}, listing "
                  f"{x['median_listed_keys_per_s']:,.0f} keys/s in one listing, "
                  f"{x['median_listed_keys_per_s_100_classes']:,.0f} keys/s over 100 classes (each listed twice): "
                  f"{x['verdict']}", flush=True)
        if a.skip != "merge":
            res["merge"] = merge_rounds(a, work)
            print(f"merge: {json.dumps(res['merge']['sizes'])}: {res['merge']['verdict']}", flush=True)
            plot(res, a.plot)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
