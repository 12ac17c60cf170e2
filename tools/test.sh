#!/usr/bin/env bash
# Runs every test of ramjet on a fresh machine: installs what is needed (tools/setup.sh),
# checks formatting and lints, starts the local S3 server, runs the Rust tests (unit,
# integration, property, fuzz-corpus replay, benchmarks once in test mode), builds the Python
# package into the venv and runs its pytest suite, then stops the server.
#
# Usage: tools/test.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$RAMJET_ROOT"

step() { printf '\n== %s\n' "$*"; }

step "setup"
tools/setup.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "build"
cargo build --workspace --bins --locked

step "local S3 server"
tools/s3-server.sh start
trap 'tools/s3-server.sh stop >/dev/null' EXIT

step "cargo test (unit, integration, property, fuzz corpus, benches in test mode)"
cargo test --workspace --all-targets --locked

step "python package (maturin develop) and pytest"
VIRTUAL_ENV="$RAMJET_VENV" "$RAMJET_VENV/bin/maturin" develop --quiet -m bindings/Cargo.toml
RAMJET_BIN="$RAMJET_ROOT/target/debug/ramjet" "$RAMJET_VENV/bin/python" -m pytest -q bindings/tests

step "all tests passed"
