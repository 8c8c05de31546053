"""The request as the engine sees it (`Req`): prompt, output so far, KV progress and status.

Owns: per-request mutable state that lives from `add_request` to finish. Does not own: deciding
what runs (scheduler.py), KV slots themselves (memory.py) or finish rules (finish.py).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from workbench.engine.sample.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    """One sequence. `fill_ids = prompt_ids + output_ids`; `kv_len` of them have KV in the pool."""

    req_id: str
    prompt: Any
    prompt_ids: list[int]
    params: SamplingParams
    arrival_step: int = 0
    queue_order: int = 0  # admission order (set by the scheduler); the latest is preempted first
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    req_pool_idx: int | None = None
    kv_len: int = 0  # tokens of fill_ids whose K/V are in the pool
    generator: Any = None  # torch.Generator for seeded requests
    # per output token: logprob, rank, top alternatives [(id, logprob)]
    output_logprobs: list[float] = field(default_factory=list)
    output_ranks: list[int] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_token_ids_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)
    finish_reason: str | None = None
    evidence: dict[str, Any] | None = None
    matched_stop: Any = None
    abort_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    cached_prompt_tokens: int = 0
    parent_id: str | None = None
    # n > 1: the sibling whose prompt KV this request copies once that sibling's prefill completes
    share_prefix_from: Req | None = None
    share_len: int | None = None  # tokens of the prompt to copy from share_prefix_from (None: its prompt - 1)
    # per-request state owned by other stages (detokenizer, grammar matcher, tool parser, spec metrics)
    detok: Any = None
    grammar: Any = None
    bias: Any = None  # (token ids, biases) tensors of params.logit_bias, made once (sample/penalties.py)
    tool_parser: Any = None
    spec_stats: Any = None
    text: str = ""
    timing: Any = None  # timing.ReqTiming: where this request's time went
    stream_deltas: list[str] = field(default_factory=list)
    forced_tokens: dict[int, int] = field(default_factory=dict)  # output position -> token (Engine.force_token)
    draws: dict[int, float] = field(default_factory=dict)  # output position -> recorded uniform (Engine.use_draws)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED
