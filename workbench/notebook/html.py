"""Static HTML pages of the notebook viewers, for places without widgets (a file, a browser, a CI log).

Owns: laying out the viewer's figures in one page with plotly.js embedded inline (once), so the
page renders with no network, and screenshots of such a page in headless Chromium. Does not own: the figures (figures.py) or the selection (viewer.py).
"""

from __future__ import annotations

import html
import os
import pathlib
import shutil
import subprocess
import tempfile
from collections.abc import Mapping

import plotly.graph_objects as go

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 16px; background: #fff; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px 0; }
.summary { margin: 0 0 12px 0; padding: 8px; background: #f6f6f6; border-radius: 4px; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
.wide { grid-column: 1 / span 2; }
"""
_WIDE = ("tokens",)


def plotly_js() -> str:
    """The plotly.js bundle shipped with the plotly package (about 4.8 MB)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def figure_divs(figs: Mapping[str, go.Figure]) -> str:
    """Each figure as a `<div>` (no plotly.js), the wide panels spanning both columns."""
    parts = []
    for name, fig in figs.items():
        div = fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"wb-{name}",
                          config={"displaylogo": False, "displayModeBar": False})
        parts.append(f"<div class='panel {'wide' if name in _WIDE else ''}' data-panel='{name}'>{div}</div>")
    return "<div class='grid'>" + "\n".join(parts) + "</div>"


def render_page(title: str, summary_html: str, figs: Mapping[str, go.Figure], full_html: bool = True,
                include_plotlyjs: bool = True) -> str:
    """A page with a title, a summary block and the figures, plotly.js inline unless told otherwise.

    `full_html=False` gives a `<div>` fragment (for a notebook cell or a page of one's own);
    `include_plotlyjs=False` leaves plotly.js out, for a page that already loads it.
    """
    body = (f"<h1>{html.escape(title)}</h1><div class='summary'>{summary_html}</div>\n"
            f"{figure_divs(figs)}")
    script = f"<script type='text/javascript'>{plotly_js()}</script>" if include_plotlyjs else ""
    if not full_html:
        return f"<div class='wb-viewer'><style>{_STYLE}</style>{script}{body}</div>"
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style>{script}</head><body>{body}</body></html>")


CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The path of a Chromium/Chrome binary on PATH, or None."""
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


def screenshot(html_path: str | os.PathLike[str], png_path: str | os.PathLike[str], width: int = 1200,
               height: int = 1600, timeout: float = 120.0) -> None:
    """Render a local HTML file in headless Chromium and save a PNG screenshot (offline; no GPU).

    RuntimeError when no Chromium is installed (Debian: `apt-get install -y chromium`) or it fails.
    """
    binary = find_chromium()
    if binary is None:
        raise RuntimeError("no chromium on PATH; install it (Debian: apt-get install -y chromium)")
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 10000:
            raise ValueError(f"{name} must be an integer in [100, 10000], got {value!r}")
    url = pathlib.Path(html_path).resolve().as_uri()
    pathlib.Path(png_path).unlink(missing_ok=True)  # a stale file must not pass for a new screenshot
    with tempfile.TemporaryDirectory(prefix="wb-chromium-") as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", "--hide-scrollbars",
               "--virtual-time-budget=5000", f"--screenshot={os.fspath(png_path)}", url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0 or not os.path.exists(png_path):
        raise RuntimeError(f"chromium failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
