"""Importance ratios of logged rollouts: what truncated or masked importance sampling would do.

Owns: `Thresholds` (the TIS cap and the masking range), `classify_ratio` (one position's log ratio
reference − engine, whether TIS clips it or masking drops it, and why), and `ImportanceReport`
(the run: counts by action and reason, the largest ratios, `render()` lines for the check's table,
`summary()` for the stored check). Standard library only. Does not own the reference's logprobs
(check.py computes them) or the records (check_report.py).

An RL trainer corrects for its rollout engine with the per-token ratio w = π_ref / π_engine =
exp(log_ratio): truncated IS (TIS) uses min(w, C) and so clips every token with w > C; masked IS
(MIS) drops every token with w outside [low, high]. Why a token is affected, in this order:

- `processed`: the engine's logprob is the reference's after temperature / top-p (its
  `processed_logprobs` mode) rather than the raw distribution the trainer computes: recomputing
  the reference's processed logprob from its top-20 explains the engine's figure far better;
- `low_prob`: the engine sampled a token either side gives under `LOW_PROB` probability, where
  small logit differences become large ratios;
- `near_tie`: the reference's top-2 margin there is under the check's tolerance;
- `numerics`: none of the above: the engine's logprob differs from the reference's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

LOW_PROB = 0.01
REASONS = ("processed", "low_prob", "near_tie", "numerics")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """TIS clips where w > tis_cap; MIS drops where w < mis_low or w > mis_high (w = exp(log ratio))."""

    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0

    def __post_init__(self) -> None:
        for name in ("tis_cap", "mis_low", "mis_high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not self.mis_low < self.mis_high:
            raise ValueError(f"mis_low must be below mis_high, got [{self.mis_low}, {self.mis_high}]")


@dataclass(slots=True)
class RatioVerdict:
    """One position: log ratio, and what each correction does to it (None: kept unchanged)."""

    log_ratio: float
    tis: str | None  # "clip" or None
    mis: str | None  # "drop" or None
    reason: str | None  # one of REASONS when tis or mis acts


def processed_logprob(top: list[tuple[int, float]], token: int, temperature: float, top_p: float,
                      top_k: int) -> float | None:
    """The reference's logprob of `token` after temperature, top-k and top-p, estimated from its top
    list `[(id, raw logprob), ...]` best first (the mass outside the list is left out: exact for
    the cut distributions, a slight overestimate otherwise). None when `token` is not in the list."""
    if temperature <= 0:
        return None
    scaled = [(t, lp / temperature) for t, lp in top]
    if top_k > 0:
        scaled = scaled[:top_k]
    z = _logsumexp([lp for _, lp in scaled])
    kept, mass = [], 0.0
    for t, lp in scaled:
        kept.append((t, lp - z))
        mass += math.exp(lp - z)
        if mass >= top_p:
            break
    zk = _logsumexp([lp for _, lp in kept])
    return next((lp - zk for t, lp in kept if t == token), None)


def _logsumexp(values: list[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def classify_ratio(engine_lp: float, ref_lp: float, *, thresholds: Thresholds, ref_processed: float | None,
                   ref_margin: float, rank: int, tolerance: float) -> RatioVerdict:
    """Log ratio (reference − engine), whether TIS clips it / MIS drops it, and the first reason that holds."""
    r = ref_lp - engine_lp
    tis = "clip" if r > math.log(thresholds.tis_cap) else None
    mis = "drop" if (r < math.log(thresholds.mis_low) or r > math.log(thresholds.mis_high)) else None
    reason = None
    if tis or mis:
        if ref_processed is not None and abs(engine_lp - ref_processed) < 0.25 * abs(r):
            reason = "processed"
        elif min(engine_lp, ref_lp) < math.log(LOW_PROB):
            reason = "low_prob"
        elif ref_margin < tolerance and rank <= 2:
            reason = "near_tie"
        else:
            reason = "numerics"
    return RatioVerdict(r, tis, mis, reason)


@dataclass(slots=True)
class ImportanceReport:
    """Every scored position's ratio, summed up: what TIS and MIS would do to these rollouts."""

    thresholds: Thresholds
    tokens: int = 0
    log_ratios: list[float] = field(default_factory=list, repr=False)
    clipped: int = 0
    dropped: int = 0
    dropped_low: int = 0  # w < mis_low: the engine overrated the token
    dropped_high: int = 0  # w > mis_high: the engine underrated it
    reasons: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    worst: list[tuple[float, str, int]] = field(default_factory=list)  # (log ratio, request, position)
    requests_affected: set[str] = field(default_factory=set)

    def add(self, req_id: str, position: int, v: RatioVerdict) -> None:
        self.tokens += 1
        self.log_ratios.append(v.log_ratio)
        self.clipped += v.tis == "clip"
        if v.mis == "drop":
            self.dropped += 1
            self.dropped_low += v.log_ratio < 0
            self.dropped_high += v.log_ratio > 0
        if v.reason:
            self.reasons[v.reason] += 1
            self.requests_affected.add(req_id)
        self.worst.append((v.log_ratio, req_id, position))
        self.worst = sorted(self.worst, key=lambda w: -abs(w[0]))[:5]

    @property
    def mean(self) -> float | None:
        return sum(self.log_ratios) / len(self.log_ratios) if self.log_ratios else None

    @property
    def max_abs(self) -> float | None:
        return max((abs(r) for r in self.log_ratios), default=None)

    def summary(self) -> dict[str, Any]:
        t = self.thresholds
        return {"tis_cap": t.tis_cap, "mis_low": t.mis_low, "mis_high": t.mis_high, "tokens": self.tokens,
                "mean_log_ratio": self.mean, "max_abs_log_ratio": self.max_abs, "tis_clipped": self.clipped,
                "mis_dropped": self.dropped, "mis_dropped_low": self.dropped_low,
                "mis_dropped_high": self.dropped_high, "reasons": dict(self.reasons),
                "requests_affected": sorted(self.requests_affected),
                "worst": [{"log_ratio": r, "req_id": q, "position": p} for r, q, p in self.worst]}

    def render(self) -> list[str]:
        t = self.thresholds
        why = ", ".join(f"{k} {v}" for k, v in self.reasons.items() if v) or "—"
        mean = "—" if self.mean is None else f"{self.mean:+.4g}"
        mx = "—" if self.max_abs is None else f"{self.max_abs:.4g}"
        lines = [f"  importance ratio  log w = reference − engine over {self.tokens} tokens: mean {mean}, "
                 f"max |log w| {mx}",
                 f"  {f'TIS (cap C={t.tis_cap:g})':<17} {self.clipped} tokens clipped (w > C)",
                 f"  {f'MIS [{t.mis_low:g}, {t.mis_high:g}]':<17} {self.dropped} tokens dropped ({self.dropped_low} "
                 f"below, {self.dropped_high} above); TIS or MIS acts in {len(self.requests_affected)} requests",
                 f"  why               {why}"]
        if self.worst and self.max_abs:
            lines.append("  largest |log w|   " + ", ".join(f"{q}:{p} {r:+.3g}" for r, q, p in self.worst[:3]))
        return lines
