"""Builders that turn engine objects into trace events; called only from `Engine.step()` and its
helpers, and only when `tracer.on` (so level `off` never reaches this module).

Owns: the mapping from Req / ScheduleBatch / ForwardBatch / SamplerOutput / DetokUpdate /
FinishResult to the typed records of `workbench.trace.events`, and creating the tracer with its
sinks and run metadata. Does not own: the event schema (trace/events.py) or storage (trace/store.py).
"""

from __future__ import annotations

import math
import platform
import time
from typing import TYPE_CHECKING, Any

import torch

from workbench.trace import events as ev
from workbench.trace.recorder import MemorySink, Tracer

if TYPE_CHECKING:
    from workbench.engine.engine import Engine
    from workbench.engine.run.forward_batch import ForwardBatch
    from workbench.engine.sched.request import Req
    from workbench.engine.sched.scheduler import ScheduleBatch


def make_tracer(path: str | None, level: str, sinks: list | None, engine: Engine) -> Tracer:
    """A tracer writing to `path` (a .wbtrace file) and/or the given sinks; an in-memory sink when
    tracing is on without a file, so notebooks and tests can read what happened."""
    ev.level_value(level)
    all_sinks = list(sinks or [])
    if path is not None and level != "off":
        from workbench.trace.store import TraceWriter

        all_sinks.append(TraceWriter(path))
    elif level != "off" and not all_sinks:
        all_sinks.append(MemorySink())
    tracer = Tracer(level if all_sinks else "off", all_sinks)
    if tracer.on:
        for key, value in run_meta(engine, level).items():
            tracer.set_meta(key, value)
    return tracer


def run_meta(engine: Engine, level: str) -> dict[str, Any]:
    import transformers

    tok = engine.tokenizer
    return {
        "engine": engine.config,
        "model": engine.loaded.identity(),
        "tokenizer": {"name": getattr(tok, "name_or_path", ""), "vocab_size": len(tok),
                      "eos_token_id": tok.eos_token_id, "class": type(tok).__name__},
        "versions": {"workbench": "0.1.0", "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "trace_level": level,
        "created": time.time(),
    }


def _now() -> float:
    return time.perf_counter()


def request_added_event(engine: Engine, req: Req) -> ev.RequestAdded:
    return ev.RequestAdded(step=engine.step_no + 1, req_id=req.req_id, t=req.arrival_time, prompt=req.prompt,
                           prompt_ids=list(req.prompt_ids), params=req.params.to_dict(), parent_id=req.parent_id)


def schedule_event(engine: Engine, batch: ScheduleBatch) -> ev.ScheduleDecision:
    alloc = engine.memory.allocator
    return ev.ScheduleDecision(
        step=engine.step_no, t=_now(), mode=batch.mode.value,
        waiting=[r.req_id for r in engine.scheduler.waiting], running=[r.req_id for r in engine.scheduler.running],
        prefill=[{"req_id": c.req.req_id, "start": c.start, "length": c.length, "last_chunk": c.last_chunk}
                 for c in batch.prefill],
        decode=[r.req_id for r in batch.decode], preempted=[r.req_id for r in batch.preempted],
        token_budget=batch.token_budget, tokens_scheduled=batch.tokens_scheduled,
        kv_used=alloc.used(), kv_total=alloc.size)


def forward_batch_event(engine: Engine, fb: ForwardBatch, model: str = "target") -> ev.ForwardBatchBuilt:
    info = fb.sampling_info
    return ev.ForwardBatchBuilt(
        step=engine.step_no, t=_now(), forward_mode=fb.forward_mode.value, batch_size=fb.batch_size,
        input_ids=fb.input_ids.tolist(), req_pool_indices=fb.req_pool_indices.tolist(),
        seq_lens=fb.seq_lens.tolist(), out_cache_loc=fb.out_cache_loc.tolist(), positions=fb.positions.tolist(),
        extend_prefix_lens=fb.extend_prefix_lens.tolist(), extend_seq_lens=fb.extend_seq_lens.tolist(),
        return_logprob=fb.return_logprob, top_logprobs_nums=list(fb.top_logprobs_nums), req_ids=list(fb.req_ids),
        sampling_info=info.summary() if info is not None else [], model=model)


def forward_done_event(engine: Engine, fb: ForwardBatch, forward_s: float, sample_s: float,
                       model: str = "target") -> ev.ForwardDone:
    return ev.ForwardDone(step=engine.step_no, t=_now(), forward_mode=fb.forward_mode.value,
                          num_tokens=fb.num_tokens, batch_size=fb.batch_size, forward_ms=forward_s * 1e3,
                          sample_ms=sample_s * 1e3, model=model)


def emit_sampling(engine: Engine, reqs: list[Req], logits: torch.Tensor, sample: Any) -> None:
    """Logits summary, sampling stages and the chosen token of every sampled row."""
    k = engine.trace_topk
    step, t = engine.step_no, _now()
    lp = sample.raw_logprobs
    # One device-to-host transfer per quantity for the whole batch (a per-row .tolist() syncs a GPU each time).
    # softmax and log-softmax keep the order of the logits: one top-k serves every list
    if sample.stages is not None:
        top_ids = torch.tensor([row[0]["top_ids"] for row in sample.stages], dtype=torch.int64, device=logits.device)
        top_vals = logits.gather(1, top_ids)
    else:
        top_vals, top_ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    lp_vals = lp.gather(1, top_ids)
    top_vals, top_ids, lp_vals = (x.cpu().tolist() for x in (top_vals, top_ids, lp_vals))
    lp_ids = top_ids
    if sample.stages is not None:  # the sampler's first record is the model's own distribution
        entropy = [row[0]["entropy"] for row in sample.stages]
    else:
        probs = lp.exp()
        entropy = (-torch.special.xlogy(probs, probs).sum(-1)).cpu().tolist()
    full = logits.float().cpu().numpy() if engine.tracer.full else None
    for i, req in enumerate(reqs):
        position = len(req.output_ids)  # the token these logits choose (appended after this call)
        tensor_name = None
        if full is not None:
            tensor_name = f"logits/{step}/{req.req_id}/{position}"
            engine.tracer.tensor(tensor_name, step, req.req_id, full[i])
        engine.tracer.emit(ev.Logits(step=step, req_id=req.req_id, t=t, position=position, top_ids=top_ids[i],
                                     top_logits=top_vals[i], entropy=entropy[i], tensor=tensor_name))
        if sample.stages is not None:
            engine.tracer.emit(ev.SamplingStages(
                step=step, req_id=req.req_id, t=t, position=position, stages=sample.stages[i],
                chosen=sample.next_token_ids[i], greedy=req.params.temperature == 0, draw=sample.draws[i],
                seeded=req.generator is not None))
        tok = sample.next_token_ids[i]
        tops = [[tid, v, engine.outputs.token_text(tid)] for tid, v in zip(lp_ids[i], lp_vals[i])]
        engine.tracer.emit(ev.TokenChosen(
            step=step, req_id=req.req_id, t=t, position=position, token_id=tok, text=engine.outputs.token_text(tok),
            logprob=_finite(sample.logprobs[i]), rank=sample.ranks[i], top_logprobs=tops,
            source="forced" if i in getattr(sample, "forced", ()) else "sample"))


def emit_output_events(engine: Engine, req: Req, new_ids: list[int], detok: Any, decision: Any) -> None:
    step, t = engine.step_no, _now()
    engine.tracer.emit(ev.DetokState(
        step=step, req_id=req.req_id, t=t, new_ids=list(new_ids), prefix_offset=detok.prefix_offset,
        read_offset=detok.read_offset, decoded_len=detok.decoded_len, held_text=detok.held_text,
        held_reason=detok.held_reason, delta=detok.delta, stop_matched=detok.stop_matched))
    engine.tracer.emit(ev.FinishDecision(step=step, req_id=req.req_id, t=t, checks=list(decision.checks),
                                         finish_reason=decision.finish_reason, evidence=decision.evidence))


def finished_event(engine: Engine, req: Req, out: Any) -> ev.RequestFinished:
    return ev.RequestFinished(
        step=engine.step_no, req_id=req.req_id, t=_now(), text=out.text, output_ids=list(out.token_ids),
        finish_reason=out.finish_reason, matched_stop=out.matched_stop, evidence=out.evidence, usage=out.usage,
        timings=out.timings, spec=out.spec, error=out.error)


def kv_event(engine: Engine, req_id: str | None, op: str, slots: list[int], reason: str) -> ev.KVEvent:
    """A KV operation, emitted after it happened: `kv_used` is the pool's occupancy afterwards."""
    alloc = engine.memory.allocator
    return ev.KVEvent(step=engine.step_no, req_id=req_id, t=_now(), op=op, slots=slots, reason=reason,
                      kv_used=alloc.used(), kv_total=alloc.size)


def emit_schedule_kv(engine: Engine, batch: Any) -> None:
    """The KV changes `schedule()` made: cached prefixes evicted to make room, preempted requests'
    slots freed, and cached prefixes copied into admitted requests."""
    emit_evicted(engine, batch.evicted, "make room")
    for req in batch.preempted:
        slots = engine.scheduler.preempted_slots.get(req.req_id)
        if slots is not None and slots.numel():
            engine.tracer.emit(kv_event(engine, req.req_id, "free", slots.tolist(), "preempt"))
    for req, slots, source in batch.cache_hits:
        engine.tracer.emit(kv_event(engine, req.req_id, "alloc", slots.tolist(),
                                    f"copy of {source}'s cached KV ({slots.numel()} tokens)"))


def emit_release_kv(engine: Engine, req_id: str, released: Any, reason: str) -> None:
    """A finished or aborted request's KV (a scheduler `Released`): freed, or kept by the prefix cache,
    and the cache entries that keeping it superseded."""
    if released.slots.numel():
        engine.tracer.emit(kv_event(engine, req_id, "cache" if released.kept else "free", released.slots.tolist(),
                                    f"{reason}: kept by the prefix cache" if released.kept else reason))
    emit_evicted(engine, released.dropped, f"superseded by {req_id}")


def emit_evicted(engine: Engine, entries: list, why: str) -> None:
    for entry in entries:
        engine.tracer.emit(kv_event(engine, None, "evict", entry.slots.tolist(),
                                    f"prefix cache: {entry.source}'s {len(entry.tokens)} tokens ({why})"))


def stamp_event(engine: Engine, req_id: str, stage: str, detail: dict[str, Any], t: float | None = None,
                step: int | None = None) -> ev.Stamp:
    return ev.Stamp(step=engine.step_no if step is None else step, req_id=req_id, t=t if t is not None else _now(),
                    stage=stage, detail=detail)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def error_event(engine: Engine, message: str, affected: list[str]) -> ev.EngineError:
    return ev.EngineError(step=engine.step_no, t=_now(), message=message, affected=affected)
