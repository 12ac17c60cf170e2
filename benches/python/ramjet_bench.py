"""ramjet-bench: the published pre-export (P2) and streaming (P3) scenario, with ramjet and its
peers side by side on the same data, the same S3 server and the same output.

Run it through `tools/ramjet-bench` (it builds ramjet, makes the peers' venv and starts the
local S3 server); `tools/ramjet-bench --help` lists the options. docs/benchmarks.md gives the current
figure of each target, docs/benchmarks-history.md how each was measured.

Each loader runs in its own process (so no loader inherits another's warm state), a fresh one
for every cold round; the parent drives their cold, warm and step epochs in interleaved rounds
(benches/python/measure.py) and each answer is a row: scenario, time to first batch, epoch
wall time, samples/s, CPU seconds per 1,000 images, steal share, origin bytes, cache hit rate.
Every loader yields the same thing: batches of 8 uint8 images, 3x224x224, RandomResizedCrop
(scale 0.08-1, ratio 3/4-4/3) plus a random horizontal flip, from the same synthetic JPEGs.
"""

import argparse
import concurrent.futures as cf
import datetime
import gc
import io
import json
import multiprocessing as mp
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(os.environ.get("RAMJET_ROOT", Path(__file__).resolve().parents[2]))
STATE = Path(os.environ.get("RAMJET_STATE", ROOT / ".ramjet"))
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
RAMJET = Path(os.environ.get("RAMJET_BIN", ROOT / "target/release/ramjet"))
BATCH = 8
OUT = 224
MIB = 1 << 20

sys.path.insert(0, str(ROOT / "benches/python"))
import measure  # noqa: E402 - the shared measuring rules of every benchmark (benches/python/measure.py)

# The WAN-like origin: a second SeaweedFS inside this network namespace, reached over a veth
# pair whose namespace end is shaped (never the host's own interfaces).
NETNS = "rjbench"
VETH_HOST, VETH_NS = "rjb0", "rjb1"
IP_HOST, IP_NS = "10.77.0.1", "10.77.0.2"
WAN_INNER_PORT, WAN_PORT = 8433, 8333

LOADERS = ["ramjet", "ramjet-plain", "ramjet-mds", "ramjet-wds", "torch-files", "mosaicml", "webdataset", "boto3"]
# Shorter names for the charts' axes.
SHORT = {"ramjet-plain": "ramjet, JPEGs as given", "ramjet-mds": "ramjet on MDS", "ramjet-wds": "ramjet on tars", "torch-files": "torch, local files",
         "mosaicml": "MosaicML (MDS)", "webdataset": "WebDataset (tar)", "boto3": "boto3 GETs"}
# ramjet itself, and ramjet reading the peers' own copies in place (`ramjet index`).
RAMJETS = ["ramjet", "ramjet-plain", "ramjet-mds", "ramjet-wds"]
# `ramjet index --jpeg-restarts` for the in-place copies (off with --in-place-as-given): the
# caches then hold their JPEGs with restart markers, as ramjet's own copy holds them.
IN_PLACE_RESTARTS = True
TITLES = {
    "ramjet": "ramjet",
    "ramjet-plain": "ramjet, its shards holding the JPEGs as given",
    "ramjet-mds": "ramjet on the MDS copy (in place)",
    "ramjet-wds": "ramjet on the WebDataset tars (in place)",
    "torch-files": "torch DataLoader, local files",
    "mosaicml": "MosaicML Streaming (MDS)",
    "webdataset": "WebDataset (tar)",
    "boto3": "boto3 GET per object",
}


def log(msg):
    print(f"ramjet-bench: {msg}", file=sys.stderr, flush=True)


def now():
    return time.perf_counter()


def sh(*cmd, check=True, env=None):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def s3_client(endpoint, pool=32):
    import boto3
    import botocore.config

    cfg = botocore.config.Config(max_pool_connections=pool, retries={"max_attempts": 5, "mode": "standard"})
    return boto3.client("s3", endpoint_url=endpoint, config=cfg)


def split_url(url):
    assert url.startswith("s3://"), url
    bucket, _, key = url[5:].partition("/")
    return bucket, key


# ----- links ---------------------------------------------------------------------------------


class Link:
    """An S3 origin: the local server on loopback, or the WAN-like one in a namespace."""

    def __init__(self, name, endpoint, detail, port):
        self.name, self.endpoint, self.detail, self.port = name, endpoint, detail, port
        self.relay = None

    def origin_pids(self):
        """The S3 server's process (and the relay's): their CPU serves the measured work."""
        pids = []
        try:
            pids.append(int((STATE / f"s3-{self.port}" / "weed.pid").read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
        if self.relay is not None:
            pids.append(self.relay.pid)
        return pids

    def env(self):
        e = dict(os.environ)
        e["AWS_ENDPOINT_URL"] = self.endpoint
        e["RAMJET_BENCH_ORIGIN_PIDS"] = ",".join(str(p) for p in self.origin_pids())
        e["S3_ENDPOINT_URL"] = self.endpoint  # MosaicML Streaming's name for it
        return e


def loopback_link():
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    return Link("loopback", endpoint, f"SeaweedFS on {endpoint.split('//')[1]}, no shaping",
                os.environ.get("RAMJET_S3_PORT", "8333"))


def wan_env():
    e = dict(os.environ)
    e.update(RAMJET_S3_NETNS=NETNS, RAMJET_S3_HOST="127.0.0.1", RAMJET_S3_PORT=str(WAN_INNER_PORT))
    return e


def wan_down(link=None):
    if link is not None and link.relay is not None:
        link.relay.send_signal(signal.SIGKILL)
        link.relay.wait()
    if sh("ip", "netns", "pids", NETNS, check=False).returncode == 0:
        sh(str(ROOT / "tools/s3-server.sh"), "stop", env=wan_env(), check=False)
        for pid in sh("ip", "netns", "pids", NETNS, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        sh("ip", "netns", "del", NETNS, check=False)
    sh("ip", "link", "del", VETH_HOST, check=False)


def wan_up(rate, rtt_ms):
    """Namespace + veth; the namespace's egress (the origin's replies) shaped to `rate` with
    netem where the kernel has it, else tbf for the rate and a delay relay for the RTT."""
    if os.geteuid() != 0:
        raise SystemExit("ramjet-bench: the WAN-like link needs root (ip netns, tc)")
    wan_down()
    sh("ip", "netns", "add", NETNS)
    sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
    sh("ip", "link", "set", VETH_NS, "netns", NETNS)
    sh("ip", "addr", "add", f"{IP_HOST}/24", "dev", VETH_HOST)
    sh("ip", "link", "set", VETH_HOST, "up")
    ns = ("ip", "netns", "exec", NETNS)
    sh(*ns, "ip", "addr", "add", f"{IP_NS}/24", "dev", VETH_NS)
    sh(*ns, "ip", "link", "set", VETH_NS, "up")
    sh(*ns, "ip", "link", "set", "lo", "up")
    netem = sh(*ns, "tc", "qdisc", "add", "dev", VETH_NS, "root", "netem", "rate", rate, "delay", f"{rtt_ms}ms",
               "limit", "100000", check=False)
    if netem.returncode == 0:
        shaper, relay_rtt = f"tc netem rate {rate} delay {rtt_ms} ms", 0.0
    else:
        # This kernel lacks sch_netem (CONFIG_NET_SCH_NETEM unset): tbf shapes the rate, the
        # relay adds the round trip.
        sh(*ns, "tc", "qdisc", "add", "dev", VETH_NS, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "50ms")
        shaper, relay_rtt = f"tc tbf rate {rate} + delay relay RTT {rtt_ms} ms (no sch_netem in this kernel)", rtt_ms
    sh(str(ROOT / "tools/s3-server.sh"), "start", env=wan_env())
    link = Link("wan", f"http://{IP_NS}:{WAN_PORT}", f"SeaweedFS in netns {NETNS} over veth, {shaper}",
                WAN_INNER_PORT)
    link.relay = subprocess.Popen(
        [*ns, sys.executable, str(Path(__file__).with_name("delay_relay.py")), "--listen", f"{IP_NS}:{WAN_PORT}",
         "--to", f"127.0.0.1:{WAN_INNER_PORT}", "--rtt-ms", str(relay_rtt)],
        stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            s3_client(link.endpoint).head_bucket(Bucket=BUCKET)
            return link
        except Exception:  # noqa: BLE001 - the relay is still starting
            time.sleep(0.1)
    raise RuntimeError(f"WAN-like origin at {link.endpoint} does not answer")


# ----- the data, in every peer's format ----------------------------------------------------


class Data:
    """The synthetic set and its copies: ramjet shards, MDS, WebDataset tars, one object per image."""

    def __init__(self, samples, shard_mib, in_place_restarts=True):
        self.samples, self.shard_mib, self.in_place_restarts = samples, shard_mib, in_place_restarts
        self.dir = STATE / f"bench/data-{samples}-{shard_mib}m"
        self.synth = self.dir / "synth"
        self.prefix = f"bench/ramjet-bench/{samples}-{shard_mib}m"

    # ramjet's own copy is packed with `--jpeg-restarts` (the same pixels, JPEGs a crop can be
    # cut from), under a folder of its own so that a copy packed before is not taken for it.
    PATHS = {"ramjet": "ramjet-rst32", "ramjet-plain": "ramjet"}

    def url(self, fmt):
        return f"s3://{BUCKET}/{self.prefix}/{self.PATHS.get(fmt, fmt)}"

    def images(self):
        return sorted((self.synth / "images").glob("*.jpg"))

    def prepare_local(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.synth / ".complete").exists():
            shutil.rmtree(self.synth, ignore_errors=True)
            log(f"generating {self.samples} synthetic images")
            subprocess.run([str(RAMJET), "synth", str(self.synth), "--samples", str(self.samples)], check=True,
                           stdout=subprocess.DEVNULL)
            (self.synth / ".complete").touch()
        if not (self.dir / "mds/.complete").exists():
            self._write_mds()
        if not (self.dir / "wds/.complete").exists():
            self._write_wds()

    def _samples(self):
        for img in self.images():
            lbl = self.synth / "labels" / (img.stem + ".txt")
            yield img.stem, img.read_bytes(), lbl.read_text() if lbl.exists() else ""

    def _write_mds(self):
        from streaming import MDSWriter

        out = self.dir / "mds"
        shutil.rmtree(out, ignore_errors=True)
        log("writing the MDS copy (MosaicML Streaming)")
        with MDSWriter(out=str(out), columns={"image": "bytes", "label": "str"}, size_limit=self.shard_mib * MIB,
                       progress_bar=False) as w:
            for _, img, lbl in self._samples():
                w.write({"image": img, "label": lbl})
        (out / ".complete").touch()

    def _write_wds(self):
        import webdataset as wds

        out = self.dir / "wds"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        log("writing the WebDataset tar copy")
        with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=self.shard_mib * MIB, verbose=0) as w:
            for key, img, lbl in self._samples():
                w.write({"__key__": key, "jpg": img, "txt": lbl})
        (out / ".complete").touch()

    def wds_pattern(self):
        """The tars as a WebDataset brace pattern (what `ramjet index` is given)."""
        n = len(list((self.dir / "wds").glob("*.tar")))
        return f"shard-{{000000..{n - 1:06d}}}.tar"

    def upload(self, link):
        """Puts every copy on the link's server once (a `_complete` object marks each)."""
        c = s3_client(link.endpoint)
        env = link.env()

        def done(fmt):
            try:
                c.head_object(Bucket=BUCKET, Key=f"{self.prefix}/{self.PATHS.get(fmt, fmt)}/_complete")
                return True
            except Exception:  # noqa: BLE001 - absent
                return False

        def mark(fmt):
            c.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{self.PATHS.get(fmt, fmt)}/_complete", Body=b"")

        if not done("ramjet"):
            log(f"packing into {self.url('ramjet')} ({link.name})")
            subprocess.run([str(RAMJET), "pack", str(self.synth), self.url("ramjet"), "--shard-size",
                            f"{self.shard_mib}MiB", "--jpeg-restarts"], check=True, env=env, stdout=subprocess.DEVNULL)
            mark("ramjet")
        if not done("ramjet-plain"):
            log(f"packing into {self.url('ramjet-plain')} ({link.name}), the JPEGs as given")
            subprocess.run([str(RAMJET), "pack", str(self.synth), self.url("ramjet-plain"), "--shard-size",
                            f"{self.shard_mib}MiB"], check=True, env=env, stdout=subprocess.DEVNULL)
            mark("ramjet-plain")
        jobs = []
        for fmt, files, base in [
            # The MDS copy's own files: its index.json and shards (not a folder, nor a manifest
            # that a `ramjet index` of the local copy may have left beside them).
            ("mds", sorted(p for p in (self.dir / "mds").iterdir()
                           if p.is_file() and not p.name.startswith(".") and p.name != "manifest.json"), self.dir / "mds"),
            ("wds", sorted((self.dir / "wds").glob("*.tar")), self.dir / "wds"),
            ("objects", self.images(), self.synth / "images"),
        ]:
            if not done(fmt):
                jobs += [(fmt, f, f"{self.prefix}/{fmt}/{f.relative_to(base)}") for f in files]
        if jobs:
            from logbar import bar

            with cf.ThreadPoolExecutor(16) as ex, bar(total=len(jobs), desc=f"upload copies ({link.name})",
                                                       unit="obj", file=sys.stderr, leave=False) as progress:
                for _ in ex.map(lambda j: c.upload_file(str(j[1]), BUCKET, j[2]), jobs):
                    progress.update(1)
            for fmt in sorted({j[0] for j in jobs}):
                mark(fmt)
        # ramjet reads the MDS and WebDataset copies in place, through its index of them
        # (written each run, untimed: the same bytes for the same copy, in this build's form).
        # With --jpeg-restarts, the shards they transcode to (what the caches hold) store their
        # JPEGs with restart markers; the copies themselves are not changed.
        flags = ["--jpeg-restarts"] if self.in_place_restarts else []
        for fmt, src in (("mds", self.url("mds")), ("wds", f"{self.url('wds')}/{self.wds_pattern()}")):
            log(f"indexing the {fmt} copy in place ({link.name}){' with --jpeg-restarts' if flags else ''}")
            subprocess.run([str(RAMJET), "index", *flags, src], check=True, env=env, stdout=subprocess.DEVNULL)

    def warm_origin(self, link):
        """Reads the first byte of every object of every copy, untimed: a server just started
        (the WAN-like one starts with its link) answers its first requests for each object
        slowly, or not at all until it has registered their volumes, and whichever loader came
        first in cold round 1 paid for it (1.8 s instead of 0.13 s for ramjet's first sample).
        A real S3 endpoint is always warm."""
        from logbar import bar

        c = s3_client(link.endpoint)
        keys = []
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=self.prefix + "/"):
            keys += [o["Key"] for o in page.get("Contents", []) if o["Size"] > 0]
        def touch(k):
            # A server just started may not have registered every volume yet ("volume not
            # found"): retry for up to 30 s. Past that the failure is the origin's, and shows
            # again in the timed runs.
            deadline = time.monotonic() + 30
            while True:
                try:
                    c.get_object(Bucket=BUCKET, Key=k, Range="bytes=0-0")["Body"].read()
                    return None
                except Exception as e:  # noqa: BLE001
                    if time.monotonic() > deadline:
                        return f"{k}: {e}"
                    time.sleep(0.5)

        failed = []
        with cf.ThreadPoolExecutor(32) as ex, bar(total=len(keys), desc=f"warm the origin ({link.name})",
                                                   unit="obj", file=sys.stderr, leave=False) as progress:
            for err in ex.map(touch, keys):
                progress.update(1)
                if err:
                    failed.append(err)
        if failed:
            log(f"warming the origin: {len(failed)} of {len(keys)} reads failed, e.g. {failed[0]}")

    def bytes_of(self, fmt):
        if fmt in ("ramjet", "ramjet-plain"):
            return None  # read from the manifest by the child
        base = {"mds": self.dir / "mds", "wds": self.dir / "wds", "objects": self.synth / "images"}[fmt]
        return sum(p.stat().st_size for p in base.rglob("*") if p.is_file() and not p.name.startswith("."))


# ----- measuring (child processes) ---------------------------------------------------------


def decode(blob):
    """The peers' decode + augmentation: Pillow (libjpeg-turbo) and torchvision v2."""
    global _TF
    if _TF is None:
        from torchvision.transforms import v2

        _TF = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(OUT, antialias=True), v2.RandomHorizontalFlip()])
    from PIL import Image

    return _TF(Image.open(io.BytesIO(blob)).convert("RGB"))


_TF = None


def images_of(batch):
    if not isinstance(batch, dict):
        return batch
    # ramjet's batches: the image column is `image`, or `jpg` in a WebDataset read in place.
    return batch["image"] if "image" in batch else batch["jpg"]


def Meter():
    """A measure.Meter that does not count the origin's processes (the local S3 server, the
    WAN-like link's relay: RAMJET_BENCH_ORIGIN_PIDS) as other load: they serve the work."""
    pids = [int(p) for p in os.environ.get("RAMJET_BENCH_ORIGIN_PIDS", "").split(",") if p.strip().isdigit()]
    return measure.Meter(origin=pids)


def epoch(batches, *, desc, total, step_ms=0.0, t0=None, meter=None, run_on=None):
    """Consumes one epoch; returns time to first batch, wall time and samples, and the CPU
    seconds of this process and its workers with the machine's steal share over it.

    run_on: a ramjet loader. Its window ends when its run-on into the next epoch has
    (measure.run_on_end: the next epoch's first batches, decoded after this one's last), and
    its CPU is read once the process is idle (measure.wait_idle)."""
    from logbar import bar

    meter = meter or Meter().__enter__()
    t0 = now() if t0 is None else t0
    first, n = None, 0
    with bar(total=total, desc=desc, unit="img", file=sys.stderr, leave=False, mininterval=0.5) as progress:
        for b in batches:
            img = images_of(b)
            if first is None:
                first = now() - t0
                shape = tuple(img.shape[1:])
                if shape != (3, OUT, OUT) or str(img.dtype) != "torch.uint8":
                    raise RuntimeError(f"{desc}: batches are {img.dtype} {shape}, not uint8 (3, {OUT}, {OUT})")
            n += img.shape[0]
            progress.update(img.shape[0])
            if step_ms:
                time.sleep(step_ms / 1000)
    end = now()
    if run_on is not None:
        end = measure.run_on_end(run_on)
        measure.wait_idle()
    meter.__exit__(None, None, None)
    if n != total:
        raise RuntimeError(f"{desc}: {n} samples, expected {total}")
    return {"ttfb_s": first, "wall_s": end - t0, "samples": n, "cpu_s": meter.cpu_s, "steal": meter.steal,
            "others": meter.others}


def row(loader, scenario, r, *, origin, total_bytes, step_ms=0.0, **extra):
    out = {"loader": loader, "scenario": scenario, "step_ms": step_ms, "origin_bytes": origin, **r, **extra}
    out["samples_per_s"] = r["samples"] / r["wall_s"] if r.get("samples") else None
    out["cpu_per_1000"] = r["cpu_s"] / r["samples"] * 1000 if r.get("samples") and "cpu_s" in r else None
    out["hit_rate"] = None if total_bytes is None or not r.get("samples") else max(0.0, 1 - origin / total_bytes)
    return out


def export(url, dest, endpoint, desc):
    """P2's pre-export: every object under `url` to local disk, 16 GETs in flight."""
    from logbar import bar

    bucket, prefix = split_url(url)
    c = s3_client(endpoint)
    keys = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)

    def get(k):
        path = dest / k[0][len(prefix) + 1:]
        path.parent.mkdir(parents=True, exist_ok=True)
        c.download_file(bucket, k[0], str(path))
        return k[1]

    total = 0
    with cf.ThreadPoolExecutor(16) as ex, bar(total=sum(s for _, s in keys), desc=desc, unit="B", unit_scale=True,
                                               file=sys.stderr, leave=False) as progress:
        for n in ex.map(get, keys):
            total += n
            progress.update(n)
    return total


def timed_export(url, dest, endpoint, desc, loader, total_bytes, r):
    with Meter() as m:
        got = export(url, dest, endpoint, desc)
    res = {"ttfb_s": None, "wall_s": m.wall_s, "samples": 0, "cpu_s": m.cpu_s, "steal": m.steal, "others": m.others}
    return row(loader, "P2 export (S3 -> local disk)", res, origin=got, total_bytes=total_bytes, phase="export",
               round=r)


class Counter:
    """Bytes fetched from the origin, summed across DataLoader worker processes."""

    def __init__(self):
        self.v = mp.Value("Q", 0)

    def add(self, n):
        with self.v.get_lock():
            self.v.value += n

    @property
    def value(self):
        return self.v.value


class Contender:
    """One loader, alive in its own process for the whole run: the parent asks it for a cold
    epoch (every state rebuilt from empty), warm epochs and the epoch with a training step, in
    turns with the other loaders. Each answer is a list of rows."""

    def __init__(self, a, link_env):
        self.a, self.env, self.dl = a, link_env, None

    def close(self):
        self.dl = None
        gc.collect()
        return []


class Ramjet(Contender):
    """ramjet on its own shards: P3 streaming, and P2 (export, then epochs from local disk)."""

    loader, scenario, image_column, boxes_column, p2_too = "ramjet", "P3 streaming", "image", "boxes", True
    common = dict(batch_size=BATCH, shuffle=True, seed=0, image_size=OUT, augment="train")

    def __init__(self, a, link_env):
        super().__init__(a, link_env)
        self.p2 = None
        self.common = dict(Ramjet.common, image_column=self.image_column, boxes_column=self.boxes_column)
        self.total_bytes = a.ramjet_bytes if self.loader == "ramjet" else a.format_bytes

    def cold(self, r):
        import ramjet

        self.dl = None
        gc.collect()
        cache = Path(self.a.work) / "ramjet-cache"
        shutil.rmtree(cache, ignore_errors=True)
        m = Meter().__enter__()
        t0 = now()
        self.dl = ramjet.StreamingDataset(self.a.url, local=str(cache), cache_limit="64GiB", **self.common)
        res = epoch(self.dl, desc=f"{self.loader} cold {r + 1}", total=self.a.samples, t0=t0, meter=m, run_on=self.dl)
        out = [row(self.loader, f"{self.scenario}, cold", res, origin=self.dl.metrics()["origin_bytes"],
                   total_bytes=self.total_bytes, phase="cold", round=r)]
        if self.p2_too and self.p2 is None:
            # P2, once: export the shards to local disk, then a first epoch from there. Its
            # time to first step is the export's plus the first batch's.
            local = Path(self.a.work) / "ramjet-p2"
            exp = timed_export(self.a.url, local, self.env["AWS_ENDPOINT_URL"], "ramjet P2 export", "ramjet",
                               self.a.ramjet_bytes, r)
            m = Meter().__enter__()
            t0 = now()
            self.p2 = ramjet.StreamingDataset(str(local), local=None, **self.common)
            res = epoch(self.p2, desc="ramjet P2 first epoch", total=self.a.samples, t0=t0, meter=m, run_on=self.p2)
            res["ttfb_s"] += exp["wall_s"]
            out += [exp, row("ramjet", "P2 first epoch from local disk", res, origin=0,
                             total_bytes=self.a.ramjet_bytes, phase="p2-first", round=r)]
        return out

    def _streamed(self, ep, desc, scenario, phase, r, step_ms=0.0):
        """A warm streaming epoch, with its origin bytes."""
        before = self.dl.metrics()["origin_bytes"]
        self.dl.set_epoch(ep)
        res = epoch(self.dl, desc=desc, total=self.a.samples, step_ms=step_ms, run_on=self.dl)
        return [row(self.loader, scenario, res, origin=self.dl.metrics()["origin_bytes"] - before,
                    total_bytes=self.total_bytes, step_ms=step_ms, phase=phase, round=r)]

    def warm(self, r, phase, ep):
        if phase == "warm":
            return self._streamed(ep, f"{self.loader} warm {r + 1}", f"{self.scenario}, warm", "warm", r)
        # P2: epochs from the local copy, on the same epoch numbers (same order, same crops).
        self.p2.set_epoch(ep)
        res = epoch(self.p2, desc=f"ramjet P2 epoch {r + 1}", total=self.a.samples, run_on=self.p2)
        return [row("ramjet", "P2 epoch from local disk", res, origin=0, total_bytes=self.a.ramjet_bytes,
                    phase="p2", round=r)]

    def step(self, ep):
        ms = self.a.step_ms
        return self._streamed(ep, f"{self.loader} warm, step {ms:g} ms", f"{self.scenario}, warm, step {ms:g} ms",
                              "step", 0, step_ms=ms)

    def close(self):
        self.p2 = None
        return super().close()


class RamjetPlain(Ramjet):
    """ramjet on shards packed without `--jpeg-restarts`: the JPEGs as given, the bytes the
    peers read. The in-place readers (RamjetMds, RamjetWds) are held to its rate."""

    loader, scenario, p2_too = "ramjet-plain", "streaming, JPEGs as given", False


class RamjetMds(Ramjet):
    """ramjet on the MDS copy that MosaicML Streaming reads, in place, through the manifest
    `ramjet index` wrote beside it: the same loader, the same transform, no P2."""

    loader, scenario, boxes_column, p2_too = "ramjet-mds", "streaming", None, False


class RamjetWds(Ramjet):
    """ramjet on the tars that WebDataset reads, in place (as RamjetMds)."""

    loader, scenario, image_column, boxes_column, p2_too = "ramjet-wds", "streaming", "jpg", None, False


class Peer(Contender):
    """A peer: a torch DataLoader (2 workers, persistent) over its own dataset."""

    name, cold_scenario, warm_scenario = "", "streaming, cold", "streaming, warm"

    def make(self):
        raise NotImplementedError

    def origin(self):
        return 0

    def fresh(self, r):
        """Clears every state a cold epoch must not find (caches, exports); returns rows."""
        return []

    def cold(self, r):
        self.dl = None
        gc.collect()
        out = self.fresh(r)
        m = Meter().__enter__()
        t0 = now()
        before = self.origin()
        self.dl = self.make()
        res = epoch(self.dl, desc=f"{self.name} cold {r + 1}", total=self.a.samples, t0=t0, meter=m)
        if out:  # P2: the time to first step includes the export
            res["ttfb_s"] += out[0]["wall_s"]
        return [row(self.name, self.cold_scenario, res, origin=self.origin() - before,
                    total_bytes=self.a.format_bytes, phase="cold", round=r)] + out

    def warm(self, r, phase, ep):
        before = self.origin()
        res = epoch(self.dl, desc=f"{self.name} warm {r + 1}", total=self.a.samples)
        return [row(self.name, self.warm_scenario, res, origin=self.origin() - before,
                    total_bytes=self.a.format_bytes, phase="warm", round=r)]

    def step(self, ep):
        a = self.a
        before = self.origin()
        res = epoch(self.dl, desc=f"{self.name} warm, step {a.step_ms:g} ms", total=a.samples, step_ms=a.step_ms)
        return [row(self.name, f"{self.warm_scenario}, step {a.step_ms:g} ms", res, origin=self.origin() - before,
                    total_bytes=a.format_bytes, step_ms=a.step_ms, phase="step", round=0)]

    def loader(self, ds, shuffle):
        import torch

        return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=shuffle, num_workers=self.a.workers,
                                           persistent_workers=self.a.workers > 0)


class TorchFiles(Peer):
    name = "torch-files"
    cold_scenario, warm_scenario = "P2 epoch from local disk, cold", "P2 epoch from local disk, warm"

    def fresh(self, r):
        self.local = Path(self.a.work) / "files-p2"
        return [timed_export(self.a.url, self.local, self.env["AWS_ENDPOINT_URL"], "torch-files P2 export",
                             self.name, self.a.format_bytes, r)]

    def make(self):
        import torch

        class Files(torch.utils.data.Dataset):
            def __init__(self, paths):
                self.paths = paths

            def __len__(self):
                return len(self.paths)

            def __getitem__(self, i):
                return decode(self.paths[i].read_bytes())

        return self.loader(Files(sorted(self.local.rglob("*.jpg"))), True)


class MosaicML(Peer):
    name = "mosaicml"

    def fresh(self, r):
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        self.local = Path(self.a.work) / "mds-cache"
        shutil.rmtree(self.local, ignore_errors=True)
        return []

    def origin(self):
        return sum(p.stat().st_size for p in self.local.rglob("*") if p.is_file())

    def make(self):
        import torch  # noqa: F401 - before streaming, which imports it too
        from streaming import StreamingDataset

        class Mds(StreamingDataset):
            def __getitem__(self, i):
                return decode(super().__getitem__(i)["image"])

        ds = Mds(remote=self.a.url, local=str(self.local), shuffle=True, shuffle_seed=0, batch_size=BATCH)
        # The constructor fetched index.json with a boto3 client that the DataLoader's forked
        # workers would inherit and share: interleaved responses on one pooled connection
        # silently corrupted shards here (MDS carries no hashes by default). Each worker gets
        # its own client instead.
        for s in ds.streams:
            s._downloader.clean_up()
        return self.loader(ds, False)


class WebDataset(Peer):
    name = "webdataset"

    def __init__(self, a, link_env):
        super().__init__(a, link_env)
        import webdataset as wds

        counter = self.counter = Counter()
        clients = {}
        endpoint = link_env["AWS_ENDPOINT_URL"]

        class Body(io.RawIOBase):
            def __init__(self, body):
                self.body = body

            def readable(self):
                return True

            def readinto(self, b):
                data = self.body.read(len(b))
                counter.add(len(data))
                b[: len(data)] = data
                return len(data)

        def s3_open(url, mode="rb", bufsize=8192, **kw):
            pid = os.getpid()
            if pid not in clients:
                clients[pid] = s3_client(endpoint)
            bucket, key = split_url(url)
            return io.BufferedReader(Body(clients[pid].get_object(Bucket=bucket, Key=key)["Body"]), 1 << 20)

        wds.gopen_schemes["s3"] = s3_open

    def origin(self):
        return self.counter.value

    def make(self):
        import webdataset as wds

        urls = [f"{self.a.url}/{p.name}" for p in sorted(Path(self.a.local_copy).glob("*.tar"))]
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False).shuffle(1000).map(
            lambda s: decode(s["jpg"]))
        return self.loader(ds, False)


class Boto3(Peer):
    name = "boto3"

    def __init__(self, a, link_env):
        super().__init__(a, link_env)
        self.counter = Counter()

    def origin(self):
        return self.counter.value

    def make(self):
        import torch

        counter, endpoint = self.counter, self.env["AWS_ENDPOINT_URL"]
        bucket, prefix = split_url(self.a.url)
        names = sorted(p.name for p in Path(self.a.local_copy).glob("*.jpg"))  # an index, as a user would keep

        class Objects(torch.utils.data.Dataset):
            def __init__(self):
                self.client, self.pid = None, None

            def __len__(self):
                return len(names)

            def __getitem__(self, i):
                if self.pid != os.getpid():
                    self.client, self.pid = s3_client(endpoint, pool=4), os.getpid()
                blob = self.client.get_object(Bucket=bucket, Key=f"{prefix}/{names[i]}")["Body"].read()
                counter.add(len(blob))
                return decode(blob)

        return self.loader(Objects(), True)


CONTENDERS = {"ramjet": Ramjet, "ramjet-plain": RamjetPlain, "ramjet-mds": RamjetMds, "ramjet-wds": RamjetWds, "torch-files": TorchFiles,
              "mosaicml": MosaicML, "webdataset": WebDataset, "boto3": Boto3}


def child(argv):
    """A contender's process: answers the parent's requests, one JSON line each, until `close`."""
    p = argparse.ArgumentParser()
    for k in ["loader", "url", "work", "local_copy"]:
        p.add_argument("--" + k.replace("_", "-"))
    for k in ["samples", "workers", "format_bytes", "ramjet_bytes", "cmd_fd", "res_fd"]:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=0)
    p.add_argument("--step-ms", type=float, default=0.0)
    a = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    cmds, res = os.fdopen(a.cmd_fd, "r"), os.fdopen(a.res_fd, "w")
    c = CONTENDERS[a.loader](a, dict(os.environ))
    res.write(json.dumps({"rows": []}) + "\n")  # ready: imports done
    res.flush()
    for line in cmds:
        req = json.loads(line)
        op = req.pop("op")
        try:
            out = {"rows": getattr(c, op)(**req)}
        except Exception:  # noqa: BLE001 - reported to the parent, which stops the run
            out = {"error": traceback.format_exc()}
        res.write(json.dumps(out) + "\n")
        res.flush()
        if op == "close" or "error" in out:
            break


# ----- orchestration -----------------------------------------------------------------------


def fmt_s(x):
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def fmt_rate(x):
    return "-" if x is None else f"{x:,.0f}"


def fmt_mib(x):
    return "-" if x is None else f"{x / MIB:,.1f}"


def fmt_pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def aggregate(rows):
    """One row per link, loader and scenario: the medians over its rounds, with every round's
    samples/s, CPU per 1,000 images and steal share kept beside them."""
    groups = {}
    for r in rows:
        groups.setdefault((r["link"], r["loader"], r["scenario"]), []).append(r)
    out = []
    for (link, loader, scenario), rs in groups.items():
        def med(k):
            xs = [x[k] for x in rs if x.get(k) is not None]
            return statistics.median(xs) if xs else None

        m = dict(rs[0])
        for k in ("ttfb_s", "wall_s", "samples_per_s", "cpu_s", "cpu_per_1000", "origin_bytes", "hit_rate", "steal",
                  "others"):
            m[k] = med(k)
        m["rounds"] = len(rs)
        m["rounds_samples_per_s"] = [x["samples_per_s"] for x in rs]
        m["rounds_ttfb_s"] = [x["ttfb_s"] for x in rs]
        m["rounds_cpu_per_1000"] = [x.get("cpu_per_1000") for x in rs]
        m["rounds_steal"] = [x.get("steal") for x in rs]
        out.append(m)
    return out


def table(agg):
    out = ["| link | loader | scenario | rounds | time to first batch (s) | epoch wall (s) | samples/s | "
           "CPU s / 1,000 img | origin (MiB) | cache hit rate | steal | other load |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in agg:
        cpu = "-" if r.get("cpu_per_1000") is None else f"{r['cpu_per_1000']:.2f}"
        steal = "-" if r.get("steal") is None else measure.fmt_steal(r["steal"])
        others = "-" if r.get("others") is None else measure.fmt_others(r["others"])
        out.append(f"| {r['link']} | {TITLES[r['loader']]} | {r['scenario']} | {r['rounds']} | {fmt_s(r['ttfb_s'])} | "
                   f"{fmt_s(r['wall_s'])} | {fmt_rate(r['samples_per_s'])} | {cpu} | {fmt_mib(r['origin_bytes'])} | "
                   f"{fmt_pct(r['hit_rate'])} | {steal} | {others} |")
    return "\n".join(out)


def per_round(rows, phase="warm"):
    """The warm rounds side by side: each contender's samples/s and CPU per 1,000 images, the
    steal share, in the order they ran."""
    out = []
    for link in sorted({r["link"] for r in rows}, key=["loopback", "wan"].index):
        lr = [r for r in rows if r["link"] == link and r["phase"] in (phase, "p2")]
        names = list(dict.fromkeys(f"{TITLES[r['loader']]}{' P2' if r['phase'] == 'p2' else ''}" for r in lr))
        if not lr:
            continue
        out += [f"{link}, warm rounds (samples/s, CPU s per 1,000 images, steal share, other processes' load; "
                f"! = above {measure.STEAL_FLAG:.0%}):", "",
                "| round | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for k in sorted({r["round"] for r in lr}):
            cells = []
            for nm in names:
                got = [r for r in lr if r["round"] == k and
                       f"{TITLES[r['loader']]}{' P2' if r['phase'] == 'p2' else ''}" == nm]
                cells.append("-" if not got else f"{got[0]['samples_per_s']:,.0f}/s, "
                             f"{got[0]['cpu_per_1000']:.2f} s, {measure.fmt_steal(got[0]['steal'])}, "
                             f"{measure.fmt_others(got[0].get('others', 0.0))}")
            out.append(f"| {k + 1} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


BEST_PEERS = ["torch-files", "mosaicml", "webdataset"]  # the "best peer" candidates


def checks(rows):
    """The targets, per link, from every round's rows. A verdict needs measure.VERDICT_ROUNDS
    interleaved rounds; below that the check shows its figures and ratios only."""
    out = []
    for link in sorted({r["link"] for r in rows}, key=["loopback", "wan"].index):
        lr = [r for r in rows if r["link"] == link]

        def rounds_of(loader, phase):
            return {r["round"]: r for r in lr if r["loader"] == loader and r["phase"] == phase}

        def med(xs):
            return statistics.median(xs) if xs else None

        def flagged(phases, loaders):
            """Rounds in which a measurement of these loaders and phases was under steal or another
            process's load."""
            return len({r["round"] for r in lr if r["phase"] in phases and r["loader"] in loaders
                        and measure.flagged_row(r)})

        def add(target, measured, met, n, nflag):
            v = None if n < measure.VERDICT_ROUNDS or nflag else ("met" if met else "missed")
            out.append(dict(link=link, target=target, measured=measured, verdict=v, rounds=n, flagged=nflag,
                            met=None if v is None else v == "met"))

        warm, p2, cold = rounds_of("ramjet", "warm"), rounds_of("ramjet", "p2"), rounds_of("ramjet", "cold")
        peers = [p for p in LOADERS if p not in RAMJETS and any(r["loader"] == p for r in lr)]
        both = sorted(set(warm) & set(p2))
        if both:
            ratios = [warm[k]["wall_s"] / p2[k]["wall_s"] for k in both]
            m = med(ratios)
            add("ramjet warm streaming epoch within 5% of its P2 local-disk epoch",
                f"median {med([warm[k]['wall_s'] for k in both]):.2f} s vs {med([p2[k]['wall_s'] for k in both]):.2f} s"
                f" = {m:.3f}x; per round {', '.join(f'{x:.3f}' for x in ratios)}", m <= 1.05, len(both),
                flagged({"warm", "p2"}, {"ramjet"}))
        def cold_ratios(phase):
            """Per round of `phase`: the fastest peer's time to first batch over ramjet's, and
            which peer that was."""
            mine, per, fastest = rounds_of("ramjet", phase), [], []
            for k in sorted(mine):
                peer_ttfb = {p: rounds_of(p, phase)[k]["ttfb_s"] for p in peers if k in rounds_of(p, phase)}
                if len(peer_ttfb) == len(peers):
                    best = min(peer_ttfb, key=peer_ttfb.get)
                    per.append(peer_ttfb[best] / mine[k]["ttfb_s"])
                    fastest.append(best)
            return per, fastest

        if cold and peers:
            per, fastest = cold_ratios("cold")
            warmup, _ = cold_ratios("warmup-cold")
            if per:
                best = max(set(fastest), key=fastest.count)
                add("cold time to first batch at least 10x shorter than every peer's, in every round",
                    f"ramjet median {med([c['ttfb_s'] for c in cold.values()]):.3f} s; fastest peer mostly "
                    f"{TITLES[best]}; per round {', '.join(f'{x:.1f}x' for x in per)} (lowest {min(per):.1f}x)"
                    + (f"; warm-up round, not counted: {', '.join(f'{x:.1f}x' for x in warmup)}" if warmup else ""),
                    min(per) >= 10, len(per), flagged({"cold"}, set(LOADERS)))
        cands = [p for p in BEST_PEERS if p in peers and rounds_of(p, "warm")]
        if warm and cands:
            rate = {p: med([r["samples_per_s"] for r in rounds_of(p, "warm").values()]) for p in cands}
            cpu = {p: med([r["cpu_per_1000"] for r in rounds_of(p, "warm").values()]) for p in cands}
            best, frugal = max(rate, key=rate.get), min(cpu, key=cpu.get)
            r_rate = med([r["samples_per_s"] for r in warm.values()])
            r_cpu = med([r["cpu_per_1000"] for r in warm.values()])
            br = rounds_of(best, "warm")
            per = [warm[k]["samples_per_s"] / br[k]["samples_per_s"] for k in sorted(warm) if k in br]
            ratio, cpu_ratio = r_rate / rate[best], cpu[frugal] / r_cpu
            add("warm loader-only at least 3x the best peer, by median samples/s and by CPU per image",
                f"ramjet {r_rate:,.0f}/s, {r_cpu:.2f} CPU s/1000; best peer {TITLES[best]} {rate[best]:,.0f}/s = "
                f"{ratio:.2f}x (per round {', '.join(f'{x:.2f}' for x in per)}); least CPU {TITLES[frugal]} "
                f"{cpu[frugal]:.2f} s/1000 = {cpu_ratio:.2f}x", ratio >= 3 and cpu_ratio >= 3, len(per),
                flagged({"warm"}, {"ramjet", *cands}))
        # ramjet reading the peers' formats in place: 3x the peer on its own format, and
        # within 5% of ramjet on its own format holding the same JPEGs: packed with
        # --jpeg-restarts when the copies were indexed with it, else without (the given bytes).
        own = "ramjet" if IN_PLACE_RESTARTS or not rounds_of("ramjet-plain", "warm") else "ramjet-plain"
        own_warm = rounds_of(own, "warm")
        for mine, peer in (("ramjet-mds", "mosaicml"), ("ramjet-wds", "webdataset")):
            fw, pw = rounds_of(mine, "warm"), rounds_of(peer, "warm")
            ks = sorted(set(fw) & set(pw))
            if ks:
                per = [fw[k]["samples_per_s"] / pw[k]["samples_per_s"] for k in ks]
                add(f"{TITLES[mine]}: warm loader-only at least 3x {TITLES[peer]} on its own format",
                    f"{med([fw[k]['samples_per_s'] for k in ks]):,.0f}/s vs {med([pw[k]['samples_per_s'] for k in ks]):,.0f}/s"
                    f" = {med(per):.2f}x; per round {', '.join(f'{x:.2f}' for x in per)}", med(per) >= 3, len(ks),
                    flagged({"warm"}, {mine, peer}))
            ks = sorted(set(fw) & set(own_warm))
            if ks:
                per = [fw[k]["samples_per_s"] / own_warm[k]["samples_per_s"] for k in ks]
                add(f"{TITLES[mine]}: warm loader-only within 5% of {TITLES[own]}",
                    f"{med(per):.3f}x its rate; per round {', '.join(f'{x:.3f}' for x in per)}",
                    med(per) >= 0.95, len(ks), flagged({"warm"}, {mine, own}))
    return out


def checks_md(cs):
    out = ["| link | target | measured | rounds | |", "|---|---|---|---|---|"]
    out += [f"| {c['link']} | {c['target']} | {c['measured']} | {c['rounds']} | "
            f"**{measure.verdict_text(c['verdict'], c['rounds'], c.get('flagged', 0))}** |" for c in cs]
    return "\n".join(out)


def chart(rows, agg, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in agg}, key=["loopback", "wan"].index)
    fig, axes = plt.subplots(len(links), 3, figsize=(19, 4.4 * len(links)), squeeze=False)
    for i, link in enumerate(links):
        lr = [r for r in agg if r["link"] == link]
        loaders = [lo for lo in LOADERS if any(r["loader"] == lo for r in lr)]
        labels = [SHORT.get(lo, TITLES[lo]).replace(", ", ",\n").replace(" (", "\n(") for lo in loaders]
        ax = axes[i][0]
        phases = [("cold", "cold (P2: first epoch)"), ("warm", "warm, step 0"), ("step", "warm, with step")]
        w = 0.26
        for j, (ph, label) in enumerate(phases):
            vals = []
            for lo in loaders:
                got = [r for r in lr if r["loader"] == lo and r["phase"] == ph]
                vals.append(got[0]["samples_per_s"] if got else 0)
            ax.bar([k + (j - 1) * w for k in range(len(loaders))], vals, w, label=label)
        ax.set_xticks(range(len(loaders)), labels, fontsize=8, rotation=30, ha="right")
        ax.set_ylabel("samples/s (median of rounds)")
        ax.set_title(f"{link}: loader throughput (batch {BATCH}, 224x224 RandomResizedCrop)", fontsize=10)
        ax.legend(fontsize=8)
        ax = axes[i][1]
        vals = [next((r["ttfb_s"] for r in lr if r["loader"] == lo and r["phase"] == "cold"), 0) for lo in loaders]
        bars = ax.bar(range(len(loaders)), vals, color=["tab:green" if lo in RAMJETS else "tab:gray" for lo in loaders])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f} s", ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(loaders)), labels, fontsize=8, rotation=30, ha="right")
        ax.set_ylabel("seconds (log), median of cold rounds")
        ax.set_title(f"{link}: cold time to first batch (P2 includes the export)", fontsize=10)
        ax = axes[i][2]
        wr = [r for r in rows if r["link"] == link and r["phase"] in ("warm", "p2")]
        for lo in loaders:
            for ph in ("warm", "p2"):
                xs = sorted((r["round"] + 1, r["samples_per_s"]) for r in wr if r["loader"] == lo and r["phase"] == ph)
                if xs:
                    ax.plot(*zip(*xs), marker="o", label=TITLES[lo] + (" P2" if ph == "p2" else ""))
        ax2 = ax.twinx()
        st = {}
        for r in wr:
            st.setdefault(r["round"] + 1, []).append(r.get("steal") or 0)
        if st:
            ks = sorted(st)
            ax2.bar(ks, [100 * max(st[k]) for k in ks], 0.4, color="tab:red", alpha=0.15)
            ax2.set_ylabel("highest steal share in the round (%)", color="tab:red", fontsize=8)
        ax.set_xticks(sorted(st))
        ax.set_xlabel("warm round (contenders interleaved)")
        ax.set_ylabel("samples/s")
        ax.set_title(f"{link}: every warm round", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Child:
    """A contender's process and its two pipes: one JSON request, one JSON answer."""

    def __init__(self, loader, args, env):
        cr, cw = os.pipe()
        rr, rw = os.pipe()
        self.loader = loader
        self.proc = subprocess.Popen([sys.executable, __file__, "_run", "--loader", loader, *args, "--cmd-fd", str(cr),
                                      "--res-fd", str(rw)], pass_fds=(cr, rw), env=env)
        os.close(cr)
        os.close(rw)
        self.cmds, self.res = os.fdopen(cw, "w"), rr

    def _read(self):
        buf = b""
        while not buf.endswith(b"\n"):
            # A dead contender's workers may hold the pipe open: poll its exit as well.
            ready, _, _ = select.select([self.res], [], [], 1.0)
            if ready:
                chunk = os.read(self.res, 1 << 20)
                if not chunk:
                    break
                buf += chunk
            elif self.proc.poll() is not None:
                break
        if not buf.endswith(b"\n"):
            raise SystemExit(f"ramjet-bench: {TITLES[self.loader]} exited ({self.proc.wait()}) without an answer")
        out = json.loads(buf)
        if "error" in out:
            raise SystemExit(f"ramjet-bench: {TITLES[self.loader]} failed:\n{out['error']}")
        return out["rows"]

    def ready(self):
        return self._read()

    def call(self, op, **args):
        self.cmds.write(json.dumps({"op": op, **args}) + "\n")
        self.cmds.flush()
        return self._read()

    def close(self):
        try:
            if self.proc.poll() is None:
                self.call("close")
        except SystemExit:
            pass
        finally:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            os.close(self.res)


def machine():
    cores = os.cpu_count()
    mem = 0
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) / (1 << 20)
    return f"{cores} cores, {mem:.0f} GiB RAM, Linux {platform.release()}, Python {platform.python_version()}"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_run":
        return child(sys.argv[2:])
    p = argparse.ArgumentParser(prog="ramjet-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1,000 samples, 16 MiB shards, 5 warm rounds and 1 cold round, loopback only")
    p.add_argument("--samples", type=int, help="dataset size (default 5315; --quick: 1000)")
    p.add_argument("--shard-mib", type=int, help="shard size of every format, MiB (default 64; --quick: 16)")
    p.add_argument("--link", choices=["loopback", "wan", "both"], help="origin link (default both; --quick: loopback)")
    p.add_argument("--rate", default="200mbit", help="WAN-like link rate (tc syntax, default 200mbit)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="WAN-like link round-trip time (default 20 ms)")
    p.add_argument("--step-ms", type=float, default=50.0, help="simulated training step, ms (0: loader only)")
    p.add_argument("--rounds", type=int,
                   help="interleaved warm rounds, one epoch of every loader each (default 5, --quick too)")
    p.add_argument("--cold-rounds", type=int,
                   help="interleaved cold rounds, every state rebuilt from empty each (default 3; --quick: 1)")
    p.add_argument("--cold-warmup-rounds", type=int,
                   help="cold rounds run first and reported apart, never counted (default 1 on the WAN-like link, "
                        "whose first cold round after the origin starts is slower for every loader; 0 on loopback)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers of the peers")
    p.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated subset of {','.join(LOADERS)}")
    p.add_argument("--out", default=str(ROOT / "target/bench/ramjet-bench"), help="folder for table, JSON and chart")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")
    p.add_argument("--in-place-as-given", action="store_true",
                   help="index the MDS and WebDataset copies without --jpeg-restarts: ramjet then reads their "
                        "JPEGs as given, and is held to the rate of ramjet on its own shards holding them as given")
    a = p.parse_args()
    samples = a.samples or (1000 if a.quick else 5315)
    shard_mib = a.shard_mib or (16 if a.quick else 64)
    rounds = a.rounds or 5
    cold_rounds = a.cold_rounds or (1 if a.quick else 3)
    links = {"loopback": ["loopback"], "wan": ["wan"], "both": ["loopback", "wan"]}[a.link or
                                                                                   ("loopback" if a.quick else "both")]
    loaders = [x for x in a.loaders.split(",") if x]
    for x in loaders:
        if x not in LOADERS:
            p.error(f"unknown loader {x!r}; choose from {', '.join(LOADERS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    global IN_PLACE_RESTARTS
    IN_PLACE_RESTARTS = not a.in_place_as_given
    if IN_PLACE_RESTARTS:
        for k in ("ramjet-mds", "ramjet-wds"):
            TITLES[k] = TITLES[k].replace("(in place)", "(in place, indexed with --jpeg-restarts)")
    data = Data(samples, shard_mib, IN_PLACE_RESTARTS)
    data.prepare_local()
    work = STATE / "bench/work"
    rows, details, warmups_of = [], {}, {}
    for link_name in links:
        link = loopback_link() if link_name == "loopback" else wan_up(a.rate, a.rtt_ms)
        details[link_name] = link.detail
        children = {}
        try:
            data.upload(link)
            data.warm_origin(link)
            ramjet_bytes = data_bytes_of_ramjet(data, link)
            shutil.rmtree(work, ignore_errors=True)
            # Every loader's process stays alive from its last cold round to the end of the
            # link: its warm state is its own, and its epochs run in turns with the others'.
            # Each cold round starts every loader in a fresh process, so none brings a warm
            # connection pool, runtime or worker into it (the work folders are kept: each
            # loader's cold step empties its own cache and export).
            def spawn():
                for c in children.values():
                    c.close()
                for loader in loaders:
                    fmt = {"ramjet": "ramjet", "ramjet-plain": "ramjet-plain", "ramjet-mds": "mds", "ramjet-wds": "wds", "torch-files": "objects",
                           "mosaicml": "mds", "webdataset": "wds", "boto3": "objects"}[loader]
                    local_copy = {"wds": data.dir / "wds", "objects": data.synth / "images"}.get(fmt, data.dir)
                    (work / loader).mkdir(parents=True, exist_ok=True)
                    children[loader] = Child(loader, [
                        "--url", data.url(fmt), "--work", str(work / loader), "--local-copy", str(local_copy),
                        "--samples", str(samples), "--workers", str(a.workers), "--step-ms", str(a.step_ms),
                        "--format-bytes", str(data.bytes_of(fmt) or ramjet_bytes), "--ramjet-bytes",
                        str(ramjet_bytes)], link.env())
                for c in children.values():
                    c.ready()

            def turn(what, loader, warmup=False, **req):
                got = children[loader].call(what, **req)
                for r in got:
                    if warmup:
                        # Kept in the results, apart: never in a median, a ratio or a verdict.
                        r.update(phase=f"warmup-{r['phase']}", scenario=f"{r['scenario']} (warm-up round, not counted)")
                    rows.append({"link": link_name, **r})
                lead = got[0]
                if lead.get("samples_per_s"):
                    log(f"  {TITLES[loader]} {lead['scenario']}: {lead['samples_per_s']:,.0f}/s, "
                        f"first batch {lead['ttfb_s']:.3f} s, {lead['cpu_per_1000']:.2f} CPU s/1000, "
                        f"steal {measure.fmt_steal(lead['steal'])}, other load {measure.fmt_others(lead['others'])}")

            # On the WAN-like link the first cold round after the origin comes up is slower for
            # every loader (docs/benchmarks-history.md, "The first cold round on the WAN-like link"): by
            # default one cold round runs first there and is reported apart, not counted.
            warmups = a.cold_warmup_rounds if a.cold_warmup_rounds is not None else (1 if link_name == "wan" else 0)
            warmups_of[link_name] = warmups
            for w in range(warmups):
                log(f"[{link_name}] cold warm-up round {w + 1}/{warmups} (reported apart, not counted)")
                spawn()
                for loader in measure.order(loaders, w):
                    turn("cold", loader, warmup=True, r=w)
            for r in range(cold_rounds):
                log(f"[{link_name}] cold round {r + 1}/{cold_rounds}")
                spawn()
                for loader in measure.order(loaders, r):
                    turn("cold", loader, r=r)
            contenders = [(lo, "warm") for lo in loaders]
            if "ramjet" in loaders:
                contenders.insert(1, ("ramjet", "p2"))
            for r in range(rounds):
                log(f"[{link_name}] warm round {r + 1}/{rounds}")
                for loader, phase in measure.order(contenders, r):
                    turn("warm", loader, r=r, phase=phase, ep=1 + r)
            if a.step_ms:
                log(f"[{link_name}] warm epochs with a {a.step_ms:g} ms training step")
                for loader in loaders:
                    turn("step", loader, ep=1 + rounds)
        finally:
            for c in children.values():
                c.close()
            if link_name == "wan":
                wan_down(link)
    shutil.rmtree(work, ignore_errors=True)
    agg = aggregate(rows)
    cs = checks(rows)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "tools/ramjet-bench " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "samples": samples, "batch": BATCH, "shard_mib": shard_mib, "rounds": rounds, "cold_rounds": cold_rounds,
        "step_ms": a.step_ms, "peer_workers": a.workers, "links": details, "seconds": round(time.time() - started, 1),
        "in_place": "indexed with --jpeg-restarts" if IN_PLACE_RESTARTS else "JPEGs as given",
        "cold_warmup_rounds": warmups_of,
    }
    md = "\n".join([
        f"ramjet-bench, {meta['date']}: {samples} samples, batch {BATCH}, {shard_mib} MiB shards, "
        f"{cold_rounds} cold and {rounds} warm interleaved round(s) (medians), peers with {a.workers} DataLoader "
        f"workers; {meta['machine']}",
        *[f"- {k}: {v}" + (f"; {warmups_of[k]} cold warm-up round(s) first, reported apart and not counted"
                            if warmups_of.get(k) else "") for k, v in details.items()], "", table(agg), "", per_round(rows), checks_md(cs), "",
        f"({meta['seconds']:.0f} s; chart: {out / 'chart.png'})"])
    (out / "results.md").write_text(md + "\n")
    doc = {"meta": meta, "rows": rows, "medians": agg, "checks": cs}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    chart(rows, agg, out / "chart.png")
    print(md)
    if a.json == "-":
        print(json.dumps(doc, indent=1))
    elif a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))


def data_bytes_of_ramjet(data, link):
    c = s3_client(link.endpoint)
    total = 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=data.prefix + "/ramjet/"):
        total += sum(o["Size"] for o in page.get("Contents", []) if not o["Key"].endswith("/_complete"))
    return total


if __name__ == "__main__":
    main()
