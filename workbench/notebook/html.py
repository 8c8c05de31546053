"""Static HTML pages of the notebook viewers, for places without widgets (a file, a browser, a CI log).

Owns: laying out the viewer's figures in one page with plotly.js embedded inline (once), so the
page renders with no network. Does not own: the figures (figures.py) or the selection (viewer.py).
"""

from __future__ import annotations

import html
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
                          config={"displaylogo": False, "responsive": True})
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
