"""ramjet-bench --trainer yolo: the published P2/P3 scenario with real Ultralytics YOLO training.

- P2 (pre-export): the dataset is one object per image and per label file in S3. The run
  exports every object to local disk (16 GETs in flight), writes a data.yaml, and trains
  stock Ultralytics (`YOLO(...).train`) on the files.
- P3 (streaming): `ramjet.integrations.ultralytics.streaming_train` on the packed dataset in
  the same S3 server, from an empty node cache (embedded daemon), so its first epoch is cold.

Both train `yolov8n.yaml` (built from the yaml: no weight download) with the same
hyperparameters and seed, offline (YOLO_OFFLINE, a private YOLO_CONFIG_DIR, amp off). Each run
is its own process, started by this script, and the clock starts when it is spawned: time to
first step includes Python and Ultralytics start-up for both, and the export for P2. P2 and P3
alternate round by round (the order flips every round); every figure is a median over rounds,
with the per-round ratios beside it.

Run through `tools/ramjet-bench --trainer yolo` (it builds ramjet and starts the S3 server).
"""

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ramjet_bench as rb  # noqa: E402

ROOT, STATE, BUCKET, RAMJET = rb.ROOT, rb.STATE, rb.BUCKET, rb.RAMJET


def log(msg):
    print(f"ramjet-bench yolo: {msg}", file=sys.stderr, flush=True)


# ----- data --------------------------------------------------------------------------------


class YoloData:
    """The synthetic YOLO set (train + val), as raw objects (P2) and packed (P3)."""

    def __init__(self, train, val):
        self.train, self.val = train, val
        self.dir = STATE / f"bench/yolo-{train}-{val}"
        self.prefix = f"bench/yolo/{train}-{val}"

    @property
    def raw_url(self):
        return f"s3://{BUCKET}/{self.prefix}/raw"

    @property
    def packed_url(self):
        return f"s3://{BUCKET}/{self.prefix}/packed"

    def prepare(self, link):
        for split, n, seed in (("train", self.train, 0), ("val", self.val, 1)):
            d = self.dir / split
            if not (d / ".complete").exists():
                shutil.rmtree(d, ignore_errors=True)
                log(f"generating {n} synthetic {split} images")
                subprocess.run([str(RAMJET), "synth", str(d), "--samples", str(n), "--seed", str(seed)], check=True,
                               stdout=subprocess.DEVNULL)
                (d / ".complete").touch()
        c = rb.s3_client(link.endpoint)
        marker = f"{self.prefix}/_complete"
        try:
            c.head_object(Bucket=BUCKET, Key=marker)
            return
        except Exception:  # noqa: BLE001 - absent: upload
            pass
        env = link.env()
        for split in ("train", "val"):
            log(f"packing {split} into {self.packed_url}/{split} ({link.name})")
            subprocess.run([str(RAMJET), "pack", str(self.dir / split), f"{self.packed_url}/{split}"], check=True,
                           env=env, stdout=subprocess.DEVNULL)
        jobs = []
        for split in ("train", "val"):
            for sub in ("images", "labels"):
                for f in sorted((self.dir / split / sub).iterdir()):
                    jobs.append((f, f"{self.prefix}/raw/{split}/{sub}/{f.name}"))
        import concurrent.futures as cf

        from logbar import bar

        with cf.ThreadPoolExecutor(16) as ex, bar(total=len(jobs), desc="upload raw objects", unit="obj",
                                                   file=sys.stderr, leave=False) as progress:
            for _ in ex.map(lambda j: c.upload_file(str(j[0]), BUCKET, j[1]), jobs):
                progress.update(1)
        c.put_object(Bucket=BUCKET, Key=marker, Body=b"")


# ----- one run (a child process) -----------------------------------------------------------


class FirstStepDone(Exception):
    """Ends a --first-step-only run right after its first training step."""


def stop_after_first_step(trainer):
    raise FirstStepDone()


def child(a):
    """Runs P2 or P3 once and prints one JSON line."""
    t0 = float(os.environ["RJ_T0"])
    from ramjet.integrations.ultralytics import StepTimer, offline_environment

    offline_environment(a.work + "/yolo-config")
    out = {"scenario": a.child}
    train_args = dict(epochs=a.epochs, batch=a.batch, workers=a.workers, imgsz=a.imgsz, device=a.device, seed=0,
                      deterministic=True, amp=False, plots=False, val=False, project=a.work + "/runs", name="run",
                      exist_ok=True, verbose=False)
    if a.child == "p2":
        t = time.perf_counter()
        dest = Path(a.work) / "export"
        got = rb.export(a.raw_url, dest, os.environ["AWS_ENDPOINT_URL"], "P2 export")
        (dest / "data.yaml").write_text(
            f"path: {dest}\ntrain: train/images\nval: val/images\nnames: {json.dumps(list(NAMES))}\n")
        out["export_s"] = time.perf_counter() - t
        out["export_bytes"] = got
        from ultralytics import YOLO

        model = YOLO("yolov8n.yaml")
        timer = StepTimer(t0=t0 - time.time() + time.perf_counter()).attach(model)
        if a.first_step_only:
            model.add_callback("on_train_batch_end", stop_after_first_step)
        try:
            model.train(data=str(dest / "data.yaml"), **train_args)
        except FirstStepDone:
            pass
    else:
        from ramjet.integrations.ultralytics import streaming_train
        from ultralytics import YOLO

        model = YOLO("yolov8n.yaml")
        timer = StepTimer(t0=t0 - time.time() + time.perf_counter()).attach(model)
        if a.first_step_only:
            model.add_callback("on_train_batch_end", stop_after_first_step)
        try:
            streaming_train(model, data=a.packed_url, cache_dir=a.work + "/ramjet-cache", **train_args)
        except FirstStepDone:
            pass
    ds = getattr(getattr(model, "trainer", None), "train_loader", None)
    it = getattr(ds, "iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()  # join the workers, so their CPU time is in RUSAGE_CHILDREN
    # This process and its DataLoader workers (reaped by now), so P2 (no workers on CPU) and
    # P3 (workers) are counted alike.
    ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out.update(
        first_step_s=timer.first_step_s,
        epochs=timer.epochs,
        losses=[s["loss"] for s in timer.steps],
        cpu_s=ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime,
        images_per_epoch=len(ds.dataset) if ds is not None else 0,
    )
    print("RESULT " + json.dumps(out), flush=True)


NAMES = ("crate", "ball", "sign", "pole", "barrel", "panel", "cone", "car")


def run_child(scenario, a, link, data):
    work = Path(tempfile.mkdtemp(prefix=f"rjyolo-{scenario}-", dir=a.scratch))
    cmd = [sys.executable, __file__, "--child", scenario, "--work", str(work), "--raw-url", data.raw_url,
           "--packed-url", data.packed_url, "--epochs", str(a.epochs), "--batch", str(a.batch), "--workers",
           str(a.workers), "--imgsz", str(a.imgsz), "--device", a.device]
    if a.first_step_only:
        cmd.append("--first-step-only")
    env = link.env()
    env["RJ_T0"] = repr(time.time())
    env["YOLO_OFFLINE"] = "1"
    env["YOLO_CONFIG_DIR"] = str(work / "yolo-config")
    env.pop("RAMJET_SOCKET", None)  # each P3 run gets its own embedded daemon and empty cache
    env["RAMJET_SOCKET"] = str(work / "daemon.sock")
    st = rb.measure.proc_stat()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    steal = rb.measure.steal_share(st, rb.measure.proc_stat())
    shutil.rmtree(work, ignore_errors=True)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{scenario} run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return json.loads(lines[-1][len("RESULT "):]) | {"steal": steal}


# ----- statistics and output ---------------------------------------------------------------


def ks_2samp(x, y):
    """Two-sample Kolmogorov-Smirnov statistic and its asymptotic p-value."""
    x, y = sorted(x), sorted(y)
    n, m = len(x), len(y)
    i = j = 0
    d = 0.0
    while i < n and j < m:
        v = min(x[i], y[j])
        while i < n and x[i] <= v:
            i += 1
        while j < m and y[j] <= v:
            j += 1
        d = max(d, abs(i / n - j / m))
    en = math.sqrt(n * m / (n + m))
    lam = (en + 0.12 + 0.11 / en) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(max(p, 0.0), 1.0)


def summarise(run):
    ep = run["epochs"] or [{"wall_s": float("nan"), "steps": 0, "wait_s": 0.0}]
    warm = ep[1:] if len(ep) > 1 else ep
    steps = sum(e["steps"] for e in ep)
    wall = sum(e["wall_s"] for e in ep)
    return {
        "first_step_s": run["first_step_s"],
        "export_s": run.get("export_s"),
        "cold_epoch_s": ep[0]["wall_s"],
        "warm_epoch_s": statistics.median(e["wall_s"] for e in warm),
        "it_s": steps / wall if wall else float("nan"),
        "warm_wait_pct": 100 * sum(e["wait_s"] for e in warm) / max(sum(e["wall_s"] for e in warm), 1e-9),
        "cpu_s_per_image": run["cpu_s"] / max(run["images_per_epoch"] * len(ep), 1),
        "steal": run.get("steal", 0.0),
    }


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def report(a, link, rounds, out_dir):
    p2 = [summarise(r["p2"]) for r in rounds]
    p3 = [summarise(r["p3"]) for r in rounds]
    ttfs_ratio = [x["first_step_s"] / y["first_step_s"] for x, y in zip(p2, p3)]
    warm_ratio = [y["warm_epoch_s"] / x["warm_epoch_s"] for x, y in zip(p2, p3)]
    cold_ratio = [y["cold_epoch_s"] / x["cold_epoch_s"] for x, y in zip(p2, p3)]
    # Each run is deterministic (seed 0, deterministic=True), so rounds repeat one curve per
    # scenario: the distributions are compared on the first round's steps.
    l2, l3 = rounds[0]["p2"]["losses"], rounds[0]["p3"]["losses"]
    ks, p = ks_2samp(l2, l3)
    maxdiff = max((abs(x - y) for x, y in zip(l2, l3)), default=float("nan"))
    n_ep = max(len(rounds[0]["p2"]["epochs"]), 1)

    def epoch_means(ls):
        k = max(len(ls) // n_ep, 1)
        return [statistics.mean(ls[i * k:(i + 1) * k]) for i in range(n_ep) if ls[i * k:(i + 1) * k]]
    rows = [
        ("time to first step (s), P2 incl. export", med(x["first_step_s"] for x in p2),
         med(y["first_step_s"] for y in p3)),
        ("  of which P2's export (s)", med(x["export_s"] for x in p2), None),
        ("first epoch (s): P2 local files / P3 cold from S3", med(x["cold_epoch_s"] for x in p2),
         med(y["cold_epoch_s"] for y in p3)),
        ("warm epoch (s), median of epochs 2..", med(x["warm_epoch_s"] for x in p2), med(y["warm_epoch_s"] for y in p3)),
        ("it/s (all epochs)", med(x["it_s"] for x in p2), med(y["it_s"] for y in p3)),
        ("data wait, % of warm epoch", med(x["warm_wait_pct"] for x in p2), med(y["warm_wait_pct"] for y in p3)),
        ("CPU s per image (process + workers, whole run)", med(x["cpu_s_per_image"] for x in p2),
         med(y["cpu_s_per_image"] for y in p3)),
    ]

    def f(v):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"

    md = [
        f"Link: {link.detail}. Device: {a.device}. {a.train} train + {a.val} val images, imgsz {a.imgsz}, "
        f"batch {a.batch}, workers {a.workers}, "
        f"{'runs end after their first step' if a.first_step_only else f'{a.epochs} epochs'}, {len(rounds)} rounds (P2 and P3 alternate, the "
        f"order flips every round). Medians over rounds.",
        "",
        "| figure | P2 pre-export (stock Ultralytics) | P3 ramjet `streaming_train` |",
        "|---|---|---|",
    ]
    if a.first_step_only:
        rows = rows[:2]
    md += [f"| {name} | {f(x)} | {f(y)} |" for name, x, y in rows]
    n = len(rounds)

    def verdict(ok):
        v = None if n < rb.measure.VERDICT_ROUNDS else ("met" if ok else "missed")
        return rb.measure.verdict_text(v, n)

    md += [
        "",
        f"- time to first step, P2 / P3, per round: {', '.join(f'{r:.2f}x' for r in ttfs_ratio)} "
        f"(median {med(ttfs_ratio):.2f}x; target at least 9x: **{verdict(med(ttfs_ratio) >= 9)}**)",
        f"- steal share per round, P2 / P3 (! above {rb.measure.STEAL_FLAG:.0%}): "
        + ", ".join(f"{rb.measure.fmt_steal(x['steal'])} / {rb.measure.fmt_steal(y['steal'])}" for x, y in zip(p2, p3)),
    ]
    if not a.first_step_only:
        md += [
        f"- warm epoch, P3 / P2, per round: {', '.join(f'{r:.3f}x' for r in warm_ratio)} "
        f"(median {med(warm_ratio):.3f}x; target at most 1.05x: **{verdict(med(warm_ratio) <= 1.05)}**)",
        f"- first epoch, P3 cold / P2, per round: {', '.join(f'{r:.3f}x' for r in cold_ratio)} "
        f"(median {med(cold_ratio):.3f}x)",
        f"- loss per step, P2 vs P3 (first round): {len(l2)} and {len(l3)} steps; mean loss per epoch "
        f"P2 {', '.join(f'{x:.3f}' for x in epoch_means(l2))} and P3 {', '.join(f'{x:.3f}' for x in epoch_means(l3))}; "
        f"largest step-by-step difference {maxdiff:.3f}; two-sample Kolmogorov-Smirnov D = {ks:.3f}, p = {p:.3f} "
        f"({'same distribution not rejected' if p > 0.05 else 'distributions differ'} at 5%)",
        ]
    text = "\n".join(md)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "results-first-step" if a.first_step_only else "results"
    (out_dir / f"{stem}.md").write_text(text + "\n")
    (out_dir / f"{stem}.json").write_text(json.dumps(
        {"args": vars(a), "link": link.detail, "rounds": rounds, "p2": p2, "p3": p3, "ttfs_ratio": ttfs_ratio,
         "warm_ratio": warm_ratio, "cold_ratio": cold_ratio, "ks": [ks, p], "machine": rb.machine()}, indent=1))
    chart(rounds, p2, p3, out_dir / ("chart-first-step.png" if a.first_step_only else "chart.png"))
    print(text)


def chart(rounds, p2, p3, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is missing: no chart")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, color, label in (("p2", "tab:blue", "P2 stock Ultralytics, exported files"),
                              ("p3", "tab:orange", "P3 ramjet streaming_train")):
        for k, r in enumerate(rounds):
            ax1.plot(r[key]["losses"], color=color, alpha=0.35 if k else 0.9, lw=1,
                     label=label if k == 0 else None)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (box + cls + dfl)")
    ax1.set_title("loss per step, every round")
    ax1.legend()
    names = ["first step", "first epoch", "warm epoch"]
    xs = range(len(names))
    v2 = [med(x["first_step_s"] for x in p2), med(x["cold_epoch_s"] for x in p2), med(x["warm_epoch_s"] for x in p2)]
    v3 = [med(x["first_step_s"] for x in p3), med(x["cold_epoch_s"] for x in p3), med(x["warm_epoch_s"] for x in p3)]
    ax2.bar([x - 0.2 for x in xs], v2, 0.4, label="P2 (incl. export)", color="tab:blue")
    ax2.bar([x + 0.2 for x in xs], v3, 0.4, label="P3", color="tab:orange")
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("seconds (median over rounds)")
    ax2.set_title("time to first step and epochs")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----- main --------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", default="yolo", choices=["yolo"])
    p.add_argument("--device", default=None, help="cpu, or a GPU index such as 0 (default: 0 with CUDA, else cpu)")
    p.add_argument("--train", type=int, default=None,
                   help="train images (default: 5,315 on a GPU; a 480-image subset on CPU)")
    p.add_argument("--val", type=int, default=None, help="val images (default: a tenth of train, at least 16)")
    p.add_argument("--imgsz", type=int, default=None, help="image size (default: 640 on a GPU, 160 on CPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers (default 8 on a GPU, 1 on CPU; stock Ultralytics forces 0 on CPU, so P2 "
                        "loads in its main process there, while ramjet's trainer keeps the workers asked for)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run: the first is cold for P3")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a smoke run: 64 images, imgsz 64, 2 epochs, 1 round")
    p.add_argument("--first-step-only", action="store_true",
                   help="measure time to first step only (each run ends after its first step)")
    p.add_argument("--link", choices=["loopback", "wan"], default="loopback")
    p.add_argument("--rate", default="200mbit", help="WAN-like link rate")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="WAN-like link round trip")
    p.add_argument("--out", default=str(ROOT / "target/bench/yolo"))
    p.add_argument("--scratch", default=None, help="folder for the runs' files (default: system temp)")
    # child mode
    p.add_argument("--child", choices=["p2", "p3"])
    p.add_argument("--work")
    p.add_argument("--raw-url")
    p.add_argument("--packed-url")
    a = p.parse_args()
    if a.child:
        return child(a)
    if a.device is None:
        try:
            import torch

            a.device = "0" if torch.cuda.is_available() else "cpu"
        except ImportError:
            a.device = "cpu"
    gpu = a.device != "cpu"
    if a.quick:
        a.train, a.val, a.imgsz, a.epochs, a.rounds = a.train or 64, a.val or 16, a.imgsz or 64, 2, 1
    a.train = a.train or (5315 if gpu else 480)
    a.val = a.val or max(16, a.train // 10)
    a.imgsz = a.imgsz or (640 if gpu else 160)
    a.workers = (8 if gpu else 1) if a.workers is None else a.workers
    link = rb.loopback_link() if a.link == "loopback" else rb.wan_up(a.rate, a.rtt_ms)
    try:
        data = YoloData(a.train, a.val)
        data.prepare(link)
        rounds = []
        for k in range(a.rounds):
            order = ("p2", "p3") if k % 2 == 0 else ("p3", "p2")
            r = {}
            for s in order:
                log(f"round {k + 1}/{a.rounds}: {s.upper()} ({a.epochs} epochs)")
                r[s] = run_child(s, a, link, data)
                sm = summarise(r[s])
                log(f"  first step {sm['first_step_s']:.2f} s, epochs "
                    + ", ".join(f"{e['wall_s']:.1f}" for e in r[s]["epochs"]) + " s")
            rounds.append(r)
        report(a, link, rounds, Path(a.out) / link.name)
    finally:
        if a.link == "wan":
            rb.wan_down(link)
    log(f"platform: {platform.platform()}")


if __name__ == "__main__":
    main()
