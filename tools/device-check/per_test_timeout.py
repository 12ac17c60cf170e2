"""A pytest plugin of the device check (`-p per_test_timeout`): each test may take at most
RAMJET_TEST_TIMEOUT_S seconds (default 90), so one hung GPU test fails alone and the others
still run. The GPU machine's Python may lack pytest-timeout, and nothing can be installed
there.

At the limit SIGALRM raises in the test (a hang in Python code, or in a C call that returns to
Python); 30 s later, if the test is still stuck in C, faulthandler prints every thread's stack
and ends the process, so the step ends well before its own limit with the stacks in the log.
"""
import faulthandler
import os
import signal
import sys

import pytest

LIMIT_S = float(os.environ.get("RAMJET_TEST_TIMEOUT_S", "90"))
#: Seconds after the limit at which a test stuck in C ends the process.
HARD_AFTER_S = 30


class TestTimeout(Exception):
    """A test ran past its limit."""


def _alarm(signum, frame):
    raise TestTimeout(f"the test ran past its {LIMIT_S:.0f} s (RAMJET_TEST_TIMEOUT_S)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    faulthandler.dump_traceback_later(LIMIT_S + HARD_AFTER_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, old)
