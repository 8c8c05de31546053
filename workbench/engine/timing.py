"""Per-request latency anatomy on one monotonic clock (`time.perf_counter`).

Owns: the step clock (when this step was scheduled, its forward ended, sampling ended) and each
request's accumulation of where its time went: tokenize, queue (before first scheduled), wait
(between its steps: other steps, preemption), schedule, forward, sample, output (detokenize,
stop and finish checks). Every interval is measured at a hand-off; consecutive intervals tile
[arrival, last hand-off], so the shares of a request add up to its end-to-end time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

STAGES = ("tokenize", "queue", "wait", "schedule", "forward", "sample", "output")


@dataclass(slots=True)
class StepClock:
    """Hand-off times of one engine step."""

    start: float = field(default_factory=time.perf_counter)
    scheduled: float = 0.0
    forward_end: float = 0.0
    sampled: float = 0.0


@dataclass(slots=True)
class ReqTiming:
    arrival: float
    tokenized: float = 0.0
    first_scheduled: float | None = None
    last_mark: float = 0.0
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    def mark_tokenized(self, t: float) -> None:
        self.tokenized = t
        self.last_mark = t
        self.stages["tokenize"] = t - self.arrival

    def _enter_step(self, clock: StepClock) -> None:
        gap = max(0.0, clock.start - self.last_mark)
        if self.first_scheduled is None:
            self.first_scheduled = clock.scheduled
            self.stages["queue"] += gap
        else:
            self.stages["wait"] += gap
        self.stages["schedule"] += clock.scheduled - max(clock.start, self.last_mark)

    def account_chunk(self, clock: StepClock) -> None:
        """A prefill chunk that sampled nothing: its step ends for this request at forward end."""
        self._enter_step(clock)
        self.stages["forward"] += clock.forward_end - clock.scheduled
        self.last_mark = clock.forward_end

    def account_step(self, clock: StepClock, done: float) -> dict[str, float]:
        """A step that produced tokens for this request; `done` is when its output was processed."""
        self._enter_step(clock)
        self.stages["forward"] += clock.forward_end - clock.scheduled
        self.stages["sample"] += clock.sampled - clock.forward_end
        self.stages["output"] += done - clock.sampled
        self.last_mark = done
        return {"start": clock.start, "scheduled": clock.scheduled, "forward_end": clock.forward_end,
                "sampled": clock.sampled, "output_done": done}

    def summary(self, token_times: list[float], finished: float) -> dict[str, Any]:
        e2e = finished - self.arrival
        first = token_times[0] if token_times else None
        gaps = [b - a for a, b in zip(token_times, token_times[1:])]
        return {
            "arrival": self.arrival, "ttft": (first - self.arrival) if first is not None else None,
            "tpot": (token_times[-1] - first) / (len(token_times) - 1) if len(token_times) > 1 else None,
            "itl": gaps, "e2e": e2e, "queue": self.stages["queue"],
            "stages": dict(self.stages),
            "shares": {k: (v / e2e if e2e > 0 else 0.0) for k, v in self.stages.items()},
        }
