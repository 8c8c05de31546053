"""Structured output with xgrammar: JSON schema, regex and EBNF constraints.

Owns: checking a constraint's structural limits and syntax at validation time (`check_grammar`,
no tokenizer needed; grammar_limits.py), compiling it once per (kind, source) against the model's
tokenizer (`GrammarBackend`, built lazily on the first constrained request, or ahead by `prestart`): first in
a worker process under the time and memory budget (grammar_worker.py), then, once that worker said
it fits, in this process, kept in a cache bounded in bytes (least recently used dropped), the per-request matcher (`GrammarState`, stored
in `Req.grammar`), the per-batch token bitmask (`grammar_bitmask`, filled and applied on the CPU)
and advancing the matcher after every appended token (`accept_tokens`). Does not own: where the
mask sits among the sampling stages (sampler.py) or finishing the request (finish.py: a matcher
terminates by accepting EOS, which the mask allows only once the grammar is complete).

JSON schemas compile with `any_whitespace=False` (compact JSON: `{"a":1}`), because small models
given free whitespace tend to emit it until `max_new_tokens`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from workbench.engine.sample.grammar_limits import GrammarLimits, check_limits
from workbench.engine.sample.grammar_worker import GrammarWorkers, clean_error, grammar_key

KINDS = ("json_schema", "regex", "ebnf")
log = logging.getLogger(__name__)


def _lower_priority() -> None:
    """This thread yields the CPU to the engine's: a compile waits a little, a stream does not (Linux
    gives each thread its own nice value)."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


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


_clean = clean_error


def check_grammar(kind: str, source: Any, limits: GrammarLimits | None = None, parse: bool = True) -> None:
    """Check the structural limits, then (with `parse`) parse the constraint (no tokenizer needed);
    ValueError naming the parameter if it is over a limit or invalid.

    Parsing is not bounded by the structural limits: xgrammar turns a JSON schema's string `pattern`
    into grammar rules in time that grows with the square of its quantifier bounds (`a{1,5000}`: 3.8 s
    on this CPU). Callers that must not block (the server, `Engine.add_request`) pass `parse=False`
    and leave parsing to the budgeted compile (GrammarBackend.compile, in the worker process)."""
    if kind not in KINDS:
        raise ValueError(f"grammar kind must be one of {KINDS}, got {kind!r}")
    check_limits(kind, source, limits or GrammarLimits())
    text = grammar_source(kind, source)
    if not parse:
        return
    import xgrammar as xgr

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
    """Compiles constraints for one tokenizer under `limits`; compiled grammars are cached by (kind, source)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.limits = limits or GrammarLimits()
        self._compiler: Any = None
        self._info: Any = None
        self._lock = threading.Lock()  # the cache
        self._build_lock = threading.Lock()  # the compiler, built once
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key -> CompiledGrammar, least recent first
        self._cache_bytes = 0
        self.workers = GrammarWorkers(self._tokenizer_info_json, self.limits)
        self._executor: Any = None
        self._building: dict[str, threading.Lock] = {}  # keys being compiled here now
        self.compiles: Counter[str] = Counter()  # compiles in this process, by kind (each grammar once)
        self.compiler_ready_at: float | None = None  # wall clock: xgrammar imported, the tokenizer's info built

    def prestart(self) -> threading.Thread:
        """Get structured output ready in the background: xgrammar imported and the tokenizer's info
        built here, and the worker processes started (grammar_worker.py), so the first constrained
        request does not pay seconds of imports. A failure (no xgrammar) is logged; the first request
        then tries again and reports it."""
        def run() -> None:
            try:
                self._get_compiler()
                self.workers.prestart()
            except Exception as exc:  # noqa: BLE001 - a server without working xgrammar still serves
                log.warning("structured output could not be prepared at start-up: %s", clean_error(exc))

        thread = threading.Thread(target=run, name="workbench-grammar-prestart", daemon=True)
        thread.start()
        return thread

    def status(self) -> dict[str, Any]:
        """What the server reports: compiles here by kind, the compiler's ready time, the workers' status."""
        with self._lock:
            compiles = dict(self.compiles)
        return {"compiles": compiles, "compiler_ready_at": self.compiler_ready_at, **self.workers.status()}

    @property
    def executor(self) -> Any:
        """Threads for callers that must not block on a compile (the server's handlers): they mostly
        wait on a worker process, so there are many; never the event loop's default executor."""
        with self._lock:
            if self._executor is None:
                from concurrent.futures import ThreadPoolExecutor

                self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="workbench-grammar",
                                                    initializer=_lower_priority)
            return self._executor

    def _get_compiler(self) -> Any:
        with self._build_lock:
            if self._compiler is None:  # building TokenizerInfo walks the vocabulary: ~0.5-2 s, once
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_token_ids or None)
                # no cache of xgrammar's own: ours below is bounded in bytes
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)  # a core left to the engine
                self.compiler_ready_at = time.time()
            return self._compiler

    def _tokenizer_info_json(self) -> str:
        self._get_compiler()
        return self._info.serialize_json()

    def key(self, kind: str, source: Any) -> tuple[str, str]:
        """(source text, cache key) after the structural limits; ValueError when over one or invalid JSON."""
        check_limits(kind, source, self.limits)
        text = grammar_source(kind, source)
        return text, grammar_key(kind, _cache_key(text) if kind == "json_schema" else text)

    def cached(self, kind: str, source: Any) -> bool:
        _, key = self.key(kind, source)
        with self._lock:
            return key in self._cache

    def compile(self, kind: str, source: Any, param: str | None = None) -> Any:
        """The compiled grammar (cached); ValueError naming `param` (default: `kind`) when it is invalid
        or its compile is over the time or memory budget. Blocks for up to the budget: never call it
        from the engine's stepping thread with a constraint not compiled before."""
        text, key = self.key(kind, source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        verdict = self.workers.verdict(kind, text, key, param or kind)
        if not verdict.ok:
            raise ValueError(verdict.message)
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:  # requests with the same new grammar at once: one compiles it, the others wait for it
            try:
                return self._compile_once(kind, text, key, param)
            finally:
                with self._lock:
                    self._building.pop(key, None)

    def _compile_once(self, kind: str, text: str, key: str, param: str | None) -> Any:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            self.compiles[kind] += 1
        comp = self._get_compiler()
        try:
            if kind == "json_schema":
                compiled = comp.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = comp.compile_regex(text)
            else:
                compiled = comp.compile_grammar(text)
        except Exception as exc:
            raise ValueError(f"{param or kind} is invalid: {_clean(exc)}") from None
        self._keep(key, compiled)
        return compiled

    def check_schema(self, schema: Any, param: str) -> None:
        """jsonschema's check of a schema (a tool's parameters) in a worker, under the same budget."""
        text, _ = self.key("json_schema", schema)
        verdict = self.workers.verdict("schema", text, grammar_key("schema", _cache_key(text)), param)
        if not verdict.ok:
            raise ValueError(verdict.message)

    def wrapped(self, schema: Any, head_regex: str, tail_regex: str, param: str) -> str:
        """The EBNF of `schema`'s output between two regexes (a forced tool call), built in a worker under
        the time and memory budget: xgrammar's schema parse is not bounded by the structural limits."""
        text, key = self.key("json_schema", schema)
        verdict = self.workers.verdict("wrapped", text, grammar_key("wrapped", f"{head_regex}\0{tail_regex}\0{key}"),
                                       param, {"head": head_regex, "tail": tail_regex})
        if not verdict.ok or verdict.result is None:
            raise ValueError(verdict.message or f"{param}: no grammar was built")
        return verdict.result

    def abandon(self, kind: str, source: Any) -> None:
        """The caller of `compile` gave up (its client left): the worker's compile stops if nobody else waits."""
        try:
            text, key = self.key("json_schema" if kind == "schema" else kind, source)
        except ValueError:
            return
        self.workers.abandon(grammar_key("schema", _cache_key(text)) if kind == "schema" else key)

    def _keep(self, key: str, compiled: Any) -> None:
        size = int(getattr(compiled, "memory_size_bytes", 0))
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._cache_bytes += size
            budget = self.limits.cache_mb << 20
            while self._cache_bytes > budget and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= int(getattr(old, "memory_size_bytes", 0))

    def close(self) -> None:
        self.workers.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

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
