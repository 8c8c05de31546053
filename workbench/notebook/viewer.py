"""`TraceViewer`: a trace in a notebook, with a step slider, a request picker and linked figures.

Owns: the selection (request, step), the ipywidgets layout, keeping the figures in step with the
selection, and the static-HTML export. The figures come from figures.py, the data from data.py.
Figures are plotly `FigureWidget`s when anywidget is installed (updated in place), otherwise plain
figures shown in `Output` widgets; without ipywidgets at all the viewer still builds figures and
exports HTML. Does not own: reading files (workbench.trace) or live updates (live.py).
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from typing import Any

import plotly.graph_objects as go

from workbench.notebook import figures
from workbench.notebook.check_view import (
    client_timing_figure,
    not_recorded,
    not_recorded_figure,
    reference_figure,
    source_checks,
)
from workbench.notebook.data import EventSource, RequestView, Source, TraceSource, as_source
from workbench.notebook.html import render_page
from workbench.trace.events import Event, SamplingStages
from workbench.trace.latency import RequestLatency

PANELS = ("tokens", "reference", "stages", "spec", "batch", "finish", "latency")
LATENCY_KINDS = ("stamp", "request.finished")


def request_latency(source: Source, req_id: str | None) -> RequestLatency | None:
    """The request's latency stamps and finish record, from a trace file or events in memory."""
    if req_id is None:
        return None
    events: list[Event] = []
    if isinstance(source, TraceSource):
        events = list(source.trace.events(kind=list(LATENCY_KINDS), req_id=req_id))
    elif isinstance(source, EventSource):
        # RequestView keeps no stamps; the source's own per-request list has them
        events = [e for e in source.live.request_events(req_id) if e.kind in LATENCY_KINDS]
    return RequestLatency.from_events(req_id, events)


def _ipywidgets() -> Any:
    try:
        import ipywidgets
    except ImportError:
        return None
    return ipywidgets


class _Pane:
    """One figure slot: a FigureWidget updated in place, or an Output widget re-showing a Figure."""

    def __init__(self, fig: go.Figure, widgets: Any) -> None:
        self.widget: Any = None
        self.figure: go.Figure = fig
        if widgets is None:
            return
        try:
            self.figure = go.FigureWidget(fig)
            self.widget = self.figure
        except ImportError:  # plotly's FigureWidget needs anywidget
            self.widget = widgets.Output()
            self._show_in_output()

    def update(self, fig: go.Figure) -> None:
        if isinstance(self.figure, go.FigureWidget):
            with self.figure.batch_update():
                self.figure.data = ()
                self.figure.add_traces(list(fig.data))
                self.figure.layout = fig.layout
            return
        self.figure = fig
        if self.widget is not None:
            self._show_in_output()

    def _show_in_output(self) -> None:
        from IPython.display import display

        with self.widget:
            self.widget.clear_output(wait=True)
            display(self.figure)


class TraceViewer:
    """Step through a recorded trace: pick a request and a step; every figure follows.

    `path_or_trace`: a `.wbtrace` path, an open `Trace`, a `MemorySink`, a list of events, or an
    engine recording to memory. `widgets=False` builds figures and HTML only (no ipywidgets).
    `token_text(id) -> str` names tokens the trace does not spell out (e.g. `tokenizer.decode([id])`);
    without it they show as `#id`. Figures: `viewer.figures[name]` for name in `PANELS`.
    """

    def __init__(self, path_or_trace: Any, req_id: str | None = None, step: int | None = None,
                 widgets: bool | None = None, token_text: Callable[[int], str] | None = None) -> None:
        self.source: Source = as_source(path_or_trace)
        self.not_recorded = not_recorded(self.source)  # an external engine's unreported kinds
        self.checks = source_checks(self.source)  # `workbench check` results, by request
        self.token_text = token_text
        self._widgets = _ipywidgets() if widgets is not False else None
        if widgets and self._widgets is None:
            raise ValueError("widgets=True needs ipywidgets; install it or pass widgets=False")
        ids = self.source.request_ids()
        if req_id is not None and req_id not in ids:
            raise ValueError(f"req_id {req_id!r} is not in this trace; it has {ids[:10]}")
        self.req_id: str | None = req_id or (ids[0] if ids else None)
        self.step: int | None = None
        self._request: RequestView | None = None
        self._syncing = False
        self._load_request()
        self.step = self._clamp(step if step is not None else self._default_step())
        built = self._build()
        self._panes = {name: _Pane(fig, self._widgets) for name, fig in built.items()}
        self.slider = self.picker = self.info = self.widget = None
        if self._widgets is not None:
            self._make_widgets()

    # --- selection -------------------------------------------------------------------------------

    @property
    def figures(self) -> dict[str, go.Figure]:
        """The current figure of each panel (FigureWidgets when widgets are live)."""
        return {name: pane.figure for name, pane in self._panes.items()}

    @property
    def request(self) -> RequestView | None:
        """The selected request's indexed events."""
        return self._request

    def select(self, step: int | None = None, req_id: str | None = None) -> None:
        """Select a step and/or a request; widgets and figures follow."""
        if req_id is not None and req_id != self.req_id:
            ids = self.source.request_ids()
            if req_id not in ids:
                raise ValueError(f"req_id {req_id!r} is not in this trace; it has {ids[:10]}")
            self.req_id = req_id
            self._load_request()
            ran = self._request.token_at(self.step) if self._request and self.step is not None else None
            if step is None and ran is None:
                step = self._request.first_step if self._request else None
        if step is not None:
            self.step = self._clamp(step)
        self._sync_widgets()
        self._render()

    def refresh(self) -> None:
        """Re-read the source (picks up a trace file that is still being written) and redraw."""
        reload = getattr(self.source, "refresh", None)
        if reload is not None:
            reload()
        ids = self.source.request_ids()
        if self.req_id is None and ids:
            self.req_id = ids[0]
        self._load_request()
        self.step = self._clamp(self.step)
        self._sync_widgets()
        self._render()

    def _load_request(self) -> None:
        self._request = self.source.request(self.req_id) if self.req_id is not None else None

    def _step_bounds(self) -> tuple[int, int]:
        steps = self.source.steps()
        return (steps[0].step, steps[-1].step) if steps else (0, 0)

    def _clamp(self, step: int | None) -> int:
        lo, hi = self._step_bounds()
        if step is None:
            return hi
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an integer in [{lo}, {hi}], got {step!r}")
        return min(max(step, lo), hi)

    def _default_step(self) -> int | None:
        req = self._request
        if req is not None and req.tokens:
            return max(t.step for t in req.tokens)
        return None

    # --- figures ---------------------------------------------------------------------------------

    def _build(self) -> dict[str, go.Figure]:
        req, step = self._request, self.step
        token = req.token_at(step) if req is not None and step is not None else None
        vocab = self._vocab(req, req.stages_for(token) if req else None)
        req_steps = {e.step for e in req.tokens} | {e.step for e in req.finishes} if req else set()
        built = {
            "tokens": figures.tokens_figure(req, step),
            "reference": reference_figure(self.checks.get(self.req_id or ""), self.req_id,
                                          getattr(getattr(self.source, "trace", None), "meta", {}).get("check")),
            "stages": figures.stages_figure(req.stages_for(token) if req else None, vocab),
            "spec": figures.spec_figure(req.verifies if req else [], step, vocab),
            "batch": figures.batch_figure(self.source.steps(), step, req_steps),
            "finish": figures.finish_figure(req.finish_at(step) if req and step is not None else None,
                                            req.finished if req else None),
            "latency": figures.latency_waterfall(request_latency(self.source, self.req_id)),
        }
        unreported = {"stages": ("sampling", "sampling stages"), "spec": ("spec.verify", "speculative decoding"),
                      "batch": ("forward_batch", "batch and KV usage"), "finish": ("finish", "finish decision")}
        for name, (kind, title) in unreported.items():
            if kind in self.not_recorded:
                built[name] = not_recorded_figure(title)
        if "forward" in self.not_recorded:  # no engine stamps: the client's own view of the stream
            built["latency"] = client_timing_figure(req.finished if req else None)
        return built

    def _vocab(self, req: RequestView | None, stages: SamplingStages | None) -> dict[int, str]:
        vocab = req.vocab() if req else {}
        if self.token_text is not None:
            ids = {int(t) for s in (stages.stages if stages else ()) for t in s.get("top_ids", ())}
            ids |= {int(t) for v in (req.verifies if req else ()) for t in v.draft_tokens}
            for tid in ids - vocab.keys():
                vocab[tid] = self.token_text(tid)
        return vocab

    def _render(self) -> None:
        for name, fig in self._build().items():
            self._panes[name].update(fig)
        self._hook_clicks()
        if self.info is not None:
            self.info.value = self.summary_html()

    def summary_html(self) -> str:
        """One block of HTML: the selected request, step, the text streamed so far and what is held back."""
        req, step = self._request, self.step
        if req is None or step is None:
            return f"<b>{html.escape(self.source.name)}</b>: no requests"
        detok = req.detok_at(step)
        held = ""
        if detok is not None and detok.held_text:
            held = (f" <span style='background:#ffe8a8'>{html.escape(detok.held_text)}</span>"
                    f" <i>(held back: {html.escape(str(detok.held_reason))})</i>")
        reason = req.finished.finish_reason if req.finished and req.finished.step <= step else "running"
        return (f"<div style='font-family:monospace;font-size:13px'><b>{html.escape(self.source.name)}</b> · "
                f"{html.escape(req.req_id)} · step {step} · {html.escape(str(reason))}<br>"
                f"<span style='white-space:pre-wrap'>{html.escape(req.text_at(step))}</span>{held}</div>")

    # --- widgets ---------------------------------------------------------------------------------

    def _make_widgets(self) -> None:
        w = self._widgets
        lo, hi = self._step_bounds()
        self.slider = w.IntSlider(value=self.step or lo, min=lo, max=hi, description="step",
                                  continuous_update=False, layout=w.Layout(width="60%"))
        self.picker = w.Dropdown(options=self._options(), value=self.req_id, description="request",
                                 layout=w.Layout(width="40%"))
        self.info = w.HTML(self.summary_html())
        self.slider.observe(self._on_slider, names="value")
        self.picker.observe(self._on_picker, names="value")
        pane = {name: p.widget for name, p in self._panes.items()}
        self.widget = w.VBox([
            w.HBox([self.picker, self.slider]), self.info, pane["tokens"], pane["reference"],
            w.HBox([pane["stages"], pane["spec"]], layout=w.Layout(width="100%")),
            w.HBox([pane["batch"], pane["finish"]], layout=w.Layout(width="100%")),
            pane["latency"],
        ])
        self._hook_clicks()

    def _options(self) -> list[tuple[str, str]]:
        return [(self.source.request_label(rid), rid) for rid in self.source.request_ids()]

    def _on_slider(self, change: dict[str, Any]) -> None:
        if not self._syncing:
            self.select(step=int(change["new"]))

    def _on_picker(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] is not None:
            self.select(req_id=change["new"])

    def _on_token_click(self, trace: Any, points: Any, state: Any) -> None:
        if points.point_inds:
            self.select(step=int(trace.customdata[points.point_inds[0]]))

    def _hook_clicks(self) -> None:
        fig = self._panes["tokens"].figure
        if isinstance(fig, go.FigureWidget):
            for trace in fig.data:
                if trace.name == "tokens":
                    trace.on_click(self._on_token_click)

    def _sync_widgets(self) -> None:
        if self.slider is None:
            return
        self._syncing = True
        try:
            lo, hi = self._step_bounds()
            self.slider.max = max(hi, self.slider.min)  # never min > max while the range moves
            self.slider.min, self.slider.max = lo, hi
            self.slider.value = self.step if self.step is not None else lo
            options = self._options()
            if list(self.picker.options) != options:
                self.picker.options = options
            self.picker.value = self.req_id
        finally:
            self._syncing = False

    # --- display and export ----------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        if self.widget is not None:
            return self.widget._repr_mimebundle_(**kwargs)
        return {"text/html": self.to_html(full_html=False), "text/plain": repr(self)}

    def to_html(self, path: str | os.PathLike[str] | None = None, full_html: bool = True,
                include_plotlyjs: bool = True) -> str:
        """The current view as one self-contained HTML page (plotly.js inline: works offline).

        Writes it to `path` when given. `full_html=False` gives a `<div>` fragment;
        `include_plotlyjs=False` leaves plotly.js out, for a page that already loads it.
        """
        page = render_page(f"{self.source.name} · {self.req_id} · step {self.step}", self.summary_html(),
                           {name: go.Figure(fig) for name, fig in self.figures.items()}, full_html=full_html,
                           include_plotlyjs=include_plotlyjs)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(page)
        return page

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.source.name!r} req={self.req_id} step={self.step}>"
