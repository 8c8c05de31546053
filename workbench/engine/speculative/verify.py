"""Verification of draft tokens against the target: greedy prefix matching and rejection sampling.

Owns: the acceptance rule (`u < p/q`, injectable so a test can prove a wrong rule is caught) and
one request's verification (`verify_greedy`, `verify_sampled`) returning a `VerifyResult`. `p` and
`q` are what the engine's Sampler makes of the logits (every stage of the request, with the draft
tokens before each position as `prefixes`); the recovered or bonus token is drawn through
`Sampler.draw` with an explicit uniform. Does not own: running forwards, KV rollback or output
processing (worker.py).

Rejection sampling after Leviathan et al. 2023 / Chen et al. 2023: draft token i is accepted iff
`u_i < p_i(d_i) / q_i(d_i)`; on the first rejection the extra token is drawn from the normalised
`max(p_i - q_i, 0)`; when every draft is accepted a bonus token is drawn from `p_k`. The emitted
tokens then follow the target distribution exactly, whatever the drafter proposes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workbench.engine.sample.sampler import Sampler, SamplingBatchInfo
from workbench.engine.sched.request import Req

AcceptRule = Callable[[float, float, float], bool]  # (p, q, u) -> accept?
DrawFn = Callable[[torch.Tensor, float], int]  # (unnormalised distribution [V], uniform) -> token id


def leviathan_accept(p: float, q: float, u: float) -> bool:
    """Accept iff `u < p / q` (written without the division; `q > 0` for a proposed token)."""
    return u * q < p


@dataclass(slots=True)
class VerifyResult:
    """One request's verification: per draft position p, q, u and the verdict, then the extra token."""

    draft_tokens: list[int]
    p: list[float]  # target probability of each draft token (after the request's sampling stages)
    q: list[float]  # drafter probability of each draft token (1.0 for n-gram proposals)
    u: list[float | None]  # uniform draw per examined position (None: greedy, or never examined)
    accepted: list[bool]  # per draft position; False from the first rejection on
    num_accepted: int
    extra_token: int
    extra_kind: str  # "bonus" (all accepted) | "recovered" (drawn from max(p-q,0)) | "target" (greedy)
    extra_draw: float | None  # the uniform used to draw the extra token (None for greedy)
    target_argmax: list[int]  # argmax of the target's raw logits at each of the k+1 positions
    greedy: bool

    @property
    def tokens(self) -> list[int]:
        """The tokens this verification emits: the accepted drafts, then the extra token."""
        return self.draft_tokens[: self.num_accepted] + [self.extra_token]


def uniform(req: Req) -> float:
    """One uniform in [0, 1) from the request's own generator when it is seeded (as the Sampler draws)."""
    if req.generator is not None:
        return float(torch.rand((), generator=req.generator, dtype=torch.float64))
    return float(torch.rand((), dtype=torch.float64))


def sampler_draw(sampler: Sampler, info_row: SamplingBatchInfo) -> DrawFn:
    """A draw of one token from an unnormalised `[V]` distribution with an explicit uniform, through
    `Sampler.draw` (its inverse-CDF rule). `info_row` is any one-row info of a sampled request."""

    def draw(dist: torch.Tensor, u: float) -> int:
        ids, _ = sampler.draw(dist[None], info_row, torch.tensor([u], dtype=torch.float64))
        return int(ids[0])

    return draw


def verify_greedy(drafts: list[int], q: list[float], target_argmax: list[int], p: list[float]) -> VerifyResult:
    """Accept the longest prefix of `drafts` equal to the target's argmax, then one target token."""
    k = len(drafts)
    n = 0
    while n < k and drafts[n] == target_argmax[n]:
        n += 1
    return VerifyResult(
        draft_tokens=list(drafts), p=p, q=q, u=[None] * k, accepted=[i < n for i in range(k)], num_accepted=n,
        extra_token=target_argmax[n], extra_kind="bonus" if n == k else "target", extra_draw=None,
        target_argmax=target_argmax, greedy=True)


def verify_sampled(req: Req, drafts: list[int], q: list[float], q_dist: torch.Tensor | None,
                   target_p: torch.Tensor, target_argmax: list[int], draw: DrawFn,
                   rule: AcceptRule = leviathan_accept) -> VerifyResult:
    """Rejection-sample `drafts` against `target_p` `[k+1, V]`.

    `q_dist` `[k, V]` holds the drafter's distributions, or None for a deterministic proposal
    (n-gram), where q is one-hot on the draft token and `max(p - q, 0)` is p without that token.
    """
    k = len(drafts)
    p_tok = [float(target_p[i, d]) for i, d in enumerate(drafts)]
    us: list[float | None] = [None] * k
    accepted = [False] * k
    n = 0
    while n < k:
        us[n] = uniform(req)
        if not rule(p_tok[n], q[n], us[n]):
            break
        accepted[n] = True
        n += 1
    if n == k:
        kind, dist = "bonus", target_p[k]
    else:
        kind, dist = "recovered", _residual(target_p[n], drafts[n], None if q_dist is None else q_dist[n])
    u_extra = uniform(req)
    return VerifyResult(
        draft_tokens=list(drafts), p=p_tok, q=list(q), u=us, accepted=accepted, num_accepted=n,
        extra_token=draw(dist, u_extra), extra_kind=kind, extra_draw=u_extra, target_argmax=target_argmax,
        greedy=False)


def _residual(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> torch.Tensor:
    """`max(p - q, 0)` (unnormalised; `draw` normalises); falls back to p if nothing is left."""
    if q is None:
        res = p.clone()
        res[draft] = 0.0
    else:
        res = (p - q).clamp(min=0.0)
    return res if float(res.sum()) > 0 else p
