#!/usr/bin/env python3
"""The device check: every GPU-side part of ramjet run in one prepared call (issue 40).

Runs THERE, on the GPU machine (no Rust, no network, no S3), from the bundle that
tools/device-check/build.sh made here:

  python3 BUNDLE/scripts/run.py --bundle BUNDLE --out $OUT

Each step is a process of its own with its own timeout; one failure never hides the next step.
Everything comes back in at most 5 files (the device tool returns at most 8): `summary.json`
(one shape for every run: device, driver, commit, date, and per step its rc, seconds and
figures), `log.txt` (every step's output, in order, under a header line), and the benchmarks'
`kernel.json`, `feed.json` and `cpu_scale.json`.

Without a GPU (CI's dry run, `--cpu`), steps that need one report "skipped: no GPU" and the rest
run on the CPU over the same bundle layout, so the script and the bundle stay alive between the
rare GPU sessions.

Steps:
  env        nvidia-smi, driver, torch, torchvision, NVRTC, nvJPEG and cuFile as ramjet finds them
  rust_gpu   the Rust GPU tests (--include-ignored, RAMJET_GPU_TESTS=1), then the kernel test
             again under compute-sanitizer --tool memcheck
  nvjpeg     tests/nvjpeg_gpu: nvJPEG's hardware engine and hybrid decoder over the ImageNet-like
             synthetic profile against libjpeg-turbo, the fused kernel over their output against
             the CPU path, the scratch bound, flat device memory, and decode + RandomResizedCrop
             + normalise to bf16 in images/s (`nvjpeg_rrc_img_s`)
  py_gpu     the Python GPU tests (RAMJET_GPU_TESTS=1 pytest test_gpu.py)
  feed       benches/python/gpu_feed.py: H2D from ramjet's pool against torch's pinned copy, and
             ResNet-50 (AMP bf16, channels_last) fed by ramjet (CPU decode, and GPU decode with
             decode="auto") against resident batches, rounds interleaved
  cpu_scale  the CPU path at 1, 2, 4, 8 and 16 decode threads: img/s and CPU s per 1,000 images
  kernel     benches/python/kernel_bench.py: the fused kernel against torchvision v2
             RandomResizedCrop + normalise on the GPU over the same decoded images, uint8 and
             bf16 (run after py_gpu, before feed: the steps run in the order py_gpu, kernel,
             feed, cpu_scale)
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def sh(cmd, **kw) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


class Runner:
    def __init__(self, bundle: Path, out: Path, gpu: bool):
        self.bundle, self.out, self.gpu = bundle, out, gpu
        self.log = open(out / "log.txt", "a", buffering=1)
        self.steps = {}
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["RAMJET_BIN"] = str(bundle / "bin/ramjet")
        if gpu:
            self.env["RAMJET_GPU_TESTS"] = "1"

    def write_summary(self, head: dict) -> None:
        doc = dict(head, steps=self.steps)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        tmp.replace(self.out / "summary.json")

    def step(self, name: str, cmds, timeout: float, needs_gpu: bool = False, figures=None, head=None) -> None:
        """Runs `cmds` (a list of argv lists) one after another under one time limit; the step's
        rc is the first non-zero rc. `figures(stdout_text) -> dict` reads its figures."""
        self.log.write(f"\n===== {name} ({datetime.datetime.now().isoformat(timespec='seconds')})\n")
        if needs_gpu and not self.gpu:
            self.steps[name] = {"rc": None, "seconds": 0.0, "figures": {}, "skipped": "no GPU"}
            self.log.write("skipped: no GPU\n")
            self.write_summary(head)
            return
        t0 = time.monotonic()
        rc, text = 0, []
        for argv in cmds:
            left = timeout - (time.monotonic() - t0)
            if left <= 1:
                rc = rc or 124
                self.log.write(f"$ {' '.join(map(str, argv))}\nnot started: the step's {timeout:.0f} s are spent\n")
                break
            self.log.write(f"$ {' '.join(map(str, argv))}\n")
            try:
                p = subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=self.env, start_new_session=True)
            except OSError as e:
                self.log.write(f"could not start: {e}\n")
                rc = rc or 127
                continue
            try:
                out, _ = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                out, _ = p.communicate()
                out += f"\n[killed after {left:.0f} s: the step's limit is {timeout:.0f} s]\n"
                p.returncode = 124
            self.log.write(out)
            text.append(out)
            rc = rc or p.returncode
        seconds = round(time.monotonic() - t0, 1)
        figs = {}
        if figures is not None:
            try:
                figs = figures("\n".join(text))
            except Exception as e:  # the figures of a failed step may be missing: say so
                figs = {"figures_error": str(e)[:200]}
        self.steps[name] = {"rc": rc, "seconds": seconds, "figures": figs}
        self.log.write(f"----- {name}: rc {rc}, {seconds} s, figures {json.dumps(figs)}\n")
        self.write_summary(head)


def gpu_present() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--cpu", action="store_true", help="dry run without a GPU (CI)")
    p.add_argument("--python", default=sys.executable)
    a = p.parse_args()
    bundle, out = a.bundle.resolve(), a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpu = gpu_present() and not a.cpu
    py = a.python
    scripts = bundle / "scripts"
    # The carried wheels (ramjet's, nvJPEG's) into a folder of their own, ahead on the path.
    site = Path(tempfile.mkdtemp(prefix="ramjet-devcheck-site-"))
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    r = Runner(bundle, out, gpu)
    if wheels:
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=False, stdout=r.log, stderr=r.log)
        r.env["PYTHONPATH"] = os.pathsep.join([str(site), r.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    meta = {}
    meta_file = bundle / "BUNDLE.json"
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
    smi = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    head = {
        "device": smi.split(",")[0].strip() if smi else "none (CPU dry run)",
        "driver": smi.split(",")[1].strip() if smi.count(",") >= 1 else None,
        "commit": meta.get("commit"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "gpu" if gpu else "cpu dry run",
    }
    r.write_summary(head)

    # 1. environment
    env_probe = (
        "import json, ramjet, torch\n"
        "try:\n import torchvision; tv = torchvision.__version__\nexcept Exception as e: tv = str(e)\n"
        "info = ramjet.gpu_info()\n"
        "print(json.dumps({'torch': torch.__version__, 'torchvision': tv, 'cuda': torch.version.cuda,"
        " 'gpu_info': info}, default=str))\n"
    )

    def env_figures(text):
        doc = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
        return {"devices": doc["gpu_info"].get("devices", 0)}

    r.step("env", [["nvidia-smi"] if shutil.which("nvidia-smi") else ["true"], [py, "-c", env_probe]], 60,
           figures=env_figures, head=head)

    # The Rust tests find nvJPEG in the carried wheel, NVRTC in this Python's environment.
    libs = sorted(site.glob("nvidia/*/lib/libnvjpeg.so*")) + sorted(site.glob("nvidia/nvjpeg/lib/libnvjpeg.so*"))
    if libs and "RAMJET_NVJPEG" not in r.env:
        r.env["RAMJET_NVJPEG"] = str(libs[0].parent)
    r.env.setdefault("RAMJET_VENV", sh([py, "-c", "import sys; print(sys.prefix)"]) or sys.prefix)

    # 2. the Rust GPU tests, then the kernel test under compute-sanitizer
    tests = sorted(p for p in (bundle / "tests").glob("*") if os.access(p, os.X_OK))
    args = ["--include-ignored", "--test-threads", "1"] if gpu else []
    # On a GPU the nvJPEG test runs in a step of its own (its figures); here it only lists.
    cmds = [[t, *args] for t in tests if not (gpu and t.name == "nvjpeg_gpu")]
    if gpu and shutil.which("compute-sanitizer"):
        cuda = [t for t in tests if t.name.startswith("ramjet_cuda")]
        cmds += [["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", t, "--include-ignored",
                  "--test-threads", "1", "gpu"] for t in cuda]

    def rust_figures(text):
        import re

        return {"rust_tests_passed": sum(int(n) for n in re.findall(r"test result: \w+\. (\d+) passed", text))}

    r.step("rust_gpu", cmds or [["false"]], 180, figures=rust_figures, head=head)

    # 3. nvJPEG: every decode path against the CPU's, the scratch bound, flat memory, and
    # decode + RandomResizedCrop(224) + normalise to bf16 on the hardware engine
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

    nvjpeg_test = bundle / "tests" / "nvjpeg_gpu"
    r.step("nvjpeg", [[nvjpeg_test, "--include-ignored", "--nocapture", "--test-threads", "1"]], 150,
           needs_gpu=True, figures=nvjpeg_figures, head=head)

    # 4. the Python GPU tests
    r.step("py_gpu", [[py, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(scripts / "test_gpu.py")]], 180,
           figures=lambda t: {"py_tests_passed": int(t.rsplit(" passed", 1)[0].split()[-1]) if " passed" in t else 0},
           head=head)

    # 5. the fused kernel against torchvision v2 on the GPU, over the same decoded images
    kernel_json = out / "kernel.json"

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
    r.step("kernel", [kernel], 150, figures=kernel_figures, head=head)

    # 4 and 6. H2D against torch's pinned copy; ResNet-50 fed by ramjet against resident batches
    feed_json = out / "feed.json"
    feed = [py, scripts / "gpu_feed.py", "--out", feed_json]
    feed += ["--device", "cuda", "--decode", "auto"] if gpu else ["--device", "cpu", "--quick"]

    def feed_figures(_):
        med = json.loads(feed_json.read_text())["median"]
        f = {"resnet50_fed_ratio" if gpu else "small_fed_ratio": round(med["ratio"], 4),
             "feeding_cpu_s_per_1000_img": round(med["feeding_cpu_s_per_1000"], 3),
             "fed_img_s": round(med["fed_img_s"], 1)}
        if "h2d_ratio" in med:
            f["h2d_ratio_vs_torch_pinned"] = round(med["h2d_ratio"], 3)
        if "gpu_ratio" in med:
            f["resnet50_gpu_decode_fed_ratio"] = round(med["gpu_ratio"], 4)
            f["gpu_decode_feeding_cpu_s_per_1000_img"] = round(med["gpu_feeding_cpu_s_per_1000"], 3)
            f["gpu_decode_fed_img_s"] = round(med["gpu_fed_img_s"], 1)
        return f

    r.step("feed", [feed], 300 if gpu else 180, figures=feed_figures, head=head)

    # 7. the CPU path's scaling with decode threads
    cpu_json = out / "cpu_scale.json"
    threads = "1,2,4,8,16" if gpu else "1,2"
    scale = [py, scripts / "cpu_scale.py", "--threads", threads, "--out", cpu_json]
    if not gpu:
        scale += ["--quick"]
    r.step("cpu_scale", [scale], 150,
           figures=lambda _: json.loads(cpu_json.read_text())["figures"], head=head)

    r.write_summary(head)
    failed = [n for n, s in r.steps.items() if s["rc"] not in (0, None)]
    print(json.dumps({"mode": head["mode"], "failed": failed,
                      "steps": {n: (s["rc"], s["seconds"]) for n, s in r.steps.items()}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
