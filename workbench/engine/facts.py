"""The facts about a running engine that a server, a metrics exporter or a TUI reads.

Owns: the read-only view (`step_no`, `clock`, `max_context_len`, `kv_total`, `kv_used`,
`running_ids`, `waiting_ids`, `token_text`) the Engine exposes without handing out its parts,
and `fill_token_text`, which fills the token-text table at once.
A mixin: the Engine supplies `_last`, `runner`, `memory`, `scheduler` and `outputs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.engine.output.postprocess import OutputProcessor
    from workbench.engine.run.model_runner import ModelRunner
    from workbench.engine.sched.memory import Memory
    from workbench.engine.sched.scheduler import Scheduler
    from workbench.engine.step import StepContext
    from workbench.engine.timing import StepClock


class EngineFacts:
    """Read-only facts of an engine between steps (the server reads these, never the parts)."""

    _last: StepContext
    runner: ModelRunner
    memory: Memory
    scheduler: Scheduler
    outputs: OutputProcessor

    @property
    def step_no(self) -> int:
        """The number of the last step that ran (0 before the first)."""
        return self._last.step

    @property
    def clock(self) -> StepClock:
        """The stage clock of the last step."""
        return self._last.clock

    def max_context_len(self) -> int:
        return self.runner.max_context_len

    def kv_total(self) -> int:
        return self.memory.allocator.size

    def kv_used(self) -> int:
        return self.memory.allocator.used()

    def running_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduler.running]

    def waiting_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduler.waiting]

    def token_text(self, token_id: int) -> str:
        return self.outputs.token_text(token_id)

    def fill_token_text(self) -> int:
        """Decode the whole vocabulary into the token-text table now (a long-running server does
        this at start: OutputProcessor.fill_token_text says why); returns the number of tokens."""
        return self.outputs.fill_token_text()
