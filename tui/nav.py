"""Where the user is: the selected step, request and token, and which steps the filter shows.

Owns: `Selection` and `Navigator` (moving through the visible steps, first/last, jump, keeping a
request selected across steps). Pure Python, no Textual, so every rule is testable on its own.
Does not own loading anything.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from workbench.trace.reader import StepInfo


@dataclass(frozen=True, slots=True)
class Selection:
    """The step on screen, the request the per-request panes show and its selected output position."""

    step: int | None = None
    req_id: str | None = None
    position: int | None = None


class Navigator:
    """The visible steps (all, or those running a filtered request) and moves through them."""

    def __init__(self) -> None:
        self.steps: list[StepInfo] = []
        self.visible: list[StepInfo] = []
        self._numbers: list[int] = []
        self.filter_ids: frozenset[str] | None = None

    def set_steps(self, steps: list[StepInfo]) -> None:
        self.steps = steps
        self._apply()

    def set_filter(self, req_ids: frozenset[str] | None) -> None:
        self.filter_ids = req_ids
        self._apply()

    def _apply(self) -> None:
        ids = self.filter_ids
        self.visible = self.steps if ids is None else [s for s in self.steps if ids.intersection(s.req_ids)]
        self._numbers = [s.step for s in self.visible]

    def __len__(self) -> int:
        return len(self.visible)

    def index(self, step: int | None) -> int | None:
        """Row of `step` among the visible steps, or None when it is not shown."""
        if step is None:
            return None
        i = bisect.bisect_left(self._numbers, step)
        return i if i < len(self._numbers) and self._numbers[i] == step else None

    def info(self, step: int | None) -> StepInfo | None:
        i = self.index(step)
        return self.visible[i] if i is not None else None

    def nearest(self, step: int) -> int | None:
        """The visible step at or after `step` (else the last one before it)."""
        if not self._numbers:
            return None
        i = bisect.bisect_left(self._numbers, step)
        return self._numbers[min(i, len(self._numbers) - 1)]

    def move(self, step: int | None, delta: int) -> int | None:
        """The visible step `delta` rows from `step` (clamped at both ends)."""
        if not self._numbers:
            return None
        if step is None:
            return self._numbers[0 if delta >= 0 else -1]
        i = self.index(step)
        if i is None:  # not visible (filter changed): go to the neighbour in the direction asked
            i = bisect.bisect_left(self._numbers, step) - (1 if delta > 0 else 0)
        i = min(max(i + delta, 0), len(self._numbers) - 1)
        return self._numbers[i]

    def first(self) -> int | None:
        return self._numbers[0] if self._numbers else None

    def last(self) -> int | None:
        return self._numbers[-1] if self._numbers else None


def pick_request(order: list[str], current: str | None, allowed: frozenset[str] | None) -> str | None:
    """Keep the current request when this step runs it; else the first allowed request of the step."""
    candidates = [r for r in order if allowed is None or r in allowed]
    if current in candidates:
        return current
    return candidates[0] if candidates else current
