"""Finish reasons: pure functions deciding, each time a token is appended, whether a request ends.

This module owns the order of the checks (DESIGN.md section 2) and the evidence they leave:
1. `abort` (client gone, cancelled, deadline);
2. `length`: `max_new_tokens` reached, or the context is full (`seq_len >= context_limit`); it
   wins over stop in the same step, so EOS sampled as the last allowed token finishes as `length`;
3. `stop` by token (EOS unless `ignore_eos`, then `stop_token_ids`, which `ignore_eos` leaves
   active), then by stop string (the detokenizer's match); no stop counts until more than
   `min_new_tokens` output tokens exist (the stopping token comes after `min_new_tokens` others);
4. `tool_calls` replaces `stop` when the tool parser holds a complete call (never `length`).

Every check is evaluated every time and recorded, in order, with its inputs and whether it fired,
so a trace shows why a request did or did not stop (e.g. EOS fired but `length` won). It does not
touch requests, detokenize, or emit events: `FinishResult.trace_fields()` is the `FinishDecision`
payload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

FINISH_REASONS = ("abort", "length", "stop", "tool_calls")


class FinishCheck(TypedDict):
    """One check as recorded in the trace: its name, its inputs, and True when it fired."""

    name: str
    inputs: dict[str, Any]
    result: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishInputs:
    """Everything the finish decision looks at for one request after one appended token."""

    num_output_tokens: int  # output tokens including the one just appended
    max_new_tokens: int | None  # None: no limit but the context
    seq_len: int  # prompt + output tokens
    context_limit: int
    last_token_id: int | None = None
    aborted: str | None = None  # the abort reason, None when not aborted
    min_new_tokens: int = 0
    eos_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    stop_string_matched: str | None = None  # from DetokUpdate.stop_matched
    has_complete_tool_call: bool = False

    def __post_init__(self) -> None:
        for name in ("num_output_tokens", "seq_len", "min_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")
        if self.context_limit < 1:
            raise ValueError(f"context_limit must be >= 1, got {self.context_limit}")


@dataclass(frozen=True, slots=True)
class FinishResult:
    """The decision: reason (None while running), SGLang-style evidence, the matched stop, every check."""

    finish_reason: str | None
    evidence: dict[str, Any] | None = None
    matched_stop: int | str | None = None  # the token id or stop string that ended it
    checks: list[FinishCheck] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_token(self) -> bool:
        """Ended by EOS or a stop token id (so its text is not part of the output by default)."""
        return self.finish_reason in ("stop", "tool_calls") and isinstance(self.matched_stop, int)

    def trace_fields(self) -> dict[str, Any]:
        """The payload of a `workbench.trace.events.FinishDecision` event."""
        return {"checks": [dict(c) for c in self.checks], "finish_reason": self.finish_reason,
                "evidence": dict(self.evidence) if self.evidence is not None else None}


def _check(name: str, result: bool, **inputs: Any) -> FinishCheck:
    return FinishCheck(name=name, inputs=inputs, result=bool(result))


def _length_checks(inp: FinishInputs) -> list[FinishCheck]:
    hit_max = inp.max_new_tokens is not None and inp.num_output_tokens >= inp.max_new_tokens
    return [
        _check("max_new_tokens", hit_max, num_output_tokens=inp.num_output_tokens,
               max_new_tokens=inp.max_new_tokens),
        _check("context_full", inp.seq_len >= inp.context_limit, seq_len=inp.seq_len,
               context_limit=inp.context_limit),
    ]


def _stop_checks(inp: FinishInputs) -> list[FinishCheck]:
    too_early = inp.num_output_tokens <= inp.min_new_tokens
    tok = inp.last_token_id
    is_eos = tok is not None and tok in inp.eos_token_ids and not inp.ignore_eos
    is_stop_id = tok is not None and tok in inp.stop_token_ids
    return [
        _check("before_min_new_tokens", too_early, num_output_tokens=inp.num_output_tokens,
               min_new_tokens=inp.min_new_tokens),
        _check("eos_token", is_eos and not too_early, token_id=tok,
               eos_token_ids=list(inp.eos_token_ids), ignore_eos=inp.ignore_eos),
        _check("stop_token_ids", is_stop_id and not too_early, token_id=tok,
               stop_token_ids=list(inp.stop_token_ids)),
        _check("stop_string", inp.stop_string_matched is not None and not too_early,
               matched=inp.stop_string_matched),
    ]


def decide_finish(inp: FinishInputs) -> FinishResult:
    """Run every check in DESIGN.md's order; the first that fires (abort, length, stop) decides."""
    abort = _check("abort", inp.aborted is not None, reason=inp.aborted)
    length = _length_checks(inp)
    stops = _stop_checks(inp)
    fired = {c["name"] for c in (abort, *length, *stops) if c["result"]}
    reason: str | None = None
    evidence: dict[str, Any] | None = None
    matched: int | str | None = None
    if "abort" in fired:
        reason, evidence = "abort", {"type": "abort", "message": inp.aborted}
    elif "max_new_tokens" in fired or "context_full" in fired:
        cause = "max_new_tokens" if "max_new_tokens" in fired else "context"
        reason = "length"
        evidence = {"type": "length", "length": inp.num_output_tokens, "cause": cause}
    elif "eos_token" in fired or "stop_token_ids" in fired:
        reason, matched = "stop", inp.last_token_id
    elif "stop_string" in fired:
        reason, matched = "stop", inp.stop_string_matched
    if reason == "stop":
        evidence = {"type": "stop", "matched": matched}
    replace = reason == "stop" and inp.has_complete_tool_call
    tool = _check("tool_calls", replace, has_complete_tool_call=inp.has_complete_tool_call,
                  replaces=reason)
    if replace:
        reason, evidence = "tool_calls", {"type": "tool_calls", "matched": matched}
    return FinishResult(reason, evidence, matched, [abort, *length, *stops, tool])


def stops_by_token(inp: FinishInputs) -> bool:
    """`decide_finish(inp).stopped_by_token`, without building the recorded checks: the detokenizer
    asks this before every token (whether to show its text), and only the full decision is traced."""
    tok = inp.last_token_id
    if inp.aborted is not None or not isinstance(tok, int):
        return False
    if (inp.max_new_tokens is not None and inp.num_output_tokens >= inp.max_new_tokens) \
            or inp.seq_len >= inp.context_limit or inp.num_output_tokens <= inp.min_new_tokens:
        return False
    return (tok in inp.eos_token_ids and not inp.ignore_eos) or tok in inp.stop_token_ids
