"""The records of a reference check and their summary table.

Owns: `PositionCheck` (one output position scored against the reference), `RequestCheck` (one
request: its positions, first divergence and its class), `CheckReport` (the run: figures, exit code,
`render()` as a table, `rows()` / `summary()` for the trace's `checks` table) and the top-k
divergence (`topk_divergence`). Standard library only. Does not own running the reference
(check.py) or storing (workbench/trace/checks.py).

Top-k alignment: the engine reports its k best tokens E, the reference gives its 20 best R. Both
distributions are coarse-grained onto the same partition: each token in E ∩ R is its own cell,
and every other token (those only one side lists, and all the rest) falls into one `rest` cell
holding each side's leftover mass (1 - the listed mass). `topk_kl` is KL(engine || reference)
over that partition: a lower bound of the full KL (coarse-graining never increases KL), and
exactly 0 when the two agree. `topk_overlap` is |E ∩ R_k| / k with R_k the reference's k best.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from workbench.external.importance import ImportanceReport

# `floor`: a greedy token the reference would not take, by a margin the engine's own run-to-run
# noise (a measured floor) can flip; only with a floor
VERDICTS = ("ok", "floor", "near_tie", "real", "logprob")


@dataclass(slots=True)
class PositionCheck:
    """One output position: the engine's token scored by the reference."""

    position: int
    token_id: int
    text: str
    engine_logprob: float | None
    ref_logprob: float
    delta: float | None  # engine - reference logprob of the engine's token
    ref_argmax: int
    ref_argmax_text: str
    ref_margin: float  # reference top-1 minus top-2 logprob
    gap: float  # reference logprob of its argmax minus that of the engine's token (0 when they agree)
    rank: int  # the engine token's rank under the reference (1 = argmax)
    topk_kl: float | None
    topk_overlap: float | None
    verdict: str = "ok"
    floor: float | None = None  # with a measured floor: the engine's own |Δ| bound for this token's band
    log_ratio: float | None = None  # importance ratio log w = reference - engine (with importance checks)
    tis: str | None = None  # "clip" when truncated IS caps w here
    mis: str | None = None  # "drop" when masked IS drops this token
    is_reason: str | None = None  # why (importance.REASONS) when tis or mis acts


@dataclass(slots=True)
class RequestCheck:
    """One request: every scored position, and where and how it first diverged."""

    req_id: str
    greedy: bool
    positions: list[PositionCheck] = field(default_factory=list)
    first_divergence: int | None = None
    divergence_class: str | None = None  # near_tie | real | logprob
    note: str = ""  # why fewer positions were scored than the engine produced, or a prompt mismatch

    @property
    def agree(self) -> int:
        return sum(1 for p in self.positions if p.token_id == p.ref_argmax)

    @property
    def deltas(self) -> list[float]:
        return [abs(p.delta) for p in self.positions if p.delta is not None]

    @property
    def real(self) -> int:
        return sum(1 for p in self.positions if p.verdict in ("real", "logprob"))

    @property
    def near_ties(self) -> int:
        return sum(1 for p in self.positions if p.verdict == "near_tie")

    @property
    def inside_floor(self) -> int:
        return sum(1 for p in self.positions if p.verdict == "floor")

    @property
    def beyond_floor(self) -> int:
        """Positions whose |Δlogprob| exceeds what the engine shows against itself (with a floor)."""
        return sum(1 for p in self.positions if p.floor is not None and p.delta is not None and abs(p.delta) > p.floor)

    def to_row(self) -> dict[str, Any]:
        return {"req_id": self.req_id, "greedy": self.greedy, "first_divergence": self.first_divergence,
                "divergence_class": self.divergence_class, "note": self.note,
                "positions": [asdict(p) for p in self.positions]}


@dataclass(slots=True)
class CheckReport:
    """A whole check: the reference, the tolerance and each request's result."""

    path: str
    reference: str
    tolerance: float
    requests: list[RequestCheck]
    source: str = "engine"  # the trace's source: external or this engine
    warnings: list[str] = field(default_factory=list)
    floor: dict[str, Any] | None = None  # the measured floor's summary (external/floor.py) when one was given
    importance: ImportanceReport | None = None  # importance ratios (imported rollouts, or when asked)

    @property
    def positions(self) -> int:
        return sum(len(r.positions) for r in self.requests)

    @property
    def greedy_positions(self) -> int:
        return sum(len(r.positions) for r in self.requests if r.greedy)

    @property
    def argmax_agreement(self) -> float | None:
        """Share of greedy positions whose token is the reference's argmax (a sampled token need not be)."""
        n = self.greedy_positions
        return sum(r.agree for r in self.requests if r.greedy) / n if n else None

    @property
    def max_abs_delta(self) -> float | None:
        values = [d for r in self.requests for d in r.deltas]
        return max(values) if values else None

    @property
    def mean_abs_delta(self) -> float | None:
        values = [d for r in self.requests for d in r.deltas]
        return sum(values) / len(values) if values else None

    @property
    def real_divergences(self) -> list[RequestCheck]:
        """Requests with a real divergence: a greedy token the reference would not take (beyond the
        tolerance), or a sampled position whose logprob differs beyond it."""
        return [r for r in self.requests if r.real]

    @property
    def near_ties(self) -> list[RequestCheck]:
        """Requests whose only divergences are near ties."""
        return [r for r in self.requests if r.near_ties and not r.real]

    @property
    def real_positions(self) -> int:
        return sum(r.real for r in self.requests)

    @property
    def near_tie_positions(self) -> int:
        return sum(r.near_ties for r in self.requests)

    @property
    def exit_code(self) -> int:
        return 1 if self.real_divergences else 0

    def summary(self) -> dict[str, Any]:
        return {"reference": self.reference, "tolerance": self.tolerance, "requests": len(self.requests),
                "positions": self.positions, "argmax_agreement": self.argmax_agreement,
                "max_abs_delta": self.max_abs_delta, "mean_abs_delta": self.mean_abs_delta,
                "real_divergences": self.real_positions, "near_ties": self.near_tie_positions,
                "requests_real": [r.req_id for r in self.real_divergences],
                "requests_near_tie": [r.req_id for r in self.near_ties],
                "floor": self.floor, "inside_floor": sum(r.inside_floor for r in self.requests),
                "beyond_floor": sum(r.beyond_floor for r in self.requests) if self.floor else None,
                "importance": self.importance.summary() if self.importance else None}

    def _beside_floor(self, key: str) -> str:
        return f"   (floor: the engine's own, up to {self.floor[key]:.4g})" if self.floor else ""

    def _floor_lines(self) -> list[str]:
        """The floor beside the figures: measured (its bands, and how many positions exceed it) or none."""
        if not self.floor:
            return [f"  floor             none measured: constant tolerance {self.tolerance:g} nats "
                    "(workbench floor measures the engine's own spread; check --floor FILE)"]
        f = self.floor
        src = f.get("source") or {}
        bands = " · ".join(f"{b['band']} ≤{b['bound']:.2g}" for b in f.get("bands", []))
        beyond = sum(r.beyond_floor for r in self.requests)
        inside = sum(r.inside_floor for r in self.requests)
        return [f"  floor             measured at {src.get('url') or '?'} ({f.get('positions')} positions, "
                f"{f.get('flips')} flips): |Δ| by |logprob| {bands}",
                f"  beyond the floor  {beyond} positions (|Δlogprob| above the engine's own spread)",
                f"  inside the floor  {inside} greedy flips the engine's own noise can make"]

    def rows(self) -> list[dict[str, Any]]:
        return [r.to_row() for r in self.requests]

    def render(self) -> str:
        """The summary table, then one line per request."""
        agree = self.argmax_agreement
        greedy = sum(1 for r in self.requests if r.greedy)
        width = max([len("request"), *(len(r.req_id) for r in self.requests)])
        lines = [
            f"check {self.path} against {self.reference} (tolerance {self.tolerance:g})",
            *(f"  warning: {w}" for w in self.warnings),
            f"  requests          {len(self.requests)} ({greedy} greedy, {len(self.requests) - greedy} sampled)",
            f"  positions         {self.positions}",
            f"  argmax agreement  {_pct(agree)} ({sum(r.agree for r in self.requests if r.greedy)}/"
            f"{self.greedy_positions} greedy positions)",
            f"  max |Δlogprob|    {_num(self.max_abs_delta)}{self._beside_floor('max_abs')}",
            f"  mean |Δlogprob|   {_num(self.mean_abs_delta)}",
            *self._floor_lines(),
            f"  real divergences  {self.real_positions} positions in {len(self.real_divergences)} requests",
            f"  near ties         {self.near_tie_positions} positions in "
            f"{sum(1 for r in self.requests if r.near_ties)} requests",
            *(self.importance.render() if self.importance else []),
            "",
            f"  {'request':<{width}} {'kind':<7} {'scored':>6} {'argmax':>9} {'max|Δ|':>9}"
            + (f" {'>floor':>6}" if self.floor else "") + "  first divergence",
        ]
        for r in self.requests:
            deltas = r.deltas
            lines.append(f"  {r.req_id:<{width}} {'greedy' if r.greedy else 'sampled':<7} {len(r.positions):>6} "
                         f"{r.agree:>4}/{len(r.positions):<4} {_num(max(deltas) if deltas else None):>9}"
                         + (f" {r.beyond_floor:>6}" if self.floor else "") + f"  {describe(r)}")
        lines.append("")
        lines.append("result: " + ("no real divergence" if self.exit_code == 0 else
                                   f"{len(self.real_divergences)} request(s) diverge for real"))
        return "\n".join(lines)


def describe(r: RequestCheck) -> str:
    """`position 17 real: engine ' the' #279, reference ' a' #253 (gap 1.2, margin 0.8)` or `—`."""
    note = f" [{r.note}]" if r.note else ""
    if r.first_divergence is None:
        return "—" + note
    p = next(p for p in r.positions if p.position == r.first_divergence)
    out = _one(p)
    real = next((q for q in r.positions if q.verdict in ("real", "logprob")), None)
    if real is not None and real is not p:
        out += f"; first real: {_one(real)}"
    if r.divergence_class == "logprob":
        out += f" ({sum(1 for q in r.positions if q.verdict == 'logprob')} positions beyond tolerance)"
    return out + note


def _one(p: PositionCheck) -> str:
    if p.verdict == "logprob":
        return f"position {p.position} logprob Δ {_num(p.delta)}"
    return (f"position {p.position} {p.verdict}: engine {p.text!r} #{p.token_id}, reference "
            f"{p.ref_argmax_text!r} #{p.ref_argmax} (gap {p.gap:.4f}, margin {p.ref_margin:.4f}, rank {p.rank})")


def topk_divergence(engine_top: list[tuple[int, float]], ref_top: list[tuple[int, float]],
                    ) -> tuple[float | None, float | None]:
    """`(topk_kl, topk_overlap)` of the engine's top-k against the reference's (see the module doc)."""
    engine = {int(t): float(lp) for t, lp in engine_top if isinstance(t, int) and t >= 0 and lp is not None}
    if not engine:
        return None, None
    ref = {int(t): float(lp) for t, lp in ref_top}
    shared = [t for t in engine if t in ref]
    kl = 0.0
    rest_e, rest_r = 1.0, 1.0
    for t in shared:
        pe, pr = math.exp(engine[t]), math.exp(ref[t])
        rest_e, rest_r = rest_e - pe, rest_r - pr
        if pe > 0:
            kl += pe * (engine[t] - ref[t])
    rest_e, rest_r = max(rest_e, 0.0), max(rest_r, 1e-12)
    if rest_e > 1e-12:
        kl += rest_e * math.log(rest_e / rest_r)
    k = len(engine)
    best_ref = sorted(ref, key=lambda t: -ref[t])[:k]
    overlap = len(set(engine) & set(best_ref)) / k
    return max(kl, 0.0), overlap


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}%"
