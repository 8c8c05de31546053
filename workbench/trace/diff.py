"""Diff two traces: line them up by request and output position, report the first divergence,
logprob deltas, top-k set changes and the KL divergence per position.

Owns: comparing what two runs produced (engine vs engine, or engine vs the transformers adapter).
Does not own: re-execution (workbench/replay.py). Reads only `token` and `request.*` events, so it
works across traces with different batching, chunking or speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from workbench.trace.reader import Trace


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


@dataclass(slots=True)
class RequestDiff:
    req_id: str
    req_id_b: str
    compared: int
    len_a: int
    len_b: int
    first_divergence: PositionDiff | None
    max_logprob_delta: float
    mean_kl: float
    topk_changes: int
    positions: list[PositionDiff] = field(default_factory=list)


@dataclass(slots=True)
class DiffReport:
    requests: list[RequestDiff]
    only_in_a: list[str]
    only_in_b: list[str]

    @property
    def first_divergence(self) -> PositionDiff | None:
        divs = [r.first_divergence for r in self.requests if r.first_divergence is not None]
        return min(divs, key=lambda d: (d.step_a, d.position), default=None)

    @property
    def identical(self) -> bool:
        return (self.first_divergence is None and not self.only_in_a and not self.only_in_b
                and all(r.len_a == r.len_b for r in self.requests))


def _tokens_by_request(trace: Trace) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for e in trace.events(kind="token"):
        out.setdefault(e.req_id, []).append(e)
    for toks in out.values():
        toks.sort(key=lambda e: e.position)
    return out


def _kl(top_a: list[list[Any]], top_b: list[list[Any]]) -> float | None:
    """KL(A || B) over the union of both top-k sets, each renormalised; mass outside a set is floored."""
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


def _diff_request(rid_a: str, rid_b: str, ta: list[Any], tb: list[Any]) -> RequestDiff:
    positions, first = [], None
    max_delta, kls, changes = 0.0, [], 0
    for ea, eb in zip(ta, tb):
        delta = (abs(ea.logprob - eb.logprob) if ea.logprob is not None and eb.logprob is not None else None)
        set_a = {int(t[0]) for t in ea.top_logprobs}
        set_b = {int(t[0]) for t in eb.top_logprobs}
        n = min(len(set_a), len(set_b))
        changed = n > 0 and [int(t[0]) for t in ea.top_logprobs[:n]] != [int(t[0]) for t in eb.top_logprobs[:n]]
        kl = _kl(ea.top_logprobs, eb.top_logprobs)
        pd_ = PositionDiff(rid_a, ea.position, ea.step, eb.step, ea.token_id, eb.token_id, ea.text, eb.text,
                           delta, changed, kl)
        positions.append(pd_)
        max_delta = max(max_delta, delta or 0.0)
        changes += int(changed)
        if kl is not None:
            kls.append(kl)
        if first is None and ea.token_id != eb.token_id:
            first = pd_
        if first is not None:
            break  # after a different token the two runs condition on different text
    return RequestDiff(rid_a, rid_b, len(positions), len(ta), len(tb), first, max_delta,
                       sum(kls) / len(kls) if kls else 0.0, changes, positions)


def diff_traces(a: Trace, b: Trace, tolerance: float = 1e-3) -> DiffReport:
    """Line up requests by id (or, when the ids differ, by order of arrival) and compare positions."""
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
    reqs = [_diff_request(ra, rb, toks_a.get(ra, []), toks_b.get(rb, [])) for ra, rb in pairs]
    return DiffReport(reqs, only_a, only_b)


def format_report(report: DiffReport) -> str:
    lines = []
    first = report.first_divergence
    if first is None:
        lines.append("no token differs" + ("" if report.identical else " (but the runs differ in length or requests)"))
    else:
        lines.append(f"first divergence: request {first.req_id}, position {first.position} "
                     f"(step {first.step_a} in A, {first.step_b} in B): {first.text_a!r} ({first.token_a}) vs "
                     f"{first.text_b!r} ({first.token_b})")
    lines.append(f"{'request':<16} {'compared':>8} {'len A':>6} {'len B':>6} {'max|dlp|':>9} {'mean KL':>9} {'top-k chg':>9}")
    for r in report.requests:
        lines.append(f"{r.req_id:<16} {r.compared:>8} {r.len_a:>6} {r.len_b:>6} {r.max_logprob_delta:>9.2e} "
                     f"{r.mean_kl:>9.2e} {r.topk_changes:>9}")
    for rid in report.only_in_a:
        lines.append(f"only in A: {rid}")
    for rid in report.only_in_b:
        lines.append(f"only in B: {rid}")
    return "\n".join(lines)
