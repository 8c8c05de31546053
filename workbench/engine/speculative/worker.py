"""The speculative step: draft, verify all k+1 positions in one target forward, commit, roll back.

Owns: `SpecWorker`, which `Engine.step()` calls for pure-DECODE batches when `spec=` is set. Per
step: plan how many tokens each request may draft (its sampling stages supported, tokens left,
context, free KV), let the drafter propose, run one `TARGET_VERIFY` forward through the target's
ModelRunner (rows `[last token] + drafts`), verify each request (greedy prefix / rejection
sampling), cut the accepted run where the output stage's finish rules end it, free the KV slots of
every rejected (or cut) draft at once, and hand the tokens to the output stage. Requests with no
draft this step run as plain decode rows of the same forward, through the target's Sampler. Also
keeps the engine-level metrics. It is given the target's parts (`Target`) and the output stage;
the step's state lives in the `StepContext` it is handed. Does not own: drafting (drafters.py), the
acceptance rule (verify.py) or the detokenizer / finish rules (the output stage).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workbench.engine.output.output import StepOutput
from workbench.engine.output.stage import NewTokens, OutputStage
from workbench.engine.run.forward_batch import ForwardBatch, ForwardMode, RowSpec, build_forward_batch
from workbench.engine.sample.logprobs import token_logprobs
from workbench.engine.sample.sampler import SamplingBatchInfo
from workbench.engine.sched.request import Req
from workbench.engine.speculative import trace as spec_trace
from workbench.engine.speculative.config import SpecConfig, SpecStats, Target, parse_spec
from workbench.engine.speculative.drafters import Draft, Drafter, make_drafter, token_rows
from workbench.engine.speculative.verify import (
    AcceptRule,
    VerifyResult,
    leviathan_accept,
    sampler_draw,
    verify_greedy,
    verify_sampled,
)

if TYPE_CHECKING:
    from workbench.engine.sched.batch import ScheduleBatch
    from workbench.engine.step import StepContext


@dataclass(slots=True)
class SpecTokens:
    """The tokens one verification appends, shaped like SamplerOutput for `OutputStage.append`."""

    next_token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    token_ids_logprobs: list[dict[int, float]]
    sources: list[str]  # spec_accept | spec_recover | spec_bonus | forced


def make_spec_worker(spec: str | dict[str, Any] | SpecConfig, target: Target, outputs: OutputStage) -> SpecWorker:
    """Parse `spec` (see `parse_spec`) and build its drafter and worker for `target`."""
    cfg = parse_spec(spec)
    return SpecWorker(cfg, make_drafter(cfg, target), target, outputs)


class SpecWorker:
    def __init__(self, cfg: SpecConfig, drafter: Drafter, target: Target, outputs: OutputStage) -> None:
        self.cfg = cfg
        self.drafter = drafter
        self.target = target
        self.outputs = outputs
        self.accept_rule: AcceptRule = leviathan_accept  # injectable: tests prove a wrong rule is caught
        self.totals = SpecStats()
        self.verify_steps = 0
        self.draft_forwards = 0
        self.draft_s = 0.0
        self.verify_s = 0.0

    # --- hooks the engine calls ----------------------------------------------------------

    def on_extend(self, ctx: StepContext, batch: ScheduleBatch) -> None:
        """After the target's EXTEND/MIXED forward: prefill the drafter alongside (draft model only)."""
        self.drafter.forwards = []
        self.drafter.on_extend(batch)
        self._report_draft_forwards(ctx)

    def release(self, req: Req) -> None:
        """The request finished or was preempted: drop whatever the drafter holds for it."""
        self.drafter.release(req)

    def metrics(self) -> dict[str, Any]:
        out = self.totals.to_dict()
        out.update(method=self.cfg.method, drafter=self.drafter.name,
                   num_speculative_tokens=self.cfg.num_speculative_tokens, verify_steps=self.verify_steps,
                   draft_forwards=self.draft_forwards, draft_s=self.draft_s, verify_s=self.verify_s)
        return out

    # --- the step ------------------------------------------------------------------------

    def step(self, ctx: StepContext, batch: ScheduleBatch) -> list[StepOutput]:
        reqs = list(batch.decode)
        t0 = time.perf_counter()
        self.drafter.forwards = []
        drafts = self.drafter.propose(reqs, self.drafter.limit(reqs, self._plan(reqs)))
        self.draft_s += time.perf_counter() - t0
        self._report_draft_forwards(ctx)
        spec = [(r, d) for r, d in zip(reqs, drafts) if d.tokens]
        plain = [r for r, d in zip(reqs, drafts) if not d.tokens]
        for req, draft in spec:
            spec_trace.drafted(ctx, req, self.drafter.name, draft)
        t1 = time.perf_counter()
        fb, logits = self._verify_forward(ctx, spec, plain)
        t2 = time.perf_counter()
        split = sum(len(d.tokens) + 1 for _, d in spec)
        new = self._decode_plain(ctx, plain, logits[split:]) + self._verify(ctx, spec, logits[:split])
        t3 = time.perf_counter()
        # the request's stage clock: drafting and the verify forward count as forward, verification as sample
        ctx.clock.forward_end, ctx.clock.sampled = t2, t3
        self.verify_s += t3 - t1
        self.verify_steps += bool(spec)
        ctx.obs.forward_done(ctx, fb, t2 - t1, t3 - t2)
        by_req = {id(n.req): n for n in new}
        return self.outputs.process(ctx, [by_req[id(r)] for r in reqs])

    def _plan(self, reqs: list[Req]) -> list[int]:
        """Draft tokens each request may propose: k, cut to its remaining tokens, context and free KV
        (each request's decode slot comes first; the k+1 verify slots are taken greedily)."""
        free = self.target.memory.allocator.available_size() - len(reqs)
        max_ctx = self.target.runner.max_context_len
        ks = []
        for req in reqs:
            k = max(0, min(self.cfg.num_speculative_tokens, req.params.max_new_tokens - len(req.output_ids) - 1,
                           max_ctx - req.seq_len - 1, free))
            free -= k
            ks.append(k)
        return ks

    def _verify_forward(self, ctx: StepContext, spec: list[tuple[Req, Draft]], plain: list[Req]
                        ) -> tuple[ForwardBatch, torch.Tensor]:
        """One target forward over `[last] + drafts` of every drafted request, then the plain decodes.

        Each verified position is packed as its own one-token row (see `token_rows`), so the whole
        verify batch takes the batched decode attention path."""
        t = self.target
        rows, row_reqs = [], []
        for r, d in spec:
            rows += token_rows(r.req_id, r.req_pool_idx, r.kv_len, [r.fill_ids[-1]] + d.tokens, len(d.tokens) + 1)
            row_reqs += [r] * (len(d.tokens) + 1)
        rows += [RowSpec(r.req_id, r.req_pool_idx, r.kv_len, [r.fill_ids[-1]], 1) for r in plain]
        row_reqs += plain
        mode = ForwardMode.TARGET_VERIFY if spec else ForwardMode.DECODE
        fb = ctx.fb = build_forward_batch(mode, rows, t.memory, t.device)

        def sampling() -> SamplingBatchInfo:  # the trace's per-row summary (verification builds its own)
            prefixes = [d.tokens[:i] for _, d in spec for i in range(len(d.tokens) + 1)] + [[] for _ in plain]
            return SamplingBatchInfo.build([row_reqs[i] for i in fb.logits_owner], t.vocab_size, t.device,
                                           eos_token_ids=t.eos_token_ids, prefixes=prefixes)

        ctx.obs.batch_built(ctx, fb, sampling=sampling)
        logits = t.runner.forward(fb)  # [sum(k_i + 1) + len(plain), vocab]
        for req in row_reqs:
            req.kv_len += 1
        ctx.kv_counted = True
        return fb, logits

    def _decode_plain(self, ctx: StepContext, plain: list[Req], logits: torch.Tensor) -> list[NewTokens]:
        """Requests without drafts this step: exactly the engine's normal decode sampling."""
        if not plain:
            return []
        t = self.target
        info = SamplingBatchInfo.build(plain, t.vocab_size, t.device, eos_token_ids=t.eos_token_ids)
        sample = t.sampler(logits, info, ctx.obs.topk)
        ctx.obs.sampled(ctx, plain, logits, sample)
        self.outputs.append(ctx, plain, sample)
        return [NewTokens(req, [tok]) for req, tok in zip(plain, sample.next_token_ids)]

    def _verify(self, ctx: StepContext, spec: list[tuple[Req, Draft]], logits: torch.Tensor) -> list[NewTokens]:
        """Verify every drafted request against its k+1 target rows and commit the result.

        Each row is sampled for its request with the drafts before that position as prefix, so p is
        the distribution the request would sample from there (penalties, grammar, filters)."""
        if not spec:
            return []
        t = self.target
        info = SamplingBatchInfo.build([r for r, d in spec for _ in range(len(d.tokens) + 1)], t.vocab_size,
                                       t.device, eos_token_ids=t.eos_token_ids,
                                       prefixes=[d.tokens[:i] for _, d in spec for i in range(len(d.tokens) + 1)])
        final = t.sampler.process(logits, info)  # [S, V], removed tokens -inf
        probs = torch.softmax(final, dim=-1)
        raw_lp = torch.log_softmax(logits.float(), dim=-1)
        lp = torch.where(info.processed[:, None], torch.log_softmax(final, dim=-1), raw_lp)
        argmax = final.argmax(dim=-1).tolist()  # a greedy row's token
        sampled = [r for r, _ in spec if r.params.temperature != 0]
        draw = sampler_draw(t.sampler, SamplingBatchInfo.build(sampled[:1], t.vocab_size, t.device)) \
            if sampled else None
        out, o = [], 0
        for req, d in spec:
            k = len(d.tokens)
            rows = slice(o, o + k + 1)
            if req.params.temperature == 0:
                p = raw_lp[torch.arange(o, o + k), torch.tensor(d.tokens)].exp().tolist()
                res = verify_greedy(d.tokens, d.q, argmax[rows], p)
            else:
                res = verify_sampled(req, d.tokens, d.q, d.q_dist, probs[rows], argmax[rows], draw,
                                     self.accept_rule)
            out.append(NewTokens(req, self._commit(ctx, req, res, logits[rows], raw_lp[rows], lp[rows])))
            o += k + 1
        return out

    def _commit(self, ctx: StepContext, req: Req, res: VerifyResult, logits: torch.Tensor, raw_lp: torch.Tensor,
                lp: torch.Tensor) -> list[int]:
        """Cut the run at a finish, free the KV of what is not kept, append the tokens; return them."""
        memory = self.target.memory
        k = len(res.draft_tokens)
        position = len(req.output_ids)
        tokens, forced_at = _apply_forced(req, position, res.tokens)
        tokens = tokens[: self.outputs.finish_index(req, tokens)]
        m = len(tokens)
        base = req.kv_len - (k + 1)  # KV length before this verify
        keep = base + m  # [last] and the accepted drafts before the final token stay
        freed = memory.req_to_token_pool.req_to_token[req.req_pool_idx, keep:req.kv_len].cpu()
        memory.allocator.free(freed)
        if freed.numel():
            ctx.obs.kv(ctx, req.req_id, "rollback", freed.tolist(), "spec: rejected drafts")
        req.kv_len = keep
        draft_freed = self.drafter.after_verify(req)
        if req.spec_stats is None:
            req.spec_stats = SpecStats()
        req.spec_stats.record(res.accepted, m)
        self.totals.record(res.accepted, m)
        chosen = _token_records(req, tokens, res, lp, ctx.obs.topk, forced_at)
        spec_trace.verified(ctx, req, res, position, tokens, freed, draft_freed)
        spec_trace.committed(ctx, req, position, logits, raw_lp, chosen)
        self.outputs.append(ctx, [req] * m, chosen)
        return tokens

    def _report_draft_forwards(self, ctx: StepContext) -> None:
        forwards, self.drafter.forwards = self.drafter.forwards, []
        self.draft_forwards += len(forwards)
        for f in forwards:
            spec_trace.draft_forward(ctx, f.fb, f.seconds)


def _apply_forced(req: Req, position: int, tokens: list[int]) -> tuple[list[int], int | None]:
    """The verified run with a forced token (Engine.force_token) in place: the run is cut after the
    forced position and the token there replaced, so what follows is decided from the forced token,
    as in a step without speculation. Returns the tokens and the index of the forced one (or None)."""
    if req.forced_tokens:
        for j in range(len(tokens)):
            if (forced := req.forced_tokens.get(position + j)) is not None:
                return [*tokens[:j], forced], j
    return tokens, None


def _token_records(req: Req, tokens: list[int], res: VerifyResult, lp: torch.Tensor, trace_k: int,
                   forced_at: int | None = None) -> SpecTokens:
    """Logprob (in the request's logprobs_mode), rank and top alternatives of each appended token;
    row j of the target's rows chose token j (a forced token is scored where it was forced)."""
    m = len(tokens)
    p = req.params
    facts = token_logprobs(lp[:m], torch.tensor(tokens), max(p.top_logprobs, trace_k),
                           [tuple(p.token_ids_logprob)] * m)
    n = res.num_accepted
    sources = ["forced" if j == forced_at else
               "spec_accept" if j < n else ("spec_bonus" if res.extra_kind == "bonus" else "spec_recover")
               for j in range(m)]
    return SpecTokens(list(tokens), facts.logprobs, facts.ranks, facts.top, facts.token_ids, sources)
