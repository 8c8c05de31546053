"""Inside the forward pass in a notebook (issue 18): the logit-lens heatmap and the attention view.

Owns: `lens_figure` (residual entries x captured output positions, coloured by the probability the
lens gives the finally chosen token, hover with each entry's top tokens), `attention_figure`
(positions attended, per layer as the mean over heads, or per head of one layer, labelled with the
text each position points at), `answer_layer` (the first entry from which the chosen token stays
among the lens's top tokens) and `InsideViewer`, which follows a `TraceViewer`'s step slider: the token
of the selected step is outlined in the heatmap and its attention is drawn. Reads capture through
the trace reader (workbench/trace/inside.py); never imports torch or the engine.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go


def _trace(source: Any) -> Any:
    """The `workbench.trace.reader.Trace` behind a Trace, a TraceSource or a TraceViewer."""
    for attr in ("source", "trace"):
        if not hasattr(source, "captures") and hasattr(source, attr):
            source = getattr(source, attr)
    if not hasattr(source, "captures"):
        raise ValueError("capture is read from a trace file: pass a Trace, a TraceSource or a TraceViewer of one")
    return source


def _entry(layer: int) -> str:
    return "emb" if layer < 0 else f"L{layer}"


def lens_figure(source: Any, req_id: str, position: int | None = None, k: int = 5) -> go.Figure:
    """Logit lens of every captured position of `req_id` (outlined: `position`)."""
    trace = _trace(source)
    grid = trace.lens_grid(req_id)
    fig = go.Figure()
    if grid.empty:
        fig.add_annotation(text=f"{req_id}: no logit lens captured (not recorded)", showarrow=False)
        return fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False)
    positions = sorted(set(grid["position"]))
    layers = sorted(set(grid["layer"]))
    z = np.full((len(layers), len(positions)), np.nan)
    hover = [["" for _ in positions] for _ in layers]
    top1 = [["" for _ in positions] for _ in layers]
    col = {p: j for j, p in enumerate(positions)}
    for row in grid.itertuples(index=False):
        i, j = layers.index(row.layer), col[row.position]
        z[i, j] = row.chosen_prob
        tops = ", ".join(f"{t!r} {math.exp(lp):.2f}" for t, lp in zip(row.top_texts[:k], row.top_logprobs[:k]))
        hover[i][j] = (f"position {row.position} · {_entry(row.layer)}<br>chosen {row.chosen_text!r}: "
                       f"p {row.chosen_prob:.3f}, rank {row.chosen_rank}<br>top: {tops}")
        top1[i][j] = row.top_texts[0][:8] if row.top_texts else ""
    chosen = grid.drop_duplicates("position").set_index("position")["chosen_text"]
    x = [f"{p}:{chosen[p]!r}" for p in positions]
    fig.add_trace(go.Heatmap(z=z, x=x, y=[_entry(layer) for layer in layers], text=top1, texttemplate="%{text}",
                             hovertext=hover, hoverinfo="text", colorscale="Viridis", zmin=0, zmax=1,
                             colorbar={"title": "p(chosen)"}, name="lens"))
    if position in col:
        j = col[position]
        fig.add_shape(type="rect", x0=j - 0.5, x1=j + 0.5, y0=-0.5, y1=len(layers) - 0.5,
                      line={"color": "red", "width": 3})
    return fig.update_layout(title=f"Logit lens · {req_id}: p(finally chosen token) by layer",
                             xaxis_title="output position: chosen token", yaxis_title="residual after",
                             height=max(300, 22 * len(layers) + 160))


def attention_figure(source: Any, req_id: str, position: int, layer: int | None = None) -> go.Figure:
    """What the token that chose `position` attended: layers x positions (mean over heads), or
    heads x positions of one `layer`. Top-k captures show the kept positions (others 0)."""
    trace = _trace(source)
    att = trace.attention(req_id, position)
    context = trace.context_texts(req_id)
    dense = np.zeros((att.num_layers, att.num_heads, att.kv_len))
    for li in range(att.num_layers):
        for h in range(att.num_heads):
            dense[li, h, att.positions[li, h]] = att.weights[li, h]
    z = dense.mean(axis=1) if layer is None else dense[layer]
    y = [f"L{i}" for i in range(att.num_layers)] if layer is None else [f"head {h}" for h in range(att.num_heads)]
    x = [f"{p}:{context[p]!r}" if p < len(context) else str(p) for p in range(att.kv_len)]
    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale="Blues", zmin=0, colorbar={"title": "weight"},
                               hovertemplate="%{y} → %{x}: %{z:.3f}<extra></extra>", name="attention"))
    where = "mean over heads" if layer is None else f"layer {layer}, by head"
    kept = "" if att.whole else f" (top {att.positions.shape[-1]} per head kept)"
    return fig.update_layout(title=f"Attention · {req_id} position {position}: {where}{kept}",
                             xaxis_title="attended position", height=max(300, 22 * len(y) + 200))


def answer_layer(source: Any, req_id: str, position: int, within: int = 1) -> int | None:
    """The first residual entry (-1 = embeddings) from which on the finally chosen token stays among
    the lens's top `within` tokens (1: stays its top token), or None if the lens never settles on it."""
    lens = _trace(source).logit_lens(req_id, position)
    found = None
    for layer, rank in zip(lens["layer"], lens["chosen_rank"], strict=True):
        found = (found if found is not None else int(layer)) if rank <= within else None
    return found


class InsideViewer:
    """The lens heatmap and the attention view of a `TraceViewer`'s request, following its step."""

    def __init__(self, viewer: Any, layer: int | None = None) -> None:
        self.viewer = viewer
        self.layer = layer
        self.trace = _trace(viewer)
        self.lens: go.Figure = go.Figure()
        self.attention: go.Figure = go.Figure()
        self.widget = None
        self.update()
        widgets = getattr(viewer, "_widgets", None)
        if widgets is not None and viewer.slider is not None:
            self._out = [widgets.Output(), widgets.Output()]
            self.widget = widgets.VBox(self._out)
            viewer.slider.observe(lambda change: self.update(), names="value")
            viewer.picker.observe(lambda change: self.update(), names="value")
            self._show()

    @property
    def position(self) -> int | None:
        """The output position the viewer's step produced for its request (None: none, or not captured)."""
        req, step = self.viewer.request, self.viewer.step
        token = req.token_at(step) if req is not None and step is not None else None
        return token.position if token is not None else None

    def update(self) -> None:
        req_id, pos = self.viewer.req_id, self.position
        self.lens = lens_figure(self.trace, req_id, pos)
        captured = {c.position: c for c in self.trace.captures(req_id)}
        if pos in captured and "attention_entropy" in captured[pos].tensors:
            self.attention = attention_figure(self.trace, req_id, pos, self.layer)
        else:
            self.attention = go.Figure().add_annotation(
                text=f"{req_id} position {pos}: attention not recorded", showarrow=False).update_layout(
                height=200, xaxis_visible=False, yaxis_visible=False)
        if self.widget is not None:
            self._show()

    def _show(self) -> None:
        for out, fig in zip(self._out, (self.lens, self.attention), strict=True):
            out.clear_output(wait=True)
            with out:
                fig.show()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        if self.widget is not None:
            return self.widget._repr_mimebundle_(**kwargs)
        return {"text/html": self.lens.to_html(full_html=False) + self.attention.to_html(full_html=False)}


__all__ = ["InsideViewer", "answer_layer", "attention_figure", "lens_figure"]
