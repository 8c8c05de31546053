"""The batched sampler: per-request sampling tensors built once per batch, the stages, the draw.

Owns: `SamplingBatchInfo` (per-row tensors from each request's SamplingParams), the stage order
(temperature -> top-k -> top-p -> sample), greedy argmax rows, per-request generators for seeded
rows, chosen-token logprobs/ranks/top-logprobs, and optional per-stage records for tracing.
Does not own: validation (sampling_params.py) or finish rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workbench.engine.request import Req


@dataclass(slots=True)
class SamplingBatchInfo:
    """Per-row sampling tensors; row i belongs to `reqs[i]`."""

    reqs: list[Req]
    temperatures: torch.Tensor  # [R, 1]
    top_ks: torch.Tensor  # [R] (vocab size where disabled)
    top_ps: torch.Tensor  # [R]
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    need_top_logprobs: int

    @classmethod
    def build(cls, reqs: list[Req], vocab_size: int, device: str) -> SamplingBatchInfo:
        ps = [r.params for r in reqs]
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in ps], device=device)
        top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in ps], device=device)
        greedy = torch.tensor([p.temperature == 0 for p in ps], device=device)
        return cls(reqs=reqs, temperatures=temps[:, None], top_ks=top_ks.clamp(max=vocab_size),
                   top_ps=torch.tensor([float(p.top_p) for p in ps], device=device), greedy=greedy,
                   all_greedy=bool(greedy.all()), need_top_logprobs=max(p.top_logprobs for p in ps))

    def summary(self) -> list[dict[str, Any]]:
        return [{"req_id": r.req_id, "temperature": r.params.temperature, "top_k": r.params.top_k,
                 "top_p": r.params.top_p, "seed": r.params.seed} for r in self.reqs]


@dataclass(slots=True)
class SamplerOutput:
    next_token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    draws: list[float | None]
    stages: list[list[dict[str, Any]]] | None
    raw_logprobs: torch.Tensor  # [R, V]


class Sampler:
    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo, trace_topk: int = 0) -> SamplerOutput:
        """Sample one token per row of `logits` `[R, V]`; record stages when `trace_topk > 0`."""
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        stages: list[list[dict[str, Any]]] | None = [[] for _ in info.reqs] if trace_topk else None
        if info.all_greedy and not trace_topk:
            next_ids = logits.argmax(dim=-1)
            draws: list[float | None] = [None] * len(info.reqs)
        else:
            probs = self._process(logits, info, stages, trace_topk)
            next_ids, draws = self._draw(probs, logits, info)
        chosen = raw_logprobs.gather(1, next_ids[:, None])[:, 0]
        ranks = (raw_logprobs > chosen[:, None]).sum(dim=-1) + 1
        k = info.need_top_logprobs
        tops: list[list[tuple[int, float]]] = [[] for _ in info.reqs]
        if k:
            vals, ids = raw_logprobs.topk(k, dim=-1)
            tops = [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, vals, strict=True)]
        return SamplerOutput(next_ids.tolist(), chosen.tolist(), ranks.tolist(), tops, draws, stages, raw_logprobs)

    def _process(self, logits: torch.Tensor, info: SamplingBatchInfo, stages, k: int) -> torch.Tensor:
        """Apply temperature, top-k and top-p; return the final probabilities `[R, V]`."""
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        self._record(stages, "temperature", probs, k)
        sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        sorted_p = sorted_p.masked_fill(ranks >= info.top_ks[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(1, sorted_i, sorted_p)
        self._record(stages, "top_k", probs / probs.sum(-1, keepdim=True), k)
        cum = sorted_p.cumsum(dim=-1)
        mass = cum[:, -1:]
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays)
        drop = (cum - sorted_p) / mass >= info.top_ps[:, None]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, sorted_i, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
        self._record(stages, "top_p", probs, k)
        return probs

    @staticmethod
    def _record(stages, name: str, probs: torch.Tensor, k: int) -> None:
        if stages is None:
            return
        vals, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
        kept = (probs > 0).sum(-1).tolist()
        for row, (v, i) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True)):
            stages[row].append({"name": name, "top_ids": i, "top_probs": v, "kept_count": kept[row]})

    @staticmethod
    def _draw(probs: torch.Tensor, logits: torch.Tensor, info: SamplingBatchInfo):
        """Inverse-CDF draw with one uniform per row, from the request's own generator when seeded."""
        next_ids, draws = [], []
        cdf = probs.cumsum(dim=-1)
        for row, req in enumerate(info.reqs):
            if req.params.temperature == 0:
                next_ids.append(int(logits[row].argmax()))
                draws.append(None)
                continue
            u = float(torch.rand((), generator=req.generator)) if req.generator is not None else float(torch.rand(()))
            idx = int(torch.searchsorted(cdf[row], torch.tensor([u * float(cdf[row, -1])])).clamp(max=probs.shape[-1] - 1))
            while probs[row, idx] == 0 and idx > 0:  # never land on a token a filter removed
                idx -= 1
            next_ids.append(idx)
            draws.append(u)
        return torch.tensor(next_ids, device=logits.device), draws
