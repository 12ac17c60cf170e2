"""benches/python/link_retrans.py's report: each first batch against the origin's retransmission
counter, over the batch's own window and the 2 s before it."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benches/python/link_retrans.py"


def test_report_counts_the_segments_inside_each_first_batch_and_before_it(tmp_path):
    samples = tmp_path / "retrans.txt"
    # The counter: 10 at t=100, 13 at t=101.9 (before the batch), 20 at 102.1 (inside it), 25 after.
    samples.write_text("100.000 10\n101.900 13\n102.100 20\n102.300 25\n")
    log = tmp_path / "probe.log"
    log.write_text(
        "102.000000000 ramjet-bench: ramjet P3 streaming\n"
        "102.200000000    0.2s DEBUG ramjet_engine::loader: loader: first batch handed out ms=150.0\n"
    )
    out = subprocess.run([sys.executable, str(SCRIPT), "report", str(samples), str(log)],
                         capture_output=True, text=True, check=True).stdout.split()
    # The batch ran from 102.05 to 102.2: 13 -> 20 inside it (from just before its start), 10 -> 13 before.
    assert out[2] == "150.0" and out[7] == "7" and out[-1] == "3", out
