"""A/B of two builds of ramjet on this machine: a baseline revision against the working tree,
interleaved round by round (measure.py's rules: rotated order, medians, per-round ratios, CPU
beside wall time).

    .venv/bin/python benches/python/ab.py --base REV [--rounds 6] [--url s3://ramjet/bench/stream-5315]

Each side is built once, in release: the baseline in a git worktree under target/ab/REV, the
working tree where it is. Per round, each side runs, in a fresh process:
- `cargo bench -p ramjet-benches --bench stream` (its own 9 inner rounds: the cold epoch against
  4 parallel GETs, the warm epoch against `cat`, time to first sample, CPU s/GiB);
- two epochs of the Python loader (decode, RandomResizedCrop to 224, batch 8) over `--url`
  through a warm node-local cache of its own: images/s and CPU s per 1,000 images.
Prints every round and the medians of the per-round new/old ratios, and writes
target/ab/summary.json. Needs the local S3 server (tools/s3-server.sh) and the dataset the
stream benchmark packs (run it once).
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import measure  # noqa: E402 - the shared rotation rule


def sh(cmd, cwd, **kw):
    return subprocess.run(cmd, cwd=cwd, check=True, text=True, **kw)


def build(tree: Path, out: Path) -> dict:
    """The stream benchmark's executable and the Python package (installed under `out`)."""
    msgs = sh(["cargo", "bench", "-q", "-p", "ramjet-benches", "--bench", "stream", "--no-run",
               "--message-format=json"], tree, stdout=subprocess.PIPE).stdout
    exe = [m["executable"] for m in map(json.loads, msgs.splitlines())
           if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "stream"]
    wheels = out / "wheel"
    sh([str(ROOT / ".venv/bin/maturin"), "build", "--release", "-q", "-m", "bindings/Cargo.toml", "-o", str(wheels)], tree)
    wheel = sorted(wheels.glob("*.whl"), key=lambda p: p.stat().st_mtime)[-1]
    sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(out / "py"), str(wheel)], tree)
    return {"tree": tree, "stream": exe[-1], "py": out / "py", "cache": out / "cache"}


NUM = r"([\d.]+)"


def stream_round(side: dict) -> dict:
    run = subprocess.run([side["stream"], "--bench"], cwd=side["tree"] / "benches", text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t = run.stdout
    if run.returncode != 0:
        raise SystemExit(f"the stream benchmark of {side['tree']} failed ({run.returncode}):\n{t[-3000:]}")
    cold = re.search(rf"\| cold epoch, local S3 \| {NUM} \| \d+ \| {NUM} \|[^|]*\| {NUM} \| {NUM} \| {NUM}x", t)
    warm = re.search(rf"\| warm epoch, local cache \| {NUM} \| \d+ \| {NUM} \|[^|]*\| {NUM} \| {NUM} \| {NUM}x", t)
    ttfs = re.search(rf"time to first sample, cold: {NUM}", t)
    if not (cold and warm and ttfs):
        raise SystemExit(f"the stream benchmark's output was not understood:\n{t[-2000:]}")
    return {"cold_s": float(cold[1]), "cold_cpu_s_per_gib": float(cold[2]), "cold_vs_gets": float(cold[5]),
            "warm_s": float(warm[1]), "warm_cpu_s_per_gib": float(warm[2]), "warm_vs_cat": float(warm[5]),
            "ttfs_s": float(ttfs[1])}


def loader_round(side: dict, url: str, epochs: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(side["py"]))
    out = sh([sys.executable, __file__, "_loader", url, str(side["cache"]), str(epochs)], ROOT, env=env,
             stdout=subprocess.PIPE).stdout
    got = json.loads(out.splitlines()[-1])
    if Path(got["module"]).resolve().parents[1] != Path(side["py"]).resolve():
        raise SystemExit(f"the loader ran {got['module']}, not the build under {side['py']}")
    last = got["epochs"][-1]
    return {"loader_img_s": last["rate"], "loader_cpu_s_per_1k": last["cpu_per_1k"]}


def loader_child(url: str, cache: str, epochs: int) -> None:
    import ramjet

    ds = ramjet.StreamingDataset(url, local=cache, batch_size=8, image_size=224, boxes_column=None)
    res = []
    for e in range(epochs):
        ds.set_epoch(e)
        r0, t0, n = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
        for b in ds:
            n += b["image"].shape[0]
        dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        res.append({"n": n, "s": dt, "rate": n / dt, "cpu_per_1k": cpu / n * 1000})
    print(json.dumps({"module": ramjet.__file__, "epochs": res}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_loader":
        return loader_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the baseline revision (a commit, tag or branch)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--url", default="s3://ramjet/bench/stream-5315")
    a = p.parse_args()
    if a.rounds < 5:
        raise SystemExit("--rounds: at least 5 (verdicts come from medians of 5 rounds or more)")
    work = ROOT / "target/ab"
    rev = sh(["git", "rev-parse", "--short", a.base], ROOT, stdout=subprocess.PIPE).stdout.strip()
    base_tree = work / rev
    if not base_tree.exists():
        sh(["git", "worktree", "add", "--detach", str(base_tree), rev], ROOT)
    print(f"ab: building {rev} and the working tree (release)", file=sys.stderr, flush=True)
    sides = {"old": build(base_tree, work / f"{rev}-out"), "new": build(ROOT, work / "working-tree-out")}
    for s in sides.values():
        loader_round(s, a.url, 1)  # fills each side's own node-local cache
    rows = []
    for r in range(a.rounds):
        row = {}
        for name in measure.order(list(sides), r):
            row[name] = {**stream_round(sides[name]), **loader_round(sides[name], a.url, 2)}
        rows.append(row)
        print(f"round {r + 1}: " + "; ".join(
            f"{k} new/old {row['new'][k] / row['old'][k]:.2f}" for k in row["new"]), file=sys.stderr, flush=True)
    summary = {"base": rev, "rounds": rows, "median_new_over_old": {
        k: round(statistics.median(row["new"][k] / row["old"][k] for row in rows), 3) for k in rows[0]["new"]}}
    work.mkdir(parents=True, exist_ok=True)
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["median_new_over_old"], indent=1))


if __name__ == "__main__":
    main()
