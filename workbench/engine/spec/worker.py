"""The speculative step: draft, verify all k+1 positions in one target forward, commit, roll back.

Owns: `SpecWorker`, which `Engine.step()` calls for pure-DECODE batches when `spec=` is set. Per
step: plan how many tokens each request may draft (its sampling stages supported, tokens left,
context, free KV), let the drafter propose, run one `TARGET_VERIFY` forward through the target's
ModelRunner (rows `[last token] + drafts`), verify each request (greedy prefix / rejection
sampling), cut the accepted run at a stop token or `max_new_tokens`, free the KV slots of every
rejected (or cut) draft at once, and hand the tokens to the engine's output path. Requests with no
draft this step run as plain decode rows of the same forward, through the engine's Sampler. Also
keeps the engine-level metrics. Does not own: drafting (spec_drafters.py), the acceptance rule
(spec_verify.py) or the detokenizer / finish rules (the engine's output path).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from workbench.engine import tracing
from workbench.engine.output.output import StepOutput
from workbench.engine.run.forward_batch import ForwardBatch, ForwardMode, RowSpec, build_forward_batch
from workbench.engine.sample.logprobs import token_logprobs
from workbench.engine.sample.sampler import SamplingBatchInfo
from workbench.engine.sched.request import Req
from workbench.engine.spec import trace as spec_trace
from workbench.engine.spec.config import SpecConfig, SpecStats
from workbench.engine.spec.drafters import Draft, Drafter, token_rows
from workbench.engine.spec.verify import (
    AcceptRule,
    VerifyResult,
    leviathan_accept,
    sampler_draw,
    verify_greedy,
    verify_sampled,
)

if TYPE_CHECKING:
    from workbench.engine.engine import Engine
    from workbench.engine.sched.scheduler import ScheduleBatch


@dataclass(slots=True)
class SpecTokens:
    """The tokens one verification appends, shaped like SamplerOutput for `OutputProcessor.append_tokens`."""

    next_token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    token_ids_logprobs: list[dict[int, float]]
    sources: list[str]  # spec_accept | spec_recover | spec_bonus


class SpecWorker:
    def __init__(self, cfg: SpecConfig, engine: Engine, drafter: Drafter) -> None:
        self.cfg = cfg
        self.engine = engine
        self.drafter = drafter
        self.accept_rule: AcceptRule = leviathan_accept  # injectable: tests prove a wrong rule is caught
        self.totals = SpecStats()
        self.verify_steps = 0
        self.draft_forwards = 0
        self.draft_s = 0.0
        self.verify_s = 0.0

    # --- hooks the engine calls ----------------------------------------------------------

    def on_extend(self, batch: ScheduleBatch) -> None:
        """After the target's EXTEND/MIXED forward: prefill the drafter alongside (draft model only)."""
        self.drafter.forwards = []
        self.drafter.on_extend(batch)
        self._trace_draft_forwards()

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

    def step(self, batch: ScheduleBatch) -> list[StepOutput]:
        eng = self.engine
        reqs = list(batch.decode)
        t0 = time.perf_counter()
        self.drafter.forwards = []
        drafts = self.drafter.propose(reqs, self.drafter.limit(reqs, self._plan(reqs)))
        self.draft_s += time.perf_counter() - t0
        self._trace_draft_forwards()
        spec = [(r, d) for r, d in zip(reqs, drafts) if d.tokens]
        plain = [r for r, d in zip(reqs, drafts) if not d.tokens]
        if eng.tracer.on:
            for req, draft in spec:
                spec_trace.emit_draft(eng, req, self.drafter.name, draft)
        t1 = time.perf_counter()
        fb, logits = self._verify_forward(spec, plain)
        t2 = time.perf_counter()
        split = sum(len(d.tokens) + 1 for _, d in spec)
        new_tokens = self._decode_plain(plain, logits[split:])
        new_tokens.update(self._verify(spec, logits[:split]))
        t3 = time.perf_counter()
        # the request's stage clock: drafting and the verify forward count as forward, verification as sample
        eng.clock.forward_end, eng.clock.sampled = t2, t3
        self.verify_s += t3 - t1
        self.verify_steps += bool(spec)
        if eng.tracer.on:
            eng.tracer.emit(tracing.forward_done_event(eng, fb, t2 - t1, t3 - t2))
        return eng._process_outputs(reqs, new_tokens)

    def _plan(self, reqs: list[Req]) -> list[int]:
        """Draft tokens each request may propose: k, cut to its remaining tokens, context and free KV
        (each request's decode slot comes first; the k+1 verify slots are taken greedily)."""
        eng = self.engine
        free = eng.memory.allocator.available_size() - len(reqs)
        ks = []
        for req in reqs:
            k = max(0, min(self.cfg.num_speculative_tokens, req.params.max_new_tokens - len(req.output_ids) - 1,
                           eng.runner.max_context_len - req.seq_len - 1, free))
            free -= k
            ks.append(k)
        return ks

    def _verify_forward(self, spec: list[tuple[Req, Draft]], plain: list[Req]) -> tuple[ForwardBatch, torch.Tensor]:
        """One target forward over `[last] + drafts` of every drafted request, then the plain decodes.

        Each verified position is packed as its own one-token row (see `token_rows`), so the whole
        verify batch takes the batched decode attention path."""
        eng = self.engine
        rows, row_reqs = [], []
        for r, d in spec:
            rows += token_rows(r.req_id, r.req_pool_idx, r.kv_len, [r.fill_ids[-1]] + d.tokens, len(d.tokens) + 1)
            row_reqs += [r] * (len(d.tokens) + 1)
        rows += [RowSpec(r.req_id, r.req_pool_idx, r.kv_len, [r.fill_ids[-1]], 1) for r in plain]
        row_reqs += plain
        mode = ForwardMode.TARGET_VERIFY if spec else ForwardMode.DECODE
        fb = eng._step_fb = build_forward_batch(mode, rows, eng.memory, eng.device)
        if eng.tracer.on:  # the per-row sampling summary of the trace (verification builds its own)
            prefixes = [d.tokens[:i] for _, d in spec for i in range(len(d.tokens) + 1)] + [[] for _ in plain]
            fb.sampling_info = SamplingBatchInfo.build([row_reqs[i] for i in fb.logits_owner], eng.vocab_size,
                                                       eng.device, eos_token_ids=eng.outputs.eos_token_ids,
                                                       prefixes=prefixes)
            eng.tracer.emit(tracing.forward_batch_event(eng, fb))
        logits = eng.runner.forward(fb)  # [sum(k_i + 1) + len(plain), vocab]
        for req in row_reqs:
            req.kv_len += 1
        eng._step_kv_counted = True
        return fb, logits

    def _decode_plain(self, plain: list[Req], logits: torch.Tensor) -> dict[str, list[int]]:
        """Requests without drafts this step: exactly the engine's normal decode sampling."""
        if not plain:
            return {}
        eng = self.engine
        info = SamplingBatchInfo.build(plain, eng.vocab_size, eng.device, eos_token_ids=eng.outputs.eos_token_ids)
        sample = eng.sampler(logits, info, eng.trace_topk if eng.tracer.on else 0)
        if eng.tracer.on:
            tracing.emit_sampling(eng, plain, logits, sample)
        eng.outputs.append_tokens(plain, sample, eng.step_no)
        return {req.req_id: [tok] for req, tok in zip(plain, sample.next_token_ids)}

    def _verify(self, spec: list[tuple[Req, Draft]], logits: torch.Tensor) -> dict[str, list[int]]:
        """Verify every drafted request against its k+1 target rows and commit the result.

        Each row is sampled for its request with the drafts before that position as prefix, so p is
        the distribution the request would sample from there (penalties, grammar, filters)."""
        if not spec:
            return {}
        eng = self.engine
        info = SamplingBatchInfo.build([r for r, d in spec for _ in range(len(d.tokens) + 1)], eng.vocab_size,
                                       eng.device, eos_token_ids=eng.outputs.eos_token_ids,
                                       prefixes=[d.tokens[:i] for _, d in spec for i in range(len(d.tokens) + 1)])
        final = eng.sampler.process(logits, info)  # [S, V], removed tokens -inf
        probs = torch.softmax(final, dim=-1)
        raw_lp = torch.log_softmax(logits.float(), dim=-1)
        lp = torch.where(info.processed[:, None], torch.log_softmax(final, dim=-1), raw_lp)
        argmax = final.argmax(dim=-1).tolist()  # a greedy row's token
        sampled = [r for r, _ in spec if r.params.temperature != 0]
        draw = sampler_draw(eng.sampler, SamplingBatchInfo.build(sampled[:1], eng.vocab_size, eng.device)) \
            if sampled else None
        out, o = {}, 0
        for req, d in spec:
            k = len(d.tokens)
            rows = slice(o, o + k + 1)
            if req.params.temperature == 0:
                p = raw_lp[torch.arange(o, o + k), torch.tensor(d.tokens)].exp().tolist()
                res = verify_greedy(d.tokens, d.q, argmax[rows], p)
            else:
                res = verify_sampled(req, d.tokens, d.q, d.q_dist, probs[rows], argmax[rows], draw,
                                     self.accept_rule)
            out[req.req_id] = self._commit(req, res, logits[rows], raw_lp[rows], lp[rows])
            o += k + 1
        return out

    def _commit(self, req: Req, res: VerifyResult, logits: torch.Tensor, raw_lp: torch.Tensor,
                lp: torch.Tensor) -> list[int]:
        """Cut the run at a finish, free the KV of what is not kept, append the tokens; return them."""
        eng = self.engine
        k = len(res.draft_tokens)
        tokens = res.tokens[: self._cut(req, res.tokens)]
        m = len(tokens)
        base = req.kv_len - (k + 1)  # KV length before this verify
        keep = base + m  # [last] and the accepted drafts before the final token stay
        freed = eng.memory.req_to_token_pool.req_to_token[req.req_pool_idx, keep:req.kv_len].cpu()
        position = len(req.output_ids)
        eng.memory.allocator.free(freed)
        if eng.tracer.on and freed.numel():
            eng.tracer.emit(tracing.kv_event(eng, req.req_id, "rollback", freed.tolist(), "spec: rejected drafts"))
        req.kv_len = keep
        draft_freed = self.drafter.after_verify(req)
        if req.spec_stats is None:
            req.spec_stats = SpecStats()
        req.spec_stats.record(res.accepted, m)
        self.totals.record(res.accepted, m)
        chosen = _token_records(req, tokens, res, lp, eng.trace_topk if eng.tracer.on else 0)
        if eng.tracer.on:
            spec_trace.emit_verify(eng, req, res, position, tokens, freed.tolist(), draft_freed)
            spec_trace.emit_tokens(eng, req, position, logits, raw_lp, chosen)
        eng.outputs.append_tokens([req] * m, chosen, eng.step_no)
        return tokens

    def _cut(self, req: Req, tokens: list[int]) -> int:
        """How many of `tokens` to append: through the first that ends the request (finish.py's rules:
        max_new_tokens or the context limit; EOS unless ignore_eos, stop_token_ids, a grammar's stop
        token, none while at most min_new_tokens tokens exist). Stop strings are the detokenizer's."""
        p, outputs = req.params, self.engine.outputs
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(outputs.eos_token_ids))
        if req.grammar is not None:
            stops |= set(req.grammar.stop_token_ids)
        for j, tok in enumerate(tokens):
            count = len(req.output_ids) + j + 1
            if count >= p.max_new_tokens or req.seq_len + j + 1 >= outputs.context_limit:
                return j + 1
            if count > p.min_new_tokens and tok in stops:
                return j + 1
        return len(tokens)

    def _trace_draft_forwards(self) -> None:
        forwards, self.drafter.forwards = self.drafter.forwards, []
        self.draft_forwards += len(forwards)
        if self.engine.tracer.on:
            for f in forwards:
                spec_trace.emit_draft_forward(self.engine, f.fb, f.seconds)


def _token_records(req: Req, tokens: list[int], res: VerifyResult, lp: torch.Tensor, trace_k: int
                   ) -> SpecTokens:
    """Logprob (in the request's logprobs_mode), rank and top alternatives of each appended token;
    row j of the target's rows chose token j."""
    m = len(tokens)
    p = req.params
    facts = token_logprobs(lp[:m], torch.tensor(tokens), max(p.top_logprobs, trace_k),
                           [tuple(p.token_ids_logprob)] * m)
    n = res.num_accepted
    sources = ["spec_accept" if j < n else ("spec_bonus" if res.extra_kind == "bonus" else "spec_recover")
               for j in range(m)]
    return SpecTokens(list(tokens), facts.logprobs, facts.ranks, facts.top, facts.token_ids, sources)
