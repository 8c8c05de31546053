"""The viewers' trace model: what a viewer reads (`TraceView`) and a trace that grows in memory
(`LiveEvents`), shared by the TUI's live mode and the notebook's live view.

Owns: `TraceView` (the part of `workbench.trace.reader.Trace` a viewer uses; `LiveEvents`
implements it too), `LiveEvents` (events held in memory as they arrive from any thread, grouped per
step with a running `StepSummary` and per request with its `request.added` / `request.finished`,
optionally keeping only the newest `max_steps` steps) and `Touched` (what an `add` changed, so a
viewer redraws only that). No torch, no engine. Does not own: reading files (reader.py), following
a server's SSE stream (tui/live.py) or an engine's tracer (workbench/notebook/live.py).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workbench.trace.events import Event, RequestAdded, RequestFinished
from workbench.trace.format import STEP_COLUMNS, StepSummary
from workbench.trace.reader import RequestInfo, StepInfo


class TraceView(Protocol):
    """What a viewer reads: a trace file (`Trace`) or a growing in-memory trace (`LiveEvents`)."""

    name: str
    meta: dict[str, Any]

    @property
    def finished(self) -> bool: ...
    def steps(self) -> list[StepInfo]: ...
    def step(self, n: int) -> list[Event]: ...
    def events(self, kind: str | Sequence[str] | None = None, req_id: str | None = None,
               step_range: tuple[int, int] | None = None, limit: int | None = None) -> Iterator[Event]: ...
    def requests(self) -> list[RequestInfo]: ...
    def refresh(self) -> int: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Touched:
    """The steps and requests one `LiveEvents.add` changed."""

    steps: set[int] = field(default_factory=set)
    req_ids: set[str] = field(default_factory=set)


def step_info(s: StepSummary) -> StepInfo:
    return StepInfo(**{c: getattr(s, c) for c in STEP_COLUMNS} | {"req_ids": tuple(s.req_ids)})


class LiveEvents:
    """An in-memory trace that grows as events arrive (thread-safe; with `max_steps`, the newest
    steps only)."""

    finished = False

    def __init__(self, events: Iterable[Event] = (), *, name: str = "live", meta: dict[str, Any] | None = None,
                 max_steps: int | None = None) -> None:
        self.name = name
        self.meta: dict[str, Any] = dict(meta or {})
        self.max_steps = max_steps
        self.num_events = 0
        self._lock = threading.Lock()
        self._events: dict[int, list[Event]] = {}  # per step, in arrival order
        self._by_req: dict[str, list[Event]] = {}  # per request, in arrival order (first seen first)
        self._summaries: dict[int, StepSummary] = {}
        self._infos: dict[int, StepInfo] = {}
        self._dirty: set[int] = set()
        self._order: list[int] = []  # step numbers, sorted
        self._added: dict[str, RequestAdded] = {}
        self._finished: dict[str, RequestFinished] = {}
        self.add(events)

    def add(self, events: Iterable[Event]) -> Touched:
        """Append events; return the steps and requests they touched."""
        touched = Touched()
        with self._lock:
            for event in events:
                self.num_events += 1
                step = event.step
                if step not in self._summaries:
                    self._summaries[step] = StepSummary(step=step)
                    self._events[step] = []
                    bisect.insort(self._order, step)
                self._summaries[step].add(self.num_events, event.kind, float(event.t), event.payload())
                self._events[step].append(event)
                touched.steps.add(step)
                rid = event.req_id
                if rid is None:
                    continue
                touched.req_ids.add(rid)
                self._by_req.setdefault(rid, []).append(event)
                if isinstance(event, RequestAdded):
                    self._added.setdefault(rid, event)
                elif isinstance(event, RequestFinished):
                    self._finished[rid] = event
            self._dirty |= touched.steps
            self._trim()
        return touched

    def _trim(self) -> None:
        excess = len(self._order) - self.max_steps if self.max_steps is not None else 0
        if excess <= 0:
            return
        old = self._order[:excess]
        cutoff = old[-1]
        reqs = {e.req_id for s in old for e in self._events[s] if e.req_id is not None}
        for s in old:
            del self._events[s], self._summaries[s]
            self._infos.pop(s, None)
            self._dirty.discard(s)
        del self._order[:excess]
        for rid in reqs:
            self._by_req[rid] = [e for e in self._by_req[rid] if e.step > cutoff]

    def steps(self) -> list[StepInfo]:
        with self._lock:
            for s in self._dirty:
                self._infos[s] = step_info(self._summaries[s])
            self._dirty.clear()
            return [self._infos[s] for s in self._order]

    def step(self, n: int) -> list[Event]:
        with self._lock:
            return list(self._events.get(int(n), ()))

    def events(self, kind: str | Sequence[str] | None = None, req_id: str | None = None,
               step_range: tuple[int, int] | None = None, limit: int | None = None) -> Iterator[Event]:
        """Events in step order (arrival order within a step), filtered like `Trace.events`."""
        kinds = None if kind is None else ({kind} if isinstance(kind, str) else set(kind))
        with self._lock:
            numbers = list(self._order)
            if step_range is not None:
                numbers = [s for s in numbers if step_range[0] <= s <= step_range[1]]
            matched = [e for s in numbers for e in self._events[s]
                       if (kinds is None or e.kind in kinds) and (req_id is None or e.req_id == req_id)]
        return iter(matched[:limit] if limit is not None else matched)

    def requests(self) -> list[RequestInfo]:
        """Requests by their added event (then those seen only finishing)."""
        with self._lock:
            ids = list(self._added) + [r for r in self._finished if r not in self._added]
            return [RequestInfo(r, self._added.get(r), self._finished.get(r)) for r in ids]

    def request_ids(self) -> list[str]:
        """Every request an event named, in the order first seen."""
        with self._lock:
            return list(self._by_req)

    def request(self, req_id: str) -> RequestInfo:
        with self._lock:
            return RequestInfo(req_id, self._added.get(req_id), self._finished.get(req_id))

    def request_events(self, req_id: str) -> list[Event]:
        """One request's events in arrival order."""
        with self._lock:
            return list(self._by_req.get(req_id, ()))

    def refresh(self) -> int:
        return 0  # events are pushed in by `add`

    def close(self) -> None:
        pass
