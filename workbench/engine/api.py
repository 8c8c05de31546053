"""What code outside `engine/` may ask of an engine: the `EngineAPI` protocol, and `StepFailed`.

The server, the re-runs, the peers' checks and the CLI are typed against this protocol, not the
`Engine` class: requests in (`add_request`, `abort`), one pipeline pass out (`step` -> StepOutputs,
each carrying its new tokens, text delta, logprobs and, at the end, the RequestOutput), and the facts
between steps. The engine's parts (runner, memory, scheduler, sampler, requests) stay inside;
tests/test_imports.py fails any module outside engine/ that reaches for them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workbench.engine.config import EngineArgs, EngineConfig
    from workbench.engine.output.output import RequestOutput, StepOutput
    from workbench.engine.sample.grammar import GrammarBackend
    from workbench.engine.sample.sampling_params import SamplingParams
    from workbench.engine.timing import ReqTiming, StepClock
    from workbench.trace.recorder import MemorySink, Tracer


class StepFailed(RuntimeError):
    """A step failed inside the forward pass or the sampler. The engine has already ended the
    requests of that step (`affected`, finish reason "abort" with `error` set) and freed their KV;
    it keeps serving everything else."""

    def __init__(self, message: str, affected: list[str]) -> None:
        super().__init__(message)
        self.affected = affected


class EngineAPI(Protocol):
    """The engine as its callers see it. `add_request` and `abort` are thread-safe; everything else
    runs on the stepping thread, between steps."""

    args: EngineArgs  # what it was built with
    config: EngineConfig  # what that resolved to (a trace's `engine` meta)
    tokenizer: Any
    device: Any
    vocab_size: int
    tracer: Tracer  # its trace channel: sinks can be added, stamps emitted
    finished: dict[str, RequestOutput]
    # structured output's compile service (sample/grammar.py): `limits`, `compile`, `cached`, `check_schema`,
    # `wrapped`, `abandon`, `executor`; every compile of a client's constraint under its time and memory budget
    grammars: GrammarBackend

    # requests in, steps out
    def tokenize(self, prompt: Any) -> list[int]: ...
    def add_request(self, prompt: Any, params: SamplingParams | None = None, req_id: str | None = None,
                    capture: Any = None) -> list[str]: ...
    def abort(self, req_id: str, reason: str = ...) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[StepOutput]: ...
    def forget(self, req_id: str) -> RequestOutput | None: ...
    def generate(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]: ...
    def stream(self, prompt: Any, params: SamplingParams | None = None) -> Iterator[StepOutput]: ...
    def close(self) -> None: ...

    # facts between steps
    @property
    def step_no(self) -> int: ...
    @property
    def clock(self) -> StepClock: ...
    @property
    def memory_sink(self) -> MemorySink | None: ...
    def max_context_len(self) -> int: ...
    def kv_total(self) -> int: ...
    def kv_used(self) -> int: ...
    def running_ids(self) -> list[str]: ...
    def waiting_ids(self) -> list[str]: ...
    def token_text(self, token_id: int) -> str: ...
    def fill_token_text(self) -> int: ...
    def timing(self, req_id: str) -> ReqTiming | None: ...

    # upkeep and what-ifs
    def release_buffers(self) -> None: ...
    def flush_prefix_cache(self) -> int: ...
    def force_token(self, req_id: str, position: int, token: int) -> None: ...
    def update_params(self, req_id: str, **changes: Any) -> SamplingParams: ...
    def use_draws(self, req_id: str, draws: dict[int, float]) -> None: ...


# The engine modules code outside engine/ may import: the facade and its protocol, the records that
# cross the boundary (arguments, config, sampling parameters, outputs), and the helpers the server's
# chat formatting and the CLI name. tests/test_imports.py holds every other module to this list.
PUBLIC_MODULES = (
    "workbench.engine.api", "workbench.engine.engine", "workbench.engine.config",
    "workbench.engine.sample.sampling_params", "workbench.engine.output.output",
    "workbench.engine.output.tool_formats", "workbench.engine.output.tool_prompt",
    "workbench.engine.speculative.config", "workbench.engine.whatif",
    "workbench.engine.sample.grammar_limits",  # GrammarLimits and the structural checks, engine-free
    "workbench.engine.layer_walk",  # a sequence layer by layer in chosen numerics (workbench bisect)
)
