#!/usr/bin/env python3
"""TCP segments the WAN-like link's origin retransmits, against each loader's first batch.

`sample OUT` appends, every 10 ms, a wall-clock time and the `RetransSegs` counter of the
origin's network namespace (read from `/proc/<delay relay pid>/net/snmp`: no process spawned
per sample) until killed. `report OUT LOG` pairs it with a ramjet-bench log whose loaders ran
with `RAMJET_LOG=ramjet_engine=debug` and whose lines were stamped with `date +%s.%N`, and
prints each first batch with the segments retransmitted during it and in the 2 s before.

    benches/python/link_retrans.py sample /tmp/retrans.txt &
    RAMJET_LOG=ramjet_engine=debug tools/ramjet-bench --link wan --loaders ramjet,ramjet-plain,boto3 \\
        --cold-rounds 6 --rounds 1 --step-ms 0 --out target/bench/probe-retrans2 2>&1 \\
        | stdbuf -o0 tr '\\r' '\\n' | while IFS= read -r l; do echo "$(date +%s.%N) $l"; done > /tmp/probe.log
    kill %1; benches/python/link_retrans.py report /tmp/retrans.txt /tmp/probe.log
"""
import bisect
import re
import subprocess
import sys
import time


def sample(out_path):
    pid = None
    with open(out_path, "a", buffering=1) as out:
        while True:
            try:
                if pid is None:
                    found = subprocess.run(["pgrep", "-f", "delay_relay.py"], capture_output=True, text=True).stdout.split()
                    if not found:
                        time.sleep(0.5)
                        continue
                    pid = found[0]
                with open(f"/proc/{pid}/net/snmp") as f:
                    rows = [line.split() for line in f if line.startswith("Tcp:")]
                names, values = rows[0], rows[1]
                out.write(f"{time.time():.3f} {values[names.index('RetransSegs')]}\n")
            except (OSError, IndexError, ValueError):
                pid = None  # the relay went (a link torn down): find the next one
            time.sleep(0.01)


def report(samples_path, log_path):
    series = [(float(t), int(n)) for t, n in (line.split() for line in open(samples_path) if len(line.split()) == 2)]
    times = [t for t, _ in series]

    def at(t):
        return series[max(bisect.bisect_right(times, t) - 1, 0)][1]

    for line in open(log_path, errors="replace"):
        m = re.match(r"([0-9.]+) .*loader: first batch handed out ms=([0-9.]+)", line)
        if m:
            end, ms = float(m.group(1)), float(m.group(2))
            start = end - ms / 1000
            print(f"first batch {ms:7.1f} ms  retransmitted during it: {at(end) - at(start - 0.01):5d}  "
                  f"in the 2 s before: {at(start) - at(start - 2.0):5d}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "sample":
        sample(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
