"""Measurement that survives a noisy machine, shared by every Python benchmark and ramjet-bench.

These VMs have 2 cores whose speed swings up to 5x from minute to minute (hypervisor steal).
So a benchmark here:

- interleaves its contenders round by round (`order` rotates who goes first);
- reports the median of its rounds and every round's ratio (`Rounds`);
- reports CPU seconds per 1,000 units beside the wall-clock rate, summed over every process of
  a contender, its workers included (`tree_cpu_s`, `Meter`, `run`);
- records the machine's steal share during each measurement, from /proc/stat, and the share of
  its CPUs that processes outside the measured tree used (`others`: a build running beside
  the benchmark), and flags the rounds above STEAL_FLAG or OTHERS_FLAG;
- ends a ramjet loader's window when its run-on into the next epoch has ended
  (`run_on_end`), and reads its CPU once it is idle (`wait_idle`), so that each window holds
  one epoch's work and none spills into the next contender's;
- prints a verdict only from at least VERDICT_ROUNDS rounds, none of them flagged
  (`Rounds.verdict`).

docs/benchmarks.md ("How we measure") says the same for readers of the figures.
"""

import json
import os
import resource
import statistics
import subprocess
import tempfile
import time

STEAL_FLAG = 0.10
OTHERS_FLAG = 0.10
VERDICT_ROUNDS = 3
_TICK = os.sysconf("SC_CLK_TCK")


def stream_json(text):
    """The metrics `ramjet stream --json` prints at its end (one indented JSON document, over
    several lines, after any other output)."""
    i = text.rfind("\n{")
    return json.loads(text[i + 1 if i >= 0 else text.index("{"):])


def proc_stat():
    """(steal, total, busy) jiffies of the whole machine, from /proc/stat's first line; busy is
    user + nice + system + irq + softirq."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already
    # counted in user and nice.
    return v[7] if len(v) > 7 else 0, sum(v[:8]), v[0] + v[1] + v[2] + v[5] + v[6]


def others_share(before, after, own_cpu_s, wall_s):
    """The share of the machine's CPUs used, between two proc_stat() readings, by processes
    other than the measured ones (which used own_cpu_s)."""
    busy_s = (after[2] - before[2]) / _TICK
    cap = wall_s * (os.cpu_count() or 1)
    return max(0.0, busy_s - own_cpu_s) / cap if cap > 0 else 0.0


def steal_share(before, after):
    d = after[1] - before[1]
    return (after[0] - before[0]) / d if d > 0 else 0.0


def _stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    f = s[s.rindex(")") + 2:].split()
    return int(f[1]), sum(int(x) for x in f[11:15])  # ppid; utime stime cutime cstime


def tree_cpu_s(pid):
    """CPU seconds of `pid` and every live descendant, each with its reaped children's time.

    A DataLoader's persistent workers are live descendants; workers that exited and were joined
    are in their parent's cutime and cstime. Nothing is counted twice: a process's children's
    times reach its own counters only once they are reaped, and a reaped process is no longer
    in /proc."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            s = _stat(int(d))
            if s:
                stats[int(d)] = s
    kids = {}
    for p, (pp, _) in stats.items():
        kids.setdefault(pp, []).append(p)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += stats[p][1]
        todo += kids.get(p, [])
    return total / _TICK


class Meter:
    """Wall seconds, CPU seconds of a process tree (default: this process and its children)
    and the machine's steal share and other processes' load, over a `with` block. `origin`:
    process ids whose trees serve the measured work (a local S3 server, a relay): their CPU
    is not counted as other load, nor in `cpu_s`."""

    def __init__(self, pid=None, origin=()):
        self.pid = os.getpid() if pid is None else pid
        self.origin = list(origin)

    def _origin_cpu(self):
        return sum(tree_cpu_s(p) for p in self.origin)

    def __enter__(self):
        self._s, self._o = proc_stat(), self._origin_cpu()
        self._c, self._t = tree_cpu_s(self.pid), time.perf_counter()
        self.end = None
        return self

    def __exit__(self, *exc):
        # `end` (a perf_counter time, set inside the block) ends the wall clock before the
        # block does: the block may wait past its work to see that the work has ended
        # (run_on_end). CPU, steal and other load are read at the exit, so nothing is missed.
        self.wall_s = (time.perf_counter() if self.end is None else self.end) - self._t
        self.cpu_s = tree_cpu_s(self.pid) - self._c
        origin_cpu = self._origin_cpu() - self._o
        after = proc_stat()
        self.steal = steal_share(self._s, after)
        self.others = others_share(self._s, after, self.cpu_s + origin_cpu, self.wall_s)
        return False


def run_on_end(ds, quiet_s=0.05, limit_s=10.0):
    """When a ramjet loader's epoch has really ended: the perf_counter time at which it last
    decoded an image, once it has decoded none for `quiet_s`.

    A ramjet loader runs on into the next epoch: once its last batch is handed out, its decode
    threads fill its prefetch queue (prefetch_batches + threads batches: 48 images at batch 8
    on 2 cores) with the next epoch's first batches, which are then handed out at once. A
    window that ends at the last batch leaves that work out of the epoch that paid for it and
    lays it on the next contender's window (as other load) instead, and the next epoch of this
    loader starts with it already done. Every window ending here holds one epoch's work: the
    run-on it inherits at its start is the one it leaves at its end. A DataLoader's workers
    start the next epoch only when it is asked for, so the peers need no such wait.

    ds: anything with ramjet's `metrics()` (a StreamingDataset, an SDK loader)."""
    def decoded():
        return ds.metrics().get("images_decoded", 0)

    start = last_t = time.perf_counter()
    last = decoded()
    while True:
        time.sleep(0.002)
        v, t = decoded(), time.perf_counter()
        if v != last:
            last, last_t = v, t
        elif t - last_t >= quiet_s or t - start >= limit_s:
            return last_t


def wait_idle(quiet_s=0.05, busy=0.1, limit_s=30.0):
    """Waits until this process has used less than `busy` of one core over `quiet_s`; returns
    the seconds waited.

    What a ramjet loader does after an epoch's last decode (its streams reading the next
    epoch's shards: after a cold epoch, up to its prefetch budget) is work the epoch caused.
    A Meter that exits after this counts its CPU in the epoch, and none of it lands on the
    next contender's window as other load. The wall clock is the caller's to end (Meter.end)."""
    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    start = time.perf_counter()
    t, c = start, cpu()
    while True:
        time.sleep(quiet_s)
        t2, c2 = time.perf_counter(), cpu()
        if c2 - c < busy * (t2 - t) or t2 - start >= limit_s:
            return t2 - start
        t, c = t2, c2


def run(cmd, **kw):
    """Runs a command to its end: (stdout text, wall s, CPU s of it and every child it reaped,
    steal share, peak RSS MiB). Raises on a non-zero exit, with the end of its stderr."""
    with tempfile.TemporaryFile("w+") as err:
        s, t = proc_stat(), time.perf_counter()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, **kw)
        out = p.stdout.read()
        p.stdout.close()
        # wait4, not wait: its rusage is this child's own (and its reaped children's).
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall, steal = time.perf_counter() - t, steal_share(s, proc_stat())
        if p.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed (exit {p.returncode}): {err.read().strip()[-2000:]}")
    return out, wall, ru.ru_utime + ru.ru_stime, steal, ru.ru_maxrss / 1024


def order(items, r):
    """Round r's order of the contenders: rotated by r, so none is always first."""
    items = list(items)
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def fmt_steal(s):
    return f"{100 * s:.0f}%" + ("!" if s > STEAL_FLAG else "")


def fmt_others(s):
    return f"{100 * s:.0f}%" + ("!" if s > OTHERS_FLAG else "")


def flagged_row(row):
    """A measurement taken under steal or another process's load above the flags."""
    return (row.get("steal") or 0) > STEAL_FLAG or (row.get("others") or 0) > OTHERS_FLAG


class Rounds:
    """Per-round measurements of contenders: medians, per-round ratios and verdicts.

    Each row: round, contender, wall_s, units (images, samples...), cpu_s, steal, plus extras."""

    def __init__(self, unit="images"):
        self.unit = unit
        self.rows = []

    def add(self, r, contender, *, wall_s, units, cpu_s, steal, others=0.0, **extra):
        row = dict(round=r, contender=contender, wall_s=wall_s, units=units, cpu_s=cpu_s, steal=steal,
                   others=others, **extra)
        row["rate"] = units / wall_s if wall_s > 0 else 0.0
        row["cpu_per_1000"] = cpu_s / units * 1000 if units else None
        self.rows.append(row)
        return row

    def add_meter(self, r, contender, meter, units, **extra):
        return self.add(r, contender, wall_s=meter.wall_s, units=units, cpu_s=meter.cpu_s, steal=meter.steal,
                        others=meter.others, **extra)

    def contenders(self):
        return list(dict.fromkeys(x["contender"] for x in self.rows))

    def of(self, contender):
        return [x for x in self.rows if x["contender"] == contender]

    def rounds(self, contender=None):
        """How many rounds `contender` (default: every contender) was measured in."""
        cs = [contender] if contender else self.contenders()
        return min((len({x["round"] for x in self.of(c)}) for c in cs), default=0)

    def median(self, contender, key="rate"):
        xs = [x[key] for x in self.of(contender) if x.get(key) is not None]
        return statistics.median(xs) if xs else None

    def ratios(self, a, b, key="rate"):
        """a / b per round, for the rounds where both were measured."""
        bs = {x["round"]: x[key] for x in self.of(b)}
        return [x[key] / bs[x["round"]] for x in self.of(a) if bs.get(x["round"])]

    def flagged(self):
        """Rounds in which any measurement saw steal or other processes' load above the flags."""
        return sorted({x["round"] for x in self.rows if flagged_row(x)})

    def verdict(self, met, rounds=None):
        """'met' or 'missed' from at least VERDICT_ROUNDS rounds, none flagged; None (no
        verdict) otherwise."""
        n = self.rounds() if rounds is None else rounds
        return None if n < VERDICT_ROUNDS or self.flagged() else ("met" if met else "missed")

    def summary(self, contender):
        rs = self.of(contender)
        return {
            "rounds": len(rs),
            f"median_{self.unit}_per_s": self.median(contender),
            "median_wall_s": self.median(contender, "wall_s"),
            f"median_cpu_s_per_1000_{self.unit}": self.median(contender, "cpu_per_1000"),
            "rates": [round(x["rate"], 1) for x in rs],
            "cpu_per_1000": [None if x["cpu_per_1000"] is None else round(x["cpu_per_1000"], 3) for x in rs],
            "steal": [round(x["steal"], 3) for x in rs],
            "others": [round(x["others"], 3) for x in rs],
        }

    def line(self, r):
        """One printable line for round r: each contender's rate, CPU per 1,000 and steal share."""
        xs = [x for x in self.rows if x["round"] == r]
        return f"round {r}: " + "; ".join(
            f"{x['contender']} {x['rate']:,.0f} {self.unit}/s, {x['cpu_per_1000'] or 0:.2f} CPU s/1000, "
            f"steal {fmt_steal(x['steal'])}, other load {fmt_others(x['others'])}" for x in xs)


def verdict_text(v, rounds, flagged=0):
    """How a check's verdict prints: met, missed, or why there is none."""
    if v is None and flagged:
        return (f"no verdict ({flagged} of {rounds} round{'s' if rounds != 1 else ''} under steal or another "
                f"process's load; {VERDICT_ROUNDS} clean rounds needed)")
    if v is None:
        return f"no verdict ({rounds} round{'s' if rounds != 1 else ''}; {VERDICT_ROUNDS} needed)"
    return v
