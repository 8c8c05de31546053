"""The record of one engine step (`StepContext`), created by `Engine.step()` and handed down.

Owns: what a step knows about itself while it runs: its number, its stage clock, the ForwardBatch
it built, whether that batch's KV slots already count in the requests' `kv_len` (what a failure has
to free), and the trace observer its stages report to. Nothing else keeps per-step state: the
scheduler, the speculative worker and the output stage read and write it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench.engine.timing import StepClock

if TYPE_CHECKING:
    from workbench.engine.run.forward_batch import ForwardBatch
    from workbench.engine.tracing import TraceObserver


@dataclass(slots=True)
class StepContext:
    step: int  # 1-based step number (0: before the first step)
    obs: TraceObserver
    clock: StepClock = field(default_factory=StepClock)
    fb: ForwardBatch | None = None  # the target forward of this step, once built
    forward_start: float = 0.0  # when building the target's ForwardBatch began (its forward_ms counts from here)
    kv_counted: bool = False  # fb's KV slots are part of the requests' kv_len (a failure frees them there)
