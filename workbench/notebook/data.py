"""What the notebook viewers read: one request's events, indexed, and step summaries, from any source.

Owns: `RequestView` (one request's tokens, sampling stages, spec drafts/verifies, detokenizer
states and finish decisions, with "as of step N" look-ups), and the two sources the viewers read
through one interface: `TraceSource` (a `.wbtrace` file, lazily: only the selected request's events
are loaded) and `EventSource` (events in memory, growing while an engine runs, held by the shared trace
model `workbench.trace.live.LiveEvents` that the TUI's live mode uses too). `as_source` turns
a path, a `Trace`, a `MemorySink`, an event list or an engine into a source.

Does not own: figures (figures.py), widgets (viewer.py, live.py), or the event schema
(workbench.trace.events). Imports nothing from workbench.engine: an engine is read only through
its `tracer` attribute.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workbench.trace.events import (
    DetokState,
    Event,
    FinishDecision,
    RequestAdded,
    RequestFinished,
    SamplingStages,
    SpecDraft,
    SpecVerify,
    TokenChosen,
)
from workbench.trace.live import LiveEvents
from workbench.trace.reader import StepInfo, Trace, open_trace
from workbench.trace.recorder import MemorySink


@dataclass(slots=True)
class RequestView:
    """Everything the viewers show about one request, in step order."""

    req_id: str
    added: RequestAdded | None = None
    finished: RequestFinished | None = None
    tokens: list[TokenChosen] = field(default_factory=list)  # by output position
    sampling: list[SamplingStages] = field(default_factory=list)
    drafts: list[SpecDraft] = field(default_factory=list)
    verifies: list[SpecVerify] = field(default_factory=list)
    detok: list[DetokState] = field(default_factory=list)
    finishes: list[FinishDecision] = field(default_factory=list)

    @classmethod
    def from_events(cls, req_id: str, events: Iterable[Event]) -> RequestView:
        view = cls(req_id)
        by_position: dict[int, TokenChosen] = {}
        for event in events:
            if isinstance(event, TokenChosen):
                by_position[event.position] = event  # a recomputed position keeps its latest record
            elif isinstance(event, SamplingStages):
                view.sampling.append(event)
            elif isinstance(event, SpecDraft):
                view.drafts.append(event)
            elif isinstance(event, SpecVerify):
                view.verifies.append(event)
            elif isinstance(event, DetokState):
                view.detok.append(event)
            elif isinstance(event, FinishDecision):
                view.finishes.append(event)
            elif isinstance(event, RequestAdded):
                view.added = view.added or event
            elif isinstance(event, RequestFinished):
                view.finished = event
        view.tokens = [by_position[p] for p in sorted(by_position)]
        return view

    # --- "as of step N" -------------------------------------------------------------------------

    @property
    def first_step(self) -> int | None:
        """The first step that produced a token (or the arrival step when none did)."""
        if self.tokens:
            return min(t.step for t in self.tokens)
        return self.added.step if self.added else None

    def token_at(self, step: int) -> TokenChosen | None:
        """The last token emitted at or before `step` (None before the first one)."""
        best = None
        for token in self.tokens:
            if token.step <= step and (best is None or (token.step, token.position) >= (best.step, best.position)):
                best = token
        return best

    def stages_for(self, token: TokenChosen | None) -> SamplingStages | None:
        """The sampling stages that chose `token` (None for tokens a speculative verify accepted)."""
        if token is None:
            return None
        return next((s for s in reversed(self.sampling) if s.step == token.step and s.position == token.position),
                    None)

    def verify_at(self, step: int) -> SpecVerify | None:
        """The last speculative verification at or before `step`."""
        return _last_at(self.verifies, step)

    def finish_at(self, step: int) -> FinishDecision | None:
        """The last finish decision at or before `step`."""
        return _last_at(self.finishes, step)

    def detok_at(self, step: int) -> DetokState | None:
        """The detokenizer state after the last step at or before `step` that ran this request."""
        return _last_at(self.detok, step)

    def text_at(self, step: int) -> str:
        """The text streamed to the client by the end of `step` (the detokenizer's deltas; a trace
        without detokenizer states, such as a probe of an external engine, joins its tokens' text)."""
        if not self.detok:
            return "".join(t.text for t in self.tokens if t.step <= step)
        return "".join(d.delta for d in self.detok if d.step <= step)

    def vocab(self) -> dict[int, str]:
        """Token id -> text for every id this request's events name (tokens, alternatives, drafts)."""
        out: dict[int, str] = {}
        for token in self.tokens:
            for alt in token.top_logprobs:
                if len(alt) >= 3 and isinstance(alt[2], str):
                    out.setdefault(int(alt[0]), alt[2])
            out[token.token_id] = token.text
        for draft in self.drafts:
            for tid, text in zip(draft.tokens, draft.texts):
                out.setdefault(int(tid), text)
        return out


def _last_at(events: Sequence[Event], step: int) -> Any:
    steps = [e.step for e in events]
    i = bisect.bisect_right(steps, step)
    return events[i - 1] if i else None


class Source(Protocol):
    """What a viewer reads: step summaries, request ids and one request at a time."""

    name: str

    def steps(self) -> list[StepInfo]: ...
    def request_ids(self) -> list[str]: ...
    def request(self, req_id: str) -> RequestView: ...
    def request_label(self, req_id: str) -> str: ...


def _label(req_id: str, added: RequestAdded | None, finished: RequestFinished | None) -> str:
    prompt = added.prompt if added else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content")
    text = prompt if isinstance(prompt, str) else ""
    text = " ".join(text.split())
    text = text if len(text) <= 32 else text[:31] + "…"
    reason = finished.finish_reason if finished else "running"
    return f"{req_id} · {reason} · {text!r}" if text else f"{req_id} · {reason}"


class TraceSource:
    """A `.wbtrace` file read lazily: step summaries from the steps table, one request at a time."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.name = trace.name
        self._requests: dict[str, RequestView] = {}
        self._labels: dict[str, str] | None = None

    def steps(self) -> list[StepInfo]:
        return self.trace.steps()

    def request_ids(self) -> list[str]:
        return list(self._request_labels())

    def request_label(self, req_id: str) -> str:
        return self._request_labels().get(req_id, req_id)

    def _request_labels(self) -> dict[str, str]:
        if self._labels is None:
            self._labels = {r.req_id: _label(r.req_id, r.added, r.finished) for r in self.trace.requests()}
        return self._labels

    def request(self, req_id: str) -> RequestView:
        if req_id not in self._requests:
            self._requests[req_id] = RequestView.from_events(req_id, self.trace.events(req_id=req_id))
        return self._requests[req_id]

    def refresh(self) -> None:
        """Pick up what a live writer added since the file was opened."""
        self.trace.refresh()
        self._requests.clear()
        self._labels = None


class EventSource:
    """Events held in memory (a MemorySink's, or a LiveView's) as the shared trace model
    (`workbench.trace.live.LiveEvents`); `add` may be called from any thread."""

    def __init__(self, events: Iterable[Event] = (), name: str = "live") -> None:
        self.name = name
        self.live = LiveEvents(events, name=name)

    def add(self, event: Event) -> None:
        self.live.add((event,))

    @property
    def num_events(self) -> int:
        return self.live.num_events

    def steps(self) -> list[StepInfo]:
        return self.live.steps()

    def request_ids(self) -> list[str]:
        return self.live.request_ids()

    def request_label(self, req_id: str) -> str:
        info = self.live.request(req_id)
        return _label(req_id, info.added, info.finished)

    def request(self, req_id: str) -> RequestView:
        return RequestView.from_events(req_id, self.live.request_events(req_id))


def as_source(obj: Any) -> TraceSource | EventSource:
    """A source from a path, an open `Trace`, a `MemorySink`, a list of events, or an engine object
    whose tracer has a `MemorySink` (ValueError otherwise). From a sink or an engine it is a snapshot
    of the events so far; call again after generating more (LiveView follows an engine instead)."""
    if isinstance(obj, (TraceSource, EventSource)):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return TraceSource(open_trace(obj))
    if isinstance(obj, Trace):
        return TraceSource(obj)
    if isinstance(obj, MemorySink):
        return EventSource(list(obj.events), name="memory")
    if isinstance(obj, (list, tuple)) and all(isinstance(e, Event) for e in obj):
        return EventSource(obj, name="events")
    sinks = getattr(getattr(obj, "tracer", None), "sinks", None)
    if sinks is not None:
        memory = next((s for s in sinks if isinstance(s, MemorySink)), None)
        if memory is not None:
            return EventSource(list(memory.events), name="engine")
        raise ValueError("path_or_trace: this engine records no in-memory trace; pass its trace file "
                         "path, or create it with trace=None and trace_level='summary'")
    raise ValueError("path_or_trace must be a .wbtrace path, a Trace, a MemorySink, a list of events "
                     f"or an engine; got {type(obj).__name__}")
