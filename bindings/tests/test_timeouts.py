"""The suite's time limits work: a planted hang (a test that sleeps forever) fails alone,
naming itself, with the stacks of its threads, and the tests around it still run and pass.
(The limits themselves: bindings/pyproject.toml.)"""

import subprocess
import sys
import textwrap


def test_a_planted_hang_fails_alone_naming_itself_with_stacks(tmp_path):
    (tmp_path / "test_planted.py").write_text(
        textwrap.dedent(
            """
            import threading, time

            def test_before():
                pass

            def test_hangs_forever():
                threading.Thread(target=time.sleep, args=(3600,), name="planted-sleeper", daemon=True).start()
                threading.Event().wait()

            def test_after():
                pass
            """
        )
    )
    # pytest-timeout as the suite uses it (bindings/pyproject.toml), with a 3 s limit.
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=3",
         "-o", "timeout_method=signal", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "FAILED test_planted.py::test_hangs_forever" in out, out
    assert "Timeout" in out and "planted-sleeper" in out, out
