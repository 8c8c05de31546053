"""The TUI in a browser: `python -m tui FILE --web PORT` (textual-serve, what `textual serve` runs)
opened in headless Chromium draws the TUI: the screenshot shows the timeline's highlighted step row in
the theme's accent orange and the many colours of the panes, not a blank or loading page."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def _png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG (what Chromium writes)."""
    pos, chunks, width = 8, b"", 0
    while pos < len(png):
        (n,), kind = struct.unpack(">I", png[pos:pos + 4]), png[pos + 4:pos + 8]
        data = png[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", data[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            chunks += data
        pos += 12 + n
    raw, rows, prev, stride = zlib.decompress(chunks), [], bytearray(width * bpp), width * bpp
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, bpp, rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_textual_serve_draws_the_tui_in_chromium(tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.fail("needs Debian's chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    server = subprocess.Popen([sys.executable, "-m", "tui", "traces/speculative.wbtrace", "--step", "9", "--request",
                               "req-1", "--no-times", "--web", f"127.0.0.1:{port}"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(f"http://127.0.0.1:{port}/")
            orange = 0
            for _ in range(60):  # the TUI process starts per page: wait for its first frame
                page.wait_for_timeout(1000)
                png = page.screenshot()
                width, bpp, rows = _png_pixels(png)
                pixels = [row[i:i + 3] for row in rows[::4] for i in range(0, width * bpp, bpp * 4)]
                orange = sum(1 for p in pixels if p[0] > 200 and 120 < p[1] < 190 and p[2] < 90)
                if orange > 200:
                    break
            (tmp_path / "tui_web.png").write_bytes(png)
            browser.close()
        assert orange > 200, f"no TUI drawn (see {tmp_path / 'tui_web.png'})"
        assert len(set(pixels)) > 50
    finally:
        server.terminate()
        server.wait(timeout=30)
