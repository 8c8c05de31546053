"""Which numerics an engine behaves like, from what it reported: `workbench bisect T --at REQ:POS
--against auto` on a probed or watched trace (another engine, no hidden states), or on a trace of
this engine.

Owns: teacher-forcing the request's prompt and reported tokens through the reference model in each
candidate numerics (layer_walk.CANDIDATES: float32, bfloat16, float16, fast, fast-int8, each
through this engine's runner) and each batch context (contexts.py: the reference run through the
engine's real scheduler alone, batched with the trace's other requests, with its prefix from the
prefix cache, with chunked prefill of N), and comparing, at the position and its neighbours (`window` each
side), the log-probabilities the engine reported (its chosen token and every top-k alternative it
sent) with the candidate's log-probabilities of the same tokens. The candidate with the smallest
median |Δ| is the one the engine behaves like. Does not own the per-layer attribution, which `bisect`
then runs for the winner (bisect.py).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import workbench.engine.layer_walk as lw


@dataclass(slots=True)
class CandidateFit:
    numerics: str  # a numerics (layer_walk.CANDIDATES) or a context (contexts.py: alone, batched, ...)
    deltas: dict[int, float]  # output position -> median |engine logprob - candidate logprob| over its reported tokens
    median_abs_delta: float
    note: str = ""  # a context's: e.g. how many prompt tokens the prefix cache served

    @property
    def kind(self) -> str:
        from workbench.rerun.contexts import is_context

        return "context" if is_context(self.numerics) else "numerics"

    def describe(self) -> str:
        from workbench.rerun.contexts import is_context, parse_context

        return parse_context(self.numerics).describe() if is_context(self.numerics) else f"the reference in {self.numerics}"


@dataclass(slots=True)
class BehavesLike:
    req_id: str
    position: int
    positions: list[int]
    fits: list[CandidateFit] = field(default_factory=list)  # best first
    seconds: float = 0.0

    @property
    def best(self) -> str:
        return self.fits[0].numerics

    def to_row(self) -> dict[str, Any]:
        return {"key": f"{self.req_id}:{self.position}:behaves-like", "req_id": self.req_id,
                "position": self.position, "against": "behaves-like", "positions": self.positions,
                "best": self.best, "best_text": self.fits[0].describe(),
                "candidates": [{"numerics": f.numerics, "kind": f.kind, "text": f.describe(), "note": f.note,
                                "median_abs_delta": f.median_abs_delta,
                                "deltas": {str(p): d for p, d in f.deltas.items()}} for f in self.fits]}

    def describe(self) -> str:
        lines = [f"behaves like {self.req_id}:{self.position}: median |Δ logprob| of the engine's reported tokens "
                 f"(chosen and top-k) at positions {self.positions[0]}..{self.positions[-1]}"]
        head = f"  {'candidate':<13}  {'median |Δ|':>9}  " + "  ".join(f"{p:>8}" for p in self.positions)
        lines += [head, "  " + "-" * (len(head) - 2)]
        for f in self.fits:
            cells = "  ".join(f"{f.deltas[p]:>8.2e}" if p in f.deltas else f"{'-':>8}" for p in self.positions)
            lines.append(f"  {f.numerics:<13}  {f.median_abs_delta:>9.2e}  {cells}" + (f"  ({f.note})" if f.note else ""))
        runner_up = self.fits[1] if len(self.fits) > 1 else None
        ratio = f" ({runner_up.median_abs_delta / self.fits[0].median_abs_delta:.1f}x closer than {runner_up.numerics})" \
            if runner_up and self.fits[0].median_abs_delta > 0 else ""
        lines.append(f"  behaves like: {self.best}{ratio}: {self.fits[0].describe()}")
        return "\n".join(lines)


def _reported(tok: Any) -> list[tuple[int, float]]:
    """The (token id, logprob) pairs the engine reported at one position: its token and its top-k."""
    out = {int(tok.token_id): float(tok.logprob)} if tok.logprob is not None else {}
    for alt in tok.top_logprobs or []:
        # [token_id, logprob, text]; an id the engine could not name (-1) or -inf cannot be compared
        if len(alt) >= 2 and isinstance(alt[0], int) and alt[0] >= 0 and isinstance(alt[1], (int, float)) \
                and alt[1] > -1e30:
            out.setdefault(int(alt[0]), float(alt[1]))
    return list(out.items())


def behaves_like(trace: str, at: str | tuple[str, int], *, model: str | None = None, device: str | None = None,
                 candidates: tuple[str, ...] | None = None, window: int = 4, runner: Any = None,
                 load: Any = None, store: bool = True) -> BehavesLike:
    """Fit each candidate to what the engine reported around `at` = REQ:POS of `trace`: numerics
    names (layer_walk.CANDIDATES) and contexts (contexts.py); None: every numerics and every context
    that applies to the request (contexts.default_contexts)."""
    from workbench.external.check import recorded_scored
    from workbench.rerun import contexts as cx
    from workbench.rerun.bisect import loader_like, reference_runner
    from workbench.rerun.fork import parse_at
    from workbench.trace.reader import open_trace

    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= 64:
        raise ValueError(f"window must be an int in [0, 64], got {window!r}")
    t0 = time.perf_counter()
    rid, position = parse_at(at) if isinstance(at, str) else at
    with open_trace(trace) as t:
        scored = {s.req_id: s for s in recorded_scored(t)}
        if runner is None:
            runner, load = reference_runner(t, model, device)
        elif load is None:
            load = loader_like(runner)
    s = scored.get(rid)
    if s is None or not s.tokens:
        raise ValueError(f"--at: no request {rid!r} with recorded tokens; requests are {sorted(scored)}")
    if not 0 <= position < len(s.tokens):
        raise ValueError(f"--at {rid}:{position}: position must be in [0, {len(s.tokens)}) (its recorded tokens)")
    positions = [p for p in range(max(0, position - window), min(len(s.tokens), position + window + 1))
                 if _reported(s.tokens[p])]
    if not positions:
        raise ValueError(f"--at {rid}:{position}: the engine reported no logprobs there to compare")
    ids = s.prompt_ids + [t.token_id for t in s.tokens[:positions[-1]]]
    vocab = runner.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"--at {rid}:{position}: the sequence has token ids outside the reference's vocabulary "
                         f"[0, {vocab}); is --model the model the engine served?")
    rows = [len(s.prompt_ids) + p - 1 for p in positions]
    if rows[0] < 0:
        raise ValueError(f"--at {rid}:{position}: the request has no prompt ids to condition on")
    target = cx.Request(rid, list(s.prompt_ids), [t.token_id for t in s.tokens])
    requests = [target if o.req_id == rid else cx.Request(o.req_id, list(o.prompt_ids), [t.token_id for t in o.tokens])
                for o in scored.values() if o.req_id == rid or (o.tokens and o.prompt_ids and all(
                    0 <= i < vocab for i in o.prompt_ids + [t.token_id for t in o.tokens]))]  # arrival order
    others = [r for r in requests if r is not target]
    if candidates is None:
        candidates = (*lw.CANDIDATES, *cx.default_contexts(target, others))
    for name in candidates:
        if not (name in lw.CANDIDATES or cx.is_context(name)):
            raise ValueError(f"candidates: {name!r} is neither a numerics ({', '.join(lw.CANDIDATES)}) nor a context "
                             f"({', '.join(cx.CONTEXT_NAMES)})")
        if cx.is_context(name):
            cx.parse_context(name)  # ValueError before any run
    asked = sorted({k for p in positions for k, _ in _reported(s.tokens[p])})
    fits = []
    for name in candidates:
        note = ""
        if cx.is_context(name):
            run = cx.run_context(runner.loaded, name, requests, rid, positions[-1], asked)
            got, note = [run.logprobs.get(p, {}) for p in positions], run.note
        else:
            lp = lw.walk(lw.numerics_for(name, runner, load), ids, rows).logprobs  # [rows, vocab]
            got = [{k: float(lp[i, k]) for k, _ in _reported(s.tokens[p]) if k < lp.shape[1]}
                   for i, p in enumerate(positions)]
        deltas = {}
        for i, p in enumerate(positions):
            pairs = [(k, v) for k, v in _reported(s.tokens[p]) if k in got[i]]
            if pairs:
                deltas[p] = statistics.median(abs(v - got[i][k]) for k, v in pairs)
        if deltas:
            fits.append(CandidateFit(name, deltas, statistics.median(deltas.values()), note))
    fits.sort(key=lambda f: f.median_abs_delta)
    result = BehavesLike(rid, position, positions, fits, time.perf_counter() - t0)
    if store:
        from workbench.trace.bisect_store import store_bisect

        store_bisect(trace, result.to_row())
    return result
