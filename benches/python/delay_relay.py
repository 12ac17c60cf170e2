"""A TCP relay that adds a fixed one-way delay in each direction: the round-trip time of the
WAN-like link of tools/ramjet-bench, for kernels built without sch_netem.

    python delay_relay.py --listen 10.77.0.2:8333 --to 127.0.0.1:8433 --rtt-ms 20

It runs inside the origin's network namespace; the veth it listens on is rate-shaped with tbf
there. Every chunk read from one side is written to the other side rtt/2 after it arrived, so
throughput is unchanged and each request/response exchange costs one RTT. The first client
chunk of a connection waits one more RTT: the handshake the relay's early accept hid.
"""

import argparse
import asyncio
import sys
import time


async def pump(reader, writer, delay, first_extra):
    """Copies reader to writer, each chunk `delay` seconds after it arrived."""
    queue: asyncio.Queue = asyncio.Queue()

    async def read():
        extra = first_extra
        while True:
            data = await reader.read(1 << 16)
            queue.put_nowait((time.monotonic() + delay + extra, data))
            extra = 0.0
            if not data:
                return

    async def write():
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--to", required=True)
    p.add_argument("--rtt-ms", type=float, required=True)
    a = p.parse_args()
    lh, lp = a.listen.rsplit(":", 1)
    th, tp = a.to.rsplit(":", 1)
    one_way = a.rtt_ms / 2000.0

    async def handle(cr, cw):
        try:
            sr, sw = await asyncio.open_connection(th, int(tp))
        except OSError as e:
            print(f"delay_relay: cannot reach {a.to}: {e}", file=sys.stderr)
            cw.close()
            return
        await asyncio.gather(pump(cr, sw, one_way, 2 * one_way), pump(sr, cw, one_way, 0.0))

    server = await asyncio.start_server(handle, lh, int(lp), backlog=512)
    print(f"delay_relay: {a.listen} -> {a.to}, rtt {a.rtt_ms} ms", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
