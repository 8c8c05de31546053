"""The TUI's window onto a trace: asks the source only for what is on screen, and caches it.

Owns: `TraceModel` over a `workbench.trace.live.TraceView` (a trace file, or the live trace
`tui.live.LiveTrace`): small LRU caches of step views and request outputs (bounded in count, and
for a file in the memory its reads built: together at most one read's limit, `ReadLimits`), the vocabulary,
invalidation when a live trace grows; and `open_source`. Called from worker threads;
never touches a widget. Does not own parsing files (the reader) or drawing (the widgets).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from tui.fmt import fork_label, kernels_label
from tui.inside import load_inside
from tui.stepview import RequestData, StepView, request_bisects
from tui.vocab import Vocab, load_tokenizer, tokenizer_folder
from workbench.trace.bisect_store import read_bisects
from workbench.trace.checks import read_checks
from workbench.trace.events import Event
from workbench.trace.invariance_store import read_invariance
from workbench.trace.live import TraceView
from workbench.trace.reader import RequestInfo, StepInfo, TraceError, open_trace

_STEP_CACHE = 64
_REQ_CACHE = 32
_MB = 1 << 20


def open_source(path: str) -> TraceView:
    """Open a trace file for the TUI; TraceError (a ValueError) with a one-line message if unreadable."""
    return open_trace(path)


class TraceModel:
    """Cached, thread-safe access to one source for the screens and their workers."""

    def __init__(self, source: TraceView, vocab: Vocab | None = None) -> None:
        self.source = source
        self.vocab = vocab or Vocab()
        self._lock = threading.RLock()
        self._views: OrderedDict[int, StepView] = OrderedDict()
        self._reqs: OrderedDict[str, RequestData] = OrderedDict()
        self._costs: dict[tuple[str, Any], int] = {}  # the memory each cached entry's read built
        limits = getattr(source, "limits", None)  # a trace file's ReadLimits; a live trace bounds itself
        self._max_cost = int(limits.max_read_mb * _MB) if limits is not None else None
        self._requests: list[RequestInfo] | None = None
        self.problem: str | None = None  # the last damage found while reading (one line, for the status line)
        self._checks: dict[str, dict[str, Any]] | None = None
        self._invariance: tuple[dict[str, Any] | None, dict[str, dict[str, Any]]] | None = None
        self._bisects: list[dict[str, Any]] | None = None
        self.has_capture = False  # set by the first step view read (a worker): the trace holds capture
        self._capture_known = False

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def meta(self) -> dict[str, Any]:
        return self.source.meta

    def title(self) -> str:
        """`file · model` for the header (`· external <url>` for a probe of another engine)."""
        model = self.meta.get("model")
        label = model.get("name") or model.get("spec") if isinstance(model, dict) else None
        if self.meta.get("source") == "external" and isinstance(model, dict):
            label = f"{label} · external {model.get('served_by', '')}"
        title = f"{self.name} · {label}" if label else self.name
        kernels = kernels_label(self.meta)  # a fast (non-exact) numerics mode says so in the header
        title = f"{title} · {kernels}" if kernels else title
        fork = fork_label(self.meta)  # a fork names its parent and branch point
        return f"{title} · {fork}" if fork else title

    @property
    def not_recorded(self) -> frozenset[str]:
        """Event kinds the trace's source does not report (an external engine's batches, stages, ...)."""
        value = self.meta.get("not_recorded")
        return frozenset(str(v) for v in value) if isinstance(value, list) else frozenset()

    def checks(self) -> dict[str, dict[str, Any]]:
        """The stored reference check, by request (read once; {} when the trace was never checked)."""
        with self._lock:
            if self._checks is None:
                try:
                    self._checks = read_checks(self.source)
                except TraceError as exc:  # over a read limit: show the trace without its check
                    self.problem, self._checks = str(exc), {}
            return self._checks

    def invariance(self) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
        """The stored batch-invariance run: (summary, rows by request); (None, {}) when never measured."""
        with self._lock:
            if self._invariance is None:
                try:
                    self._invariance = read_invariance(self.source)
                except TraceError as exc:
                    self.problem, self._invariance = str(exc), (None, {})
            return self._invariance

    def bisects(self) -> list[dict[str, Any]]:
        """The stored `workbench bisect` rows (read once; [] when never bisected)."""
        with self._lock:
            if self._bisects is None:
                try:
                    self._bisects = read_bisects(self.source)
                except TraceError as exc:
                    self.problem, self._bisects = str(exc), []
            return self._bisects

    def steps(self) -> list[StepInfo]:
        with self._lock:
            return list(self.source.steps())

    def step_view(self, step: int, info: StepInfo | None = None) -> StepView:
        """The view of one step (one indexed query the first time, then cached)."""
        with self._lock:
            view = self._views.get(step)
            if view is not None:
                self._views.move_to_end(step)
                return view
            budget = self._budget(f"step {step}'s events")
            try:
                events = self.source.step(step, budget=budget) if budget is not None else self.source.step(step)
            except TraceError as exc:  # a damaged step, or one over a read limit: show it empty, say why
                self.problem, events = str(exc), []
            self.vocab.learn(events)
            view = StepView.build(step, info, events)
            self._load_inside(view)
            self._remember(self._views, "step", step, view, _STEP_CACHE, budget)
            return view

    def _load_inside(self, view: StepView) -> None:
        """The layers pane's data for the step's captured tokens (tensors read here, in the worker)."""
        if not self._capture_known:
            self.has_capture = any(True for _ in self.source.events(kind="capture", limit=1))
            self._capture_known = bool(self.source.finished)  # a growing trace may get capture later
        view.has_capture = self.has_capture
        for event in view.captures:
            try:
                context = self.source.context_texts(event.req_id) if hasattr(self.source, "context_texts") else []
                inside = load_inside(self.source, event, context)
            except (TraceError, KeyError) as exc:
                self.problem, inside = str(exc), None
            if inside is not None:
                view.inside[(inside.req_id, inside.position)] = inside

    def request(self, req_id: str) -> RequestData:
        """One request's prompt, tokens and finish record (one query on the request index)."""
        with self._lock:
            data = self._reqs.get(req_id)
            if data is not None:
                self._reqs.move_to_end(req_id)
                return data
            kinds = ["request.added", "token", "request.finished"]
            budget = self._budget(f"request {req_id[:60]!r}'s events")
            events = self._readable(self.source.events(kind=kinds, req_id=req_id, budget=budget) if budget is not None
                                    else self.source.events(kind=kinds, req_id=req_id))
            self.vocab.learn(events)
            data = RequestData.build(req_id, events)
            data.check = self.checks().get(req_id)
            summary, rows = self.invariance()
            data.invariance = rows.get(req_id, {} if summary is not None else None)
            data.bisects = request_bisects(self.bisects(), req_id)
            self._remember(self._reqs, "request", req_id, data, _REQ_CACHE, budget)
            return data

    def _budget(self, what: str) -> Any:
        """A read budget from a trace file (None for a live trace, whose memory bounds itself)."""
        make = getattr(self.source, "budget", None)
        return make(what) if make is not None and self._max_cost is not None else None

    def _remember(self, cache: OrderedDict, kind: str, key: Any, value: Any, size: int, budget: Any) -> None:
        """Cache one entry; drop the least recently used past `size` entries or, for a file, once the
        entries of both caches together built more than one read's memory limit (the newest is kept)."""
        cache[key] = value
        cache.move_to_end(key)
        self._costs[(kind, key)] = budget.used if budget is not None else 0
        while len(cache) > size:
            self._costs.pop((kind, cache.popitem(last=False)[0]), None)
        if self._max_cost is None:
            return
        for other_kind, other in (("step", self._views), ("request", self._reqs)):
            while sum(self._costs.values()) > self._max_cost and len(other) > (1 if other is cache else 0):
                self._costs.pop((other_kind, other.popitem(last=False)[0]), None)

    def requests(self) -> list[RequestInfo]:
        """Every request (read once, on first use: a filter or a search needs them)."""
        with self._lock:
            if self._requests is None:
                try:
                    self._requests = self.source.requests()
                except TraceError as exc:
                    self.problem, self._requests = str(exc), []
            return self._requests

    def _readable(self, events: Iterator[Event]) -> list[Event]:
        """The events up to the first damaged one (which is noted in `problem`)."""
        out: list[Event] = []
        try:
            for event in events:
                out.append(event)
        except TraceError as exc:
            self.problem = str(exc)
        return out

    def take_problem(self) -> str | None:
        """The damage found since the last call (None if none), for the status line."""
        with self._lock:
            problem, self.problem = self.problem, None
            return problem

    def refresh(self) -> bool:
        """Pick up what a live writer added; True when there is something new."""
        with self._lock:
            new = self.source.refresh()
            if new:
                self.invalidate_tail()
            return new > 0

    def invalidate_tail(self, steps: set[int] | None = None, req_ids: set[str] | None = None) -> None:
        """Forget cached data that new events may have changed (all of it when not told what)."""
        with self._lock:
            self._requests = self._checks = self._invariance = self._bisects = None
            for kind, cache, keys in (("step", self._views, steps), ("request", self._reqs, req_ids)):
                for key in list(cache) if keys is None else keys:
                    cache.pop(key, None)
                    self._costs.pop((kind, key), None)

    def load_vocab(self, tokenizer_path: str | None = None) -> bool:
        """Load the trace's (or the given) tokenizer; True when ids can now be decoded."""
        path = tokenizer_path or tokenizer_folder(self.meta)
        tokenizer = load_tokenizer(path)
        if tokenizer is not None:
            self.vocab.tokenizer = tokenizer
        return tokenizer is not None

    def close(self) -> None:
        self.source.close()


__all__ = ["TraceModel", "TraceView", "TraceError", "open_source"]
