"""The records a trace reader hands out: steps, requests, timelines, and the one error type.

Owns: `TraceError` (every failure to read a file, one line for users), `StepInfo` (a row of the
`steps` table), `RequestInfo` and `Timeline`, and turning a raw `steps` row into a `StepInfo`.
Plain data only: no SQLite, no torch. The reader (reader.py) builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.trace.events import Event, RequestAdded, RequestFinished, TokenChosen
from workbench.trace.format import STEP_COLUMNS
from workbench.trace.limits import LimitError, ReadLimits, parse_json


class TraceError(ValueError):
    """A file that cannot be read as a workbench trace; str(e) is a one-line message for users."""


@dataclass(frozen=True, slots=True)
class StepInfo:
    """The summary of one engine step (a row of the `steps` table)."""

    step: int
    mode: str | None
    batch_size: int
    num_tokens: int
    output_tokens: int
    forward_ms: float
    kv_used: int | None
    kv_total: int | None
    req_ids: tuple[str, ...]
    t_start: float | None
    t_end: float | None
    first_id: int | None
    last_id: int | None
    num_events: int
    spec_proposed: int
    spec_accepted: int


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request as recorded by its `request.added` and (when it finished) `request.finished` events."""

    req_id: str
    added: RequestAdded | None
    finished: RequestFinished | None

    @property
    def arrival_step(self) -> int | None:
        return self.added.step if self.added else None

    @property
    def finish_step(self) -> int | None:
        return self.finished.step if self.finished else None

    @property
    def finish_reason(self) -> str | None:
        return self.finished.finish_reason if self.finished else None


@dataclass(frozen=True, slots=True)
class Timeline:
    """Everything recorded about one request, in order: its events, its tokens, the steps that ran it."""

    req_id: str
    events: list[Event]
    tokens: list[TokenChosen]
    steps: list[int]
    added: RequestAdded | None
    finished: RequestFinished | None


def _is_version(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _step_info(row: tuple[Any, ...], name: str, limits: ReadLimits | None = None) -> StepInfo:
    values = dict(zip(STEP_COLUMNS, row, strict=True))
    try:
        values["req_ids"] = tuple(parse_json(values["req_ids"] or "[]", limits or ReadLimits(),
                                             f"step {values['step']}'s request list"))
        for key in ("batch_size", "num_tokens", "output_tokens", "num_events", "spec_proposed", "spec_accepted"):
            values[key] = int(values[key] or 0)
        values["forward_ms"] = float(values["forward_ms"] or 0.0)
        return StepInfo(**values)
    except LimitError as exc:
        raise TraceError(f"{name}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{name}: corrupt step {values['step']} ({exc})") from None
