"""Per-request sampling parameters (what vLLM and SGLang users expect) and their validation.

Owns: the `SamplingParams` record, the rules for valid values (`validate(vocab_size)` raises a
`ValueError` naming the parameter, the value and the allowed range). Does not own: their
command-line form (workbench/cli/sampling_args.py), applying them (sampler.py, penalties.py, grammar.py) or deciding
finish reasons (finish.py).

Caps (documented limits, not model limits): at most `MAX_STOP_STRINGS` stop strings of at most
`MAX_STOP_LEN` characters each; `n <= MAX_N`; `top_logprobs <= MAX_TOP_LOGPROBS`; at most
`MAX_TOKEN_IDS_LOGPROB` ids in `token_ids_logprob`; logit bias values are clamped to
`[-100, 100]` (OpenAI's range). Booleans are never accepted where a number is expected, and NaN or
infinity never passes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_TOKEN_IDS_LOGPROB = 128
MAX_LOGIT_BIAS = 100.0
INT64 = (-(2**63), 2**63 - 1)
LOGPROBS_MODES = ("raw", "processed")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens", "logprobs", "prompt_logprobs")


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
    parse_tool_calls: bool = False  # parse <tool_call>{json}</tool_call> blocks; finish "tool_calls"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Normalise the forms callers naturally write: `stop="x"`, lists instead of tuples, bias
        # values outside OpenAI's range. Everything else is checked (not coerced) by validate().
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        for name in ("stop", "stop_token_ids", "token_ids_logprob"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", {k: _clamp_bias(v) for k, v in self.logit_bias.items()})
        self.check_values()  # a bad value fails where it is written, not when the request is submitted

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def grammar(self) -> tuple[str, Any] | None:
        """`(kind, source)` of the structured-output constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return None

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

    def validate(self, vocab_size: int, grammar_limits: Any = None, parse_grammar: bool = True) -> None:
        """Raise ValueError naming the parameter, its value and the allowed range; a structured-output
        constraint is checked against `grammar_limits` (a `GrammarLimits`; its defaults when None) and,
        with `parse_grammar`, parsed (grammar.check_grammar: unbounded in time; the server and the
        engine leave it to the budgeted compile)."""
        self.check_values()
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        _check_token_ids("token_ids_logprob", self.token_ids_logprob, vocab_size, cap=MAX_TOKEN_IDS_LOGPROB)
        self._validate_logit_bias(vocab_size)
        self._validate_grammar(grammar_limits, parse_grammar)

    def check_values(self) -> None:
        """Every check that needs neither the vocabulary nor the grammar compiler (run at construction)."""
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        if self.top_k not in (-1, 0):
            _check_int("top_k", self.top_k, lo=1, what="-1 or 0 (disabled) or an integer >= 1")
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        min_max = 0 if self.prompt_logprobs is True else 1
        _check_int("max_new_tokens", self.max_new_tokens, lo=min_max,
                   what=None if min_max else "an integer >= 1 (0 only with prompt_logprobs=True)")
        _check_int("min_new_tokens", self.min_new_tokens, lo=0, hi=self.max_new_tokens,
                   what=f"an integer in [0, max_new_tokens={self.max_new_tokens}]")
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=INT64[0], hi=INT64[1])
        _check_int("top_logprobs", self.top_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool (true or false), got {getattr(self, name)!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")
        self._validate_stop()
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for tid, bias in (self.logit_bias or {}).items():
            _check_number(f"logit_bias[{tid}]", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
        given = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"json_schema, regex and ebnf are mutually exclusive; got {' and '.join(given)}")

    def _validate_stop(self) -> None:
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not 1 <= len(s) <= MAX_STOP_LEN:
                raise ValueError(f"stop: each stop string must have 1 to {MAX_STOP_LEN} characters, "
                                 f"got one of {len(s)}: {s[:40]!r}")

    def _validate_logit_bias(self, vocab_size: int) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        _check_token_ids("logit_bias", tuple(self.logit_bias), vocab_size, cap=vocab_size)
        for tid, bias in self.logit_bias.items():
            _check_number(f"logit_bias[{tid}]", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)

    def _validate_grammar(self, limits: Any = None, parse: bool = True) -> None:
        given = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"json_schema, regex and ebnf are mutually exclusive; got {' and '.join(given)}")
        if given:
            from workbench.engine.sample.grammar import check_grammar

            check_grammar(given[0], getattr(self, given[0]), limits, parse)


def _clamp_bias(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value)))
    return value  # left for validate() to reject with a message


def _check_number(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False) -> None:
    bracket = "(" if lo_open else "["
    allowed = f"{bracket}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}" + (
        "]" if hi is not None else ")")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number in {allowed}, got {value!r}")
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")


def _check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None,
               what: str | None = None) -> None:
    what = what or f"an integer in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_token_ids(name: str, ids: Any, vocab_size: int, cap: int | None = None) -> None:
    if not isinstance(ids, tuple):
        raise ValueError(f"{name} must be a list of token ids, got {type(ids).__name__}")
    if cap is not None and len(ids) > cap:
        raise ValueError(f"{name}: at most {cap} token ids are allowed, got {len(ids)}")
    for tid in ids:
        _check_int(name, tid, lo=0, hi=vocab_size - 1,
                   what=f"token ids in [0, {vocab_size - 1}] (the model's vocabulary)")

