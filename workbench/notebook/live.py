"""`LiveView`: the TraceViewer's figures, updated while an engine generates.

Owns: a sink added to the engine's tracer that collects events into an `EventSource` and
refreshes the viewer as steps complete (throttled), and following the newest step until the user
moves the slider. The engine is any object with a `tracer` (a `workbench.trace.Tracer`) and
optionally a `tokenizer`; nothing is imported from workbench.engine. Refreshing happens on the
thread that emits (the engine's), which is how a cell running `engine.generate(...)` shows progress.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from workbench.notebook.data import EventSource
from workbench.notebook.viewer import TraceViewer
from workbench.trace.events import Event
from workbench.trace.recorder import MemorySink


class _LiveSink:
    """A tracer sink feeding an EventSource and asking the view to refresh at step boundaries."""

    def __init__(self, view: LiveView) -> None:
        self.view = view

    def write(self, event: Event) -> None:
        self.view._on_event(event)

    def write_tensor(self, name: str, step: int, req_id: str | None, array: Any) -> None:
        pass  # full logits are not drawn

    def set_meta(self, key: str, value: Any) -> None:
        pass

    def flush(self) -> None:
        self.view.refresh()

    def close(self) -> None:
        self.view.refresh()


class LiveView(TraceViewer):
    """Watch an engine: figures follow the newest step while it runs; `detach()` stops listening.

    `min_interval`: seconds between redraws while steps arrive; a redraw (tens of ms) is also kept
    under a fifth of the wall time, so watching never slows the engine by more than ~20%;
    `min_interval=0` redraws at every step.
    Events the engine already kept in a `MemorySink` are shown too; otherwise the view starts empty.
    """

    def __init__(self, engine: Any, min_interval: float = 0.5, widgets: bool | None = None) -> None:
        tracer = getattr(engine, "tracer", None)
        if tracer is None or not hasattr(tracer, "add_sink"):
            raise ValueError("engine: LiveView needs an engine with a tracer (a workbench Engine)")
        if getattr(tracer, "rank", 0) < 1:
            raise ValueError("engine: LiveView needs trace_level 'summary' or 'full'; this engine traces 'off'")
        if not (isinstance(min_interval, (int, float)) and min_interval >= 0):
            raise ValueError(f"min_interval must be a number >= 0 seconds, got {min_interval!r}")
        memory = next((s for s in tracer.sinks if isinstance(s, MemorySink)), None)
        source = EventSource(list(memory.events) if memory else (), name="live")
        self.min_interval = float(min_interval)
        self.following = True
        self._last_step = max((s.step for s in source.steps()), default=0)
        self._next_draw = 0.0
        self._lock = threading.RLock()
        tokenizer = getattr(engine, "tokenizer", None)
        token_text = (lambda tid: tokenizer.decode([tid])) if tokenizer is not None else None
        super().__init__(source, widgets=widgets, token_text=token_text)
        self._tracer = tracer
        self._sink = _LiveSink(self)
        tracer.add_sink(self._sink)

    def _on_event(self, event: Event) -> None:
        self.source.add(event)
        new_step = event.step > self._last_step
        self._last_step = max(self._last_step, event.step)
        if (new_step or event.kind == "request.finished") and time.monotonic() >= self._next_draw:
            self.refresh()

    def refresh(self) -> None:
        """Redraw from every event received so far; keeps to the newest step while following."""
        with self._lock:
            start = time.monotonic()
            ids = self.source.request_ids()
            if self.req_id is None and ids:
                self.req_id = ids[0]
            self._load_request()
            if self.following:
                self.step = self._clamp(None)
            self._sync_widgets()
            self._render()
            # redraw at most every min_interval, and never spend more than ~1/5 of the time drawing
            spent = time.monotonic() - start
            self._next_draw = start + max(self.min_interval, 5 * spent) if self.min_interval > 0 else 0.0

    def select(self, step: int | None = None, req_id: str | None = None) -> None:
        """Select as in TraceViewer; choosing an older step stops following the newest one."""
        if step is not None:
            self.following = step >= self._step_bounds()[1]
        super().select(step=step, req_id=req_id)

    def detach(self) -> None:
        """Stop receiving events from the engine (the figures keep what they show)."""
        self._tracer.remove_sink(self._sink)
        self.refresh()
