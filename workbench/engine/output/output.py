"""What the engine hands back: per-step deltas and the final `RequestOutput`.

Owns: the output records of the pipeline's tail (`StepOutput` per request and step, `Finished`
when a request ends, `RequestOutput` its final result) and their JSON forms. Does not own: deciding finish reasons
(finish.py) or decoding text (detokenizer.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)


@dataclass(slots=True)
class RequestOutput:
    """The final result of one request, shaped like vLLM's/SGLang's outputs."""

    req_id: str
    prompt: Any
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    matched_stop: Any = None
    evidence: dict[str, Any] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    token_ids_logprobs: list[dict[int, float]] | None = None  # per output token, for SamplingParams.token_ids_logprob
    usage: dict[str, int] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's part of one engine step: what streaming callers receive."""

    req_id: str
    new_token_ids: list[int]
    delta: str
    finished: bool
    output: RequestOutput | None = None
    # the new tokens' logprobs (with the request's top alternatives) when it asked for logprobs
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that ended: its final output and the text the detokenizer still held back (the
    stream's last delta)."""

    output: RequestOutput
    tail: str

    def step_output(self) -> StepOutput:
        """The step output of a request that ends without new tokens (abort, scoring, failure)."""
        return StepOutput(self.output.req_id, [], self.tail, True, self.output)
