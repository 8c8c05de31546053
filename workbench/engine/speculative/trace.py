"""The speculative step's trace seams (drafted, verified, tokens committed, draft forwards), reported
through the step's `TraceObserver`; each is a no-op while the tracer is off.

Owns: building `SpecDraft`, `SpecVerify`, the drafter's ForwardBatchBuilt/ForwardDone (model
"draft") and, per appended token, `Logits` and `TokenChosen` with source spec_accept / spec_recover /
spec_bonus. Does not own: the schema (trace/events.py) or the engine's other seams (tracing.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from workbench.engine import tracing
from workbench.trace import events as ev

if TYPE_CHECKING:
    from workbench.engine.run.forward_batch import ForwardBatch
    from workbench.engine.sched.request import Req
    from workbench.engine.speculative.drafters import Draft
    from workbench.engine.speculative.verify import VerifyResult
    from workbench.engine.step import StepContext


def draft_forward(ctx: StepContext, fb: ForwardBatch, seconds: float) -> None:
    ctx.obs.batch_built(ctx, fb, model="draft")
    ctx.obs.forward_done(ctx, fb, seconds, 0.0, model="draft")


def drafted(ctx: StepContext, req: Req, drafter: str, draft: Draft) -> None:
    obs = ctx.obs
    if not obs.on:
        return
    obs.emit(ev.SpecDraft(
        step=ctx.step, req_id=req.req_id, t=tracing._now(), drafter=drafter, tokens=list(draft.tokens),
        q=list(draft.q), texts=[obs.token_text(t) for t in draft.tokens], position=len(req.output_ids)))


def verified(ctx: StepContext, req: Req, res: VerifyResult, position: int, emitted: list[int],
             freed: torch.Tensor, draft_freed: list[int]) -> None:
    if not ctx.obs.on:
        return
    ctx.obs.emit(ev.SpecVerify(
        step=ctx.step, req_id=req.req_id, t=tracing._now(), draft_tokens=list(res.draft_tokens),
        p=list(res.p), q=list(res.q), u=list(res.u), accepted=list(res.accepted), num_accepted=res.num_accepted,
        extra_token=res.extra_token, extra_kind=res.extra_kind, target_argmax=list(res.target_argmax),
        freed_slots=freed.tolist(), greedy=res.greedy, position=position, emitted=list(emitted),
        extra_draw=res.extra_draw, draft_freed_slots=list(draft_freed)))


def committed(ctx: StepContext, req: Req, position: int, logits: torch.Tensor, raw_lp: torch.Tensor,
              chosen: Any) -> None:
    """A Logits and a TokenChosen event for every token the verification appends (row j chose token j)."""
    obs = ctx.obs
    if not obs.on:
        return
    k = obs.trace_topk
    step, t = ctx.step, tracing._now()
    m = len(chosen.next_token_ids)
    top_vals, top_ids = logits[:m].topk(min(k, logits.shape[-1]), dim=-1)
    entropy = (-(raw_lp[:m].exp() * raw_lp[:m]).nan_to_num().sum(-1)).tolist()
    text = obs.token_text
    for j, tok in enumerate(chosen.next_token_ids):
        tensor_name = None
        if obs.tracer.full:
            tensor_name = f"logits/{step}/{req.req_id}/{position + j}"
            obs.tracer.tensor(tensor_name, step, req.req_id, logits[j].float().cpu().numpy())
        obs.emit(ev.Logits(step=step, req_id=req.req_id, t=t, position=position + j,
                           top_ids=top_ids[j].tolist(), top_logits=top_vals[j].tolist(),
                           entropy=float(entropy[j]), tensor=tensor_name))
        tops = [[tid, lp, text(tid)] for tid, lp in chosen.top_logprobs[j][:k]]
        obs.emit(ev.TokenChosen(
            step=step, req_id=req.req_id, t=t, position=position + j, token_id=tok, text=text(tok),
            logprob=tracing._finite(chosen.logprobs[j]), rank=chosen.ranks[j], top_logprobs=tops,
            source=chosen.sources[j]))
