#!/usr/bin/env python3
"""An HTTP/1.1 proxy in front of an S3 server that throttles like S3 does: a request that would
make more than `--rps` requests start within one second is answered `503 SlowDown` (S3's XML
error body) at once, and never reaches the server. `--delay-ms` adds latency to every request
that is forwarded. Counts go to `--stats` (JSON, rewritten every 0.2 s and at exit):
requests, forwarded, throttled, the most forwarded requests in flight at once
(`max_in_flight`; with `--part-bytes N`, `max_parts_in_flight` counts only ranged GETs of at least
64 KiB that start at a multiple of N: the parts of whole shards a stream fetches with ranged GETs of
N bytes, not its reads of samples or headers), and the per-second series.

    throttle_proxy.py --listen 127.0.0.1:0 --upstream 127.0.0.1:8333 --rps 40 --stats FILE

It prints `listening HOST:PORT` once ready. Plain HTTP only (the local S3 server)."""

import argparse
import asyncio
import collections
import json
import os
import signal
import time

SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")


class Counts:
    def __init__(self):
        self.requests = 0
        self.forwarded = 0
        self.throttled = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.parts_in_flight = 0
        self.max_parts_in_flight = 0
        self.started = collections.deque()
        self.series = collections.defaultdict(lambda: [0, 0])
        self.t0 = time.monotonic()

    def admit(self, rps):
        now = time.monotonic()
        while self.started and now - self.started[0] > 1.0:
            self.started.popleft()
        self.requests += 1
        sec = int(now - self.t0)
        if len(self.started) >= rps:
            self.throttled += 1
            self.series[sec][1] += 1
            return False
        self.started.append(now)
        self.forwarded += 1
        self.series[sec][0] += 1
        return True

    def doc(self):
        return {"requests": self.requests, "forwarded": self.forwarded, "throttled": self.throttled,
                "max_in_flight": self.max_in_flight, "max_parts_in_flight": self.max_parts_in_flight,
                "series": [[s, f, t] for s, (f, t) in sorted(self.series.items())]}


def is_part(first, headers, part_bytes):
    """A ranged GET of at least 64 KiB starting at a multiple of `part_bytes`."""
    r = headers.get("range", "")
    if not part_bytes or not first.startswith("GET ") or not r.startswith("bytes="):
        return False
    lo, _, hi = r[6:].partition("-")
    try:
        return int(lo) % part_bytes == 0 and int(hi) - int(lo) + 1 >= 64 << 10
    except ValueError:
        return False


async def read_head(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for ln in lines[1:]:
        if ":" in ln:
            k, v = ln.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return head, lines[0], headers


async def relay_body(reader, writer, headers):
    if "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            chunk = await reader.read(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("upstream closed mid-body")
            writer.write(chunk)
            left -= len(chunk)
            await writer.drain()
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            writer.write(size_line)
            n = int(size_line.split(b";")[0].strip(), 16)
            data = await reader.readexactly(n + 2)
            writer.write(data)
            await writer.drain()
            if n == 0:
                break


async def serve(client_r, client_w, a, counts):
    up_r = up_w = None
    try:
        while True:
            try:
                head, first, headers = await read_head(client_r)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            body = b""
            if int(headers.get("content-length", "0") or 0) > 0:
                body = await client_r.readexactly(int(headers["content-length"]))
            if not counts.admit(a.rps):
                client_w.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                               + f"Content-Length: {len(SLOWDOWN)}\r\n\r\n".encode() + SLOWDOWN)
                await client_w.drain()
                continue
            part = is_part(first, headers, a.part_bytes)
            counts.in_flight += 1
            counts.parts_in_flight += part
            counts.max_in_flight = max(counts.max_in_flight, counts.in_flight)
            counts.max_parts_in_flight = max(counts.max_parts_in_flight, counts.parts_in_flight)
            try:
                if a.delay_ms:
                    await asyncio.sleep(a.delay_ms / 1000)
                if up_w is None:
                    host, port = a.upstream.rsplit(":", 1)
                    up_r, up_w = await asyncio.open_connection(host, int(port))
                up_w.write(head + body)
                await up_w.drain()
                rhead, rfirst, rheaders = await read_head(up_r)
                client_w.write(rhead)
                if not first.startswith("HEAD "):
                    await relay_body(up_r, client_w, rheaders)
                await client_w.drain()
            finally:
                counts.in_flight -= 1
                counts.parts_in_flight -= part
            if rheaders.get("connection", "").lower() == "close":
                up_w.close()
                up_r = up_w = None
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        client_w.close()
        if up_w is not None:
            up_w.close()


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--rps", type=float, default=1e9)
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--part-bytes", type=int, default=0, help="count ranged GETs of whole shards' parts of this size")
    ap.add_argument("--stats", required=True)
    a = ap.parse_args()
    counts = Counts()
    host, port = a.listen.rsplit(":", 1)
    server = await asyncio.start_server(lambda r, w: serve(r, w, a, counts), host, int(port))
    addr = server.sockets[0].getsockname()
    print(f"listening {addr[0]}:{addr[1]}", flush=True)
    stop = asyncio.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(s, stop.set)

    def dump():
        tmp = a.stats + ".tmp"
        with open(tmp, "w") as f:
            json.dump(counts.doc(), f)
        os.replace(tmp, a.stats)

    while not stop.is_set():
        dump()
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    dump()
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
