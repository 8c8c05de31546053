"""The trace observer: the pipeline's named seams, turned into trace events.

`Engine.step()` and its stages call `TraceObserver` at a few seams (request added, scheduled,
batch built, forward done, sampled, output processed, KV changed, finished, error); each seam is a
no-op while the tracer is off, so the pipeline itself never asks whether it is traced. The
speculative step's own seams live in spec/trace.py and report through the same observer.

Owns: the mapping from Req / ScheduleBatch / ForwardBatch / SamplerOutput / DetokUpdate /
FinishResult to the typed records of `workbench.trace.events`, and the run metadata of a trace.
Does not own: the event schema (trace/events.py), storage or the choice of sinks (the caller
builds the `Tracer` with its sinks).
"""

from __future__ import annotations

import contextlib
import math
import platform
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from workbench.trace import events as ev
from workbench.trace.recorder import MemorySink, Sink, Tracer

if TYPE_CHECKING:
    from workbench.engine.output.output import RequestOutput
    from workbench.engine.run.capture import CaptureRecord
    from workbench.engine.run.forward_batch import ForwardBatch
    from workbench.engine.sample.sampler import SamplerOutput, SamplingBatchInfo
    from workbench.engine.sched.batch import Fork, Released, ScheduleBatch
    from workbench.engine.sched.memory import TokenToKVPoolAllocator
    from workbench.engine.sched.prefix_cache import CacheEntry
    from workbench.engine.sched.request import Req
    from workbench.engine.sched.scheduler import Scheduler


class StepContext(Protocol):
    """What a seam reads of the step record (`workbench.engine.step.StepContext`): its number."""

    step: int


def make_tracer(level: str, sinks: list[Sink], meta: Callable[[], dict[str, Any]]) -> Tracer:
    """A tracer at `level` writing to `sinks` (an in-memory sink when tracing is on without one, so
    notebooks and tests can read what happened), holding the run's `meta()` when it is on."""
    ev.level_value(level)
    all_sinks = list(sinks)
    if level != "off" and not all_sinks:
        all_sinks.append(MemorySink())
    tracer = Tracer(level if all_sinks else "off", all_sinks)
    if tracer.on:
        for key, value in meta().items():
            tracer.set_meta(key, value)
    return tracer


def run_meta(config: dict[str, Any], model: dict[str, Any], tok: Any, level: str) -> dict[str, Any]:
    """The trace's run metadata: engine config (`EngineConfig.to_dict()`), model identity, tokenizer,
    versions."""
    import transformers

    return {
        "engine": config,
        "model": model,
        "tokenizer": {"name": getattr(tok, "name_or_path", ""), "vocab_size": len(tok),
                      "eos_token_id": tok.eos_token_id, "class": type(tok).__name__},
        "versions": {"workbench": "0.1.0", "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "trace_level": level,
        "created": time.time(),
    }


_BATCH_LISTS = ("input_ids", "req_pool_indices", "seq_lens", "positions", "extend_prefix_lens", "extend_seq_lens")


def _now() -> float:
    return time.perf_counter()


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class TraceObserver:
    """Called by the pipeline at its seams; emits nothing while `tracer.on` is False."""

    def __init__(self, tracer: Tracer, allocator: TokenToKVPoolAllocator, token_text: Callable[[int], str],
                 topk: int, attention: Callable[[str, int | None], list[dict[str, Any]]] | None = None,
                 token_texts: Callable[[list[int]], list[str]] | None = None) -> None:
        self.tracer = tracer
        # per layer of a forward, the attention it runs (model "target" or "draft", layer limit)
        self.attention = attention or (lambda model, layer_limit: [])
        self.allocator = allocator
        self.token_text = token_text
        self.token_texts = token_texts or (lambda ids: [token_text(t) for t in ids])  # many ids at once
        self.trace_topk = topk
        self._held: list[ev.Event] | None = None  # what `by_kind` holds back

    @property
    def on(self) -> bool:
        return self.tracer.on

    @property
    def topk(self) -> int:
        """Top-k alternatives the sampler must compute for the trace (0 while untraced)."""
        return self.trace_topk if self.tracer.on else 0

    def emit(self, event: ev.Event) -> None:
        if self._held is not None:
            self._held.append(event)
        else:
            self.tracer.emit(event)

    @contextlib.contextmanager
    def by_kind(self, order: tuple[str, ...]) -> Iterator[None]:
        """Hold back what is emitted inside, then emit it kind by kind: the kinds of `order` in that
        order, any other kind after them, each kind in emission order. A writer stores a run of one
        kind as one row (trace/format.py). The caller makes sure each request's own events keep
        their order (every request's events inside come in `order`, then the rest)."""
        if not self.tracer.on or self._held is not None:
            yield
            return
        held = self._held = []
        try:
            yield
        finally:
            self._held = None
            rank = {kind: i for i, kind in enumerate(order)}
            held.sort(key=lambda e: rank.get(e.kind, len(order)))  # stable: each kind keeps its order
            for event in held:
                self.tracer.emit(event)

    # --- admission -----------------------------------------------------------------------

    def request_added(self, req: Req, step: int) -> None:
        """`req` enters the scheduler; `step` is the step it arrives in (not yet counted)."""
        if not self.tracer.on:
            return
        self.emit(ev.RequestAdded(step=step, req_id=req.req_id, t=req.arrival_time, prompt=req.prompt,
                                  prompt_ids=list(req.prompt_ids), params=req.params.to_dict(),
                                  parent_id=req.parent_id))
        for stage, t in (("arrival", req.timing.arrival), ("tokenized", req.timing.tokenized)):
            self.emit(ev.Stamp(step=step, req_id=req.req_id, t=t, stage=stage, detail={}))

    # --- the step's seams ----------------------------------------------------------------

    def scheduled(self, ctx: StepContext, batch: ScheduleBatch, scheduler: Scheduler) -> None:
        """The KV changes `schedule()` made (evictions, preemptions, cache-hit copies), then the decision."""
        if not self.tracer.on:
            return
        self.evicted(ctx, batch.evicted, "make room")
        freed = {p.req.req_id: p.slots for p in batch.preempted_kv}
        for req in batch.preempted:
            slots = freed.get(req.req_id)
            if slots is not None and slots.numel():
                self.kv(ctx, req.req_id, "free", slots.tolist(), "preempt")
        for hit in batch.cache_hits:
            self.kv(ctx, hit.req.req_id, "alloc", hit.slots.tolist(),
                    f"copy of {hit.source}'s cached KV ({hit.slots.numel()} tokens)")
        alloc = self.allocator
        self.emit(ev.ScheduleDecision(
            step=ctx.step, t=_now(), mode=batch.mode.value,
            waiting=[r.req_id for r in scheduler.waiting], running=[r.req_id for r in scheduler.running],
            prefill=[{"req_id": c.req.req_id, "start": c.start, "length": c.length, "last_chunk": c.last_chunk}
                     for c in batch.prefill],
            decode=[r.req_id for r in batch.decode], preempted=[r.req_id for r in batch.preempted],
            token_budget=batch.token_budget, tokens_scheduled=batch.tokens_scheduled,
            kv_used=alloc.used(), kv_total=alloc.size))

    def batch_built(self, ctx: StepContext, fb: ForwardBatch, model: str = "target",
                    sampling: Callable[[], SamplingBatchInfo] | None = None) -> None:
        """A ForwardBatch is ready to run. `sampling` builds the per-row sampling summary of a batch
        that does not sample through the Sampler (speculative verification), only when traced."""
        if not self.tracer.on:
            return
        if sampling is not None:
            fb.sampling_info = sampling()
        info = fb.sampling_info
        host = fb.host  # the lists the batch's tensors were made from (a copy each where a caller left them out)
        ints = {name: list(host[name]) if name in host else getattr(fb, name).tolist() for name in _BATCH_LISTS}
        self.emit(ev.ForwardBatchBuilt(
            step=ctx.step, t=_now(), forward_mode=fb.forward_mode.value, batch_size=fb.batch_size,
            out_cache_loc=fb.out_cache_loc.tolist(), **ints,
            return_logprob=fb.return_logprob, top_logprobs_nums=list(fb.top_logprobs_nums), req_ids=list(fb.req_ids),
            sampling_info=info.summary() if info is not None else [], model=model,
            attention=self.attention(model, fb.layer_limit)))

    def forward_done(self, ctx: StepContext, fb: ForwardBatch, forward_s: float, sample_s: float,
                     model: str = "target") -> None:
        if not self.tracer.on:
            return
        self.emit(ev.ForwardDone(step=ctx.step, t=_now(), forward_mode=fb.forward_mode.value,
                                 num_tokens=fb.num_tokens, batch_size=fb.batch_size, forward_ms=forward_s * 1e3,
                                 sample_ms=sample_s * 1e3, model=model))

    def sampled(self, ctx: StepContext, reqs: list[Req], logits: torch.Tensor, sample: SamplerOutput) -> None:
        """Logits summary, sampling stages and the chosen token of every sampled row (before the
        tokens are appended)."""
        if not self.tracer.on:
            return
        k = self.trace_topk
        step, t = ctx.step, _now()
        # One device-to-host transfer per quantity for the whole batch (a per-row .tolist() syncs a GPU each time).
        # softmax and log-softmax keep the order of the logits: one top-k serves every list
        if sample.stages is not None:
            top_ids = [list(row[0]["top_ids"]) for row in sample.stages]  # the Logits events own their lists
            index = sample.record_ids  # those ids, as the sampler's record computed them
            if index is None:
                index = torch.tensor(top_ids, dtype=torch.int64, device=logits.device)
            top_vals = logits.gather(1, index).tolist()
        else:
            top_vals, index = logits.topk(min(k, logits.shape[-1]), dim=-1)
            top_vals, top_ids = top_vals.tolist(), index.tolist()
        lp_vals = sample.raw_logprobs_at(index).tolist()
        if sample.stages is not None:  # the sampler's first record is the model's own distribution
            entropy = [row[0]["entropy"] for row in sample.stages]
        else:
            probs = torch.softmax(logits.float(), dim=-1)  # the model's distribution, as the sampler's record
            entropy = (-torch.special.xlogy(probs, probs).sum(-1)).cpu().tolist()
        full = logits.float().cpu().numpy() if self.tracer.full else None
        text = self.token_text
        # kind by kind (every row's logits, then every row's stages, then every row's token): a
        # writer stores each such run as one row (trace/format.py); each request's order is kept
        positions = [len(req.output_ids) for req in reqs]  # the token these logits choose (appended after this call)
        emit = self.emit
        for i, (req, position) in enumerate(zip(reqs, positions)):
            tensor_name = None
            if full is not None:
                tensor_name = f"logits/{step}/{req.req_id}/{position}"
                self.tracer.tensor(tensor_name, step, req.req_id, full[i])
            emit(ev.Logits(step=step, req_id=req.req_id, t=t, position=position, top_ids=top_ids[i],
                           top_logits=top_vals[i], entropy=entropy[i], tensor=tensor_name))
        if sample.stages is not None:
            for i, (req, position) in enumerate(zip(reqs, positions)):
                emit(ev.SamplingStages(
                    step=step, req_id=req.req_id, t=t, position=position, stages=sample.stages[i],
                    chosen=sample.next_token_ids[i], greedy=req.params.temperature == 0, draw=sample.draws[i],
                    seeded=req.generator is not None))
        texts = self.token_texts
        for i, (req, position) in enumerate(zip(reqs, positions)):
            tok = sample.next_token_ids[i]
            tops = list(map(list, zip(top_ids[i], lp_vals[i], texts(top_ids[i]))))  # [id, logprob, text] each
            emit(ev.TokenChosen(
                step=step, req_id=req.req_id, t=t, position=position, token_id=tok, text=text(tok),
                logprob=_finite(sample.logprobs[i]), rank=sample.ranks[i], top_logprobs=tops,
                source="forced" if i in sample.forced else "sample"))

    def captured(self, ctx: StepContext, records: list[CaptureRecord]) -> None:
        """What capture.py kept inside this step's forward: its tensors, then one event per position."""
        if not self.tracer.on:
            return
        text = self.token_text
        for rec in records:
            names = {}
            for quantity, tensor in rec.tensors.items():
                names[quantity] = f"capture/{ctx.step}/{rec.req_id}/{rec.position}/{quantity}"
                self.tracer.tensor(names[quantity], ctx.step, rec.req_id, tensor.numpy(), captured=True)
            self.emit(ev.Captured(step=ctx.step, req_id=rec.req_id, t=_now(), position=rec.position,
                                  token_id=rec.token_id, kv_len=rec.kv_len, margin=_finite(rec.margin),
                                  what=rec.what, tensors=names,
                                  lens_texts=[[text(t) for t in row] for row in rec.lens_ids],
                                  prompt_texts=[text(t) for t in rec.prompt_ids or []]))

    def output_processed(self, ctx: StepContext, req: Req, token: int, detok: Any, decision: Any) -> None:
        """One appended token went through the detokenizer and the finish checks."""
        if not self.tracer.on:
            return
        step, t = ctx.step, _now()
        self.emit(ev.DetokState(
            step=step, req_id=req.req_id, t=t, new_ids=[token], prefix_offset=detok.prefix_offset,
            read_offset=detok.read_offset, decoded_len=detok.decoded_len, held_text=detok.held_text,
            held_reason=detok.held_reason, delta=detok.delta, stop_matched=detok.stop_matched))
        self.emit(ev.FinishDecision(step=step, req_id=req.req_id, t=t, checks=list(decision.checks),
                                    finish_reason=decision.finish_reason, evidence=decision.evidence))

    def stamped(self, ctx: StepContext, req_id: str, stage: str, detail: dict[str, Any]) -> None:
        if not self.tracer.on:
            return
        self.emit(ev.Stamp(step=ctx.step, req_id=req_id, t=_now(), stage=stage, detail=detail))

    def finished(self, ctx: StepContext, req: Req, out: RequestOutput, released: Released, reason: str) -> None:
        """A request ended: what happened to its KV (freed, or kept by the prefix cache, and the cache
        entries that superseded), then its final output."""
        if not self.tracer.on:
            return
        if released.slots.numel():
            self.kv(ctx, req.req_id, "cache" if released.kept else "free", released.slots.tolist(),
                    f"{reason}: kept by the prefix cache" if released.kept else reason)
        self.evicted(ctx, released.dropped, f"superseded by {req.req_id}")
        self.emit(ev.RequestFinished(
            step=ctx.step, req_id=req.req_id, t=_now(), text=out.text, output_ids=list(out.token_ids),
            finish_reason=out.finish_reason, matched_stop=out.matched_stop, evidence=out.evidence, usage=out.usage,
            timings=out.timings, spec=out.spec, error=out.error))

    def error(self, ctx: StepContext, message: str, affected: list[str]) -> None:
        if not self.tracer.on:
            return
        self.emit(ev.EngineError(step=ctx.step, t=_now(), message=message, affected=affected))

    # --- KV ------------------------------------------------------------------------------

    def kv(self, ctx: StepContext, req_id: str | None, op: str, slots: list[int], reason: str) -> None:
        """A KV operation, reported after it happened: `kv_used` is the pool's occupancy afterwards."""
        if not self.tracer.on:
            return
        alloc = self.allocator
        self.emit(ev.KVEvent(step=ctx.step, req_id=req_id, t=_now(), op=op, slots=slots, reason=reason,
                             kv_used=alloc.used(), kv_total=alloc.size))

    def forked(self, ctx: StepContext, fork: Fork) -> None:
        """A waiting request got a copy of a prefilled prompt's KV."""
        if not self.tracer.on:
            return
        what = "prompt" if fork.whole_prompt else f"first {len(fork.slots)} prompt tokens'"
        self.kv(ctx, fork.req.req_id, "alloc", fork.slots.tolist(), f"copy of {fork.source.req_id}'s {what} KV")

    def evicted(self, ctx: StepContext, entries: list[CacheEntry], why: str) -> None:
        for entry in entries:
            self.kv(ctx, None, "evict", entry.slots.tolist(),
                    f"prefix cache: {entry.source}'s {len(entry.tokens)} tokens ({why})")
