"""Structured output with xgrammar: JSON schema, regex and EBNF constraints.

Owns: checking a constraint's syntax at validation time (`check_grammar`, no tokenizer needed),
compiling it once per (kind, source) against the model's tokenizer (`GrammarBackend`, built lazily
by the engine on the first constrained request), the per-request matcher (`GrammarState`, stored
in `Req.grammar`), the per-batch token bitmask (`grammar_bitmask`, filled and applied on the CPU)
and advancing the matcher after every appended token (`accept_tokens`). Does not own: where the
mask sits among the sampling stages (sampler.py) or finishing the request (finish.py: a matcher
terminates by accepting EOS, which the mask allows only once the grammar is complete).

JSON schemas compile with `any_whitespace=False` (compact JSON: `{"a":1}`), because small models
given free whitespace tend to emit it until `max_new_tokens`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch

KINDS = ("json_schema", "regex", "ebnf")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def grammar_source(kind: str, source: Any) -> str:
    """The constraint as the string xgrammar parses (a JSON schema dict becomes JSON, its key order kept)."""
    if kind not in KINDS:
        raise ValueError(f"grammar kind must be one of {KINDS}, got {kind!r}")
    if kind == "json_schema":
        if isinstance(source, (dict, bool)):
            return json.dumps(source)  # property order as the schema gives it (xgrammar keeps it)
        if isinstance(source, str):
            try:
                json.loads(source)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc.msg} at line {exc.lineno}") from None
            return source
        raise ValueError(f"json_schema must be a dict or a JSON string, got {type(source).__name__}")
    if not isinstance(source, str) or not source:
        raise ValueError(f"{kind} must be a non-empty string, got {source!r}")
    return source


def _cache_key(schema_json: str) -> str:
    """One cache entry per schema meaning: keys sorted everywhere except in `properties`, whose order
    is the output's property order (two schemas that differ only there compile differently)."""

    def canon(obj: Any, ordered: bool = False) -> Any:
        if isinstance(obj, dict):
            items = obj.items() if ordered else sorted(obj.items())
            return [[k, canon(v, k == "properties" and not ordered)] for k, v in items]
        if isinstance(obj, list):
            return [canon(v) for v in obj]
        return obj

    return json.dumps(canon(json.loads(schema_json)))


def _clean(exc: Exception) -> str:
    """xgrammar's C++ message without its timestamp, source path and assertion text."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", first)


def check_grammar(kind: str, source: Any) -> None:
    """Parse the constraint (no tokenizer needed); ValueError naming the parameter if it is invalid."""
    import xgrammar as xgr

    text = grammar_source(kind, source)
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except Exception as exc:  # xgrammar raises RuntimeError (and friends) from C++
        raise ValueError(f"{kind} is invalid: {_clean(exc)}") from None


class GrammarBackend:
    """Compiles constraints for one tokenizer; compiled grammars are cached by (kind, source)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self._compiler: Any = None
        self._cache: dict[tuple[str, str], Any] = {}

    def _get_compiler(self) -> Any:
        if self._compiler is None:  # building TokenizerInfo walks the vocabulary: ~0.5-2 s, once
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, kind: str, source: Any) -> Any:
        text = grammar_source(kind, source)
        key = (kind, _cache_key(text) if kind == "json_schema" else text)
        if key not in self._cache:
            comp = self._get_compiler()
            try:
                if kind == "json_schema":
                    compiled = comp.compile_json_schema(text, any_whitespace=False)
                elif kind == "regex":
                    compiled = comp.compile_regex(text)
                else:
                    compiled = comp.compile_grammar(text)
            except Exception as exc:
                raise ValueError(f"{kind} is invalid: {_clean(exc)}") from None
            self._cache[key] = compiled
        return self._cache[key]

    def new_state(self, params: Any) -> GrammarState | None:
        """A fresh matcher for a request's constraint (None when it has none)."""
        constraint = params.grammar
        if constraint is None:
            return None
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(*constraint)), self.stop_token_ids)


class GrammarState:
    """One request's position in its grammar (`Req.grammar`)."""

    def __init__(self, matcher: Any, stop_token_ids: Sequence[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = list(stop_token_ids)
        self.rejected: list[int] = []  # tokens appended that the grammar did not accept (should stay empty)

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and its stop token (EOS) has been accepted."""
        return bool(self.matcher.is_terminated())

    def accept(self, token_id: int) -> bool:
        if self.terminated:
            return token_id in self.stop_token_ids
        ok = bool(self.matcher.accept_token(int(token_id)))
        if not ok:
            self.rejected.append(int(token_id))
        return ok

    def fill(self, bitmask: torch.Tensor, row: int, prefix: Sequence[int] = ()) -> None:
        """Write the allowed next tokens into `bitmask[row]`, after the tokens in `prefix` (spec rows)."""
        matcher = self.matcher
        if prefix:
            matcher = matcher.fork()
            for tok in prefix:
                if matcher.is_terminated() or not matcher.accept_token(int(tok)):
                    break  # a rejected draft: rows after it are never reached
        if matcher.is_terminated():
            bitmask[row] = 0
            for tok in self.stop_token_ids:
                _set_bit(bitmask, row, tok)
            return
        matcher.fill_next_token_bitmask(bitmask, row)


def _set_bit(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    bit = 1 << (token_id % 32)
    word = int(bitmask[row, token_id // 32])
    value = (word & 0xFFFFFFFF) | bit
    bitmask[row, token_id // 32] = value - (1 << 32) if value >= 1 << 31 else value  # int32 storage


def grammar_bitmask(states: Sequence[GrammarState | None], prefixes: Sequence[Sequence[int]] | None,
                    vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """The packed allowed-token bitmask `[R, ceil(V/32)]` int32 and the rows it applies to."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    for i in rows:
        states[i].fill(bitmask, i, prefixes[i] if prefixes else ())
    return bitmask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set disallowed tokens of the constrained rows to -inf, in place (`logits` `[R, V]` float32).

    A row left with no finite logit (the grammar allows only EOS while `min_new_tokens` bans it)
    falls back to the grammar's own set, uniformly: the grammar wins over min_new_tokens.
    """
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    alive = (logits[rows] > float("-inf")).any(dim=-1).tolist()  # one pass over the constrained rows
    for r in (r for r, ok in zip(rows, alive) if not ok):
        allowed = torch.zeros_like(logits[r])
        xgr.apply_token_bitmask_inplace(allowed[None], bitmask[r:r + 1].to(logits.device))
        logits[r] = allowed


def accept_tokens(state: GrammarState | None, token_ids: Sequence[int]) -> None:
    """Advance a request's matcher over tokens just appended to its output."""
    if state is None:
        return
    for tok in token_ids:
        state.accept(tok)
