#!/usr/bin/env bash
# Creates (or refreshes) the peers' venv at $RAMJET_STATE/bench-venv and prints its python.
# It holds MosaicML Streaming and WebDataset: ramjet-bench runs them beside ramjet, and the
# foreign-format tests write their golden fixtures with their real writers. It sees the core
# venv's packages (torch, torchvision, boto3, ramjet) through a .pth file, so neither torch is
# installed twice nor the core venv touched.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
bench_venv="$RAMJET_STATE/bench-venv"
req="$RAMJET_ROOT/benches/python/requirements-peers.txt"
if [ ! -x "$bench_venv/bin/python" ]; then
  echo "bench-venv: creating the peers' venv at $bench_venv" >&2
  python3 -m venv "$bench_venv"
fi
core_site="$("$RAMJET_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
bench_site="$("$bench_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$core_site')" > "$bench_site/_ramjet_core_venv.pth"
if ! cmp -s "$req" "$bench_venv/.ramjet-requirements" 2>/dev/null; then
  echo "bench-venv: installing the peers (benches/python/requirements-peers.txt)" >&2
  "$bench_venv/bin/python" -m pip install -q --no-cache-dir -r "$req" >&2
  cp "$req" "$bench_venv/.ramjet-requirements"
fi
echo "$bench_venv/bin/python"
