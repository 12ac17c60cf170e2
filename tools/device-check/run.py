#!/usr/bin/env python3
"""The device check: every GPU-side part of ramjet run in one prepared call (issues 40, 68).

Runs THERE, on the GPU machine (no Rust, no network, no S3), from the bundle that
tools/device-check/build.sh made here, inside ONE device call of 480 s:

  python3 BUNDLE/scripts/run.py --bundle BUNDLE --out $OUT        (--deadline 440 by default)

One deadline for the whole run: the steps run in a priority order (the environment, then the
figures the goals need, then the long tails), each with its own limit, cut to the time left.
Each step is a process group of its own whose output streams into `log.txt` as it comes; a
step that fails or overruns records its error and the next one runs; `summary.json` is
rewritten after every step (and the benchmarks rewrite their JSON after every round), so a run
cut short keeps what it measured. SIGTERM (or SIGINT) kills the running step's whole process
group, records the step as interrupted and exits; a child also dies with this script.
Everything comes back in at most 5 files (the device tool returns at most 8): `summary.json`,
`log.txt`, and the benchmarks' `kernel.json`, `feed.json` and `cpu_scale.json`.

Without a GPU (CI's dry run, `--cpu`), steps that need one report "skipped: no GPU" and the rest
run on the CPU over the same bundle layout. `--inject STEP=fail|hang` (the rehearsal in CI)
replaces a step's commands with one that fails, or hangs with a child of its own.

Steps, in the order they run:
  env        nvidia-smi, driver, torch, torchvision, NVRTC, nvJPEG and cuFile as ramjet finds them
  nvjpeg     tests/nvjpeg_gpu: nvJPEG's hardware engine and hybrid decoder over the ImageNet-like
             synthetic profile against libjpeg-turbo, the fused kernel over their output against
             the CPU path, the scratch bound, flat device memory, and decode + RandomResizedCrop
             + normalise to bf16 in images/s (`nvjpeg_rrc_img_s`: DALI's floor is 19,000)
  rust_gpu   the Rust GPU tests (--include-ignored, RAMJET_GPU_TESTS=1)
  py_gpu     the Python GPU tests (RAMJET_GPU_TESTS=1 pytest test_gpu.py, 90 s a test)
  kernel     benches/python/kernel_bench.py: the fused kernel against torchvision v2
             RandomResizedCrop + normalise on the GPU over the same decoded images, uint8 and bf16
  feed       benches/python/gpu_feed.py: H2D from ramjet's pool against torch's pinned copy, and
             ResNet-50 (AMP bf16, channels_last) fed by ramjet (CPU decode, and GPU decode with
             decode="auto") against resident batches, rounds interleaved, each contender isolated
  cpu_scale  the CPU path at 1, 2, 4, 8 and 16 decode threads: img/s and CPU s per 1,000 images
  sanitizer  ramjet-cuda's GPU tests under compute-sanitizer --tool memcheck; "unsupported"
             (a sandbox that refuses the tool the device) is recorded, not a failure
"""
import argparse
import ctypes
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: The steps in the order they run, with each one's most seconds on a GPU and in the CPU dry
#: run. On a GPU they add up to more than the deadline on purpose: a step that ends early
#: leaves its time to the next, and the last ones get what is left.
STEPS = [
    ("env", 60, 60),
    ("nvjpeg", 120, 30),
    ("rust_gpu", 120, 120),
    ("py_gpu", 120, 90),
    ("kernel", 90, 60),
    ("feed", 150, 180),
    ("cpu_scale", 100, 150),
    ("sanitizer", 90, 30),
]
#: Seconds kept back at the deadline for the last summary.
RESERVE_S = 5
#: Seconds a Python GPU test may take before it fails (then the process, 30 s later).
TEST_TIMEOUT_S = 90
#: What compute-sanitizer prints where it cannot run here (a sandboxed device).
UNSUPPORTED = re.compile(r"not supported|unsupported|Unable to (?:find|load|start)|no CUDA-capable|"
                         r"Device not supported|Target application terminated before first instrumented API call",
                         re.IGNORECASE)


def sh(cmd, **kw) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def die_with_parent() -> None:
    """In the child before exec: killed with SIGKILL when this script dies (Linux prctl
    PR_SET_PDEATHSIG), so a run killed outright leaves no step on the GPU."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:
        pass


class Runner:
    def __init__(self, bundle: Path, out: Path, gpu: bool, deadline_s: float, inject: dict):
        self.bundle, self.out, self.gpu = bundle, out, gpu
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.inject = inject
        self.log = open(out / "log.txt", "a", buffering=1)
        self.steps = {}
        self.head = {}
        self.current = None  # (step name, Popen) while a step runs
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["RAMJET_BIN"] = str(bundle / "bin/ramjet")
        if gpu:
            self.env["RAMJET_GPU_TESTS"] = "1"

    def left(self) -> float:
        return self.deadline - RESERVE_S - time.monotonic()

    def write_summary(self) -> None:
        doc = dict(self.head, steps=self.steps, elapsed_s=round(time.monotonic() - self.started, 1))
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        tmp.replace(self.out / "summary.json")

    def on_signal(self, signum, _frame) -> None:
        """Kills the running step's process group, records it, and ends the run."""
        name = signal.Signals(signum).name
        if self.current is not None:
            step, p = self.current
            if p is not None:
                kill_group(p)
            self.steps[step] = {"rc": 128 + signum, "seconds": None, "figures": {}, "interrupted": name}
        self.log.write(f"\n===== interrupted by {name}\n")
        self.write_summary()
        os._exit(128 + signum)

    def run_one(self, argv, limit: float):
        """One command, its output streamed into the log; (rc, text)."""
        self.log.write(f"$ {' '.join(map(str, argv))}\n")
        try:
            p = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, errors="replace", env=self.env, start_new_session=True,
                                 preexec_fn=die_with_parent)
        except OSError as e:
            self.log.write(f"could not start: {e}\n")
            return 127, ""
        self.current = (self.current[0] if self.current else "?", p)
        lines = []

        def pump():
            for line in p.stdout:
                self.log.write(line)
                lines.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=max(limit, 0.1))
        except subprocess.TimeoutExpired:
            kill_group(p)
            p.wait()
            rc = 124
        kill_group(p)  # what the command left running in its group goes with it
        reader.join(timeout=5)
        if rc == 124:
            lines.append(f"\n[killed after {limit:.0f} s: the step's time was spent]\n")
            self.log.write(lines[-1])
        return rc, "".join(lines)

    def step(self, name: str, cmds, budget: float, needs_gpu: bool = False, figures=None, soft=None) -> None:
        """Runs `cmds` (argv lists) one after another within `budget` seconds cut to the time
        left; the rc is the first non-zero one. `figures(text) -> dict` reads its figures;
        `soft(text) -> str | None` names an outcome that is recorded but is no failure."""
        self.log.write(f"\n===== {name} ({datetime.datetime.now().isoformat(timespec='seconds')})\n")
        mode = self.inject.get(name)
        if mode is not None:
            cmds = [injected(mode)]
        elif needs_gpu and not self.gpu:
            self.steps[name] = {"rc": None, "seconds": 0.0, "figures": {}, "skipped": "no GPU"}
            self.log.write("skipped: no GPU\n")
            self.write_summary()
            return
        limit = min(budget, self.left())
        if limit <= 1:
            self.steps[name] = {"rc": None, "seconds": 0.0, "figures": {}, "skipped": "no time left"}
            self.log.write("skipped: the deadline leaves no time\n")
            self.write_summary()
            return
        t0 = time.monotonic()
        rc, text = 0, []
        self.current = (name, None)
        for argv in cmds:
            spent = time.monotonic() - t0
            if limit - spent <= 1:
                rc = rc or 124
                self.log.write(f"$ {' '.join(map(str, argv))}\nnot started: the step's {limit:.0f} s are spent\n")
                break
            c, out = self.run_one(argv, limit - spent)
            text.append(out)
            rc = rc or c
        self.current = None
        entry = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "limit_s": round(limit, 1), "figures": {}}
        if rc == 124:
            entry["error"] = f"overran its {limit:.0f} s"
        if figures is not None:
            try:
                entry["figures"] = figures("\n".join(text))
            except Exception as e:  # the figures of a failed step may be missing: say so
                entry["figures"] = {"figures_error": f"{type(e).__name__}: {e}"[:200]}
        if rc not in (0, None) and soft is not None and mode is None:
            why = soft("\n".join(text))
            if why:
                entry["unsupported"] = why
        if rc not in (0, None) and "error" not in entry:
            tail = [line for line in "".join(text).splitlines() if line.strip()][-3:]
            entry["error"] = " | ".join(tail)[-400:]
        self.steps[name] = entry
        self.log.write(f"----- {name}: rc {rc}, {entry['seconds']} s, figures {json.dumps(entry['figures'])}\n")
        self.write_summary()

    def failed(self) -> list:
        return [n for n, s in self.steps.items() if s["rc"] not in (0, None) and "unsupported" not in s]


def kill_group(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def injected(mode: str) -> list:
    """The rehearsal's stand-in for a step: fails at once, or hangs with a child of its own."""
    if mode == "fail":
        return [sys.executable, "-c", "import sys; print('rehearsal: this step fails'); sys.exit(7)"]
    if mode == "hang":
        code = ("import subprocess, sys, time; print('rehearsal: this step hangs', flush=True); "
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)']); time.sleep(3600)")
        return [sys.executable, "-c", code]
    raise SystemExit(f"--inject: {mode!r} is not fail or hang")


def gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cpu", action="store_true", help="dry run without a GPU (CI)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--deadline", type=float, default=440.0,
                   help="seconds for the whole run (default 440, inside the device tool's 480 s call)")
    p.add_argument("--inject", action="append", default=[], metavar="STEP=fail|hang",
                   help="the rehearsal: this step fails, or hangs (repeatable)")
    a = p.parse_args()
    names = [n for n, _, _ in STEPS]
    inject = {}
    for spec in a.inject:
        step, _, mode = spec.partition("=")
        if step not in names or mode not in ("fail", "hang"):
            p.error(f"--inject {spec}: want STEP=fail|hang with STEP one of {names}")
        inject[step] = mode
    return a, inject


def install_wheels(bundle: Path, py: str, r: Runner) -> Path:
    """The carried wheels (ramjet's, nvJPEG's) into a folder of their own, ahead on the path."""
    site = Path(tempfile.mkdtemp(prefix="ramjet-devcheck-site-"))
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if wheels:
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=False, stdout=r.log, stderr=r.log,
                       timeout=max(r.left(), 1))
        r.env["PYTHONPATH"] = os.pathsep.join([str(site), r.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return site


def main() -> int:
    a, inject = parse_args()
    bundle, out = a.bundle.resolve(), a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_present() and not a.cpu
    r = Runner(bundle, out, gpu, a.deadline, inject)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, r.on_signal)
    meta_file = bundle / "BUNDLE.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    smi = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    r.head = {
        "device": smi.split(",")[0].strip() if smi else "none (CPU dry run)",
        "driver": smi.split(",")[1].strip() if smi.count(",") >= 1 else None,
        "commit": meta.get("commit"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "gpu" if gpu else "cpu dry run",
        "deadline_s": a.deadline,
        "order": [n for n, _, _ in STEPS],
    }
    if inject:
        r.head["injected"] = inject
    r.write_summary()
    site = install_wheels(bundle, a.python, r)
    # The Rust tests find nvJPEG in the carried wheel, NVRTC in this Python's environment.
    libs = sorted(site.glob("nvidia/*/lib/libnvjpeg.so*")) + sorted(site.glob("nvidia/nvjpeg/lib/libnvjpeg.so*"))
    if libs and "RAMJET_NVJPEG" not in r.env:
        r.env["RAMJET_NVJPEG"] = str(libs[0].parent)
    r.env.setdefault("RAMJET_VENV", sh([a.python, "-c", "import sys; print(sys.prefix)"]) or sys.prefix)
    # pytest's per-test limit is a plugin in the bundle's scripts folder.
    r.env["RAMJET_TEST_TIMEOUT_S"] = str(TEST_TIMEOUT_S)
    r.env["PYTHONPATH"] = os.pathsep.join([str(bundle / "scripts"), r.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    plan = steps(bundle, out, gpu, a.python)
    for name, gpu_s, cpu_s in STEPS:
        kw = plan[name]
        r.step(name, budget=gpu_s if gpu else cpu_s, **kw)
    r.write_summary()
    failed = r.failed()
    print(json.dumps({"mode": r.head["mode"], "failed": failed, "elapsed_s": round(time.monotonic() - r.started, 1),
                      "steps": {n: (s["rc"], s["seconds"]) for n, s in r.steps.items()}}))
    return 1 if failed else 0


def steps(bundle: Path, out: Path, gpu: bool, py: str) -> dict:
    """Each step's commands and how its figures are read."""
    scripts = bundle / "scripts"
    env_probe = (
        "import json, ramjet, torch\n"
        "try:\n import torchvision; tv = torchvision.__version__\nexcept Exception as e: tv = str(e)\n"
        "info = ramjet.gpu_info()\n"
        "print(json.dumps({'torch': torch.__version__, 'torchvision': tv, 'cuda': torch.version.cuda,"
        " 'gpu_info': info}, default=str))\n"
    )

    def env_figures(text):
        doc = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
        return {"devices": doc["gpu_info"].get("devices", 0), "torch": doc["torch"], "cuda": doc["cuda"]}

    tests = sorted(p for p in (bundle / "tests").glob("*") if os.access(p, os.X_OK))
    args = ["--include-ignored", "--test-threads", "1"] if gpu else []
    # On a GPU the nvJPEG test runs in a step of its own (its figures); here it only lists.
    rust = [[t, *args] for t in tests if not (gpu and t.name == "nvjpeg_gpu")]
    sanitizer = [["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", t, "--include-ignored",
                  "--test-threads", "1", "gpu"] for t in tests if t.name.startswith("ramjet_cuda")]
    if not shutil.which("compute-sanitizer"):
        sanitizer = [[sys.executable, "-c", "print('compute-sanitizer: not installed here')"]]

    def rust_figures(text):
        return {"rust_tests_passed": sum(int(n) for n in re.findall(r"test result: \w+\. (\d+) passed", text))}

    def nvjpeg_figures(text):
        figs = {}
        for line in text.splitlines():
            if line.startswith("FIGURE "):
                _, name, value = line.split(" ", 2)
                try:
                    figs[name] = float(value) if "." in value or value.isdigit() else value
                except ValueError:
                    figs[name] = value
        return figs

    def py_figures(text):
        return {"py_tests_passed": len(re.findall(r" PASSED", text)),
                "py_tests_failed": len(re.findall(r" (?:FAILED|ERROR)", text))}

    kernel_json, feed_json, cpu_json = out / "kernel.json", out / "feed.json", out / "cpu_scale.json"

    def kernel_figures(_):
        doc = json.loads(kernel_json.read_text())
        med = doc["median"]
        f = {}
        for t in ("u8", "bf16"):
            f[f"kernel_rrc_{t}_img_s"] = round(med[f"ramjet_{t}_img_s"], 1)
            f[f"torchvision_rrc_{t}_img_s"] = round(med[f"torchvision_{t}_img_s"], 1)
            f[f"kernel_vs_torchvision_{t}_ratio"] = round(med[f"{t}_ratio"], 3)
        for k in ("u8_mean_abs_diff_vs_torchvision", "u8_interior_max_abs_diff_vs_torchvision"):
            f[k] = doc[k]
        return f

    kernel = [py, scripts / "kernel_bench.py", "--out", kernel_json]
    if not gpu:
        kernel += ["--cpu", "--images", "16", "--batch", "8", "--rounds", "1"]
    feed = [py, scripts / "gpu_feed.py", "--out", feed_json]
    feed += ["--device", "cuda", "--decode", "auto"] if gpu else ["--device", "cpu", "--quick"]

    def feed_figures(_):
        doc = json.loads(feed_json.read_text())
        med, f = doc["median"], {}
        names = {"ratio": "resnet50_fed_ratio" if gpu else "small_fed_ratio",
                 "feeding_cpu_s_per_1000": "feeding_cpu_s_per_1000_img", "fed_img_s": "fed_img_s",
                 "h2d_ratio": "h2d_ratio_vs_torch_pinned", "gpu_ratio": "resnet50_gpu_decode_fed_ratio",
                 "gpu_feeding_cpu_s_per_1000": "gpu_decode_feeding_cpu_s_per_1000_img",
                 "gpu_fed_img_s": "gpu_decode_fed_img_s"}
        for k, name in names.items():
            if k in med:
                f[name] = round(med[k], 4)
        f["rounds"] = len(doc["rounds"])
        for who, why in doc.get("errors", {}).items():
            f[f"{who}_error"] = why[:200]
        return f

    threads = "1,2,4,8,16" if gpu else "1,2"
    scale = [py, scripts / "cpu_scale.py", "--threads", threads, "--out", cpu_json] + ([] if gpu else ["--quick"])
    pytest = [py, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "per_test_timeout",
              str(scripts / "test_gpu.py")]
    return {
        "env": dict(cmds=[["nvidia-smi"] if shutil.which("nvidia-smi") else ["true"], [py, "-c", env_probe]],
                    figures=env_figures),
        "nvjpeg": dict(cmds=[[bundle / "tests" / "nvjpeg_gpu", "--include-ignored", "--nocapture", "--test-threads",
                              "1"]], needs_gpu=True, figures=nvjpeg_figures),
        "rust_gpu": dict(cmds=rust or [["false"]], figures=rust_figures),
        "py_gpu": dict(cmds=[pytest], figures=py_figures),
        "kernel": dict(cmds=[kernel], figures=kernel_figures),
        "feed": dict(cmds=[feed], figures=feed_figures),
        "cpu_scale": dict(cmds=[scale], figures=lambda _: json.loads(cpu_json.read_text())["figures"]),
        "sanitizer": dict(cmds=sanitizer, needs_gpu=True, figures=rust_figures,
                          soft=lambda t: (m.group(0) if (m := UNSUPPORTED.search(t)) else None)),
    }


if __name__ == "__main__":
    sys.exit(main())
