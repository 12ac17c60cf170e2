"""ramjet-bench: the published pre-export (P2) and streaming (P3) scenario, with ramjet and its
peers side by side on the same data, the same S3 server and the same output.

Run it through `tools/ramjet-bench` (it builds ramjet, makes the peers' venv and starts the
local S3 server); `tools/ramjet-bench --help` lists the options. docs/benchmarks.md explains
every figure.

Each loader runs in its own process (so no loader inherits another's warm state) and reports
rows: scenario, time to first batch, epoch wall time, samples/s, origin bytes, cache hit rate.
Every loader yields the same thing: batches of 8 uint8 images, 3x224x224, RandomResizedCrop
(scale 0.08-1, ratio 3/4-4/3) plus a random horizontal flip, from the same synthetic JPEGs.
"""

import argparse
import concurrent.futures as cf
import datetime
import io
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("RAMJET_ROOT", Path(__file__).resolve().parents[2]))
STATE = Path(os.environ.get("RAMJET_STATE", ROOT / ".ramjet"))
BUCKET = os.environ.get("RAMJET_S3_BUCKET", "ramjet")
RAMJET = Path(os.environ.get("RAMJET_BIN", ROOT / "target/release/ramjet"))
BATCH = 8
OUT = 224
MIB = 1 << 20

# The WAN-like origin: a second SeaweedFS inside this network namespace, reached over a veth
# pair whose namespace end is shaped (never the host's own interfaces).
NETNS = "rjbench"
VETH_HOST, VETH_NS = "rjb0", "rjb1"
IP_HOST, IP_NS = "10.77.0.1", "10.77.0.2"
WAN_INNER_PORT, WAN_PORT = 8433, 8333

LOADERS = ["ramjet", "torch-files", "mosaicml", "webdataset", "boto3"]
TITLES = {
    "ramjet": "ramjet",
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

    def __init__(self, name, endpoint, detail):
        self.name, self.endpoint, self.detail = name, endpoint, detail
        self.relay = None

    def env(self):
        e = dict(os.environ)
        e["AWS_ENDPOINT_URL"] = self.endpoint
        e["S3_ENDPOINT_URL"] = self.endpoint  # MosaicML Streaming's name for it
        return e


def loopback_link():
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    return Link("loopback", endpoint, f"SeaweedFS on {endpoint.split('//')[1]}, no shaping")


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
    link = Link("wan", f"http://{IP_NS}:{WAN_PORT}", f"SeaweedFS in netns {NETNS} over veth, {shaper}")
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

    def __init__(self, samples, shard_mib):
        self.samples, self.shard_mib = samples, shard_mib
        self.dir = STATE / f"bench/data-{samples}-{shard_mib}m"
        self.synth = self.dir / "synth"
        self.prefix = f"bench/ramjet-bench/{samples}-{shard_mib}m"

    def url(self, fmt):
        return f"s3://{BUCKET}/{self.prefix}/{fmt}"

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

    def upload(self, link):
        """Puts every copy on the link's server once (a `_complete` object marks each)."""
        c = s3_client(link.endpoint)
        env = link.env()

        def done(fmt):
            try:
                c.head_object(Bucket=BUCKET, Key=f"{self.prefix}/{fmt}/_complete")
                return True
            except Exception:  # noqa: BLE001 - absent
                return False

        def mark(fmt):
            c.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{fmt}/_complete", Body=b"")

        if not done("ramjet"):
            log(f"packing into {self.url('ramjet')} ({link.name})")
            subprocess.run([str(RAMJET), "pack", str(self.synth), self.url("ramjet"), "--shard-size",
                            f"{self.shard_mib}MiB"], check=True, env=env, stdout=subprocess.DEVNULL)
            mark("ramjet")
        jobs = []
        for fmt, files, base in [
            ("mds", sorted(p for p in (self.dir / "mds").iterdir() if not p.name.startswith(".")), self.dir / "mds"),
            ("wds", sorted((self.dir / "wds").glob("*.tar")), self.dir / "wds"),
            ("objects", self.images(), self.synth / "images"),
        ]:
            if not done(fmt):
                jobs += [(fmt, f, f"{self.prefix}/{fmt}/{f.relative_to(base)}") for f in files]
        if jobs:
            from tqdm import tqdm

            with cf.ThreadPoolExecutor(16) as ex, tqdm(total=len(jobs), desc=f"upload copies ({link.name})",
                                                       unit="obj", file=sys.stderr, leave=False) as bar:
                for _ in ex.map(lambda j: c.upload_file(str(j[1]), BUCKET, j[2]), jobs):
                    bar.update(1)
            for fmt in sorted({j[0] for j in jobs}):
                mark(fmt)

    def bytes_of(self, fmt):
        if fmt == "ramjet":
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
    return batch["image"] if isinstance(batch, dict) else batch


def epoch(batches, *, desc, total, step_ms=0.0, t0=None):
    """Consumes one epoch; returns time to first batch, wall time and samples."""
    from tqdm import tqdm

    t0 = now() if t0 is None else t0
    first, n = None, 0
    with tqdm(total=total, desc=desc, unit="img", file=sys.stderr, leave=False, mininterval=0.5) as bar:
        for b in batches:
            img = images_of(b)
            if first is None:
                first = now() - t0
                shape = tuple(img.shape[1:])
                if shape != (3, OUT, OUT) or str(img.dtype) != "torch.uint8":
                    raise RuntimeError(f"{desc}: batches are {img.dtype} {shape}, not uint8 (3, {OUT}, {OUT})")
            n += img.shape[0]
            bar.update(img.shape[0])
            if step_ms:
                time.sleep(step_ms / 1000)
    if n != total:
        raise RuntimeError(f"{desc}: {n} samples, expected {total}")
    return {"ttfb_s": first, "wall_s": now() - t0, "samples": n}


def row(loader, scenario, r, *, origin, total_bytes, step_ms=0.0, **extra):
    out = {"loader": loader, "scenario": scenario, "step_ms": step_ms, "origin_bytes": origin, **r, **extra}
    out["samples_per_s"] = r["samples"] / r["wall_s"] if r.get("samples") else None
    out["hit_rate"] = None if total_bytes is None or not r.get("samples") else max(0.0, 1 - origin / total_bytes)
    return out


def median_row(rows):
    return sorted(rows, key=lambda r: r["wall_s"])[len(rows) // 2] | {"rounds_wall_s": [r["wall_s"] for r in rows]}


def export(url, dest, endpoint, desc):
    """P2's pre-export: every object under `url` to local disk, 16 GETs in flight."""
    from tqdm import tqdm

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
    with cf.ThreadPoolExecutor(16) as ex, tqdm(total=sum(s for _, s in keys), desc=desc, unit="B", unit_scale=True,
                                               file=sys.stderr, leave=False) as bar:
        for n in ex.map(get, keys):
            total += n
            bar.update(n)
    return total


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


def run_ramjet(a, link_env):
    import ramjet

    rows = []
    work = Path(a.work)
    cache = work / "ramjet-cache"
    shutil.rmtree(cache, ignore_errors=True)
    n = a.samples
    common = dict(batch_size=BATCH, shuffle=True, seed=0, image_size=OUT, augment="train")
    t0 = now()
    ds = ramjet.StreamingDataset(a.url, local=str(cache), cache_limit="64GiB", **common)
    r = epoch(ds, desc="ramjet P3 cold", total=n, t0=t0)
    total_bytes = a.ramjet_bytes
    origin = ds.metrics()["origin_bytes"]
    rows.append(row("ramjet", "P3 streaming, cold", r, origin=origin, total_bytes=total_bytes, phase="cold"))
    # P2: export the shards, then read them from local disk; alternate with P3 warm epochs.
    local = work / "ramjet-p2"
    t = now()
    got = export(a.url, local, link_env["AWS_ENDPOINT_URL"], "ramjet P2 export")
    exp = now() - t
    rows.append(row("ramjet", "P2 export (S3 -> local disk)", {"ttfb_s": None, "wall_s": exp, "samples": 0},
                    origin=got, total_bytes=total_bytes, phase="export"))
    warm, p2_rows, p2 = [], [], None
    for k in range(a.rounds):
        ep = 1 + k
        before = ds.metrics()["origin_bytes"]
        ds.set_epoch(ep)
        r = epoch(ds, desc=f"ramjet P3 warm {k + 1}/{a.rounds}", total=n)
        warm.append(row("ramjet", "P3 streaming, warm", r, origin=ds.metrics()["origin_bytes"] - before,
                        total_bytes=total_bytes, phase="warm"))
        t0 = now()
        if p2 is None:
            p2 = ramjet.StreamingDataset(str(local), local=None, **common)
        p2.set_epoch(ep)
        r = epoch(p2, desc=f"ramjet P2 epoch {k + 1}/{a.rounds}", total=n, t0=t0)
        if k == 0:
            r["ttfb_s"] += exp  # time to first step includes the export
        p2_rows.append(row("ramjet", "P2 epoch from local disk", r, origin=0, total_bytes=total_bytes, phase="p2"))
    rows += [median_row(warm), median_row(p2_rows) | {"ttfb_s": p2_rows[0]["ttfb_s"]}]
    if a.step_ms:
        before = ds.metrics()["origin_bytes"]
        ds.set_epoch(a.rounds + 1)
        r = epoch(ds, desc=f"ramjet P3 warm, step {a.step_ms:g} ms", total=n, step_ms=a.step_ms)
        rows.append(row("ramjet", f"P3 streaming, warm, step {a.step_ms:g} ms", r,
                        origin=ds.metrics()["origin_bytes"] - before, total_bytes=total_bytes, step_ms=a.step_ms,
                        phase="step"))
    return rows


def peer_epochs(name, a, make_loader, origin_now, total_bytes, cold_label="cold", t0=None):
    """Cold epoch, `rounds` warm epochs (median) and one with the training step, for a peer."""
    rows = []
    t0 = now() if t0 is None else t0
    dl = make_loader()
    r = epoch(dl, desc=f"{name} cold", total=a.samples, t0=t0)
    o = origin_now()
    rows.append(row(name, f"streaming, {cold_label}", r, origin=o, total_bytes=total_bytes, phase="cold"))
    warm = []
    for k in range(a.rounds):
        before = origin_now()
        r = epoch(dl, desc=f"{name} warm {k + 1}/{a.rounds}", total=a.samples)
        warm.append(row(name, "streaming, warm", r, origin=origin_now() - before, total_bytes=total_bytes,
                        phase="warm"))
    rows.append(median_row(warm))
    if a.step_ms:
        before = origin_now()
        r = epoch(dl, desc=f"{name} warm, step {a.step_ms:g} ms", total=a.samples, step_ms=a.step_ms)
        rows.append(row(name, f"streaming, warm, step {a.step_ms:g} ms", r, origin=origin_now() - before,
                        total_bytes=total_bytes, step_ms=a.step_ms, phase="step"))
    return rows


def torch_loader(ds, a, shuffle):
    import torch

    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=shuffle, num_workers=a.workers,
                                       persistent_workers=a.workers > 0)


def run_torch_files(a, link_env):
    import torch

    class Files(torch.utils.data.Dataset):
        def __init__(self, paths):
            self.paths = paths

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            return decode(self.paths[i].read_bytes())

    local = Path(a.work) / "files-p2"
    t = now()
    got = export(a.url, local, link_env["AWS_ENDPOINT_URL"], "torch-files P2 export")
    exp = now() - t
    rows = [row("torch-files", "P2 export (S3 -> local disk)", {"ttfb_s": None, "wall_s": exp, "samples": 0},
                origin=got, total_bytes=a.format_bytes, phase="export")]
    paths = sorted(p for p in local.rglob("*.jpg"))
    t0 = now()
    peer = peer_epochs("torch-files", a, lambda: torch_loader(Files(paths), a, True), lambda: 0, a.format_bytes,
                       t0=t0)
    for r in peer:
        r["scenario"] = r["scenario"].replace("streaming", "P2 epoch from local disk")
        r["phase"] = {"cold": "p2", "warm": "p2-warm", "step": "step"}[r["phase"]]
        r["hit_rate"] = 1.0
    peer[0]["ttfb_s"] += exp
    return rows + peer


def run_mosaicml(a, link_env):
    import torch  # noqa: F401 - before streaming, which imports it too
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    local = Path(a.work) / "mds-cache"
    shutil.rmtree(local, ignore_errors=True)

    class Mds(StreamingDataset):
        def __getitem__(self, i):
            return decode(super().__getitem__(i)["image"])

    def origin():
        return sum(p.stat().st_size for p in local.rglob("*") if p.is_file())

    def make():
        ds = Mds(remote=a.url, local=str(local), shuffle=True, shuffle_seed=0, batch_size=BATCH)
        # The constructor fetched index.json with a boto3 client that the DataLoader's forked
        # workers would inherit and share: interleaved responses on one pooled connection
        # silently corrupted shards here (MDS carries no hashes by default). Each worker gets
        # its own client instead.
        for s in ds.streams:
            s._downloader.clean_up()
        return torch_loader(ds, a, False)

    t0 = now()
    return peer_epochs("mosaicml", a, make, origin, a.format_bytes, t0=t0)


def run_webdataset(a, link_env):
    import webdataset as wds

    counter = Counter()
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
    tars = sorted(p.name for p in Path(a.local_copy).glob("*.tar"))
    urls = [f"{a.url}/{t}" for t in tars]

    def make():
        ds = wds.WebDataset(urls, shardshuffle=len(urls), seed=0, empty_check=False).shuffle(1000).map(
            lambda s: decode(s["jpg"]))
        return torch_loader(ds, a, False)

    t0 = now()
    return peer_epochs("webdataset", a, make, lambda: counter.value, a.format_bytes, t0=t0)


def run_boto3(a, link_env):
    import torch

    counter = Counter()
    endpoint = link_env["AWS_ENDPOINT_URL"]
    bucket, prefix = split_url(a.url)
    names = sorted(p.name for p in Path(a.local_copy).glob("*.jpg"))  # an index, as a user would keep

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

    t0 = now()
    return peer_epochs("boto3", a, lambda: torch_loader(Objects(), a, True), lambda: counter.value, a.format_bytes,
                       t0=t0)


RUNNERS = {"ramjet": run_ramjet, "torch-files": run_torch_files, "mosaicml": run_mosaicml,
           "webdataset": run_webdataset, "boto3": run_boto3}


def child(argv):
    p = argparse.ArgumentParser()
    for k in ["loader", "url", "work", "json_out", "local_copy"]:
        p.add_argument("--" + k.replace("_", "-"))
    for k in ["samples", "rounds", "workers", "format_bytes", "ramjet_bytes"]:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=0)
    p.add_argument("--step-ms", type=float, default=0.0)
    a = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    rows = RUNNERS[a.loader](a, dict(os.environ))
    Path(a.json_out).write_text(json.dumps(rows))


# ----- orchestration -----------------------------------------------------------------------


def fmt_s(x):
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def fmt_rate(x):
    return "-" if x is None else f"{x:,.0f}"


def fmt_mib(x):
    return "-" if x is None else f"{x / MIB:,.1f}"


def fmt_pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def table(rows):
    out = ["| link | loader | scenario | time to first batch (s) | epoch wall (s) | samples/s | origin (MiB) | "
           "cache hit rate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['link']} | {TITLES[r['loader']]} | {r['scenario']} | {fmt_s(r['ttfb_s'])} | "
                   f"{fmt_s(r['wall_s'])} | {fmt_rate(r['samples_per_s'])} | {fmt_mib(r['origin_bytes'])} | "
                   f"{fmt_pct(r['hit_rate'])} |")
    return "\n".join(out)


def checks(rows):
    """The issue's three targets, per link, from the rows."""
    out = []
    for link in sorted({r["link"] for r in rows}, key=["loopback", "wan"].index):
        lr = [r for r in rows if r["link"] == link]

        def pick(loader, phase):
            got = [r for r in lr if r["loader"] == loader and r["phase"] == phase]
            return got[0] if got else None

        warm, p2, cold = pick("ramjet", "warm"), pick("ramjet", "p2"), pick("ramjet", "cold")
        peers = [p for p in LOADERS[1:] if any(r["loader"] == p for r in lr)]
        if warm and p2:
            ratio = warm["wall_s"] / p2["wall_s"]
            out.append(dict(link=link, target="ramjet warm streaming epoch within 5% of its P2 local-disk epoch",
                            measured=f"{warm['wall_s']:.2f} s vs {p2['wall_s']:.2f} s = {ratio:.3f}x",
                            met=ratio <= 1.05))
        if cold and peers:
            peer_ttfb = {p: (pick(p, "cold") or pick(p, "p2"))["ttfb_s"] for p in peers}
            best = min(peer_ttfb, key=peer_ttfb.get)
            ratio = peer_ttfb[best] / cold["ttfb_s"]
            out.append(dict(link=link, target="cold time to first batch at least 10x shorter than every peer's",
                            measured=f"ramjet {cold['ttfb_s']:.3f} s; fastest peer {TITLES[best]} "
                                     f"{peer_ttfb[best]:.3f} s = {ratio:.1f}x", met=ratio >= 10))
        if warm and peers:
            peer_rate = {p: (pick(p, "warm") or pick(p, "p2-warm"))["samples_per_s"] for p in peers}
            best = max(peer_rate, key=peer_rate.get)
            ratio = warm["samples_per_s"] / peer_rate[best]
            out.append(dict(link=link, target="warm loader-only samples/s at least 2x the best peer's",
                            measured=f"ramjet {warm['samples_per_s']:,.0f}/s; best peer {TITLES[best]} "
                                     f"{peer_rate[best]:,.0f}/s = {ratio:.2f}x", met=ratio >= 2))
    return out


def checks_md(cs):
    out = ["| link | target | measured | |", "|---|---|---|---|"]
    out += [f"| {c['link']} | {c['target']} | {c['measured']} | {'**met**' if c['met'] else '**missed**'} |"
            for c in cs]
    return "\n".join(out)


def chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in rows}, key=["loopback", "wan"].index)
    fig, axes = plt.subplots(len(links), 2, figsize=(13, 4.2 * len(links)), squeeze=False)
    for i, link in enumerate(links):
        lr = [r for r in rows if r["link"] == link]
        loaders = [lo for lo in LOADERS if any(r["loader"] == lo for r in lr)]
        ax = axes[i][0]
        phases = [("cold", "cold (P2: first epoch)"), ("warm", "warm, step 0"), ("step", "warm, with step")]
        w = 0.26
        for j, (ph, label) in enumerate(phases):
            vals = []
            for lo in loaders:
                alias = {"cold": ["cold", "p2"], "warm": ["warm", "p2-warm"], "step": ["step"]}[ph]
                got = [r for r in lr if r["loader"] == lo and r["phase"] in alias]
                vals.append(got[0]["samples_per_s"] if got else 0)
            ax.bar([k + (j - 1) * w for k in range(len(loaders))], vals, w, label=label)
        ax.set_xticks(range(len(loaders)), [TITLES[lo].replace(", ", ",\n").replace(" (", "\n(") for lo in loaders],
                      fontsize=8)
        ax.set_ylabel("samples/s")
        ax.set_title(f"{link}: loader throughput (batch {BATCH}, 224x224 RandomResizedCrop)")
        ax.legend(fontsize=8)
        ax = axes[i][1]
        vals = []
        for lo in loaders:
            got = [r for r in lr if r["loader"] == lo and r["phase"] in ("cold", "p2")]
            if lo == "ramjet":
                got = [r for r in lr if r["loader"] == lo and r["phase"] == "cold"]
            vals.append(got[0]["ttfb_s"] if got else 0)
        bars = ax.bar(range(len(loaders)), vals, color=["tab:green" if lo == "ramjet" else "tab:gray" for lo in loaders])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f} s", ha="center", va="bottom", fontsize=8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(loaders)), [TITLES[lo].replace(", ", ",\n").replace(" (", "\n(") for lo in loaders],
                      fontsize=8)
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"{link}: cold time to first batch (P2 includes the export)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
                   help="under 3 minutes: 1,000 samples, 16 MiB shards, one warm round, loopback only")
    p.add_argument("--samples", type=int, help="dataset size (default 5315; --quick: 1000)")
    p.add_argument("--shard-mib", type=int, help="shard size of every format, MiB (default 64; --quick: 16)")
    p.add_argument("--link", choices=["loopback", "wan", "both"], help="origin link (default both; --quick: loopback)")
    p.add_argument("--rate", default="200mbit", help="WAN-like link rate (tc syntax, default 200mbit)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="WAN-like link round-trip time (default 20 ms)")
    p.add_argument("--step-ms", type=float, default=50.0, help="simulated training step, ms (0: loader only)")
    p.add_argument("--rounds", type=int, help="warm epochs per loader, median reported (default 3; --quick: 1)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers of the peers")
    p.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated subset of {','.join(LOADERS)}")
    p.add_argument("--out", default=str(ROOT / "target/bench/ramjet-bench"), help="folder for table, JSON and chart")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")
    a = p.parse_args()
    samples = a.samples or (1000 if a.quick else 5315)
    shard_mib = a.shard_mib or (16 if a.quick else 64)
    rounds = a.rounds or (1 if a.quick else 3)
    links = {"loopback": ["loopback"], "wan": ["wan"], "both": ["loopback", "wan"]}[a.link or
                                                                                   ("loopback" if a.quick else "both")]
    loaders = [x for x in a.loaders.split(",") if x]
    for x in loaders:
        if x not in LOADERS:
            p.error(f"unknown loader {x!r}; choose from {', '.join(LOADERS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    data = Data(samples, shard_mib)
    data.prepare_local()
    work = STATE / "bench/work"
    rows, details = [], {}
    for link_name in links:
        link = loopback_link() if link_name == "loopback" else wan_up(a.rate, a.rtt_ms)
        details[link_name] = link.detail
        try:
            data.upload(link)
            ramjet_bytes = data_bytes_of_ramjet(data, link)
            for k, loader in enumerate(loaders):
                log(f"[{link_name} {k + 1}/{len(loaders)}] {TITLES[loader]}")
                fmt = {"ramjet": "ramjet", "torch-files": "objects", "mosaicml": "mds", "webdataset": "wds",
                       "boto3": "objects"}[loader]
                local_copy = {"wds": data.dir / "wds", "objects": data.synth / "images"}.get(fmt, data.dir)
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                res = work.parent / "result.json"
                res.unlink(missing_ok=True)
                cmd = [sys.executable, __file__, "_run", "--loader", loader, "--url", data.url(fmt), "--work",
                       str(work), "--json-out", str(res), "--local-copy", str(local_copy), "--samples", str(samples),
                       "--rounds", str(rounds), "--workers", str(a.workers), "--step-ms", str(a.step_ms),
                       "--format-bytes", str(data.bytes_of(fmt) or ramjet_bytes), "--ramjet-bytes", str(ramjet_bytes)]
                rc = subprocess.run(cmd, env=link.env()).returncode
                if rc != 0:
                    raise SystemExit(f"ramjet-bench: {TITLES[loader]} on {link_name} failed (exit {rc})")
                for r in json.loads(res.read_text()):
                    rows.append({"link": link_name, **r})
        finally:
            if link_name == "wan":
                wan_down(link)
    shutil.rmtree(work, ignore_errors=True)
    cs = checks(rows)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "tools/ramjet-bench " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "samples": samples, "batch": BATCH, "shard_mib": shard_mib, "rounds": rounds, "step_ms": a.step_ms,
        "peer_workers": a.workers, "links": details, "seconds": round(time.time() - started, 1),
    }
    md = "\n".join([
        f"ramjet-bench, {meta['date']}: {samples} samples, batch {BATCH}, {shard_mib} MiB shards, "
        f"{rounds} warm round(s) (median), peers with {a.workers} DataLoader workers; {meta['machine']}",
        *[f"- {k}: {v}" for k, v in details.items()], "", table(rows), "", checks_md(cs), "",
        f"({meta['seconds']:.0f} s; chart: {out / 'chart.png'})"])
    (out / "results.md").write_text(md + "\n")
    doc = {"meta": meta, "rows": rows, "checks": cs}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    chart(rows, out / "chart.png")
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
