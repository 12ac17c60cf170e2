#!/usr/bin/env bash
# The Rust tests' watchdog: cargo-nextest runs every test process through this script (the
# target runner tools/test.sh sets), so that a test that hangs fails alone, naming itself, with
# every thread's stack, and the run goes on with the next test.
#
#   tools/test-watchdog.sh BINARY ARGS...
#
# The test runs in a process group of its own. Past RAMJET_TEST_LIMIT_S seconds (default 300)
# the script prints which test ran too long, every thread's stack (gdb; without gdb, each
# thread's name and kernel wait channel), kills the group and exits 124. A SIGTERM or SIGINT from
# nextest (its own slow-timeout backstop, or Ctrl-C) takes the whole group down too.
set -uo pipefail
limit="${RAMJET_TEST_LIMIT_S:-300}"

# Which test this process runs: nextest passes `--exact NAME`.
name="$(basename "$1")"
prev=""
for a in "$@"; do
  if [ "$prev" = "--exact" ]; then name="$name::$a"; fi
  prev="$a"
done

setsid -w "$@" &
child=$!

stop_group() { kill -KILL -- "-$child" 2>/dev/null; wait "$child" 2>/dev/null; }
trap 'stop_group; exit 143' TERM
trap 'stop_group; exit 130' INT

stacks() {
  local pid="$1"
  if command -v gdb >/dev/null 2>&1; then
    timeout 60 gdb -p "$pid" -batch -nx -ex "set pagination off" -ex "thread apply all bt" 2>&1 |
      grep -v -E '^\[New LWP|^warning: (Could not load|Unable to find)' || true
  else
    for t in /proc/"$pid"/task/*; do
      printf 'thread %s %s waiting in %s\n' "${t##*/}" "$(cat "$t/comm" 2>/dev/null)" "$(cat "$t/wchan" 2>/dev/null)"
    done
  fi
}

deadline=$((SECONDS + limit))
while kill -0 "$child" 2>/dev/null; do
  if [ "$SECONDS" -ge "$deadline" ]; then
    {
      printf '\nramjet test watchdog: %s ran past its limit of %s s (RAMJET_TEST_LIMIT_S); every thread of it:\n' "$name" "$limit"
      stacks "$child"
      for p in $(pgrep -g "$child" | grep -v -x "$child"); do
        printf '\n--- process %s of its group: %s\n' "$p" "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)"
      done
      printf '\nramjet test watchdog: %s killed after %s s\n' "$name" "$limit"
    } >&2
    stop_group
    exit 124
  fi
  sleep 0.1
done
wait "$child"
rc=$?
# Whatever the test started and left behind in its group goes with it.
kill -KILL -- "-$child" 2>/dev/null
exit "$rc"
