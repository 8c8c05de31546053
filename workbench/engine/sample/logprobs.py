"""Logprobs: the chosen token's logprob and rank, top alternatives, named ids, and prompt logprobs.

Owns: turning a `[R, V]` log-distribution and the chosen ids into per-row lists
(`token_logprobs`), and prompt logprobs from the logits of every prompt position
(`store_prompt_logprobs`: position p's logits score prompt token p + 1; the first prompt token
has none). Which distribution a row uses is its `logprobs_mode`: `raw` (log-softmax of the model's
logits) or `processed` (log of the distribution actually sampled from; sampler.py decides).
Prompt logprobs are always raw. Does not own: sampling, or formatting outputs (postprocess.py).

Rank is 1 + the number of tokens with a strictly higher logprob (ties share the better rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench.engine.kernels import sampling
from workbench.engine.sched.request import Req


@dataclass(slots=True)
class TokenLogprobs:
    """Per-row logprob facts for one sampled (or scored) token each."""

    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]  # the k best (id, logprob), k = the batch's largest request
    token_ids: list[dict[int, float]]  # the logprobs of each row's `token_ids_logprob`


def token_logprobs(lp: torch.Tensor, chosen: torch.Tensor, top_k: int,
                   token_ids: Sequence[Sequence[int]] | None = None,
                   argmax_rows: Sequence[int] = ()) -> TokenLogprobs:
    """`lp` `[R, V]` log-probabilities, `chosen` `[R]` ids -> logprob, rank, top-k and named ids.

    `argmax_rows`: rows whose chosen id is the argmax of the logits `lp` is the log-softmax of.
    Their rank is 1 without a pass over the row: log-softmax is `(x - max) - log(sum)` in rounded
    float steps, each monotone, so no logprob can be above the argmax's (NaN compares false)."""
    rows = lp.shape[0]
    picked = lp.gather(1, chosen.view(-1, 1).to(lp.device))[:, 0]  # [R]
    known = set(argmax_rows)
    others = [r for r in range(rows) if r not in known]
    if len(others) == rows:
        ranks = _ranks(lp, picked).tolist()
    else:
        ranks = [1] * rows
        if others:
            index = torch.tensor(others, dtype=torch.int64, device=lp.device)
            for r, rank in zip(others, _ranks(lp[index], picked[index]).tolist(), strict=True):
                ranks[r] = rank
    tops: list[list[tuple[int, float]]] = [[] for _ in range(rows)]
    if top_k > 0:
        vals, ids = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    named: list[dict[int, float]] = [{} for _ in range(rows)]
    if token_ids and any(token_ids):
        for r, ids_r in enumerate(token_ids):
            if ids_r:
                vals = lp[r, torch.tensor(list(ids_r), device=lp.device)].tolist()
                named[r] = dict(zip((int(t) for t in ids_r), vals))
    return TokenLogprobs(picked.tolist(), ranks, tops, named)


def _ranks(lp: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """1 + the number of logprobs strictly above `picked`, per row. The native count (one read of
    each row, no `[R, V]` copy or mask) where it runs; else a row whose pick is its maximum (every
    greedy row) has rank 1 by definition, which one max-reduction shows, and only the other rows
    pay for the compare-and-count over the vocabulary. Both give the same ranks (NaN compares false)."""
    counts = sampling.count_above(lp, picked) if lp.dim() == 2 else None
    if counts is not None:
        return counts + 1
    behind = (~(picked >= lp.amax(dim=-1))).nonzero().flatten()  # NaN anywhere: counted the long way
    ranks = torch.ones(lp.shape[0], dtype=torch.int64, device=lp.device)
    if behind.numel():
        ranks[behind] = (lp[behind] > picked[behind, None]).sum(dim=-1) + 1
    return ranks


def store_prompt_logprobs(reqs: Sequence[Req], rows: Sequence[tuple[int, int]], logits: torch.Tensor) -> None:
    """Record prompt logprobs from the logits of prompt positions.

    `rows[j] = (batch_index, position)`: `logits[j]` `[V]` are the model's logits at `position` of
    `reqs[batch_index]`, which score prompt token `position + 1`. Positions already recorded (a
    request recomputed after preemption) are skipped, so each prompt token is stored once, in order.
    """
    if not rows:
        return
    targets = torch.tensor([reqs[b].prompt_ids[p + 1] for b, p in rows], device=logits.device)
    k = max(reqs[b].params.top_logprobs for b, _ in rows)
    facts = token_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, k)
    for j, (b, pos) in enumerate(rows):
        req = reqs[b]
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no logprob
            req.prompt_ranks.append(None)
            req.prompt_top_logprobs.append([])
        if pos + 1 != len(req.prompt_logprobs):
            continue
        req.prompt_logprobs.append(facts.logprobs[j])
        req.prompt_ranks.append(facts.ranks[j])
        req.prompt_top_logprobs.append(facts.top[j][: req.params.top_logprobs])


def prompt_logprob_rows(req: Req, start: int, length: int) -> int:
    """How many leading positions of a prefill chunk `[start, start + length)` still need logits
    for prompt logprobs (positions up to the second-to-last prompt token; 0 when not requested)."""
    if not req.params.prompt_logprobs or len(req.prompt_logprobs) >= len(req.prompt_ids):
        return 0
    return max(0, min(start + length, len(req.prompt_ids) - 1) - start)
