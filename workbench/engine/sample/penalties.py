"""The stages before the grammar mask: penalties, min_new_tokens and logit_bias, batched.

Owns: the per-batch tensors these stages need, built once per batch from each request's history
(`PenaltyTensors`, `TokenBan`, `LogitBias`), and applying them to logits rows in place.
Does not own: the stage order or anything after logit_bias (sampler.py).

Semantics (each matches a reference the tests compare against):
- `repetition_penalty` (transformers' `RepetitionPenaltyLogitsProcessor`, vLLM, SGLang): for every
  token that occurs in the prompt or the output so far, a positive logit is divided by the
  penalty and a negative one multiplied by it.
- `frequency_penalty` and `presence_penalty` (vLLM's and OpenAI's documented semantics; transformers
  has no such processors): over output tokens only, `logit -= frequency * count + presence * (count > 0)`.
  Applied after the repetition penalty, as vLLM does.
- `min_new_tokens` (transformers' `MinNewTokensLengthLogitsProcessor`): EOS and `stop_token_ids`
  get -inf while fewer than `min_new_tokens` output tokens exist.
- `logit_bias` (OpenAI): the bias is added to the token's logit (values already clamped to [-100, 100]).

"History" of a row is `req.output_ids` plus the row's prefix (tokens after the output that precede
this row; non-empty only when a speculative verifier asks for several positions of one request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workbench.engine.sched.request import Req


def _history(req: Req, prefix: Sequence[int]) -> list[int]:
    return list(req.output_ids) + list(prefix)


@dataclass(slots=True)
class PenaltyTensors:
    """Repetition/frequency/presence state of the rows that use any of them (`P` rows)."""

    rows: torch.Tensor  # [P] row indices into the batch
    counts: torch.Tensor  # [P, V] float32: occurrences in the output so far
    seen: torch.Tensor | None  # [P, V] bool: in the prompt or the output (only if a repetition penalty is set)
    repetition: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]
    presence: torch.Tensor  # [P, 1]

    @classmethod
    def build(cls, reqs: Sequence[Req], prefixes: Sequence[Sequence[int]], vocab_size: int,
              device: str) -> PenaltyTensors | None:
        rows = [i for i, r in enumerate(reqs) if _has_penalty(r)]
        if not rows:
            return None
        ps = [reqs[i].params for i in rows]
        counts = torch.zeros((len(rows), vocab_size), dtype=torch.float32)
        out_r, out_t, seen_r, seen_t = [], [], [], []
        for j, i in enumerate(rows):
            hist = _history(reqs[i], prefixes[i])
            out_r += [j] * len(hist)
            out_t += hist
            if ps[j].repetition_penalty != 1.0:
                seen_r += [j] * len(reqs[i].prompt_ids)
                seen_t += reqs[i].prompt_ids
        if out_t:
            counts.index_put_((torch.tensor(out_r), torch.tensor(out_t)), torch.ones(len(out_t)), accumulate=True)
        seen = None
        if any(p.repetition_penalty != 1.0 for p in ps):
            seen = counts > 0
            if seen_t:
                seen[torch.tensor(seen_r), torch.tensor(seen_t)] = True
            seen = seen.to(device)
        col = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)[:, None]  # noqa: E731
        return cls(torch.tensor(rows, device=device), counts.to(device), seen,
                   col([p.repetition_penalty for p in ps]), col([p.frequency_penalty for p in ps]),
                   col([p.presence_penalty for p in ps]))

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise `logits` `[R, V]` in place (rows not in `self.rows` are untouched)."""
        x = logits[self.rows]
        if self.seen is not None:
            x = torch.where(self.seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
        x = x - self.frequency * self.counts - self.presence * (self.counts > 0).float()
        logits[self.rows] = x


def _has_penalty(req: Req) -> bool:
    p = req.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass(slots=True)
class TokenBan:
    """`(row, token)` pairs forced to -inf: EOS and stop ids of rows still under `min_new_tokens`."""

    rows: torch.Tensor  # [M]
    token_ids: torch.Tensor  # [M]
    banned_rows: list[int]

    @classmethod
    def build(cls, reqs: Sequence[Req], prefixes: Sequence[Sequence[int]], eos_token_ids: Sequence[int],
              device: str) -> TokenBan | None:
        rows, ids, banned = [], [], []
        for i, req in enumerate(reqs):
            p = req.params
            if p.min_new_tokens and len(req.output_ids) + len(prefixes[i]) < p.min_new_tokens:
                toks = sorted(set(eos_token_ids) | set(p.stop_token_ids))
                rows += [i] * len(toks)
                ids += toks
                banned.append(i)
        if not ids:
            return None
        return cls(torch.tensor(rows, device=device), torch.tensor(ids, device=device), banned)

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows, self.token_ids] = float("-inf")


def bias_tensors(logit_bias: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [M] int64, biases [M] float32) of one request's logit_bias, on the CPU: built once,
    where the request is added (the admission thread), never per step on the engine's thread."""
    return (torch.tensor([int(t) for t in logit_bias], dtype=torch.int64),
            torch.tensor([float(v) for v in logit_bias.values()], dtype=torch.float32))


@dataclass(slots=True)
class LogitBias:
    """`(row, token, bias)` triples added to the logits."""

    rows: torch.Tensor  # [M]
    token_ids: torch.Tensor  # [M]
    values: torch.Tensor  # [M] float32
    biased_rows: list[int]

    @classmethod
    def build(cls, reqs: Sequence[Req], device: str) -> LogitBias | None:
        """Per step, from each request's tensors made once when it was added (`bias_tensors`): a
        request biasing the whole vocabulary costs each step a concatenation, not a Python loop."""
        rows, ids, vals, biased = [], [], [], []
        for i, req in enumerate(reqs):
            if req.params.logit_bias:
                if req.bias is None:
                    req.bias = bias_tensors(req.params.logit_bias)
                token_ids, values = req.bias
                rows.append(torch.full((len(token_ids),), i, dtype=torch.int64))
                ids.append(token_ids)
                vals.append(values)
                biased.append(i)
        if not ids:
            return None
        return cls(torch.cat(rows).to(device), torch.cat(ids).to(device), torch.cat(vals).to(device), biased)

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)
