"""The notebook's view of a reference check, and of what a trace's source did not record.

Owns: `not_recorded(source)` (the event kinds an external engine does not report, from the trace's
meta), `not_recorded_figure` (the panel that says so, instead of an empty or zero chart),
`source_checks(source)` (the stored `workbench check` results) and `reference_figure` (Δlogprob by
output position, engine minus reference, with real divergences and near ties marked). Reads
traces through workbench.trace only. Does not own computing a check (workbench/external/check.py).
"""

from __future__ import annotations

import html
import math
from typing import Any

import plotly.graph_objects as go

from workbench.notebook.figures import HEIGHT, _figure, _note, show_token
from workbench.trace.checks import read_checks

MARKS = {"real": ("real divergence", "#d62728", "x"), "near_tie": ("near tie", "#ff9f1c", "diamond"),
         "logprob": ("logprob beyond tolerance", "#9467bd", "x"),
         "floor": ("inside the noise floor", "#17becf", "circle")}


def _meta(source: Any) -> dict[str, Any]:
    trace = getattr(source, "trace", None)
    meta = getattr(trace, "meta", None)
    return meta if isinstance(meta, dict) else {}


def not_recorded(source: Any) -> frozenset[str]:
    """Event kinds the trace's source does not report (empty for this engine's own traces)."""
    value = _meta(source).get("not_recorded")
    return frozenset(str(v) for v in value) if isinstance(value, list) else frozenset()


def not_recorded_figure(title: str, height: int = HEIGHT) -> go.Figure:
    return _note(_figure(title, height), "not recorded: an external engine reports only its stream "
                                         "(tokens, logprobs, top-k, finish reason, usage, chunk times)")


def source_checks(source: Any) -> dict[str, dict[str, Any]]:
    """The stored check of a trace file, by request ({} for events in memory or an unchecked trace)."""
    trace = getattr(source, "trace", None)
    return read_checks(trace) if trace is not None else {}


def reference_figure(check: dict[str, Any] | None, req_id: str | None, meta_check: Any = None) -> go.Figure:
    """Δlogprob (engine minus reference) by output position; divergences marked, hover tells all."""
    title = "Δlogprob vs the reference"
    if check is None or not check.get("positions"):
        return _note(_figure(title, 260), "not checked: run  workbench check TRACE --reference MODEL")
    points = [p for p in check["positions"] if isinstance(p, dict)]
    xs = [p.get("position") for p in points]
    ys = [p["delta"] if isinstance(p.get("delta"), (int, float)) else math.nan for p in points]
    hover = [_hover(p) for p in points]
    ref = ""
    if isinstance(meta_check, dict):
        ref = f" ({html.escape(str(meta_check.get('reference', '')), quote=False)}, tolerance {meta_check.get('tolerance')})"
    counts = {v: sum(1 for p in points if p.get("verdict") == v) for v in MARKS}
    fig = _figure(f"{html.escape(str(req_id), quote=False)}: Δlogprob by position vs the reference{ref}<br><sup>"
                  f"{counts['real'] + counts['logprob']} real divergences, {counts['near_tie']} near ties</sup>", 300)
    fig.add_trace(go.Bar(name="Δlogprob", x=xs, y=ys, hovertext=hover, hoverinfo="text", marker_color="#1f77b4"))
    for verdict, (label, colour, symbol) in MARKS.items():
        marked = [i for i, p in enumerate(points) if p.get("verdict") == verdict]
        if marked:
            fig.add_trace(go.Scatter(
                name=label, x=[xs[i] for i in marked], y=[0.0 if math.isnan(ys[i]) else ys[i] for i in marked],
                mode="markers+text", text=[label] * len(marked), textposition="top center",
                hovertext=[hover[i] for i in marked], hoverinfo="text",
                marker={"color": colour, "symbol": symbol, "size": 14, "line": {"width": 1, "color": "#222"}}))
    fig.update_xaxes(title_text="output position")
    fig.update_yaxes(title_text="engine − reference logprob")
    return fig


def client_timing_figure(finished: Any) -> go.Figure:
    """A probed request's chunk timing as its client saw it: the gap before each output token
    (the first bar is the TTFT), with the server's own timings from OTLP spans when they were joined."""
    timings = getattr(finished, "timings", None)
    if not isinstance(timings, dict) or timings.get("clock") != "client":
        return _note(_figure("client timing", 260), "no client timings for this request")
    gaps = [timings.get("ttft")] + list(timings.get("itl") or [])
    ms = [1000 * g if isinstance(g, (int, float)) else math.nan for g in gaps]
    server = timings.get("server") if isinstance(timings.get("server"), dict) else {}
    told = "  ".join(f"{k[:-2]} {1000 * v:.1f} ms" for k, v in server.items() if isinstance(v, (int, float)))
    e2e = timings.get("e2e")
    title = (f"client timing: TTFT {ms[0]:.1f} ms, e2e {1000 * e2e:.1f} ms" if isinstance(e2e, (int, float))
             else "client timing") + f"<br><sup>server: {told or 'not recorded (probe --otlp-port joins its spans)'}</sup>"
    fig = _figure(title, 280)
    fig.add_trace(go.Bar(name="gap", x=list(range(len(ms))), y=ms, marker_color=["#ff7f0e"] + ["#1f77b4"] * (len(ms) - 1),
                         hovertemplate="token %{x}: %{y:.1f} ms after the previous one<extra></extra>"))
    fig.update_xaxes(title_text="output position")
    fig.update_yaxes(title_text="ms since the previous token (first: since sent)")
    return fig


def _hover(p: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, (int, float)) else "—"

    token = html.escape(show_token(str(p.get("text", ""))), quote=False)
    argmax = html.escape(show_token(str(p.get("ref_argmax_text", ""))), quote=False)
    return (f"<b>{token}</b> (id {p.get('token_id')}) · position {p.get('position')} · {p.get('verdict')}<br>"
            f"engine {f(p.get('engine_logprob'))} · reference {f(p.get('ref_logprob'))} · Δ {f(p.get('delta'))}<br>"
            f"reference argmax {argmax} (id {p.get('ref_argmax')}) · margin {f(p.get('ref_margin'))} · "
            f"rank {p.get('rank')}<br>top-k KL {f(p.get('topk_kl'))} · overlap {f(p.get('topk_overlap'))}")
