"""A bisect result in a notebook (issue 35): added vs propagated error by layer.

Owns: `bisect_figure`, one plotly figure of a stored `workbench bisect` row (trace/bisect_store.py):
per decoder layer the error the layer adds itself (the suspect numerics on the reference's input),
the error it carries on (the reference layer on the suspect's input), the total, and the floor of
the suspect's dtype (against a batch context: the growth of the difference per layer and the
total, no carried line), on a log axis, with the first layer over its floor marked; hover names each
layer's worst sub-block and its ratio to its floor. Reads the stored row, never torch or the engine.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from workbench.trace.bisect_store import BLOCK_LABEL, read_bisects


def stored_bisect(source: Any, key: str | None = None) -> dict[str, Any]:
    """The stored bisect row `key` (REQ:POS:AGAINST) of a trace (path or open Trace); without `key`
    the last stored layer bisect. ValueError naming the stored keys when there is none."""
    rows = [r for r in read_bisects(source) if isinstance(r.get("layers"), list)]
    if key is not None:
        rows = [r for r in rows if r["key"] == key]
    if not rows:
        known = [r["key"] for r in read_bisects(source)]
        raise ValueError(f"no stored bisect {key or ''} in this trace (run `workbench bisect T --at REQ:POS`); "
                         f"stored: {known}")
    return rows[-1]


def _floor0(x: Any) -> float | None:
    return x if isinstance(x, (int, float)) and x > 0 else None  # a log axis cannot draw 0


def bisect_figure(source: Any, key: str | None = None) -> go.Figure:
    """Added vs propagated error by layer for a stored bisect row (`source`: a row, a trace path or an
    open Trace)."""
    row = source if isinstance(source, dict) else stored_bisect(source, key)
    layers = row["layers"]
    xs = [x["layer"] for x in layers]
    added = "growth" if row.get("kind") == "context" else "added"  # a context: how much the layer grew the difference
    hover = []
    for x in layers:
        blocks = sorted((b for b in x["blocks"] if b.get("ratio") is not None), key=lambda b: -b["ratio"])
        worst = f"{BLOCK_LABEL.get(blocks[0]['block'], blocks[0]['block'])} {blocks[0]['ratio']:.3g}x its floor" \
            if blocks else "-"
        carried = "-" if x["propagated"] is None else f"{x['propagated']:.3g}"  # None: a context (not separable)
        hover.append(f"layer {x['layer']}<br>{added} {x['added']:.3g} ({(x['ratio'] or 0):.3g}x floor)"
                     f"<br>carried {carried}<br>total {x['total']:.3g}<br>worst sub-block: {worst}")
    fig = go.Figure()
    fig.add_bar(x=xs, y=[_floor0(x["added"]) for x in layers], name=f"{added} by the layer", hovertext=hover,
                hoverinfo="text", marker_color="#d62728")
    if any(x["propagated"] is not None for x in layers):
        fig.add_scatter(x=xs, y=[_floor0(x["propagated"]) for x in layers], name="carried from before",
                        mode="lines+markers", line_color="#1f77b4", hoverinfo="skip")
    fig.add_scatter(x=xs, y=[_floor0(x["total"]) for x in layers], name="total at the layer's output",
                    mode="lines", line={"color": "#7f7f7f", "dash": "dot"}, hoverinfo="skip")
    fig.add_scatter(x=xs, y=[_floor0(x["floor"] * row.get("factor", 1.0)) for x in layers],
                    name=f"floor ({row.get('factor', 1.0):g}x one rounding)", mode="lines",
                    line={"color": "#2ca02c", "dash": "dash"}, hoverinfo="skip")
    first = row.get("first_layer")
    title = f"{row['req_id']}:{row['position']} {row['reference']} vs {row['against']}"
    if first is not None:
        fig.add_vline(x=first, line_dash="dot", line_color="#d62728")
        title += f": first over its floor: layer {first}, {BLOCK_LABEL.get(row['first_block'], row['first_block'])}"
    else:
        title += ": no layer adds more than its floor"
    fig.update_layout(title=title, xaxis_title="decoder layer", yaxis_title="L2 error at the deciding row",
                      yaxis_type="log", barmode="overlay", height=420, legend={"orientation": "h", "y": -0.2})
    return fig


__all__ = ["bisect_figure", "stored_bisect"]
