"""What the panes show, as plain records built from one step's events (no Textual here).

Owns: grouping a step's events into batch-level records (schedule, forward batches, forwards, KV
operations) and per-request records (logits, sampling stages, tokens, drafts, verification,
detokenizer states, finish decisions), and a request's whole output (`RequestData`). Built in
worker threads; the widgets only read them. Does not own reading the file (the source does) or
drawing (the widgets do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.trace.events import (
    Captured,
    DetokState,
    EngineError,
    Event,
    FinishDecision,
    ForwardBatchBuilt,
    ForwardDone,
    KVEvent,
    Logits,
    RequestAdded,
    RequestFinished,
    SamplingStages,
    ScheduleDecision,
    SpecDraft,
    SpecVerify,
    TokenChosen,
)
from workbench.trace.format import shown_mode
from workbench.trace.reader import StepInfo


@dataclass(slots=True)
class ReqStep:
    """Everything one request did in one step."""

    req_id: str
    logits: list[Logits] = field(default_factory=list)
    sampling: list[SamplingStages] = field(default_factory=list)
    tokens: list[TokenChosen] = field(default_factory=list)
    drafts: list[SpecDraft] = field(default_factory=list)
    verifies: list[SpecVerify] = field(default_factory=list)
    detok: list[DetokState] = field(default_factory=list)
    finish: list[FinishDecision] = field(default_factory=list)
    kv: list[KVEvent] = field(default_factory=list)
    added: RequestAdded | None = None
    finished: RequestFinished | None = None

    def logits_at(self, position: int | None) -> Logits | None:
        return _at(self.logits, position)

    def sampling_at(self, position: int | None) -> SamplingStages | None:
        return _at(self.sampling, position)

    @property
    def positions(self) -> list[int]:
        """Output positions this request produced in this step (several with speculative decoding)."""
        return [t.position for t in self.tokens]


def _at(items: list, position: int | None):  # noqa: ANN001, ANN202 - Logits | SamplingStages lists
    if not items:
        return None
    if position is None:
        return items[0]
    return next((x for x in items if x.position == position), None)


@dataclass(slots=True)
class StepView:
    """One step: its summary row, batch-level events and a `ReqStep` per request it touched."""

    step: int
    info: StepInfo | None
    schedule: ScheduleDecision | None = None
    batches: list[ForwardBatchBuilt] = field(default_factory=list)
    forwards: list[ForwardDone] = field(default_factory=list)
    kv: list[KVEvent] = field(default_factory=list)
    errors: list[EngineError] = field(default_factory=list)
    reqs: dict[str, ReqStep] = field(default_factory=dict)
    captures: list[Captured] = field(default_factory=list)  # capture inside the forward (issue 18)
    inside: dict[tuple[str, int], Any] = field(default_factory=dict)  # (req, position) -> tui.inside.InsideView
    has_capture: bool = False  # the trace holds capture (the layers pane shows itself)

    @property
    def mode(self) -> str:
        """The step's mode: TARGET_VERIFY when the target's forward verified drafts (the scheduler
        still calls such a step DECODE), else the schedule's, the batch's or the summary's."""
        if any(b.forward_mode == "TARGET_VERIFY" and getattr(b, "model", "target") == "target"
               for b in self.batches):
            return "TARGET_VERIFY"
        if self.schedule is not None:
            return self.schedule.mode
        if self.batches:
            return self.batches[-1].forward_mode
        return (shown_mode(self.info.mode, self.info.spec_proposed) if self.info else None) or "IDLE"

    def req_order(self) -> list[str]:
        """Requests in batch order (the target forward's order), then any others that had events."""
        order: list[str] = []
        for batch in reversed(self.batches):  # the target forward comes last; its order wins
            order.extend(r for r in batch.req_ids if r not in order)
        if self.info is not None:
            order.extend(r for r in self.info.req_ids if r not in order)
        order.extend(r for r in self.reqs if r not in order)
        return order

    def req(self, req_id: str | None) -> ReqStep | None:
        return self.reqs.get(req_id) if req_id is not None else None

    @classmethod
    def build(cls, step: int, info: StepInfo | None, events: list[Event]) -> StepView:
        view = cls(step=step, info=info)
        for event in events:
            view._add(event)
        return view

    def _add(self, event: Event) -> None:
        if isinstance(event, ScheduleDecision):
            self.schedule = event
        elif isinstance(event, ForwardBatchBuilt):
            self.batches.append(event)
        elif isinstance(event, ForwardDone):
            self.forwards.append(event)
        elif isinstance(event, EngineError):
            self.errors.append(event)
        elif isinstance(event, KVEvent) and event.req_id is None:
            self.kv.append(event)
        elif isinstance(event, Captured):
            self.captures.append(event)
        elif event.req_id is not None:
            self._add_req(event)

    def _add_req(self, event: Event) -> None:
        rs = self.reqs.setdefault(event.req_id, ReqStep(event.req_id))  # type: ignore[arg-type]
        lists = {Logits: rs.logits, SamplingStages: rs.sampling, TokenChosen: rs.tokens, SpecDraft: rs.drafts,
                 SpecVerify: rs.verifies, DetokState: rs.detok, FinishDecision: rs.finish, KVEvent: rs.kv}
        target = lists.get(type(event))
        if target is not None:
            target.append(event)
        elif isinstance(event, RequestAdded):
            rs.added = event
        elif isinstance(event, RequestFinished):
            rs.finished = event


@dataclass(slots=True)
class RequestData:
    """One request's prompt record, output tokens in position order, finish record and reference check."""

    req_id: str
    added: RequestAdded | None
    tokens: list[TokenChosen]
    finished: RequestFinished | None
    check: dict | None = None  # `workbench check`'s result for this request (workbench/trace/checks.py)
    # `workbench invariance`'s row for this request (workbench/trace/invariance_store.py); {} when the
    # trace was measured but not this request, None when it was never measured
    invariance: dict | None = None
    # `workbench bisect`'s stored results for this request: (position, layer bisect, behaves-like fit)
    bisects: list[tuple[int, dict | None, dict | None]] = field(default_factory=list)

    @property
    def bisect_positions(self) -> list[int]:
        return [p for p, _, _ in self.bisects]

    @classmethod
    def build(cls, req_id: str, events: list[Event]) -> RequestData:
        added = next((e for e in events if isinstance(e, RequestAdded)), None)
        finished = next((e for e in reversed(events) if isinstance(e, RequestFinished)), None)
        by_pos: dict[int, TokenChosen] = {}
        for e in events:
            if isinstance(e, TokenChosen):
                by_pos[e.position] = e  # a recomputed position (after preemption) keeps the latest
        return cls(req_id, added, [by_pos[p] for p in sorted(by_pos)], finished)

    def index_of(self, position: int | None) -> int | None:
        if position is None:
            return None
        return next((i for i, t in enumerate(self.tokens) if t.position == position), None)

    def text_until(self, step: int) -> str:
        """The output text the request had produced by the end of `step` (from its token texts)."""
        return "".join(t.text for t in self.tokens if t.step <= step)


def request_bisects(rows: list[dict[str, Any]], req_id: str) -> list[tuple[int, dict | None, dict | None]]:
    """(position, layer bisect row or None, behaves-like row or None) of `req_id`, by position (the
    last stored layer bisect of a position when there are several)."""
    out: dict[int, list[dict | None]] = {}
    for row in rows:
        if row.get("req_id") != req_id or not isinstance(row.get("position"), int):
            continue
        slot = out.setdefault(row["position"], [None, None])
        if isinstance(row.get("layers"), list):
            slot[0] = row
        elif isinstance(row.get("candidates"), list):
            slot[1] = row
    return [(p, a, b) for p, (a, b) in sorted(out.items())]
