"""Progress for long steps: tqdm's bar on a terminal, and in a log file (no terminal) a plain
line every few seconds instead of every redraw joined by carriage returns.

    with bar(total=n, desc="upload copies", unit="obj") as b:
        b.update(1)

``RAMJET_PROGRESS_S`` sets the seconds between lines (default 5).
"""
import os
import sys
import time


def _human(n: float, unit: str, scale: bool) -> str:
    if not scale:
        return f"{n:,.0f} {unit}"
    binary = unit == "B"
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or prefix == "T":
            return f"{n:.1f} {prefix}{'i' if binary else ''}{unit}" if prefix else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} {unit}"


class LineProgress:
    """tqdm's `update`/context manager, printing `desc: done/total unit (pct), rate, elapsed`
    every `every` seconds and once at the end."""

    def __init__(self, total=None, desc="", unit="it", unit_scale=False, file=None, every=None, **_ignored):
        self.total, self.desc, self.unit, self.scale = total, desc, unit, unit_scale
        self.file = file or sys.stderr
        self.every = float(every if every is not None else os.environ.get("RAMJET_PROGRESS_S", "5"))
        self.n = 0
        self.t0 = self.last = time.monotonic()

    def _line(self, now: float) -> str:
        el = max(now - self.t0, 1e-9)
        done = _human(self.n, self.unit, self.scale)
        of = f"/{_human(self.total, self.unit, self.scale)} ({100 * self.n / self.total:.0f}%)" if self.total else ""
        return f"{self.desc}: {done}{of}, {_human(self.n / el, self.unit, self.scale)}/s, {el:.0f} s"

    def update(self, n=1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            print(self._line(now), file=self.file, flush=True)

    def close(self) -> None:
        print(self._line(time.monotonic()) + " (done)", file=self.file, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def bar(total=None, desc="", unit="it", unit_scale=False, file=None, **kw):
    """tqdm on a terminal, :class:`LineProgress` otherwise."""
    out = file or sys.stderr
    if hasattr(out, "isatty") and out.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=out, **kw)
    return LineProgress(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=out, **kw)
