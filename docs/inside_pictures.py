"""Regenerates the README's pictures of capture inside the forward pass (issue 18): the TUI's layers
pane (docs/inside_tui.svg, Textual's own SVG export) and the notebook's logit-lens heatmap and
attention view (docs/inside_notebook.png, the figures' HTML page in headless Chromium).

    python docs/inside_pictures.py [--trace FILE]   # default: capture one smollm2 request first
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "The capital of France is Paris. The capital of Italy is"


def make_trace(path: str) -> None:
    from workbench import Engine, SamplingParams

    with Engine("smollm2", trace=path) as engine:
        engine.add_request("Write a haiku about the sea.", SamplingParams(temperature=0, max_new_tokens=8))
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_new_tokens=6), req_id="capital",
                           capture={"attention_topk": 8})
        while engine.has_work():
            engine.step()


async def shoot_tui(trace: str, out: Path) -> None:
    from textual.widgets import Static  # noqa: F401 - Textual loads before the app

    from tui.app import WorkbenchApp
    from workbench.trace.reader import open_trace

    with open_trace(trace) as t:
        step = t.capture("capital", 0).step
    app = WorkbenchApp(trace, step=step, request="capital")
    async with app.run_test(size=(150, 44)) as pilot:
        screen = app.main
        for _ in range(400):
            if screen.view is not None and screen.view.step == step:
                break
            await pilot.pause(0.05)
        await pilot.pause(0.5)
        pane = screen.query_one("#layers")
        pane.focus()
        screen.maximize(pane)
        await pilot.pause(0.5)
        app.save_screenshot(out.name, str(out.parent))


def shoot_notebook(trace: str, out: Path) -> None:
    from workbench.notebook.html import plotly_js, screenshot
    from workbench.notebook.inside import attention_figure, lens_figure
    from workbench.trace.reader import open_trace

    with open_trace(trace) as t:
        figs = [lens_figure(t, "capital", position=0).update_layout(width=1150, height=760),
                attention_figure(t, "capital", 0).update_layout(width=1150, height=760)]
    divs = "".join(f.to_html(full_html=False, include_plotlyjs=False, config={"displayModeBar": False}) for f in figs)
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "inside.html")
        Path(page).write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><script>{plotly_js()}</script>"
                              f"</head><body style='margin:8px'>{divs}</body></html>")
        screenshot(page, out, width=1180, height=1540)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="a trace with request 'capital' captured")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="inside-pictures-") as tmp:
        trace = args.trace or os.path.join(tmp, "inside.wbtrace")
        if args.trace is None:
            make_trace(trace)
        asyncio.run(shoot_tui(trace, ROOT / "docs" / "inside_tui.svg"))
        shoot_notebook(trace, ROOT / "docs" / "inside_notebook.png")
    print("wrote docs/inside_tui.svg and docs/inside_notebook.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
