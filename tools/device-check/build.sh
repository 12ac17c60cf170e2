#!/usr/bin/env bash
# Builds the device-check bundle HERE (no GPU needed): a self-contained folder that the GPU
# machine (no Rust toolchain, no network, no S3 server) runs with nothing else (issue 40).
#
#   tools/device-check/build.sh [--dev] [OUT]      OUT defaults to .devcheck (git-ignored)
#
# What it packs:
#   bin/ramjet            the CLI, stripped (makes the checks' datasets: synth + pack)
#   tests/*               the GPU test binaries (ramjet-cuda's unit tests, the fused-kernel
#                         test), built with --no-run, stripped
#   wheels/ramjet-*.whl   the abi3 wheel (maturin build --release --strip)
#   wheels/nvidia_nvjpeg-13.0.*.whl   nvJPEG for CUDA 13.0 (the lent machines' driver 580)
#   scripts/              run.py (the check), per_test_timeout.py (its pytest plugin),
#                         test_gpu.py, gpu_feed.py, cpu_scale.py, kernel_bench.py
#   BUNDLE.json           commit, date, profile and every file with its size and sha256
#
# --dev packs CI's debug builds instead (no release build, no wheels: the Python package is the
# one installed in the venv): the CPU dry run that keeps the check alive between GPU sessions.
# It ends by checking what it packed (every file present, the wheel's abi3 tag, the total
# under 50 MiB) and prints the command to run on the GPU machine, and how long it took.
#
# Every cargo call uses the release profile as Cargo.toml sets it (no profile variables), so
# the CLI, the test binaries and the wheel share one build of the dependencies, and a tree
# already built with `cargo build --release` is reused: only the test harnesses and the
# crates that depend on pyo3 (built by maturin with `extension-module`) compile again.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../env.sh"
cd "$RAMJET_ROOT"

dev=0
if [ "${1:-}" = "--dev" ]; then dev=1; shift; fi
out="${1:-$RAMJET_ROOT/.devcheck}"
rm -rf "$out"
mkdir -p "$out"/{bin,tests,wheels,scripts}
if [ "$dev" = 1 ]; then profile=() dir=debug; else profile=(--release) dir=release; fi
say() { printf 'device-check build: %s\n' "$*"; }

# The whole workspace is selected in every cargo call, with RAMJET_CARGO_FEATURES when set (CI's
# tools/test.sh sets it): features resolve as in CI's own build, so --dev compiles nothing new.
features=()
if [ -n "${RAMJET_CARGO_FEATURES:-}" ]; then features=(--features "$RAMJET_CARGO_FEATURES"); fi
say "the CLI ($dir)"
if [ "$dev" = 0 ]; then
  cargo build --locked --release "${features[@]}" --workspace --bins -q
fi
[ -x "target/$dir/ramjet" ] || { say "target/$dir/ramjet is missing: build the workspace first"; exit 1; }
cp "target/$dir/ramjet" "$out/bin/"

say "the GPU test binaries ($dir, --no-run)"
cargo test --locked "${profile[@]}" "${features[@]}" --workspace --lib --tests --no-run --message-format=json -q 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and m["target"]["name"] in ("ramjet_cuda", "fused_kernel", "nvjpeg_gpu"):
        print(m["executable"])' >"$out/tests.txt"
while read -r exe; do
  cp "$exe" "$out/tests/$(basename "$exe" | sed 's/-[0-9a-f]*$//')"
done <"$out/tests.txt"
rm "$out/tests.txt"

if [ "$dev" = 0 ]; then
  strip "$out"/bin/* "$out"/tests/*
  say "the wheel (maturin build --release --strip)"
  "$RAMJET_VENV/bin/maturin" build --release --strip --quiet -m bindings/Cargo.toml \
    -o "$out/wheels"
  say "nvJPEG for CUDA 13.0 (PyPI nvidia-nvjpeg 13.0.x)"
  "$RAMJET_VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/wheels" "nvidia-nvjpeg>=13.0,<13.1"
fi

cp tools/device-check/run.py tools/device-check/run.sh tools/device-check/per_test_timeout.py bindings/tests/test_gpu.py benches/python/gpu_feed.py benches/python/cpu_scale.py \
  benches/python/kernel_bench.py \
  "$out/scripts/"

# What was packed, and the checks of it.
"$RAMJET_VENV/bin/python" - "$out" "$dev" "$(git rev-parse HEAD)" "$(git status --porcelain | wc -l)" <<'PY'
import datetime, hashlib, json, sys, zipfile
from pathlib import Path
out, dev, commit, dirty = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], int(sys.argv[4])
files = {}
for p in sorted(out.rglob("*")):
    if p.is_file():
        files[str(p.relative_to(out))] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
problems = []
need = ["bin/ramjet", "tests/ramjet_cuda", "tests/fused_kernel", "tests/nvjpeg_gpu", "scripts/run.py", "scripts/run.sh", "scripts/per_test_timeout.py", "scripts/test_gpu.py",
        "scripts/gpu_feed.py", "scripts/cpu_scale.py", "scripts/kernel_bench.py"]
problems += [f"missing {n}" for n in need if n not in files]
if not dev:
    wheels = [n for n in files if n.startswith("wheels/ramjet-")]
    if len(wheels) != 1:
        problems.append(f"expected one ramjet wheel, found {wheels}")
    for w in wheels:
        tags = [l for l in zipfile.ZipFile(out / w).read(next(n for n in zipfile.ZipFile(out / w).namelist()
                if n.endswith(".dist-info/WHEEL"))).decode().splitlines() if l.startswith("Tag:")]
        if not any("abi3" in t for t in tags):
            problems.append(f"{w} is not an abi3 wheel: {tags}")
    if not any(n.startswith("wheels/nvidia_nvjpeg-13.0") for n in files):
        problems.append("missing the nvidia-nvjpeg 13.0 wheel")
    total = sum(f["bytes"] for f in files.values())
    if total > 50 << 20:
        problems.append(f"the bundle is {total / 2**20:.1f} MiB, over 50 MiB")
doc = {"commit": commit + ("+dirty" if dirty else ""), "date": datetime.datetime.now(datetime.timezone.utc)
       .isoformat(timespec="seconds"), "profile": "dev" if dev else "release", "files": files}
(out / "BUNDLE.json").write_text(json.dumps(doc, indent=1))
total = sum(f["bytes"] for f in files.values())
print(f"device-check build: {len(files)} files, {total / 2**20:.1f} MiB, commit {doc['commit']}")
for p in problems:
    print(f"device-check build: PROBLEM: {p}")
sys.exit(1 if problems else 0)
PY

rel="${out#"$RAMJET_ROOT"/}"
say "built in $((SECONDS / 60)) min $((SECONDS % 60)) s"
say "done. On the GPU machine (the device tool's run, carry [\"$rel\"]):"
echo "  python3 $rel/scripts/run.py --bundle $rel --out \$OUT"
