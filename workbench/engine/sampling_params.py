"""Per-request sampling parameters (what vLLM and SGLang users expect) and their validation.

Owns: the `SamplingParams` record and the rules for valid values. Does not own: applying them
(sampler.py) or deciding finish reasons (finish.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request samples and when it stops. `temperature=0` means greedy."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    token_ids_logprob: tuple[int, ...] = ()
    logprobs_mode: str = "raw"
    json_schema: Any = None
    regex: str | None = None
    ebnf: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                v = list(v)
            if isinstance(v, dict) and f.name == "logit_bias":
                v = {str(k): b for k, b in v.items()}
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        d = dict(d)
        for k in ("stop", "stop_token_ids", "token_ids_logprob"):
            if k in d and isinstance(d[k], list):
                d[k] = tuple(d[k])
        if isinstance(d.get("logit_bias"), dict):
            d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"].items()}
        return cls(**d)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the parameter, its value and the allowed range."""
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("max_new_tokens", self.max_new_tokens, lo=0 if self.prompt_logprobs else 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)


def _check_number(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi if hi is not None else 'inf'}], got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")


def _check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value!r}")
