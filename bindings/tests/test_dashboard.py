"""The live dashboard in a real browser: Debian's headless Chromium, driven by Playwright with
`executable_path` set to it (Playwright's own browser download is never used).

Two `ramjet serve` daemons in a ring with an API key, the first with its HTTP port on a
non-loopback address (0.0.0.0, so it asks for the read credential), and a reader streaming
through it. The page lists both nodes and the job; its figures match `/stats` within one
refresh; freezing the ring shows it frozen; a SIGKILLed daemon shows down; a
missing or wrong credential gets 401 and no data; two ranks of one job stepping at different
paces show as the job's step-time skew, the slow rank named. The screenshot goes to the
test's temporary folder; RAMJET_DASHBOARD_PNG=docs/img/dashboard.png asks for the docs' one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import ramjet
from ports import free_port
from ramjet_cli import RAMJET, run

KEY = "dashboard-test-key"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"



def get(addr, path, token=None):
    """(status, body) of GET http://addr/path, with a bearer token if given."""
    req = urllib.request.Request(f"http://{addr}{path}")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_for(what, cond, timeout):
    t0 = time.monotonic()
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def serve(tmp_path, name, me, members, http):
    sock = tmp_path / f"{name}.sock"
    env = dict(os.environ, RAMJET_API_KEY=KEY)
    p = subprocess.Popen(
        [RAMJET, "serve", "--socket", str(sock), "--cache-dir", str(tmp_path / f"cache-{name}")]
        + ["--cache-limit", "256MiB", "--listen", me, "--advertise", me, "--http", http]
        + ["--peers", ",".join(members), "--threads", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(f"daemon {name} up", lambda: sock.exists() and get(http.replace("0.0.0.0", "127.0.0.1"), "/health")[0] == 200, 30)
    return p, sock


# A decoding consumer that leaves corrupt samples out (on_corrupt="skip"), epoch after epoch.
CORRUPT_READER = """
import sys, ramjet
ds = ramjet.StreamingDataset(sys.argv[1], batch_size=4, image_size=32, shuffle=False,
                             on_corrupt="skip", daemon=sys.argv[2])
while True:
    for _ in ds:
        pass
"""


def corrupt_folder(images, root):
    """A folder of 8 images whose third cannot be decoded (its first component names
    quantisation table 3, never defined), though its structure is valid."""
    (root / "a").mkdir(parents=True)
    for i, src in enumerate(sorted(images.iterdir())[:8]):
        data = src.read_bytes()
        if i == 2:
            sof = data.index(b"\xff\xc0")
            data = data[: sof + 12] + b"\x03" + data[sof + 13 :]
        (root / "a" / src.name).write_bytes(data)


def test_the_dashboard_in_a_real_browser(tmp_path):
    assert os.path.exists(CHROMIUM), "Debian's chromium is not installed (tools/setup.sh installs it)"
    from playwright.sync_api import sync_playwright

    run("synth", str(tmp_path / "synth"), "--samples", "48")
    run("pack", str(tmp_path / "synth"), str(tmp_path / "packed"), "--shard-size", "200KiB")
    corrupt_folder(tmp_path / "synth" / "images", tmp_path / "bad")
    run("pack", str(tmp_path / "bad"), str(tmp_path / "badpacked"))
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    port_a = free_port()
    http_a, http_b = f"0.0.0.0:{port_a}", f"127.0.0.1:{free_port()}"
    page_addr = f"127.0.0.1:{port_a}"
    da, sock_a = serve(tmp_path, "a", a, [a, b], http_a)
    db, sock_b = serve(tmp_path, "b", b, [a, b], http_b)
    token = subprocess.run([RAMJET, "token"], env=dict(os.environ, RAMJET_API_KEY=KEY), capture_output=True, text=True, check=True).stdout.strip()
    # Two ranks of one job, one on each node, the second stepping three times slower.
    readers = [
        subprocess.Popen(
            [RAMJET, "stream", str(tmp_path / "packed"), "--daemon", str(sock), "--shuffle", "none"]
            + ["--epochs", "100000", "--step-ms", str(step_ms), "--prefetch", "1KiB"]
            + ["--rank", str(rank), "--world", "2"],
            env=dict(os.environ, RAMJET_JOB="browser-test"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, (sock, step_ms) in enumerate([(sock_a, 20), (sock_b, 60)])
    ]
    readers.append(
        subprocess.Popen(
            [sys.executable, "-c", CORRUPT_READER, str(tmp_path / "badpacked"), str(sock_a)],
            env=dict(os.environ, RAMJET_JOB="browser-corrupt"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    lease = None
    try:
        # No credential, or a wrong one, on the non-loopback port: 401 and nothing about
        # datasets or jobs. The probes stay open.
        for path in ["/", "/cluster", "/stats", "/metrics", "/jobs"]:
            for tok in [None, "0" * 64, token[:-1] + ("0" if token[-1] != "0" else "1"), "not-hex"]:
                status, body = get(page_addr, path, tok)
                assert status == 401, (path, tok, status, body)
                assert "packed" not in body and "browser-test" not in body and "members" not in body, body
        assert get(page_addr, "/health")[0] == 200
        # With it: data. The loopback port of the other daemon asks for nothing.
        assert get(page_addr, "/stats", token)[0] == 200
        assert get(http_b, "/stats")[0] == 200

        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
                + ["--disable-background-networking", "--disable-component-update", "--disable-sync"],
            )
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            # The printed URL carries the token; the daemon sets a cookie and drops it from the URL.
            page.goto(f"http://{page_addr}/?token={token}")
            assert page.url.rstrip("/") == f"http://{page_addr}", page.url
            page.wait_for_selector(f'tr[data-node="{a}"]', timeout=15_000)
            page.wait_for_selector(f'tr[data-node="{b}"]', timeout=15_000)
            for n in (a, b):
                state = page.get_attribute(f'tr[data-node="{n}"]', "data-state")
                assert state in ("ready", "up"), (n, state)
            page.wait_for_selector('tr[data-job="browser-test"]', timeout=20_000)
            assert "browser-test" in page.inner_text("#jobs")

            # Figures match /stats within one refresh: /stats before, two page refreshes (the
            # second gathered after it), the page's figures, /stats after.
            def updated():
                return page.get_attribute("body", "data-updated")

            def reads(doc):
                return sum(doc["reads"].values())

            before = json.loads(get(page_addr, "/stats", token)[1])
            for _ in range(2):
                u0 = updated()
                wait_for("a page refresh", lambda: updated() != u0, 10)
            row = f'tr[data-node="{a}"]'
            on_page = sum(
                int(page.get_attribute(f"{row} td[{attr}]", attr))
                for attr in ("data-reads-cache-local", "data-reads-cache-peer", "data-reads-origin")
            )
            cached_on_page = int(page.get_attribute(f"{row} td[data-cache-bytes]", "data-cache-bytes"))
            after = json.loads(get(page_addr, "/stats", token)[1])
            assert reads(before) <= on_page <= reads(after), (reads(before), on_page, reads(after))
            assert on_page > 0
            assert min(before["cache_bytes"], after["cache_bytes"]) <= cached_on_page <= max(before["cache_bytes"], after["cache_bytes"])
            rate = float(page.get_attribute('tr[data-job="browser-test"]', "data-wait"))
            assert 0.0 <= rate <= 1.0
            # Evenness: the job's two ranks side by side, the slow one named, each consumer's
            # step time shown (heartbeats every 2 s: wait until both have stepped).
            skew = 'table#skew tr[data-job="browser-test"]'
            page.wait_for_selector(f'{skew}[data-slowest="1"]', timeout=20_000)
            assert float(page.get_attribute(skew, "data-skew")) > 0.3, page.inner_text("#skew")
            steps = [float(page.get_attribute(f'tr[data-consumer$="/{r}.0"] td[data-step]', "data-step")) for r in (0, 1)]
            assert 0.0 < steps[0] < steps[1], steps
            # The corrupt-sample count: the decoding consumer's on the page and in /metrics,
            # none for the others.
            bad = 'tr[data-job="browser-corrupt"] td[data-corrupt]:not([data-corrupt="0"])'
            page.wait_for_selector(bad, timeout=30_000)
            assert int(page.get_attribute(bad, "data-corrupt")) >= 1
            assert page.get_attribute('tr[data-job="browser-test"] td[data-corrupt]', "data-corrupt") == "0"
            prom = get(page_addr, "/metrics", token)[1]
            skipped = [line for line in prom.splitlines() if line.startswith("ramjet_job_samples_skipped_total{job=\"browser-corrupt\"")]
            assert skipped and float(skipped[0].rsplit(" ", 1)[1]) >= 1, prom

            png = Path(os.environ.get("RAMJET_DASHBOARD_PNG", tmp_path / "dashboard.png"))
            png.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(png), full_page=True)
            assert png.stat().st_size > 10_000

            # Freezing the ring (over the Unix socket, as a trainer does) shows it frozen.
            lease = ramjet._ramjet.freeze(str(sock_a))
            page.wait_for_selector(f'tr[data-node="{a}"][data-state="frozen"]', timeout=10_000)
            lease.release()
            page.wait_for_selector(f'tr[data-node="{a}"]:not([data-state="frozen"])', timeout=10_000)

            # A daemon killed outright shows down, with the reason (60 s: a hang guard, no speed
            # asserted).
            db.send_signal(signal.SIGKILL)
            db.wait()
            page.wait_for_selector(f'tr[data-node="{b}"][data-state="down"]', timeout=60_000)
            assert page.inner_text(f'tr[data-node="{b}"] .err')
            browser.close()
    finally:
        if lease is not None:
            lease.release()
        for proc in (*readers, da, db):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
