"""The batched sampler: per-row sampling tensors built once per batch, the stages, the draw.

Owns: `SamplingBatchInfo` (per-row tensors from each request's SamplingParams), the stage order
`penalties (+ min_new_tokens) -> logit_bias -> grammar -> temperature -> top_k -> top_p -> min_p`,
the draw (inverse CDF of one uniform per row, from the request's own generator when seeded),
greedy rows (argmax of the processed logits), chosen-token logprobs, and per-stage records for
tracing (only computed when asked for: `trace_topk > 0`). Does not own: validation
(sampling_params.py), the stages' tensors (penalties.py, grammar.py), logprob bookkeeping
(logprobs.py) or finish rules.

Stable API (the speculative decoder relies on it):
- `SamplingBatchInfo.build(reqs, vocab_size, device, *, eos_token_ids=(), prefixes=None)`: row i is
  sampled for `reqs[i]`; a request may own several rows. `prefixes[i]` are the tokens that follow
  `reqs[i].output_ids` before row i (draft tokens, for penalties, min_new_tokens and the grammar).
- `Sampler.process(logits, info) -> [R, V]` final logits: every stage applied, removed tokens -inf,
  greedy rows at temperature 1.
- `Sampler.probs(logits, info) -> [R, V]`: the distribution each row is sampled from, without
  drawing; greedy rows are one-hot at their argmax.
- `Sampler.draw(probs, info, u=None) -> (ids [R] int64, u [R] float64)`: inverse-CDF draw
  (`id = first index whose CDF exceeds u * total`); `u` explicit or drawn per row (seeded rows from
  `req.generator`, in row order); greedy rows take the argmax and report u = NaN.
- `Sampler(stage_order=...)`: the order is injectable so tests can show a wrong order is detected.
- `Sampler.__call__(logits, info, trace_topk=0) -> SamplerOutput`.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.engine.kernels import sampling
from workbench.engine.kernels.sampling import draw_formula
from workbench.engine.sample import grammar as grammar_mod
from workbench.engine.sample import logprobs as lp_mod
from workbench.engine.sample.argmax import first_argmax
from workbench.engine.sample.penalties import LogitBias, PenaltyTensors, TokenBan
from workbench.engine.sched.request import Req
from workbench.trace.events import RepeatedStage

STAGES = ("penalties", "logit_bias", "grammar", "temperature", "top_k", "top_p", "min_p")
NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingBatchInfo:
    """Per-row sampling tensors; row i belongs to `reqs[i]` (a request may own several rows)."""

    reqs: list[Req]
    prefixes: list[tuple[int, ...]]
    vocab_size: int
    temperatures: torch.Tensor  # [R, 1] (1.0 for greedy rows)
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    top_ks: torch.Tensor  # [R] int64 (vocab size where disabled)
    top_ps: torch.Tensor  # [R]
    min_ps: torch.Tensor  # [R]
    processed: torch.Tensor  # [R] bool: logprobs_mode == "processed"
    penalties: PenaltyTensors | None
    ban: TokenBan | None
    bias: LogitBias | None
    grammar: tuple[torch.Tensor, list[int]] | None  # (bitmask [R, ceil(V/32)] int32, constrained rows)
    need_top_logprobs: int
    wants_logprobs: bool  # some row asked for logprobs, top logprobs or named token logprobs
    token_ids_logprob: list[tuple[int, ...]]
    # `applied`'s answers, per stage: the fields above are not changed after `build`, and a traced
    # step asks each stage twice or more (~0.1 ms a step at batch 1 as tensor compares each time)
    _applied: dict[str, list[bool]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, reqs: Sequence[Req], vocab_size: int, device: str, *, eos_token_ids: Sequence[int] = (),
              prefixes: Sequence[Sequence[int]] | None = None) -> SamplingBatchInfo:
        reqs = list(reqs)
        pre = [tuple(p) for p in prefixes] if prefixes is not None else [()] * len(reqs)
        if len(pre) != len(reqs):
            raise ValueError(f"prefixes: got {len(pre)} for {len(reqs)} rows")
        ps = [r.params for r in reqs]
        t = lambda xs, dt=torch.float32: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
        greedy = t([p.temperature == 0 for p in ps], torch.bool)
        # `applied` of the tensor-valued stages, from the same values rounded to float32 as the
        # tensors hold them (array "f"), without a compare and a copy back per stage and step
        f32 = lambda xs: array("f", xs)  # noqa: E731
        temps = f32([p.temperature if p.temperature > 0 else 1.0 for p in ps])
        known = {"temperature": [x != 1.0 and p.temperature != 0 for x, p in zip(temps, ps)],
                 "top_k": [0 < p.top_k < vocab_size for p in ps],
                 "top_p": [x < 1.0 for x in f32([p.top_p for p in ps])],
                 "min_p": [x > 0.0 for x in f32([p.min_p for p in ps])]}
        return cls(
            reqs=reqs, prefixes=pre, vocab_size=vocab_size,
            temperatures=t([p.temperature if p.temperature > 0 else 1.0 for p in ps])[:, None], greedy=greedy,
            all_greedy=bool(greedy.all()) if reqs else True,
            top_ks=t([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps], torch.int64),
            top_ps=t([p.top_p for p in ps]), min_ps=t([p.min_p for p in ps]),
            processed=t([p.logprobs_mode == "processed" for p in ps], torch.bool),
            penalties=PenaltyTensors.build(reqs, pre, vocab_size, device),
            ban=TokenBan.build(reqs, pre, eos_token_ids, device), bias=LogitBias.build(reqs, device),
            grammar=grammar_mod.grammar_bitmask([r.grammar for r in reqs], pre, vocab_size),
            need_top_logprobs=max((p.top_logprobs for p in ps), default=0),
            wants_logprobs=any(p.logprobs or p.top_logprobs or p.token_ids_logprob for p in ps),
            token_ids_logprob=[tuple(p.token_ids_logprob) for p in ps], _applied=known)

    @property
    def needs_stages(self) -> bool:
        """False when plain argmax of the raw logits is exactly what every row would get."""
        return not self.all_greedy or any(x is not None for x in (self.penalties, self.ban, self.bias, self.grammar)) \
            or bool(self.processed.any())

    def any_stage_applied(self) -> bool:
        return any(any(self.applied(stage)) for stage in STAGES)

    def applied(self, stage: str) -> list[bool]:
        """Per row: do this row's params make `stage` do anything? (A new list each call.)"""
        known = self._applied.get(stage)
        if known is None:
            known = self._applied[stage] = self._applied_now(stage)
        return list(known)

    def _applied_now(self, stage: str) -> list[bool]:
        rows = range(len(self.reqs))
        if stage == "penalties":
            marked = set(self.penalties.rows.tolist()) if self.penalties else set()
            marked |= set(self.ban.banned_rows) if self.ban else set()
            return [i in marked for i in rows]
        if stage == "logit_bias":
            return [i in set(self.bias.biased_rows) for i in rows] if self.bias else [False] * len(rows)
        if stage == "grammar":
            return [i in set(self.grammar[1]) for i in rows] if self.grammar else [False] * len(rows)
        if stage == "temperature":
            return ((self.temperatures[:, 0] != 1.0) & ~self.greedy).tolist()
        if stage == "top_k":
            return (self.top_ks < self.vocab_size).tolist()
        if stage == "top_p":
            return (self.top_ps < 1.0).tolist()
        if stage == "min_p":
            return (self.min_ps > 0.0).tolist()
        raise ValueError(f"unknown sampling stage {stage!r}; stages are {STAGES}")

    def summary(self) -> list[dict[str, Any]]:
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "min_new_tokens", "seed", "logprobs_mode")
        out = []
        for r, pre in zip(self.reqs, self.prefixes):
            d = {"req_id": r.req_id, **{k: getattr(r.params, k) for k in keys}}
            d.update(logit_bias=len(r.params.logit_bias or {}), grammar=(r.params.grammar or (None,))[0],
                     prefix_len=len(pre))
            out.append(d)
        return out


@dataclass(slots=True)
class SamplerOutput:
    next_token_ids: list[int]
    logprobs: list[float]  # of the chosen token, in each row's logprobs_mode (NaN when untraced and unasked)
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    draws: list[float | None]  # the uniform each row used (None for greedy rows)
    stages: list[list[dict[str, Any]]] | None  # per row, one dict per stage (when traced)
    # [R, V] log-softmax of the model's logits (None: not computed, or not stored: raw_logprobs_at
    # gives it at any index where lp_stats is set); a buffer the next call overwrites
    raw_logprobs: torch.Tensor | None
    token_ids_logprobs: list[dict[int, float]]
    forced: list[int] = field(default_factory=list)  # rows whose token was forced (Engine.force_token)
    # [R, k] int64: the ids of the record's first stage (the model's own distribution), when traced
    record_ids: torch.Tensor | None = None
    # (logits, stats [R, 2]) where raw_logprobs was not stored: each row's maximum and log-sum
    lp_stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def raw_logprobs_at(self, index: torch.Tensor) -> torch.Tensor:
        """`raw_logprobs.gather(1, index)` (`index [R, n]`), whether or not raw_logprobs was stored."""
        if self.raw_logprobs is not None:
            return self.raw_logprobs.gather(1, index)
        if self.lp_stats is None:
            raise ValueError("raw logprobs were not computed for this batch")
        return sampling.lp_at(*self.lp_stats, index)


def _force(ids: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, list[int]]:
    """Replace the sampled id of every row whose request has a forced token at that output position."""
    rows = [(r, req.forced_tokens[p]) for r, (req, pre) in enumerate(zip(info.reqs, info.prefixes))
            if req.forced_tokens and (p := len(req.output_ids) + len(pre)) in req.forced_tokens]
    if rows:
        ids = ids.clone()
        for r, token in rows:
            ids[r] = token
    return ids, [r for r, _ in rows]


def _rows(mask: torch.Tensor) -> torch.Tensor:
    return mask.nonzero().flatten()


def _stage_temperature(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    return x if bool((info.temperatures == 1.0).all()) else x / info.temperatures


def _stage_top_k(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Keep the k largest logits (ties with the k-th kept, as transformers' TopKLogitsWarper)."""
    rows = _rows(info.top_ks < x.shape[-1])
    if rows.numel():
        ks = info.top_ks[rows]
        sub = x[rows]
        kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])  # [r, 1]
        x[rows] = sub.masked_fill(sub < kth, NEG_INF)
    return x


def _stage_top_p(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the crossing token stays)."""
    rows = _rows(info.top_ps < 1.0)
    if rows.numel():
        sub = x[rows]
        sorted_p, order = torch.softmax(sub, dim=-1).sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # exclusive cumulative mass
        drop_sorted = mass_before >= info.top_ps[rows][:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        x[rows] = sub.masked_fill(drop, NEG_INF)
    return x


def _stage_min_p(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    rows = _rows(info.min_ps > 0.0)
    if rows.numel():
        sub = x[rows]
        probs = torch.softmax(sub, dim=-1)
        threshold = info.min_ps[rows][:, None] * probs.max(dim=-1, keepdim=True).values
        x[rows] = sub.masked_fill(probs < threshold, NEG_INF)
    return x


def _stage_penalties(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    if info.penalties is not None:
        info.penalties.apply(x)
    if info.ban is not None:
        info.ban.apply(x)
    return x


def _stage_logit_bias(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    if info.bias is not None:
        info.bias.apply(x)
    return x


def _stage_grammar(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    if info.grammar is not None:
        grammar_mod.apply_bitmask(x, *info.grammar)
    return x


_STAGE_FNS = {"penalties": _stage_penalties, "logit_bias": _stage_logit_bias, "grammar": _stage_grammar,
              "temperature": _stage_temperature, "top_k": _stage_top_k, "top_p": _stage_top_p,
              "min_p": _stage_min_p}


class StageRecorder:
    """Per row, the top-k distribution after every stage (only built when tracing asks for it). The
    model's own distribution is `torch.softmax(logits)`, as every stage's is of its logits."""

    def __init__(self, k: int, logits: torch.Tensor, info: SamplingBatchInfo,
                 logprobs: torch.Tensor | None = None,
                 model: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        self.k = min(k, logits.shape[-1])
        self.info = info
        self.rows: list[list[dict[str, Any]]] = [[] for _ in range(logits.shape[0])]
        self._logits = logits
        self._lp = logprobs  # computed by _add_model where not given and needed
        self._prev: torch.Tensor | None = None  # the previous record's probabilities, when a stage needs them
        self.model_ids: torch.Tensor | None = None  # [R, k] ids of the model distribution's record
        self._add_model(model)

    @property
    def prev(self) -> torch.Tensor:
        if self._prev is None:  # the model's own distribution, rebuilt only for the first stage that applies
            self._prev = torch.softmax(self._logits, dim=-1)
        return self._prev

    def _add_model(self, model: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        """The model's own distribution, its top-k and entropy: given (`model`, from the sampler's
        native log-softmax pass), or by torch's ops: softmax, then top-k, then p * log p in place and
        the row sums."""
        if model is not None:
            vals, ids, entropy_t = model
            entropy = entropy_t.tolist()
        else:
            if self._lp is None:
                self._lp = torch.log_softmax(self._logits, dim=-1)
            lp = self._lp
            probs = torch.softmax(self._logits, dim=-1)
            vals, ids = sampling.topk(probs, self.k)
            # log-softmax of the raw (finite) logits: no 0 * -inf to guard
            native = sampling.entropy(probs, lp)  # the same bits in one pass (kernels/sampling.py)
            entropy = (native if native is not None else -(probs.mul_(lp).sum(-1))).tolist()
        rows, vocab = self._logits.shape
        self.model_ids = ids
        self._append("logits", vals, ids, [1.0] * rows, [vocab] * rows, entropy, [True] * rows)

    def record(self, stage: str, x: torch.Tensor) -> None:
        applied = self.info.applied(stage)
        if not any(applied):  # the distribution is unchanged: repeat the previous record, all mass kept
            for row in self.rows:
                row.append(RepeatedStage.of(row[-1], stage))
            return
        probs = torch.softmax(x, dim=-1)
        self._add(stage, probs, self.prev, applied, kept=torch.isfinite(x))
        self._prev = probs

    def _add(self, name: str, probs: torch.Tensor, prev: torch.Tensor, applied: list[bool],
             kept: torch.Tensor) -> None:
        vals, ids = sampling.topk(probs, self.k)
        counts = kept.sum(-1).tolist()
        kept_mass = (prev * kept).sum(-1).tolist()
        entropy = (-torch.special.xlogy(probs, probs).sum(-1)).tolist()  # 0 log 0 = 0
        self._append(name, vals, ids, kept_mass, counts, entropy, applied)

    def _append(self, name: str, vals: torch.Tensor, ids: torch.Tensor, kept_mass: list[float], counts: list[int],
                entropy: list[float], applied: list[bool]) -> None:
        for r, (v, i) in enumerate(zip(vals.tolist(), ids.tolist())):
            self.rows[r].append({"name": name, "top_ids": i, "top_probs": v, "kept_mass": kept_mass[r],
                                 "kept_count": counts[r], "entropy": entropy[r], "applied": applied[r]})


class Sampler:
    def __init__(self, stage_order: Sequence[str] = STAGES) -> None:
        if sorted(stage_order) != sorted(STAGES):
            raise ValueError(f"stage_order must be a permutation of {STAGES}, got {tuple(stage_order)}")
        self.stage_order = tuple(stage_order)
        # an [R, V] buffer kept between steps: the raw log-softmax
        self._buffers: dict[str, torch.Tensor] = {}

    def release_buffers(self) -> None:
        """Drop the kept buffers (a server going idle: they come back with the next traced step)."""
        self._buffers.clear()

    def _buffer(self, slot: str, like: torch.Tensor) -> torch.Tensor:
        """A reused buffer shaped and typed as `like` (grown, never shrunk: at most the largest batch).
        What it holds is valid until the next call of this sampler."""
        s = self._buffers.get(slot)
        if s is None or s.numel() < like.numel() or s.dtype != like.dtype or s.device != like.device:
            s = self._buffers[slot] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        return s[: like.numel()].view(like.shape)

    def process(self, logits: torch.Tensor, info: SamplingBatchInfo,
                recorder: StageRecorder | None = None) -> torch.Tensor:
        """Final logits `[R, V]` after every stage, in this sampler's order; removed tokens are -inf."""
        x = logits.float().clone()
        for stage in self.stage_order:
            x = _STAGE_FNS[stage](x, info)
            if recorder is not None:
                recorder.record(stage, x)
        return x

    def probs(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The distribution each row samples from `[R, V]` (greedy rows: one-hot at the argmax)."""
        return self._final_probs(self.process(logits, info), info)

    @staticmethod
    def _final_probs(final: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = torch.softmax(final, dim=-1)
        if bool(info.greedy.any()):
            rows = _rows(info.greedy)
            one_hot = torch.zeros_like(probs[rows]).scatter_(1, first_argmax(final[rows])[:, None], 1.0)
            probs[rows] = one_hot
        return probs

    def draw(self, probs: torch.Tensor, info: SamplingBatchInfo,
             u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse-CDF draw per row; returns `(ids [R] int64, u [R] float64)` (u NaN for greedy rows)."""
        if u is None:
            u = self.uniforms(info)
        u = u.to(torch.float64).cpu()
        # the float64 cumsum formula (kernels/sampling.draw_formula), by the native kernel where it was found
        # to give the same ids on this CPU; rows it leaves (NaN) and CPUs without it take the formula
        ids = sampling.sample_draw(probs.detach(), u)
        if ids is None:
            ids = draw_formula(probs, u)
        elif bool((ids < 0).any()):
            left = _rows(ids < 0)
            ids[left] = draw_formula(probs[left], u[left])
        # float rounding at the top end could land past the last kept token: take the last kept one
        bad = _rows(probs.detach().cpu().gather(1, ids[:, None])[:, 0] <= 0)
        for r in bad.tolist():
            ids[r] = int(_rows(probs[r].cpu() > 0)[-1])
        greedy = info.greedy.cpu()
        if bool(greedy.any()):
            ids = torch.where(greedy, first_argmax(probs.detach().cpu()), ids)
        return ids.to(probs.device), u

    @staticmethod
    def uniforms(info: SamplingBatchInfo) -> torch.Tensor:
        """One uniform in [0, 1) per row: seeded rows from their request's generator (in row order),
        the rest from torch's global generator; greedy rows get NaN and consume nothing. A request
        given recorded draws (`Req.draws`, Engine.use_draws: a fork re-executing its parent) takes
        the recorded one at each output position that has one; a seeded request still advances its
        generator there, so positions past the recorded ones continue the parent's stream."""
        u = torch.full((len(info.reqs),), math.nan, dtype=torch.float64)
        unseeded = []
        for r, req in enumerate(info.reqs):
            if req.params.temperature == 0:
                continue
            recorded = req.draws.get(len(req.output_ids) + len(info.prefixes[r])) if req.draws else None
            if req.generator is not None:
                u[r] = torch.rand((), generator=req.generator, dtype=torch.float64)
            elif recorded is None:
                unseeded.append(r)
            if recorded is not None:
                u[r] = recorded
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
        return u

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo, trace_topk: int = 0) -> SamplerOutput:
        """Sample one token per row of `logits` `[R, V]`; record stages when `trace_topk > 0`."""
        logits = logits.float()
        rows = logits.shape[0]
        if not (trace_topk or info.wants_logprobs or info.needs_stages):
            # untraced greedy rows nobody asked logprobs of: the argmax is all (as vLLM does)
            ids, forced = _force(first_argmax(logits), info)
            return SamplerOutput(ids.tolist(), [math.nan] * rows, [0] * rows, [[] for _ in range(rows)],
                                 [None] * rows, None, None, [{} for _ in range(rows)], forced)
        k = min(trace_topk, logits.shape[-1]) if rows else 0
        staged = info.needs_stages or (k > 0 and info.any_stage_applied())
        if k and not staged and not info.need_top_logprobs and not any(info.token_ids_logprob) \
                and not any(req.forced_tokens for req in info.reqs):
            # a traced batch of greedy rows that asks for no more than each pick's logprob: the
            # native pass records without storing the [R, V] log-softmax (its logprobs at the few
            # indices the trace shows come from each row's maximum and log-sum: sampling.lp_at)
            native = sampling.log_softmax(logits, None, k)
            if native is not None:
                return self._traced_argmax(logits, info, k, native)
        raw_lp = self._buffer("raw_logprobs", logits)
        # the log-softmax and each row's argmax (and, traced, the record of the model's distribution)
        # in one native pass per row where it was found identical to torch's ops (kernels/sampling.py)
        native = sampling.log_softmax(logits, raw_lp, k)
        if native is None:
            torch.log_softmax(logits, dim=-1, out=raw_lp)
        recorder = StageRecorder(trace_topk, logits, info, raw_lp, native[1] if native is not None else None) \
            if k else None
        if staged:
            final = self.process(logits, info, recorder)
            ids, u = self.draw(self._final_probs(final, info), info)
            draws = [None if math.isnan(x) else x for x in u.tolist()]
        else:  # every row greedy and no stage touches any row: the argmax of the raw logits
            final, ids, draws = None, native[0] if native is not None else first_argmax(logits), [None] * rows
            for stage in self.stage_order if recorder is not None else ():
                recorder.record(stage, logits)  # applies to no row: repeats the logits record
        ids, forced = _force(ids, info)
        lp = raw_lp
        if final is not None and bool(info.processed.any()):
            lp = torch.where(info.processed[:, None], torch.log_softmax(final, dim=-1), raw_lp)
        # rows that took the argmax of the logits `lp` comes from have rank 1 (token_logprobs says why)
        argmax_rows = [r for r in range(rows) if r not in forced] if final is None else ()
        facts = lp_mod.token_logprobs(lp, ids, info.need_top_logprobs, info.token_ids_logprob, argmax_rows)
        return SamplerOutput(ids.tolist(), facts.logprobs, facts.ranks, facts.top, draws,
                             recorder.rows if recorder is not None else None, raw_lp, facts.token_ids, forced,
                             recorder.model_ids if recorder is not None else None)

    def _traced_argmax(self, logits: torch.Tensor, info: SamplingBatchInfo, k: int,
                       native: tuple[torch.Tensor, sampling.Record | None, torch.Tensor]) -> SamplerOutput:
        """`__call__` for a traced batch of greedy rows that no stage touches, asking no top or named
        logprobs, none forced, from the native pass that stored no log-softmax: each row takes its
        argmax (rank 1), its logprob from the row's stats, and the model's record."""
        rows = logits.shape[0]
        ids, record, stats = native
        recorder = StageRecorder(k, logits, info, None, record)
        for stage in self.stage_order:
            recorder.record(stage, logits)  # applies to no row: repeats the logits record
        picked = sampling.lp_at(logits, stats, ids[:, None])[:, 0]
        return SamplerOutput(ids.tolist(), picked.tolist(), [1] * rows, [[] for _ in range(rows)], [None] * rows,
                             recorder.rows, None, [{} for _ in range(rows)], [], recorder.model_ids,
                             (logits, stats))
