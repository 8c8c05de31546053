"""Batch invariance, explained: does a request produce the same tokens alone as in its batch?

Owns: re-running a recorded trace twice on the recorded engine config — every request in its
recorded batch (replay's `run_recorded`), then each request alone — and comparing per output
position the chosen token's logprob (the drift batching causes), the first token that differs and
whether it was a near tie (the batched run's top-2 margin), and the flip-risk map: per request and
position, the drift of the logprobs between the two contexts (the largest change over the tokens
both runs recorded) divided by the batched run's top-2 margin (`PositionDrift.risk`; above 1 the drift could flip the token), high risk first
(`risk_table`). `workbench invariance T` prints it; the notebook's `InvarianceView` draws it. Stands above `trace/` because it needs the engine.

Contexts (`CONTEXTS`, one column each of the map): `alone` (each request by itself, always run),
`chunked:N` (each request alone with chunked prefill of N tokens), `prefix-cache` (each request alone
a second time, its prompt now a prefix-cache hit: the first run was the miss), `speculative` (the
recorded batch with speculative decoding toggled: early-exit self-drafting when the trace ran without it,
none when it ran with it; greedy requests only: a sampled request's verify steps draw other random
numbers). Each is compared with the recorded batch position by position up to its
own first differing token; a position's drift is the largest over the contexts, so its flip risk
says whether *some* context change could flip it, and `drifts` says which.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from workbench.rerun.rebuild import build_engine, recorded_requests, run_recorded
from workbench.trace.diff import Verdict, verdict
from workbench.trace.reader import open_trace


@dataclass(slots=True)
class PositionDrift:
    position: int
    token_batched: int
    token_alone: int
    text_batched: str
    text_alone: str
    logprob_batched: float | None
    logprob_alone: float | None
    margin: float | None = None  # the batched run's top-2 logprob margin here (from its recorded top-k)
    drift: float | None = None  # max over contexts of max |logprob batched - logprob there| (_drift)
    drifts: dict[str, float | None] = field(default_factory=dict)  # per context (alone, chunked:N, ...)

    @property
    def delta(self) -> float | None:
        """|logprob batched - logprob alone| of the same token (None where the tokens differ)."""
        if self.token_batched != self.token_alone or self.logprob_batched is None or self.logprob_alone is None:
            return None
        return abs(self.logprob_batched - self.logprob_alone)

    @property
    def risk(self) -> float | None:
        """Flip risk: drift / top-2 margin. Above 1, the drift seen between the contexts is as large as
        the lead of the chosen token, so it could flip it (inf: an exact tie that drifted)."""
        if self.drift is None or self.margin is None:
            return None
        if self.margin <= 0:
            return float("inf") if self.drift > 0 else 0.0
        return self.drift / self.margin


@dataclass(slots=True)
class RequestDrift:
    req_id: str
    positions: list[PositionDrift]
    len_batched: int
    len_alone: int
    first_diff: int | None  # the first position whose token differs
    verdict: Verdict | None  # at first_diff: near tie or real, from the batched run's top-k
    seeded: bool  # False: sampled without a seed, so the draws differ as well as the numerics
    batch_sizes: list[int] = field(default_factory=list)  # rows in the step that chose each position
    flips: dict[str, int | None] = field(default_factory=dict)  # per context: its first differing position

    @property
    def max_delta(self) -> float:
        return max((p.delta for p in self.positions if p.delta is not None), default=0.0)

    @property
    def identical(self) -> bool:
        return self.first_diff is None and self.len_batched == self.len_alone


@dataclass(slots=True)
class InvarianceReport:
    trace: str
    requests: list[RequestDrift]
    device: str
    dtype: str
    seconds: float
    contexts: list[str] = field(default_factory=lambda: ["alone"])

    @property
    def max_delta(self) -> float:
        return max((r.max_delta for r in self.requests), default=0.0)

    def summary(self) -> dict[str, Any]:
        """The run's facts for the trace's meta (trace/invariance_store.py)."""
        return {"device": self.device, "dtype": self.dtype, "seconds": round(self.seconds, 3),
                "max_delta": self.max_delta, "requests": len(self.requests),
                "identical": sum(r.identical for r in self.requests), "flip_risk": self.risk_summary(),
                "contexts": list(self.contexts),
                "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-able row per request, as trace/invariance_store.py stores it."""
        out = []
        for r in self.requests:
            sizes = r.batch_sizes + [0] * len(r.positions)
            out.append({"req_id": r.req_id, "len_batched": r.len_batched, "len_alone": r.len_alone,
                        "first_diff": r.positions[r.first_diff].position if r.first_diff is not None else None,
                        "seeded": r.seeded, "max_delta": r.max_delta, "flips": dict(r.flips),
                        "verdict": None if r.verdict is None else {"near_tie": r.verdict.near_tie,
                                                                    "margin": r.verdict.margin,
                                                                    "text": r.verdict.describe()},
                        "positions": [{"position": p.position, "token_batched": p.token_batched,
                                       "token_alone": p.token_alone, "text_batched": p.text_batched,
                                       "text_alone": p.text_alone, "logprob_batched": p.logprob_batched,
                                       "logprob_alone": p.logprob_alone, "delta": p.delta, "batch_size": b,
                                       "margin": p.margin, "drift": p.drift, "risk": _finite(p.risk),
                                       "drifts": dict(p.drifts)}
                                      for p, b in zip(r.positions, sizes)]})
        return out

    def risk_map(self) -> list[tuple[str, PositionDrift]]:
        """Every compared position with a flip risk, highest risk first."""
        cells = [(r.req_id, p) for r in self.requests for p in r.positions if p.risk is not None]
        return sorted(cells, key=lambda c: -c[1].risk)

    def risk_summary(self) -> dict[str, Any]:
        """How many positions carry a flip risk above 1, how many flips there were, and how many of the
        flips sit at such a position (a flip is a request's first differing token)."""
        cells = self.risk_map()
        flips = [(r.req_id, p) for r in self.requests if r.seeded for p in _flipped(r)]
        flipped = {(rid, p.position) for rid, p in flips}
        by_context = {c: sum(1 for r in self.requests if r.seeded and r.flips.get(c) is not None)
                      for c in self.contexts}
        return {"positions": len(cells), "above_1": sum(p.risk > 1 for _, p in cells),
                "exact_ties": sum(p.margin is not None and p.margin <= 0 for _, p in cells), "flips": len(flips),
                "flips_above_1": sum(p.risk is not None and p.risk > 1 for _, p in flips),
                "unflipped_above_1": sum(p.risk > 1 and (rid, p.position) not in flipped for rid, p in cells),
                "flips_by_context": by_context}

    def risk_table(self, limit: int = 12) -> str:
        """The flip-risk map, high-risk positions first: drift between the contexts / top-2 margin."""
        # a flip needs the margin to close: logprobs drifting by half the margin each way can do it
        s = self.risk_summary()
        vs = ", ".join(self.contexts)
        flips = ", ".join(f"{c} {n}" for c, n in s["flips_by_context"].items())
        lines = [f"flip risk (max logprob drift batched vs {vs} / top-2 margin): {s['above_1']} of {s['positions']} "
                 f"positions above 1; {s['flips_above_1']} of {s['flips']} flips at such a position, "
                 f"{s['unflipped_above_1']} positions above 1 did not flip; {s['exact_ties']} exact ties (margin 0)"]
        if len(self.contexts) > 1:
            lines.append(f"flips by context: {flips}; drift per context below (- : not compared there)")
        cols = "".join(f" {c[:12]:>12}" for c in self.contexts) if len(self.contexts) > 1 else ""
        lines.append(f"{'request':<16} {'pos':>4} {'risk':>8} {'drift':>9} {'margin':>9}{cols}  token (batched / alone)")
        for rid, p in self.risk_map()[:limit]:
            tok = repr(p.text_batched) + ("" if p.token_batched == p.token_alone else f" / {p.text_alone!r} FLIPPED")
            per = "".join(f" {_exp(p.drifts.get(c)):>12}" for c in self.contexts) if cols else ""
            lines.append(f"{rid:<16} {p.position:>4} {p.risk:>8.3g} {p.drift:>9.2e} {p.margin:>9.2e}{per}  {tok}")
        return "\n".join(lines)

    def request(self, req_id: str) -> RequestDrift:
        return next(r for r in self.requests if r.req_id == req_id)

    def describe(self) -> str:
        same = sum(r.identical for r in self.requests)
        lines = [f"batch invariance of {self.trace} ({self.device}, {self.dtype}): {same}/{len(self.requests)} "
                 f"requests produce the same tokens alone as in their batch; max |dlogprob| {self.max_delta:.2e} "
                 f"({self.seconds:.1f} s)",
                 f"{'request':<16} {'compared':>8} {'max batch':>9} {'max|dlp|':>9}  first differing token"]
        for r in self.requests:
            first = "none"
            if r.first_diff is not None:
                p = r.positions[r.first_diff]
                first = (f"position {p.position}: {p.text_batched!r} batched vs {p.text_alone!r} alone, "
                         f"{r.verdict.describe() if r.verdict else 'no verdict'}")
            elif r.len_batched != r.len_alone:
                first = f"none, but {r.len_batched} tokens batched vs {r.len_alone} alone"
            if not r.seeded:
                first += " (sampled without a seed: the draws differ too)"
            lines.append(f"{r.req_id:<16} {len(r.positions):>8} {max(r.batch_sizes, default=0):>9} "
                         f"{r.max_delta:>9.2e}  {first}")
        return "\n".join(lines)

    def positions_table(self, req_id: str) -> str:
        r = self.request(req_id)
        lines = [f"{'pos':>4} {'batch':>5} {'batched':<16} {'alone':<16} {'lp batched':>10} {'lp alone':>10} {'|dlp|':>9}"]
        for p, b in zip(r.positions, r.batch_sizes + [0] * len(r.positions)):
            d = "differs" if p.delta is None and p.token_batched != p.token_alone else (
                f"{p.delta:.2e}" if p.delta is not None else "—")
            lines.append(f"{p.position:>4} {b:>5} {p.text_batched!r:<16} {p.text_alone!r:<16} "
                         f"{_num(p.logprob_batched):>10} {_num(p.logprob_alone):>10} {d:>9}")
        return "\n".join(lines)


def _greedy(r: dict[str, Any]) -> bool:
    """Greedy: speculation changes only the numerics. A sampled request's verify steps draw their own
    random numbers (rejection sampling), so its tokens would differ for that reason alone."""
    return r["params"].get("temperature", 1.0) == 0


def _flipped(r: RequestDrift) -> list[PositionDrift]:
    """The positions where some context's token first differed from the batched run's (one per position)."""
    at = sorted({p for p in r.flips.values() if p is not None})
    return [q for q in r.positions if q.position in at]


def _exp(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def _finite(x: float | None) -> float | None:
    return None if x is None or x == float("inf") else x


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def _tokens(events: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for e in events:
        if e.kind == "token":
            out.setdefault(e.req_id, []).append(e)
    for toks in out.values():
        toks.sort(key=lambda e: e.position)
    return out


def _batch_sizes(events: list[Any]) -> dict[int, int]:
    """Rows sampled per step (how many requests shared the forward that chose a token)."""
    sizes: dict[int, int] = {}
    for e in events:
        if e.kind == "token":
            sizes[e.step] = sizes.get(e.step, 0) + 1
    return sizes


def _margin(top: list[Any]) -> float | None:
    """Top-2 logprob margin of a recorded top-k (`[[id, logprob, text], ...]`, best first)."""
    lps = sorted((float(t[1]) for t in top if len(t) >= 2 and isinstance(t[1], (int, float))), reverse=True)
    return lps[0] - lps[1] if len(lps) >= 2 else None


def _drift(eb: Any, ea: Any) -> float | None:
    """How far the distribution moved between the two contexts here: the largest |logprob batched -
    logprob alone| over the tokens both runs recorded (each chosen token and the top-k they share;
    the batched run's token must be among them). A flip needs the top-2 margin to close, which a
    drift of each logprob by at least half the margin can do."""
    batched = {eb.token_id: eb.logprob, **{t[0]: float(t[1]) for t in eb.top_logprobs if len(t) >= 2}}
    alone = {ea.token_id: ea.logprob, **{t[0]: float(t[1]) for t in ea.top_logprobs if len(t) >= 2}}
    if batched.get(eb.token_id) is None or alone.get(eb.token_id) is None:
        return None
    return max(abs(v - alone[k]) for k, v in batched.items() if v is not None and alone.get(k) is not None)


def _compare(rid: str, batched: list[Any], runs: dict[str, list[Any]], seeded: bool, sizes: dict[int, int],
             tolerance: float) -> RequestDrift:
    """Per position of the batched run, its drift to each context's run (`runs`, "alone" among them),
    up to the first token that differs alone; each context compared up to its own first difference."""
    alone = runs["alone"]
    flips: dict[str, int | None] = {c: None for c in runs}
    positions, first, why = [], None, None
    for i, (eb, ea) in enumerate(zip(batched, alone)):
        drifts = {}
        for c, run in runs.items():
            if flips[c] is None and i < len(run):
                drifts[c] = _drift(eb, run[i])
                if run[i].token_id != eb.token_id:
                    flips[c] = eb.position
        known = [d for d in drifts.values() if d is not None]
        positions.append(PositionDrift(eb.position, eb.token_id, ea.token_id, eb.text, ea.text, eb.logprob, ea.logprob,
                                       _margin(eb.top_logprobs), max(known) if known else None, drifts))
        if eb.token_id != ea.token_id:
            first, why = len(positions) - 1, verdict(eb.top_logprobs, eb.token_id, ea.token_id, tolerance)
            break  # after a different token the two runs condition on different text
    return RequestDrift(rid, positions, len(batched), len(alone), first, why, seeded,
                        [sizes.get(e.step, 0) for e in batched[: len(positions)]], flips)


def _alone(r: dict[str, Any]) -> dict[str, Any]:
    """The recorded request as a request of its own: arriving at once; an n > 1 sibling as n = 1 with
    the seed it had (the engine seeds sibling i with seed + i)."""
    params = {**r["params"], "n": 1}
    if r.get("parent_id") is not None and params.get("seed") is not None:
        params["seed"] += int(r["req_id"].rsplit("-", 1)[1])
    return {**r, "step": 0, "parent_id": None, "params": params}


CONTEXTS = ("alone", "chunked:N", "prefix-cache", "speculative")


def check_contexts(contexts: list[str] | tuple[str, ...]) -> list[str]:
    """`alone` first, then each other context once; ValueError naming the allowed ones."""
    out = ["alone"]
    for c in contexts:
        if c.startswith("chunked:"):
            from workbench.rerun.contexts import parse_context

            c = parse_context(c).name
        elif c not in CONTEXTS:
            raise ValueError(f"context must be one of {', '.join(CONTEXTS)}, got {c!r}")
        if c not in out:
            out.append(c)
    return out


def _run_alone(engine: Any, sink: Any, r: dict[str, Any], warm: bool = False) -> list[Any]:
    """Request `r` by itself (with `warm`, twice: the second run's prompt is a prefix-cache hit)."""
    engine.forget(r["req_id"])
    engine.flush_prefix_cache()  # alone means nothing cached from another run
    for _ in range(2 if warm else 1):
        engine.forget(r["req_id"])
        sink.events.clear()
        for _ in run_recorded(engine, sink, [_alone(r)]):
            pass
    return _tokens(sink.events).get(r["req_id"], [])


def _context_runs(recorded: Any, cfg: dict[str, Any], device: str | None, context: str,
                  requests: list[dict[str, Any]], chosen: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each chosen request's tokens in `context` (besides alone), through an engine rebuilt with it."""
    if context == "speculative":
        # early-exit self-drafting drafts at every step (n-gram lookup may find nothing to propose)
        overrides: dict[str, Any] = {"spec": None if cfg.get("spec") else "early-exit"}
    elif context == "prefix-cache":
        overrides = {"prefix_cache": True}
    else:
        chunk = int(context.split(":", 1)[1])
        overrides = {"chunk_size": chunk, "max_batch_tokens": max(chunk, int(cfg.get("max_batch_tokens") or 0))}
    engine, sink = build_engine(recorded, cfg, device, overrides=overrides)
    try:
        if context == "speculative":  # the whole recorded batch, drafting toggled
            for _ in run_recorded(engine, sink, requests):
                pass
            toks = _tokens(sink.events)
            return {r["req_id"]: toks.get(r["req_id"], []) for r in chosen}
        return {r["req_id"]: _run_alone(engine, sink, r, warm=context == "prefix-cache") for r in chosen}
    finally:
        engine.close()


def invariance(trace: str, *, device: str | None = None, tolerance: float = 1e-3, progress: bool = False,
               req_ids: list[str] | None = None, contexts: list[str] | tuple[str, ...] = ("alone",)) -> InvarianceReport:
    """Re-run `trace` as recorded (batched) and each request alone (and in each other context of
    `contexts`: chunked:N, prefix-cache, speculative); compare them per position."""
    contexts = check_contexts(contexts)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    with open_trace(trace) as recorded:
        requests = recorded_requests(recorded)
        if not requests:
            raise ValueError(f"trace {trace!r} records no requests: nothing to compare")
        known = {r["req_id"] for r in requests}
        for rid in req_ids or []:
            if rid not in known:
                raise ValueError(f"invariance: no recorded request {rid!r}; requests are {sorted(known)}")
        cfg = dict(recorded.meta.get("engine") or {})
        engine, sink = build_engine(recorded, cfg, device)
    bar = tqdm(total=len(requests) + len(contexts), disable=not progress, desc="batched, then alone", unit="run")
    try:
        for _ in run_recorded(engine, sink, requests):
            pass
        batched_events = list(sink.events)
        bar.update(1)
        chosen = [r for r in requests if not req_ids or r["req_id"] in req_ids]
        alone: dict[str, list[Any]] = {}
        for r in chosen:
            alone[r["req_id"]] = _run_alone(engine, sink, r)
            bar.update(1)
    finally:
        device_name, dtype = str(engine.device), str(engine.config.dtype)
        engine.close()
    try:
        others = {}
        with open_trace(trace) as recorded:
            for c in contexts[1:]:  # one engine at a time: each context's is built after the last closed
                others[c] = _context_runs(recorded, cfg, device, c, requests, chosen)
                bar.update(1)
    finally:
        bar.close()
    batched, sizes = _tokens(batched_events), _batch_sizes(batched_events)
    drifts = [_compare(r["req_id"], batched.get(r["req_id"], []),
                       {"alone": alone[r["req_id"]], **{c: others[c][r["req_id"]] for c in contexts[1:]
                                                        if c != "speculative" or _greedy(r)}},
                       r["params"].get("temperature", 1.0) == 0 or r["params"].get("seed") is not None, sizes,
                       tolerance) for r in requests if r["req_id"] in alone]
    return InvarianceReport(str(trace), drifts, device_name, dtype, time.perf_counter() - t0, contexts)
