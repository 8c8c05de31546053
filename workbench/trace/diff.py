"""Diff two traces: line them up by request and output position, report the first divergence with
a near-tie / real verdict and both sides' top-k there, logprob deltas, top-k set changes and the KL
divergence per position (only where both sides recorded a distribution).

Owns: comparing what two runs produced (engine vs engine, parent vs fork, or engine vs the
transformers adapter) and the near-tie verdict that `workbench replay` shares. Does not own:
re-execution (workbench/rerun/replay.py) or the text report (trace/diff_format.py). Reads only `token`
and `request.*` events, so it works across traces with different batching, chunking or speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from workbench.trace.reader import Trace

CONTINUATION_TOKENS = 24  # tokens of each side's continuation kept after the first divergence


@dataclass(slots=True)
class Verdict:
    """Why two runs chose different tokens at one position: a near tie or a real difference.

    `margin` is how much side A preferred its own token over B's, in A's logprobs (from A's top-k;
    None when A recorded no distribution or B's token is not in it)."""

    margin: float | None
    near_tie: bool | None
    forced: bool = False  # B's token was forced (a fork's branch point), not chosen
    floor: float | None = None  # with a measured floor: the margin the engine's own noise can flip here
    sampled: bool = False  # A's request sampled: its runs drew tokens, a differing draw is no near-tie question

    @property
    def inside_floor(self) -> bool:
        return (not self.sampled and self.floor is not None and self.margin is not None
                and 0 <= self.margin <= self.floor)

    @property
    def short(self) -> str:
        """`floor`, `near tie`, `real`, `forced` or `unknown`: the verdict in one word."""
        if self.forced:
            return "forced"
        if self.sampled:
            return "sampled"
        if self.near_tie is None:
            return "unknown"
        return "floor" if self.inside_floor else "near tie" if self.near_tie else "real"

    def describe(self) -> str:
        if self.forced:
            why = f"; A preferred its own token by {self.margin:.3g} nats" if self.margin is not None else ""
            return f"forced (the fork's branch point{why})"
        if self.sampled:
            pref = (f"; A's logprob of its token minus of B's: {self.margin:+.3g} nats"
                    if self.margin is not None else "")
            return f"sampled (the runs drew different tokens{pref})"
        if self.near_tie is None:
            return "unknown (a side recorded no top-k distribution here)"
        if self.inside_floor:
            return (f"inside the floor (top-2 margin {self.margin:.3g} nats, within the {self.floor:.3g} "
                    "the engine's own noise can flip)")
        kind = "a near tie" if self.near_tie else "a real difference"
        return f"{kind} (top-2 margin {self.margin:.3g} nats)"


def verdict(top_a: list[Any], token_a: int, token_b: int, tolerance: float, floor: Any = None) -> Verdict:
    """Near tie when A's logprob of its token exceeds that of B's token by less than `tolerance`
    (B's token missing from A's top-k: the margin to A's runner-up is a lower bound). `floor`: a
    measured noise floor (external/floor.py: anything with `flip_bound(logprob)`); a margin within
    it is inside the floor, a flip the engine makes against itself."""
    lps = {int(t[0]): t[1] for t in top_a if t[1] is not None}
    if token_a not in lps or len(lps) < 2:
        return Verdict(None, None)
    if token_b in lps:
        margin = float(lps[token_a] - lps[token_b])
    else:
        margin = float(lps[token_a] - max(v for k, v in lps.items() if k != token_a))
    bound = float(floor.flip_bound(lps[token_a])) if floor is not None else None
    return Verdict(margin, margin < tolerance, floor=bound)


@dataclass(slots=True)
class PositionDiff:
    """One output position of one request in both traces."""

    req_id: str
    position: int
    step_a: int
    step_b: int
    token_a: int
    token_b: int
    text_a: str
    text_b: str
    logprob_delta: float | None
    topk_changed: bool
    kl: float | None
    top_a: list[Any] = field(default_factory=list)
    top_b: list[Any] = field(default_factory=list)
    verdict: Verdict | None = None  # set at the first divergence
    logprob_a: float | None = None  # A's logprob of its token (B's is logprob_a ± logprob_delta)
    band: str | None = None  # with a floor: "floor" when |Δ| is within the engine's own spread, else "beyond"


@dataclass(slots=True)
class RequestDiff:
    req_id: str
    req_id_b: str
    compared: int
    len_a: int
    len_b: int
    first_divergence: PositionDiff | None
    max_logprob_delta: float
    mean_kl: float | None  # None: no position had a distribution on both sides
    topk_changes: int
    positions: list[PositionDiff] = field(default_factory=list)
    kl_undefined: str | None = None  # why KL is missing at some positions ("A has no top-k", ...)
    continuation_a: str = ""  # the text from the first divergence on (the whole output without one)
    continuation_b: str = ""
    beyond_floor: int = 0  # with a floor: positions whose |Δlogprob| exceeds the engine's own spread

    @property
    def shared_prefix(self) -> int:
        return self.first_divergence.position if self.first_divergence else min(self.len_a, self.len_b)


@dataclass(slots=True)
class DiffReport:
    requests: list[RequestDiff]
    only_in_a: list[str]
    only_in_b: list[str]
    fork: dict[str, Any] | None = None  # B's (or A's) fork meta when one is a fork of the other
    # each side's numerics mode (meta engine.kernels: "exact", "fast", ...; None: not this engine's trace)
    kernels: tuple[str | None, str | None] = (None, None)
    floor: dict[str, Any] | None = None  # the measured floor's summary when one was given
    tolerance: float = 1e-3

    @property
    def differing(self) -> list[RequestDiff]:
        """Requests whose tokens differ somewhere, or whose lengths differ."""
        return [r for r in self.requests if r.first_divergence is not None or r.len_a != r.len_b]

    @property
    def first_divergence(self) -> PositionDiff | None:
        divs = [r.first_divergence for r in self.requests if r.first_divergence is not None]
        return min(divs, key=lambda d: (d.step_a, d.position), default=None)

    @property
    def identical(self) -> bool:
        return (self.first_divergence is None and not self.only_in_a and not self.only_in_b
                and all(r.len_a == r.len_b for r in self.requests))

    def request(self, req_id: str) -> RequestDiff:
        for r in self.requests:
            if r.req_id == req_id:
                return r
        raise KeyError(req_id)


def _tokens_by_request(trace: Trace) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    budget = trace.budget("the token events a diff lines up") if hasattr(trace, "budget") else None
    for e in trace.events(kind="token", budget=budget) if budget is not None else trace.events(kind="token"):
        out.setdefault(e.req_id, []).append(e)
    for toks in out.values():
        toks.sort(key=lambda e: e.position)
    return out


def _kl(top_a: list[list[Any]], top_b: list[list[Any]]) -> float | None:
    """KL(A || B) over the union of both top-k sets, each renormalised; mass outside a set is floored.
    None when a side recorded no distribution (KL is not defined there)."""
    pa = {int(t[0]): math.exp(t[1]) for t in top_a if t[1] is not None}
    pb = {int(t[0]): math.exp(t[1]) for t in top_b if t[1] is not None}
    if not pa or not pb:
        return None
    keys = set(pa) | set(pb)
    floor = 1e-9
    za = sum(pa.get(k, floor) for k in keys)
    zb = sum(pb.get(k, floor) for k in keys)
    kl = 0.0
    for k in keys:
        a, b = pa.get(k, floor) / za, pb.get(k, floor) / zb
        kl += a * math.log(a / b)
    return max(kl, 0.0)


def _no_distribution(ea: Any, eb: Any) -> str | None:
    sides = [s for s, e in (("A", ea), ("B", eb)) if not any(t[1] is not None for t in e.top_logprobs)]
    return " and ".join(sides) + (" has" if len(sides) == 1 else " have") + " no top-k distribution" if sides else None


def _text(events: list[Any]) -> str:
    return "".join(e.text for e in events[:CONTINUATION_TOKENS])


def _diff_request(rid_a: str, rid_b: str, ta: list[Any], tb: list[Any], tolerance: float,
                  floor: Any = None, sampled: bool = False) -> RequestDiff:
    positions, first = [], None
    max_delta, kls, changes, undefined, beyond = 0.0, [], 0, None, 0
    for ea, eb in zip(ta, tb):
        delta = (abs(ea.logprob - eb.logprob) if ea.logprob is not None and eb.logprob is not None else None)
        n = min(len(ea.top_logprobs), len(eb.top_logprobs))
        changed = n > 0 and [int(t[0]) for t in ea.top_logprobs[:n]] != [int(t[0]) for t in eb.top_logprobs[:n]]
        kl = _kl(ea.top_logprobs, eb.top_logprobs)
        pd_ = PositionDiff(rid_a, ea.position, ea.step, eb.step, ea.token_id, eb.token_id, ea.text, eb.text,
                           delta, changed, kl, list(ea.top_logprobs), list(eb.top_logprobs), logprob_a=ea.logprob)
        if floor is not None and delta is not None:
            pd_.band = "floor" if delta <= floor.bound(ea.logprob) else "beyond"
            beyond += pd_.band == "beyond"
        positions.append(pd_)
        max_delta = max(max_delta, delta or 0.0)
        changes += int(changed)
        if kl is not None:
            kls.append(kl)
        else:
            undefined = undefined or _no_distribution(ea, eb)
        if ea.token_id != eb.token_id:
            first = pd_
            pd_.verdict = verdict(ea.top_logprobs, ea.token_id, eb.token_id, tolerance, floor)
            pd_.verdict.forced = getattr(eb, "source", "") == "forced"
            pd_.verdict.sampled = sampled
            break  # after a different token the two runs condition on different text
    at = first.position if first else len(positions)
    return RequestDiff(rid_a, rid_b, len(positions), len(ta), len(tb), first, max_delta,
                       sum(kls) / len(kls) if kls else None, changes, positions, undefined,
                       _text(ta[at:]), _text(tb[at:]), beyond_floor=beyond)


def diff_traces(a: Trace, b: Trace, tolerance: float = 1e-3, floor: Any = None) -> DiffReport:
    """Line up requests by id (or, when the ids differ, by order of arrival) and compare positions.

    `floor`: a measured noise floor (workbench.external.floor.Floor, or anything with `bound`,
    `flip_bound` and `summary`): positions are then banded against it and a flip within it is
    `inside the floor` rather than a near tie or real."""
    toks_a, toks_b = _tokens_by_request(a), _tokens_by_request(b)
    ids_a = [r.req_id for r in a.requests()]
    ids_b = [r.req_id for r in b.requests()]
    if set(ids_a) & set(ids_b):
        pairs = [(r, r) for r in ids_a if r in set(ids_b)]
        only_a = [r for r in ids_a if r not in set(ids_b)]
        only_b = [r for r in ids_b if r not in set(ids_a)]
    else:
        pairs = list(zip(ids_a, ids_b))
        only_a, only_b = ids_a[len(pairs):], ids_b[len(pairs):]
    sampled = {r.req_id for r in a.requests() if _sampled(r.added)}
    reqs = [_diff_request(ra, rb, toks_a.get(ra, []), toks_b.get(rb, []), tolerance, floor, ra in sampled)
            for ra, rb in pairs]
    return DiffReport(reqs, only_a, only_b, _fork_of(b, a) or _fork_of(a, b), (kernels_of(a), kernels_of(b)),
                      floor.summary() if floor is not None else None, tolerance)


def _sampled(added: Any) -> bool:
    """A request that drew its tokens (temperature > 0, top_k not 1); False when unknown."""
    params = getattr(added, "params", None)
    if not isinstance(params, dict):
        return False
    if isinstance(params.get("greedy"), bool):
        return not params["greedy"]
    t = params.get("temperature")
    return isinstance(t, (int, float)) and t > 0 and params.get("top_k") != 1


def kernels_of(trace: Trace | dict) -> str | None:
    """The numerics mode the engine ran, from a trace or its meta (`exact` for traces from before the
    mode existed); None for a trace another program wrote (transformers' reference, an external server)."""
    engine = (trace if isinstance(trace, dict) else trace.meta).get("engine")
    if not isinstance(engine, dict) or "adapter" in engine:  # transformers' reference names its adapter
        return None
    kernels = engine.get("kernels", "exact")
    return kernels if isinstance(kernels, str) else str(kernels)


def _fork_of(child: Trace, parent: Trace) -> dict[str, Any] | None:
    """`child`'s fork meta when `child` is a fork of `parent` (same file, or the same name)."""
    import os

    fork = child.meta.get("fork")
    if not isinstance(fork, dict) or not fork.get("parent"):
        return None
    named, path = str(fork["parent"]), str(getattr(parent, "path", ""))
    try:
        same = os.path.samefile(named, path)
    except OSError:
        same = os.path.basename(named) == os.path.basename(path)
    return fork if same else None

