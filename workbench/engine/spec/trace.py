"""Trace events of the speculative step (called by the spec worker, part of `Engine.step()`, only when
`tracer.on`).

Owns: building `SpecDraft`, `SpecVerify`, the drafter's ForwardBatchBuilt/ForwardDone (model
"draft") and, per appended token, `Logits` and `TokenChosen` with source spec_accept / spec_recover /
spec_bonus. Does not own: the schema (trace/events.py) or the engine's other events (tracing.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from workbench.engine import tracing
from workbench.trace import events as ev

if TYPE_CHECKING:
    from workbench.engine.engine import Engine
    from workbench.engine.run.forward_batch import ForwardBatch
    from workbench.engine.sched.request import Req
    from workbench.engine.spec.drafters import Draft
    from workbench.engine.spec.verify import VerifyResult


def emit_draft_forward(engine: Engine, fb: ForwardBatch, seconds: float) -> None:
    engine.tracer.emit(tracing.forward_batch_event(engine, fb, model="draft"))
    engine.tracer.emit(tracing.forward_done_event(engine, fb, seconds, 0.0, model="draft"))


def emit_draft(engine: Engine, req: Req, drafter: str, draft: Draft) -> None:
    engine.tracer.emit(ev.SpecDraft(
        step=engine.step_no, req_id=req.req_id, t=tracing._now(), drafter=drafter, tokens=list(draft.tokens),
        q=list(draft.q), texts=[engine.outputs.token_text(t) for t in draft.tokens],
        position=len(req.output_ids)))


def emit_verify(engine: Engine, req: Req, res: VerifyResult, position: int, emitted: list[int],
                freed: list[int], draft_freed: list[int]) -> None:
    engine.tracer.emit(ev.SpecVerify(
        step=engine.step_no, req_id=req.req_id, t=tracing._now(), draft_tokens=list(res.draft_tokens),
        p=list(res.p), q=list(res.q), u=list(res.u), accepted=list(res.accepted), num_accepted=res.num_accepted,
        extra_token=res.extra_token, extra_kind=res.extra_kind, target_argmax=list(res.target_argmax),
        freed_slots=freed, greedy=res.greedy, position=position, emitted=list(emitted),
        extra_draw=res.extra_draw, draft_freed_slots=list(draft_freed)))


def emit_tokens(engine: Engine, req: Req, position: int, logits: torch.Tensor, raw_lp: torch.Tensor,
                chosen: Any) -> None:
    """A Logits and a TokenChosen event for every token the verification appends (row j chose token j)."""
    k = engine.trace_topk
    step, t = engine.step_no, tracing._now()
    m = len(chosen.next_token_ids)
    top_vals, top_ids = logits[:m].topk(min(k, logits.shape[-1]), dim=-1)
    entropy = (-(raw_lp[:m].exp() * raw_lp[:m]).nan_to_num().sum(-1)).tolist()
    text = engine.outputs.token_text
    for j, tok in enumerate(chosen.next_token_ids):
        tensor_name = None
        if engine.tracer.full:
            tensor_name = f"logits/{step}/{req.req_id}/{position + j}"
            engine.tracer.tensor(tensor_name, step, req.req_id, logits[j].float().cpu().numpy())
        engine.tracer.emit(ev.Logits(step=step, req_id=req.req_id, t=t, position=position + j,
                                     top_ids=top_ids[j].tolist(), top_logits=top_vals[j].tolist(),
                                     entropy=float(entropy[j]), tensor=tensor_name))
        tops = [[tid, lp, text(tid)] for tid, lp in chosen.top_logprobs[j][:k]]
        engine.tracer.emit(ev.TokenChosen(
            step=step, req_id=req.req_id, t=t, position=position + j, token_id=tok, text=text(tok),
            logprob=tracing._finite(chosen.logprobs[j]), rank=chosen.ranks[j], top_logprobs=tops,
            source=chosen.sources[j]))
