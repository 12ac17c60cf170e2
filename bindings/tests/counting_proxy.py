"""An HTTP/1.1 proxy in front of the S3 server that records every request it forwards.

Tests put it between ramjet and SeaweedFS to count origin requests independently of ramjet's
own counters: `requests()` gives (method, path, range header) for each request, in order.
Keep-alive connections, Content-Length and chunked bodies are relayed as they are; each client
connection gets one upstream connection.

As a program it relays until killed and prints each request:
    python counting_proxy.py LISTEN_HOST:PORT UPSTREAM_HOST:PORT
"""

import socket
import threading


def _read_head(f):
    lines = []
    while True:
        line = f.readline(65536)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            return lines


def _headers(lines):
    h = {}
    for line in lines[1:]:
        k, _, v = line.decode("latin-1").partition(":")
        if v:
            h[k.strip().lower()] = v.strip()
    return h


def _copy(src, dst, n):
    while n:
        b = src.read(min(n, 1 << 16))
        if not b:
            raise EOFError
        dst.write(b)
        n -= len(b)


def _relay_body(src, dst, h, *, response_to_head=False, status=200):
    if response_to_head or status in (204, 304) or 100 <= status < 200:
        return
    if h.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = src.readline(65536)
            dst.write(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    t = src.readline(65536)
                    dst.write(t)
                    if t in (b"\r\n", b"\n", b""):
                        break
                return
            _copy(src, dst, size + 2)  # the chunk and its CRLF
    _copy(src, dst, int(h.get("content-length", "0") or 0))


class CountingProxy:
    def __init__(self, listen_host, upstream, port=0):
        self.upstream = upstream
        self._log = []
        self._lock = threading.Lock()
        self._srv = socket.create_server((listen_host, port))
        self.address = "%s:%d" % self._srv.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def requests(self):
        with self._lock:
            return list(self._log)

    def close(self):
        self._srv.close()

    def _accept(self):
        while True:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        try:
            u = socket.create_connection(self.upstream)
        except OSError:
            c.close()
            return
        cf, uf = c.makefile("rb"), u.makefile("rb")
        cw, uw = c.makefile("wb"), u.makefile("wb")
        try:
            while True:
                head = _read_head(cf)
                if head is None:
                    return
                method, path = head[0].decode("latin-1").split()[:2]
                h = _headers(head)
                with self._lock:
                    self._log.append((method, path, h.get("range")))
                uw.write(b"".join(head))
                _relay_body(cf, uw, h)
                uw.flush()
                rhead = _read_head(uf)
                if rhead is None:
                    return
                status = int(rhead[0].split()[1])
                rh = _headers(rhead)
                cw.write(b"".join(rhead))
                _relay_body(uf, cw, rh, response_to_head=(method == "HEAD"), status=status)
                cw.flush()
        except (OSError, EOFError, ValueError, IndexError):
            pass
        finally:
            for s in (c, u):
                try:
                    s.close()
                except OSError:
                    pass


if __name__ == "__main__":
    import sys
    import time

    lh, lp = sys.argv[1].rsplit(":", 1)
    uh, up = sys.argv[2].rsplit(":", 1)
    p = CountingProxy(lh, (uh, int(up)), port=int(lp))
    print(f"relaying {p.address} -> {sys.argv[2]}", flush=True)
    seen = 0
    while True:
        time.sleep(0.5)
        r = p.requests()
        for m, path, rng in r[seen:]:
            print(m, path, rng or "", flush=True)
        seen = len(r)
