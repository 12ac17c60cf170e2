"""The tests' port band (ports.py): a port handed out is claimed for its process and never given
to another process of the run while that one lives, a bound port is passed over, and a claim
whose process has ended is taken over."""
import os
import socket
import subprocess
import sys

import ports


def test_a_claim_holds_while_its_process_lives_and_is_taken_over_after(tmp_path):
    assert ports.claim(tmp_path, 30500)
    assert not ports.claim(tmp_path, 30500), "a live claim was taken over"
    # A claim by a process that has ended: taken over, and then this process's.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "30501").write_text(dead)
    assert ports.claim(tmp_path, 30501)
    assert (tmp_path / "30501").read_text() == str(os.getpid())


def test_free_port_takes_the_bands_unclaimed_unbound_ports_in_turn(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    lo = 31990
    monkeypatch.setenv("RAMJET_TEST_PORTS", f"{lo}-{lo + 2}")
    with socket.socket() as held:
        held.bind(("127.0.0.1", lo + os.getpid() % 3))  # where this process starts: bound elsewhere
        held_port = held.getsockname()[1]
        got = {ports.free_port(), ports.free_port()}
        assert got == {lo, lo + 1, lo + 2} - {held_port}
        assert sorted(p.name for p in (tmp_path / "ramjet-ports").iterdir()) == sorted(str(p) for p in got)
        try:
            ports.free_port()
        except RuntimeError as e:
            assert f"{lo}-{lo + 2}" in str(e) and "RAMJET_TEST_PORTS" in str(e)
        else:
            raise AssertionError("a band with every port claimed or bound gave a port")
    # Released by its holder and never claimed: given out.
    assert ports.free_port() == held_port
