#!/usr/bin/env bash
# Runs every test of ramjet on a fresh machine: installs what is needed (tools/setup.sh),
# checks formatting and lints, starts the local S3 server, runs the Rust tests (unit,
# integration, property, fuzz-corpus replay, benchmarks once in test mode), builds the Python
# package into the venv and runs its pytest suite, then stops the server.
#
# Usage: tools/test.sh
set -euo pipefail

# A run owns its ports and its temporary root, so two runs on one machine (from two clones) do
# not meet. Its S3 port (and every port and namespace derived from it: the server's others, the
# private S3 of the Rust tests at +100, the Slurm test cluster's) is RAMJET_S3_PORT when given,
# else the first of 8333, 8533, ... that no other run holds; the hold is a lock on
# /tmp/ramjet-run-PORT.lock, kept until this run (and whatever it started) ends. Its temporary
# root is /tmp/rj-PORT (short: Unix socket paths under it stay within their 108 bytes), emptied
# at the start: the Rust tests' run folders, pytest's, the S3 start lock all live there.
hold_port() {
  exec 9>"/tmp/ramjet-run-$1.lock"
  flock -n 9 && return 0
  exec 9>&-
  return 1
}
if [ -n "${RAMJET_S3_PORT:-}" ]; then
  hold_port "$RAMJET_S3_PORT" || { echo "tools/test.sh: another run holds port $RAMJET_S3_PORT" >&2; exit 1; }
else
  for p in 8333 8533 8733 8933 9133; do
    if hold_port "$p"; then
      export RAMJET_S3_PORT=$p
      break
    fi
  done
  [ -n "${RAMJET_S3_PORT:-}" ] || { echo "tools/test.sh: five other runs hold every port it uses" >&2; exit 1; }
fi
export TMPDIR="/tmp/rj-$RAMJET_S3_PORT"
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
echo "test run: S3 port $RAMJET_S3_PORT, temporary root $TMPDIR"

source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$RAMJET_ROOT"


# A run of this script builds everything once, from clean on a CI machine: incremental
# artifacts (1.4 GB of target/debug) would never be reused, and CI machines can be short of
# disk (a run failed when the S3 server's volumes turned read-only at 1.6 GB free).
export CARGO_INCREMENTAL=0
df -h "$RAMJET_ROOT" | sed 's/^/disk: /'

# Step times, so that a slow step shows in the log.
t0=$SECONDS
# Each step's line says the disk's free space too: a CI machine short of disk fails where it
# runs out (the S3 server's volumes turn read-only under its floor), and this shows where.
free_disk() { df -h --output=avail "$RAMJET_ROOT" 2>/dev/null | tail -n 1 | tr -d ' '; }
step() { printf '\n== [%dm%02ds] %s (disk free %s)\n' $(((SECONDS - t0) / 60)) $(((SECONDS - t0) % 60)) "$*" "$(free_disk)"; }
# Every command of every step runs under a time limit: `limited SECONDS CMD...` runs CMD under
# timeout(1) (TERM at the limit, KILL 30 s later) and, past it, says which command it was, so
# a hang fails its step by name long before CI's own limit. The limits are several times each
# step's time on a 2-core CI machine (the log's step lines give those times).
limited() {
  local secs=$1 rc=0
  shift
  timeout --kill-after=30 "$secs" "$@" || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "tools/test.sh: ran past its limit of $secs s: $*" >&2
  fi
  return "$rc"
}

step "setup"
limited 2400 tools/setup.sh

# Every Rust test process runs under the watchdog (tools/test-watchdog.sh): a test that hangs
# fails alone past RAMJET_TEST_LIMIT_S, naming itself, with every thread's stack.
host="$(rustc -vV | sed -n 's/^host: //p')"
runner_var="CARGO_TARGET_$(printf '%s' "$host" | tr 'a-z-' 'A-Z_')_RUNNER"
export "$runner_var=$RAMJET_ROOT/tools/test-watchdog.sh"

step "cargo fmt --check"
limited 300 cargo fmt --all -- --check

# Every workspace-wide cargo call of this run builds the RDMA transport too (cargo feature
# `rdma`, off by default for users): one feature set for clippy, the build, the tests, the
# benchmarks and the device-check bundle, so the workspace compiles once and the RDMA code is
# linted and tested with everything else (a separate `cargo test -p ramjet-transport --features
# rdma` resolved other features and recompiled the engine below it: 4 minutes of CI).
export RAMJET_CARGO_FEATURES="ramjet-tools/rdma"
features=(--features "$RAMJET_CARGO_FEATURES")

step "cargo clippy -D warnings (the workspace, with the RDMA transport)"
limited 2400 cargo clippy --workspace --all-targets "${features[@]}" --locked -- -D warnings

step "cargo clippy -D warnings: the transport as users build it (no cargo feature rdma)"
# The code behind cfg(not(feature = "rdma")) (the "this build has no RDMA" refusal) is linted
# here; the RDMA code was linted above, and its tests (without RDMA hardware: the verbs calls are
# checked at build time, at run time the clear no-device errors and the fallback to TCP,
# docs/cluster.md) run with the Rust tests below.
limited 1800 cargo clippy -p ramjet-transport --all-targets --locked -- -D warnings

step "build (every target: the tests' build below then finds it all done)"
# --all-targets resolves features as the tests do (their dev-dependencies change tokio's, and
# with them everything above it): building only the binaries here compiled the workspace a
# second time for the tests.
limited 2400 cargo build --workspace --all-targets "${features[@]}" --locked

step "local S3 server"
limited 300 tools/s3-server.sh start
# On a failure, say what the machine and the S3 server saw: free disk and the server's last
# errors (a PUT's 500 names no cause; the server's log does).
on_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    printf '\n== failed (exit %s): disk and S3 server state\n' "$rc"
    df -h "$RAMJET_ROOT" "${TMPDIR:-/tmp}" 2>/dev/null || true
    du -sh "$RAMJET_ROOT/target" "$RAMJET_VENV" "$RAMJET_STATE"/* "${TMPDIR:-/tmp}"/pytest-of-* 2>/dev/null | sort -h | tail -n 8 || true
    grep -a -E '^[EF][0-9]{4}' "$RAMJET_STATE/s3-$RAMJET_S3_PORT/weed.log" 2>/dev/null | tail -n 15 || true
  fi
  tools/s3-server.sh stop >/dev/null
}
trap on_exit EXIT

# What a test falls back to per user is made this run's too, so two runs at once never meet
# there: the daemon's default socket (under XDG_RUNTIME_DIR when set, else the temporary root)
# and the learned manifests of foreign datasets (under XDG_CACHE_HOME), which are keyed by URL
# and two runs' S3 servers hold different objects under the same URLs.
unset XDG_RUNTIME_DIR
export XDG_CACHE_HOME="$TMPDIR/xdg-cache"

step "Rust tests (cargo-nextest: unit, integration, property, fuzz corpus; one process per test)"
# This machine has io_uring: its suites must run, and fail rather than skip if it is missing.
# The stable fuzzer (tests/tests/fuzz_stable.rs) mutates each target's corpus for 10 s.
RAMJET_FUZZ_SECONDS=10 RAMJET_EXPECT_IO_URING=1 limited 2400 cargo nextest run --workspace --lib --bins --tests --examples "${features[@]}" --locked
# Benchmarks once in test mode (their own harness, so cargo test runs them, still watched).
# --workspace: the same feature set as the build above, so nothing is compiled again (alone,
# the benches package resolved other features and recompiled four crates: 4 minutes).
limited 900 cargo test --workspace --benches "${features[@]}" --locked
rm -rf "${TMPDIR:-/tmp}"/ramjet-tests-*

step "the watchdog stops a planted hang alone, naming it, with stacks (tests/tests/watchdog.rs)"
if RAMJET_TEST_LIMIT_S=5 limited 600 cargo nextest run -p ramjet-tests --test watchdog --run-ignored only "${features[@]}" --locked \
  >"$RAMJET_STATE/planted-hang.log" 2>&1; then
  cat "$RAMJET_STATE/planted-hang.log"; echo "the planted hang passed: the watchdog did not stop it"; exit 1
fi
for want in "ran past its limit of 5 s" "watchdog::planted_hang_waits_forever" \
  "FAIL .*a_planted_hang_fails_alone_naming_itself" "2 tests run: 1 passed, 1 failed"; do
  grep -q -E "$want" "$RAMJET_STATE/planted-hang.log" || {
    cat "$RAMJET_STATE/planted-hang.log"; echo "the planted hang's output lacks: $want"; exit 1
  }
done
echo "planted hang: failed alone after 5 s with its stacks; the test beside it passed"

step "device-check bundle from CI's debug builds (its dry run is the last step), then the Rust test executables freed"
# The bundle takes the GPU test binaries it needs; the other test executables (1.6 GB) are not
# used again (pytest needs target/debug/ramjet and the rlibs maturin links), and a CI machine
# short of disk needs that room for the Python suite's datasets and the S3 server's volumes.
ci="$RAMJET_STATE/ci"
rm -rf "$ci" && mkdir -p "$ci"
limited 900 tools/device-check/build.sh --dev "$ci/devcheck"
find target/debug/deps -maxdepth 1 -type f -perm -u+x ! -name '*.so' ! -name '*.rlib' ! -name '*.rmeta' ! -name '*.d' -delete

step "python package (maturin develop, dev profile) and pytest"
# The dev profile (dependencies at opt-level 2, ours at 1) reuses what the Rust steps above
# built: 2 minutes here instead of 10 for a release build, which only the benchmarks need
# (their figures come from release builds: tools/ramjet-bench, docs/benchmarks.md).
VIRTUAL_ENV="$RAMJET_VENV" limited 1800 "$RAMJET_VENV/bin/maturin" develop --profile dev --quiet -m bindings/Cargo.toml
# The peers' venv (MosaicML Streaming, WebDataset): the foreign-format tests write their golden
# fixtures with the real writers there, never in the core venv.
RAMJET_BENCH_PYTHON="$(limited 1200 tools/bench-venv.sh)"
export RAMJET_BENCH_PYTHON
RAMJET_BIN="$RAMJET_ROOT/target/debug/ramjet" limited 2400 "$RAMJET_VENV/bin/python" -m pytest -q bindings/tests

step "examples: CNN training (device auto: a GPU when usable, else the CPU), 2-process torchrun (gloo), a small GPT on token windows"
py="$RAMJET_VENV/bin/python"
limited 300 target/debug/ramjet synth "$ci/synth" --samples 400 >/dev/null
url="s3://$RAMJET_S3_BUCKET/ci/synth-400-$(date +%s)"
limited 300 target/debug/ramjet pack "$ci/synth" "$url" >/dev/null
limited 900 "$py" examples/train_cnn.py --remote "$url" --steps 200
# The rendezvous port is the first of this run's band (tools/env.sh; the tests that claim from it
# have ended), not torchrun's fixed 29500, which two runs at once would both take.
limited 900 "$RAMJET_VENV/bin/torchrun" --nproc_per_node 2 --master_port "${RAMJET_TEST_PORTS%-*}" examples/ddp_train.py --remote "$url" --epochs 2 2>&1 | grep -v "^W.*torch/distributed"
limited 900 "$py" examples/train_lm.py --remote "s3://$RAMJET_S3_BUCKET/ci/lm" --steps 150 2>&1 | grep -v "^$"

step "examples: Ultralytics YOLO streamed from S3 (train + val, offline), and the YOLO P2/P3 bench in quick mode"
RAMJET_BIN=target/debug/ramjet limited 1200 "$py" examples/yolo_streaming.py --epochs 1 --imgsz 96 --workers 1
RAMJET_BIN=target/debug/ramjet limited 1200 "$py" benches/python/yolo_bench.py --quick --out "$ci/bench-yolo" | tail -12

step "loader benchmark (quick mode: checks it runs; figures come from the full run)"
mkdir -p "$ci/bench/a"
cp "$ci"/synth/images/*.jpg "$ci/bench/a/"
limited 300 target/debug/ramjet pack "$ci/bench" "$url-bench" >/dev/null
RAMJET_BIN=target/debug/ramjet limited 900 "$py" benches/python/bench_loader.py --images "$ci/bench" --remote "$url-bench" --n 400 --rounds 1 --rss-epochs 3 --large 16 \
  --local "$ci/bench-cache" | tail -4

step "two datasets alive in one process (quick mode: checks it runs; figures come from the full run)"
RAMJET_BIN=target/debug/ramjet limited 600 "$py" benches/python/two_datasets.py --quick --out "$ci/two_datasets.json" | tail -2

step "device check, CPU dry run and its rehearsal (tools/device-check: run.py --cpu on the bundle built above, then rehearse.py: each step failing or hanging in turn, a deadline, SIGTERM)"
# The GPU check is prepared here and run only where a GPU is lent (docs/gpu.md). Between those
# rare runs this keeps the bundle's build and every step of run.py alive: steps that need a GPU
# say "skipped: no GPU", the others run on the CPU, and summary.json keeps its one shape.
limited 900 "$py" tools/device-check/run.py --bundle "$ci/devcheck" --out "$ci/devcheck-out" --cpu --python "$py"
limited 120 "$py" - "$ci/devcheck-out/summary.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert {"device", "driver", "commit", "date", "steps"} <= set(doc), doc.keys()
want = {"env", "rust_gpu", "nvjpeg", "py_gpu", "feed", "cpu_scale", "kernel", "sanitizer"}
assert set(doc["steps"]) == want, doc["steps"].keys()
for name, s in doc["steps"].items():
    assert {"rc", "seconds", "figures"} <= set(s), (name, s)
    assert s["rc"] in (0, None), f"step {name} failed: {s}"
assert doc["steps"]["rust_gpu"]["figures"]["rust_tests_passed"] > 0
assert doc["steps"]["nvjpeg"].get("skipped") == "no GPU", doc["steps"]["nvjpeg"]
assert doc["steps"]["sanitizer"].get("skipped") == "no GPU", doc["steps"]["sanitizer"]
assert doc["elapsed_s"] < doc["deadline_s"], (doc["elapsed_s"], doc["deadline_s"])
assert doc["steps"]["cpu_scale"]["figures"]["ramjet_t2_img_s"] > 0
k = doc["steps"]["kernel"]["figures"]  # the kernel's CPU reference against torchvision
assert k["u8_interior_max_abs_diff_vs_torchvision"] <= 1 and k["kernel_rrc_u8_img_s"] > 0, k
print("device check dry run:", {n: s.get("skipped", s["rc"]) for n, s in doc["steps"].items()})
PY
limited 900 "$py" tools/device-check/rehearse.py --bundle "$ci/devcheck" --out "$ci/devcheck-rehearsal" --python "$py"

step "all tests passed"
