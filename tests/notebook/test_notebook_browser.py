"""A viewer exported with `to_html()` and opened in headless Chromium shows its plotly figures:
checked on the screenshot's pixels (the panels' own colours), against a page without plotly.js."""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.notebook_scenario import write_scenario
from workbench.notebook import TraceViewer
from workbench.notebook.html import screenshot


@pytest.fixture(autouse=True)
def _needs_chromium(chromium: str) -> None:  # every test here drives the browser: fails without one
    pass


# colours only plotly draws on this page: batch bars of the selected request, the KV line, the spec
# strip's accepted and rejected cells
PANEL_COLOURS = {"batch bars": (0x1F, 0x77, 0xB4), "KV line": (0xFF, 0x7F, 0x0E),
                 "accepted drafts": (0x2C, 0xA0, 0x2C), "rejected draft": (0xD6, 0x27, 0x28)}


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) into rows of RGB bytes."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        header = body if kind == b"IHDR" else header
        chunks += [body] if kind == b"IDAT" else []
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour in (2, 6) and interlace == 0
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(b"".join(chunks)), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a, b = line[i - bpp] if i >= bpp else 0, prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            pred = (0, a, b, (a + b) // 2, _paeth(a, b, c))[kind]
            line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return width, height, rows


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def colour_counts(rows: list[bytes]) -> Counter:
    counts: Counter = Counter()
    for row in rows:
        counts.update(row[i:i + 3] for i in range(0, len(row), 3))
    return counts


def near(counts: Counter, rgb: tuple[int, int, int], tol: int = 12) -> int:
    return sum(n for px, n in counts.items() if all(abs(px[i] - rgb[i]) <= tol for i in range(3)))


def test_exported_viewer_renders_its_figures_in_chromium(tmp_path: Path) -> None:
    viewer = TraceViewer(str(write_scenario(tmp_path / "t.wbtrace")), req_id="req-b", step=3, widgets=False)
    page, bare = tmp_path / "viewer.html", tmp_path / "bare.html"
    viewer.to_html(page)
    viewer.to_html(bare, include_plotlyjs=False)  # the same page with no plotly.js: nothing draws
    screenshot(page, tmp_path / "viewer.png")
    screenshot(bare, tmp_path / "bare.png")
    width, height, rows = read_png(tmp_path / "viewer.png")
    assert (width, height) == (1200, 1600)
    drawn, blank = colour_counts(rows), colour_counts(read_png(tmp_path / "bare.png")[2])
    for name, rgb in PANEL_COLOURS.items():
        assert near(drawn, rgb) > 150, f"{name} not drawn"
        assert near(blank, rgb) == 0, f"{name} appears without plotly.js"
    # the token figure (top of the page) is drawn: many colours (colour scale, markers, text)
    top = colour_counts(rows[80:450])
    assert len(top) > 200 and sum(n for px, n in top.items() if px != b"\xff\xff\xff") > 5000
