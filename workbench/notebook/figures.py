"""Plotly figures built from trace data: pure functions, one per viewer panel.

Owns: how each panel draws its data (tokens coloured by logprob with their alternatives on hover,
the sampling-stage waterfall, the speculative accept/reject strip, batch size and KV usage over
steps, the finish decision, a request's latency waterfall from arrival to the socket). Each function takes plain records (events, `RequestView`, `StepInfo`)
and the selected step, and returns a new `go.Figure`; no widgets, no state, no I/O.
Does not own: choosing what is selected (viewer.py) or reading traces (data.py).
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.notebook.data import RequestView
from workbench.trace.events import FinishDecision, RequestFinished, SamplingStages, SpecVerify
from workbench.trace.latency import ROW_STAGES, RequestLatency
from workbench.trace.reader import StepInfo

HEIGHT = 320
ACCEPT, REJECT, DISCARD = 1.0, 0.0, 0.5  # spec strip cell values (discarded: after the first rejection)
_SPEC_COLOURS = [[0.0, "#d62728"], [0.25, "#d62728"], [0.25, "#c7c7c7"], [0.75, "#c7c7c7"],
                 [0.75, "#2ca02c"], [1.0, "#2ca02c"]]


def show_token(text: str) -> str:
    """A token's text with its whitespace made visible (␣ for a space, ⏎ for a newline)."""
    return text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") if text else "∅"


Vocab = Mapping[int, str] | Callable[[int], str]  # token id -> text: a table, or e.g. a tokenizer's decode


def token_label(token_id: int, vocab: Vocab) -> str:
    """A token's visible text from `vocab` (a mapping or a function), or `#id` when it is unknown."""
    if callable(vocab):
        return show_token(vocab(token_id))
    return show_token(vocab[token_id]) if token_id in vocab else f"#{token_id}"


# A small white template: plotly's named templates are deep-copied into every figure, which made
# a viewer redraw cost ~5x more (it matters to LiveView, which redraws while the engine runs).
_GRID = {"gridcolor": "#ebf0f8", "zerolinecolor": "#ebf0f8", "linecolor": "#ebf0f8", "automargin": True}
TEMPLATE = {"layout": {
    "paper_bgcolor": "white", "plot_bgcolor": "white", "font": {"color": "#2a3f5f"}, "xaxis": _GRID,
    "yaxis": _GRID, "colorway": ["#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A", "#19d3f3", "#FF6692",
                                 "#B6E880", "#FF97FF", "#FECB52"],
    "hoverlabel": {"align": "left"}}}


def _figure(title: str, height: int = HEIGHT) -> go.Figure:
    return go.Figure(layout={"title": {"text": title, "font": {"size": 14}}, "height": height, "template": TEMPLATE,
                             "margin": {"l": 50, "r": 20, "t": 45, "b": 40}, "showlegend": False})


def _note(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 13, "color": "#777"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


# --- tokens ------------------------------------------------------------------------------------


def _token_hover(token: Any) -> str:
    lp = "n/a" if token.logprob is None else f"{token.logprob:.3f}"
    lines = [f"<b>{html.escape(show_token(token.text), quote=False)}</b> (id {token.token_id})",
             f"position {token.position} · step {token.step} · {token.source}",
             f"logprob {lp} · rank {token.rank}", "<i>alternatives</i>"]
    for alt in token.top_logprobs[:8]:
        text = alt[2] if len(alt) > 2 else f"#{alt[0]}"
        lines.append(f"{html.escape(show_token(str(text)), quote=False)}: {alt[1]:.3f}")
    return "<br>".join(lines)


def tokens_figure(req: RequestView | None, step: int | None) -> go.Figure:
    """Output tokens by position, coloured by logprob; tokens after `step` faded, the token of `step` ringed."""
    if req is None or not req.tokens:
        return _note(_figure("tokens"), "no tokens yet")
    tokens = req.tokens
    selected = req.token_at(step) if step is not None else None
    logprobs = [t.logprob if t.logprob is not None else math.nan for t in tokens]
    fig = _figure(f"{html.escape(req.req_id, quote=False)}: tokens by position (colour = logprob)")
    fig.add_trace(go.Scatter(
        name="tokens", x=[t.position for t in tokens], y=logprobs, mode="markers+text",
        text=[show_token(t.text) for t in tokens], textposition="top center", textfont={"size": 10},
        customdata=[t.step for t in tokens], hovertext=[_token_hover(t) for t in tokens], hoverinfo="text",
        marker={"color": logprobs, "colorscale": "RdYlGn", "cmin": -6.0, "cmax": 0.0, "size": 11,
                "opacity": [1.0 if step is None or t.step <= step else 0.25 for t in tokens],
                "colorbar": {"title": {"text": "logprob"}, "thickness": 12}}))
    if selected is not None:
        fig.add_trace(go.Scatter(
            name="selected", x=[selected.position], y=[selected.logprob if selected.logprob is not None else 0.0],
            mode="markers", hoverinfo="skip",
            marker={"size": 22, "color": "rgba(0,0,0,0)", "line": {"width": 3, "color": "#222"}}))
    low = min((lp for lp in logprobs if not math.isnan(lp)), default=-1.0)
    fig.update_yaxes(title_text="logprob", range=[min(low, -1.0) - 0.5, 1.0])
    fig.update_xaxes(title_text="output position")
    return fig


# --- sampling stages ---------------------------------------------------------------------------


def _stage_name(stage: dict[str, Any]) -> str:
    count = stage.get("kept_count")
    mass = stage.get("kept_mass")
    parts = [str(stage.get("name", "?"))]
    if count is not None:
        parts.append(f"kept {count:,}")
    if mass is not None:
        parts.append(f"mass {mass:.3f}")
    if stage.get("applied") is False:
        parts.append("(off)")
    return " · ".join(parts)


def shown_stages(stages: SamplingStages) -> list[dict[str, Any]]:
    """The stages worth drawing: the first (the model's distribution) and every one that was applied."""
    return [s for i, s in enumerate(stages.stages) if i == 0 or s.get("applied", True)]


def stage_tokens(stages: SamplingStages, limit: int = 12) -> list[int]:
    """The token ids the waterfall shows: the first stage's top ids, then any a later stage adds."""
    ids: list[int] = []
    for stage in shown_stages(stages):
        for tid in stage.get("top_ids", []):
            if tid not in ids:
                ids.append(int(tid))
    if stages.chosen < 0 or stages.chosen in ids[:limit]:
        return ids[:limit]
    return [t for t in ids if t != stages.chosen][:limit - 1] + [stages.chosen]  # always show the chosen one


def stage_probs(stage: dict[str, Any], ids: Sequence[int]) -> list[float]:
    """A stage's probability of each id (0 for ids outside its recorded top list: cut or negligible)."""
    probs = dict(zip(stage.get("top_ids", []), stage.get("top_probs", [])))
    return [float(probs.get(tid, 0.0)) for tid in ids]


def stages_figure(stages: SamplingStages | None, vocab: Vocab) -> go.Figure:
    """The sampling-stage waterfall for one token: the top tokens' probability after each stage, and
    how many tokens (and how much mass) each stage kept."""
    if stages is None or not stages.stages:
        return _note(_figure("sampling stages"), "no sampling stages for this token "
                                                 "(greedy without tracing, or accepted from a draft)")
    shown = shown_stages(stages)
    off = [str(s.get("name", "?")) for s in stages.stages if s not in shown]
    ids = stage_tokens(stages)
    labels = [token_label(t, vocab) for t in ids]
    chosen = token_label(stages.chosen, vocab) if stages.chosen >= 0 else "?"
    draw = "greedy (argmax)" if stages.greedy else f"draw u={stages.draw:.3f}" if stages.draw is not None else ""
    peak = max((max(stage_probs(st, ids), default=0.0) for st in shown), default=0.0)
    traces = [go.Bar(name=_stage_name(st), x=labels, y=stage_probs(st, ids),
                     hovertemplate="%{x}: %{y:.4f}<extra>%{fullData.name}</extra>") for st in shown]
    traces.append(go.Bar(name="kept", x=[str(st.get("name", "?")) for st in shown], xaxis="x2", yaxis="y2",
                         y=[st.get("kept_count") or 0 for st in shown], marker_color="#7f7f7f",
                         text=[_kept_text(st) for st in shown], textposition="outside", showlegend=False,
                         hovertemplate="%{x}: %{y:,} tokens<extra></extra>"))
    notes = [_subtitle("probability after each stage", 0.36), _subtitle("tokens kept", 0.89)]
    if chosen in labels:
        notes.append({"x": chosen, "y": peak, "xref": "x", "yref": "y", "text": "chosen", "showarrow": True,
                      "arrowhead": 2, "ax": 0, "ay": -25})
    title = (f"sampling stages · position {stages.position} (step {stages.step}) · "
             f"chose {html.escape(chosen, quote=False)} · {draw}"
             + (f"<br><sup>stages off: {', '.join(off)}</sup>" if off else ""))
    return go.Figure(data=traces, layout={
        "title": {"text": title, "font": {"size": 14}}, "height": HEIGHT + 40, "template": TEMPLATE,
        "barmode": "group", "showlegend": True, "legend": {"orientation": "h", "y": -0.25, "font": {"size": 10}},
        "margin": {"l": 50, "r": 20, "t": 90, "b": 40}, "annotations": notes,
        "xaxis": {"domain": [0.0, 0.72]}, "yaxis": {"anchor": "x"},
        "xaxis2": {"domain": [0.8, 1.0], "anchor": "y2"}, "yaxis2": {"anchor": "x2", "type": "log"}})


def _subtitle(text: str, x: float) -> dict[str, Any]:
    return {"text": text, "x": x, "y": 1.0, "xref": "paper", "yref": "paper", "xanchor": "center",
            "yanchor": "bottom", "showarrow": False, "font": {"size": 12}}


def _kept_text(stage: dict[str, Any]) -> str:
    mass = stage.get("kept_mass")
    return f"{mass:.2f}" if mass is not None else ""


# --- speculative decoding ----------------------------------------------------------------------


def spec_cells(verify: SpecVerify) -> list[float]:
    """Per draft position: ACCEPT, REJECT (the first rejected draft) or DISCARD (after it)."""
    cells, rejected = [], False
    for ok in verify.accepted:
        cells.append(DISCARD if rejected else ACCEPT if ok else REJECT)
        rejected = rejected or not ok
    return cells


def spec_figure(verifies: Sequence[SpecVerify], step: int | None, vocab: Vocab) -> go.Figure:
    """One row per verification, one cell per draft position: accepted, rejected, or discarded."""
    if not verifies:
        return _note(_figure("speculative decoding", 200), "no speculative steps for this request")
    width = max(len(v.accepted) for v in verifies)
    z, text, hover = [], [], []
    for v in verifies:
        cells = spec_cells(v)
        z.append(cells + [math.nan] * (width - len(cells)))
        text.append([token_label(t, vocab) for t in v.draft_tokens] + [""] * (width - len(v.draft_tokens)))
        hover.append([_spec_hover(v, i) for i in range(len(cells))] + [""] * (width - len(cells)))
    rows = [f"step {v.step}" for v in verifies]
    accepted = sum(v.num_accepted for v in verifies)
    proposed = sum(len(v.draft_tokens) for v in verifies)
    fig = _figure(f"speculative drafts: {accepted}/{proposed} accepted", max(200, 90 + 26 * len(verifies)))
    fig.add_trace(go.Heatmap(name="spec", z=z, x=list(range(width)), y=rows, text=text, texttemplate="%{text}",
                             hovertext=hover, hoverinfo="text", zmin=0.0, zmax=1.0, colorscale=_SPEC_COLOURS,
                             showscale=False, xgap=2, ygap=2))
    current = next((i for i, v in reversed(list(enumerate(verifies))) if step is not None and v.step <= step), None)
    if current is not None:
        fig.add_shape(type="rect", x0=-0.5, x1=width - 0.5, y0=current - 0.5, y1=current + 0.5,
                      line={"color": "#222", "width": 3}, name="selected")
    fig.update_xaxes(title_text="draft position (green accepted · red rejected · grey discarded)", dtick=1)
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def _spec_hover(v: SpecVerify, i: int) -> str:
    def at(values: Sequence[Any]) -> Any:
        return values[i] if i < len(values) else None

    p, q, u, target = at(v.p), at(v.q), at(v.u), at(v.target_argmax)
    parts = [f"draft {v.draft_tokens[i]} at position {i}: {'accepted' if v.accepted[i] else 'not accepted'}"]
    parts.append(" · ".join(f"{k}={x:.3f}" for k, x in (("p", p), ("q", q), ("u", u)) if x is not None))
    if target is not None:
        parts.append(f"target argmax {target}")
    if v.extra_token is not None:
        parts.append(f"then {v.extra_kind} token {v.extra_token}")
    return "<br>".join(parts)


# --- batch and KV over steps -------------------------------------------------------------------


def batch_figure(steps: Sequence[StepInfo], step: int | None, req_steps: Collection[int] = ()) -> go.Figure:
    """Batch size (bars) and KV pool usage (line, right axis) per step; the selected step marked."""
    if not steps:
        return _note(_figure("batch and KV usage"), "no steps recorded")
    xs = [s.step for s in steps]
    kv = [100.0 * s.kv_used / s.kv_total if s.kv_used is not None and s.kv_total else math.nan for s in steps]
    traces = [
        go.Bar(name="batch size", x=xs, y=[s.batch_size for s in steps],
               marker_color=["#1f77b4" if s.step in req_steps else "#aec7e8" for s in steps],
               customdata=[s.mode or "" for s in steps],
               hovertemplate="step %{x}: %{y} requests (%{customdata})<extra></extra>"),
        go.Scatter(name="KV used %", x=xs, y=kv, mode="lines", line={"color": "#ff7f0e"}, yaxis="y2",
                   hovertemplate="step %{x}: %{y:.2f}% of the KV pool<extra></extra>"),
    ]
    shapes = [] if step is None else [{"type": "line", "x0": step, "x1": step, "y0": 0, "y1": 1, "xref": "x",
                                       "yref": "paper", "line": {"width": 2, "color": "#222", "dash": "dot"}}]
    return go.Figure(data=traces, layout={
        "title": {"text": "batch size and KV usage", "font": {"size": 14}}, "height": HEIGHT - 40,
        "template": TEMPLATE, "showlegend": False, "margin": {"l": 50, "r": 50, "t": 45, "b": 40},
        "shapes": shapes, "xaxis": {"title": {"text": "step (dark bars: the selected request ran)"}},
        "yaxis": {"title": {"text": "requests"}},
        "yaxis2": {"title": {"text": "KV used %"}, "overlaying": "y", "side": "right", "rangemode": "tozero"}})


# --- finish decision ---------------------------------------------------------------------------


def finish_figure(decision: FinishDecision | None, finished: RequestFinished | None = None) -> go.Figure:
    """The finish checks of one step, in the order the engine made them, with inputs and result;
    the evidence of the check that fired, and the request's final reason once it has finished."""
    if decision is None:
        return _note(_figure("finish decision", 220), "no finish decision yet")
    title = f"finish checks at step {decision.step}: {decision.finish_reason or 'continue'}"
    notes = []
    if decision.evidence:
        notes.append(f"evidence {json.dumps(decision.evidence)}")
    if finished is not None and finished.step > decision.step:
        notes.append(f"(finished later, at step {finished.step}: {finished.finish_reason})")
    if notes:
        title += "<br><sup>" + html.escape(" ".join(notes)[:120], quote=False) + "</sup>"
    names = [str(c.get("name", "?")) for c in decision.checks]
    inputs = [html.escape(json.dumps(c.get("inputs", {}), default=str), quote=False) for c in decision.checks]
    results = ["fired" if c.get("result") else "–" for c in decision.checks]
    fill = ["#ffd8a8" if c.get("result") else "white" for c in decision.checks]
    fig = _figure(title, 120 + 36 * max(1, len(names)))
    fig.update_layout(margin={"t": 60})
    fig.add_trace(go.Table(
        name="checks", columnwidth=[0.22, 0.63, 0.15],
        header={"values": ["check", "inputs", "result"], "fill_color": "#eeeeee", "align": "left"},
        cells={"values": [names, inputs, results], "fill_color": [fill], "align": "left", "height": 22}))
    return fig


# --- latency waterfall -------------------------------------------------------------------------

ROW_STAGES_ALL = ("tokenize", "queue", *ROW_STAGES)
STAGE_COLOURS = {"tokenize": "#c7c7c7", "queue": "#9edae5", "schedule": "#aec7e8", "forward": "#1f77b4",
                 "sample": "#9467bd", "output": "#17becf", "buffered": "#ffbb78", "handoff": "#dbdb8d",
                 "deliver": "#ff7f0e", "serialize": "#e377c2", "write": "#2ca02c"}


def _latency_title(lat: RequestLatency) -> str:
    h = lat.headline()
    ms = (lambda v: "–" if v is None else f"{v * 1000:.1f} ms")  # noqa: E731
    title = f"latency of {html.escape(lat.req_id, quote=False)}: TTFT {ms(h['ttft'])} · TPOT {ms(h['tpot'])}"
    title += f" · end to end {ms(h['e2e'])}"
    if lat.has_server:
        title += f"<br><sup>at the socket: first token written {ms(h['ttft_socket'])}, last {ms(h['e2e_socket'])}"
        if lat.aborted:
            title += f" · aborted: {html.escape(lat.aborted, quote=False)}"
        title += "</sup>"
    return title


def latency_waterfall(lat: RequestLatency | None, max_rows: int = 120) -> go.Figure:
    """One request's way from arrival to the socket: row 0 its arrival (tokenize, queue), then one row per
    engine step that produced its tokens (schedule, forward, sample, output) continued, when it was
    served over HTTP, by the frame that carried them (buffered behind a slow write, hand-off, deliver,
    serialize, write). Times in ms after arrival; the first `max_rows` rows."""
    segs = [s for s in (lat.segments() if lat is not None else []) if s.row <= max_rows]
    if not segs:
        return _note(_figure("latency waterfall", 220), "no latency stamps for this request")
    labels = {s.row: s.label for s in segs}
    order = [labels[r] for r in sorted(labels)]
    fig = _figure(_latency_title(lat), min(900, 120 + 16 * len(order)))
    for stage in ROW_STAGES_ALL:
        mine = [s for s in segs if s.stage == stage]
        if not mine:
            continue
        fig.add_trace(go.Bar(
            name=stage, orientation="h", y=[s.label for s in mine], base=[s.start * 1000 for s in mine],
            x=[max((s.end - s.start) * 1000, 0.01) for s in mine], marker_color=STAGE_COLOURS.get(stage, "#7f7f7f"),
            customdata=[[s.start * 1000, s.end * 1000] for s in mine],
            hovertemplate=f"{stage}: %{{x:.3f}} ms<br>%{{customdata[0]:.2f}} → %{{customdata[1]:.2f}} ms"
                          "<extra>%{y}</extra>"))
    fig.update_layout(barmode="overlay", showlegend=True, legend={"orientation": "h", "y": -0.15},
                      margin={"t": 70 if lat.has_server else 50},
                      yaxis={"categoryorder": "array", "categoryarray": order[::-1], "title": {"text": ""}},
                      xaxis={"title": {"text": "ms after arrival"}})
    return fig

