"""The suite's time limits work: a planted hang (a test that sleeps forever) is stopped at its
limit by pytest-timeout's watcher thread, which prints the stacks of every thread (the test's
own frame among them) and ends the run with a failure; the tests before it passed. (The
limits themselves: bindings/pyproject.toml. The watcher thread also stops a hang in native
code holding the GIL, which the signal method cannot reach.)"""

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
         "-o", "timeout_method=thread", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert out.startswith("."), f"test_before did not pass first:\n{out}"
    assert "Timeout" in out and "Stack of planted-sleeper" in out, out
    assert "in test_hangs_forever" in out, out
