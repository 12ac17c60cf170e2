"""Ports for the daemons a test starts, free of the bind-then-release race.

A port found by binding port 0 and closing the socket can be taken before the daemon binds it:
by another test's daemon, or by any outgoing connection, which the kernel gives a local port from
the same ephemeral range. Under tools/test.sh a run owns a band of ports below that range
(RAMJET_TEST_PORTS=LO-HI, set by tools/env.sh from the run's S3 port, so two runs on one machine
have disjoint bands), and each port handed out is claimed by a file in the run's temporary root
naming the claiming process: no other test process of the run is given it while that process
lives. The Rust tests (tests/src/ports.rs) claim from the same band the same way.
"""
import os
import socket
import tempfile
from pathlib import Path


def _band():
    """The run's band (lo, hi), inclusive, from RAMJET_TEST_PORTS, or None."""
    try:
        lo, hi = (int(x) for x in os.environ["RAMJET_TEST_PORTS"].split("-", 1))
    except (KeyError, ValueError):
        return None
    return (lo, hi) if 1024 < lo <= hi <= 65535 else None


def _alive(path: Path) -> bool:
    """Whether the process that wrote the claim at `path` still lives (unreadable: yes)."""
    try:
        return Path(f"/proc/{int(path.read_text().strip())}").exists()
    except (OSError, ValueError):
        return True


def claim(folder: Path, port: int) -> bool:
    """Claims `port` for this process: a new claim file, or one whose process has ended."""
    path, me = folder / str(port), str(os.getpid())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if _alive(path):
            return False
        mine = folder / f".{port}.{me}"
        mine.write_text(me)
        os.replace(mine, path)  # two reclaimers: the one whose file is there afterwards wins
        return path.read_text() == me
    with os.fdopen(fd, "w") as f:
        f.write(me)
    return True


def _bindable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port free on `ip` for a daemon to bind: from the run's band, claimed for this
    process; outside tools/test.sh (no band), one the kernel finds free now."""
    band = _band()
    if band is None:
        with socket.socket() as s:
            s.bind((ip, 0))
            return s.getsockname()[1]
    lo, hi = band
    folder = Path(tempfile.gettempdir()) / "ramjet-ports"
    folder.mkdir(parents=True, exist_ok=True)
    span = hi - lo + 1
    start = os.getpid() % span
    for i in range(span):
        port = lo + (start + i) % span
        if _bindable(ip, port) and claim(folder, port):
            return port
    raise RuntimeError(f"every port of the run's band {lo}-{hi} (RAMJET_TEST_PORTS) is claimed or bound on {ip}")
