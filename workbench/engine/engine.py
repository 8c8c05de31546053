"""The Engine: requests in, the pipeline once per `step()`, outputs out.

`Engine.step()` reads as the pipeline (schedule -> ForwardBatch -> ModelRunner -> logits ->
Sampler -> output processing -> detokenizer -> finish) and is the one place that emits trace
events; components return values and know nothing about tracing. Owns: request admission
(tokenize, validate, refuse what can never fit), the step loop, abort, and the public API
(`generate`, `stream`, `add_request`, `abort`). Thread-safe entry points (`add_request`, `abort`)
queue work that the stepping thread picks up at the start of its next step.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from workbench.engine import tracing
from workbench.engine.output.output import RequestOutput, StepOutput
from workbench.engine.output.postprocess import OutputProcessor
from workbench.engine.prompts import Prompt, as_prompt_list, tokenize_prompt
from workbench.engine.run import cpu_kernels
from workbench.engine.run.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from workbench.engine.run.model_runner import ModelRunner
from workbench.engine.sample.grammar import GrammarBackend
from workbench.engine.sample.logprobs import store_prompt_logprobs
from workbench.engine.sample.sampler import Sampler, SamplingBatchInfo
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.prefix_cache import PrefixCache
from workbench.engine.sched.request import Req, ReqStatus
from workbench.engine.sched.scheduler import Scheduler
from workbench.engine.timing import ReqTiming, StepClock
from workbench.models.loader import LoadedModel, load_model
from workbench.trace.recorder import MemorySink, Tracer


class StepFailed(RuntimeError):
    """A step failed inside the forward pass or the sampler. The engine has already ended the
    requests of that step (`affected`, finish reason "abort" with `error` set) and freed their KV;
    it keeps serving everything else."""

    def __init__(self, message: str, affected: list[str]) -> None:
        super().__init__(message)
        self.affected = affected


class Engine:
    def __init__(self, model: str | LoadedModel = "smollm2", *, device: str = "auto", dtype: str | None = None,
                 max_batch_tokens: int = 2048, chunk_size: int = 512, kv_tokens: int | None = None,
                 max_running: int = 64, enable_mixed: bool = True, trace: str | None = None,
                 trace_level: str = "summary", trace_topk: int = 10, trace_sinks: list | None = None,
                 spec: Any = None, seed: int = 0, prefix_sharing: bool = True, prefix_cache: bool = False,
                 max_model_len: int | None = None) -> None:
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device, dtype=dtype)
        self.tokenizer = self.loaded.tokenizer
        self.runner = ModelRunner(self.loaded)
        self.device = self.loaded.device
        self.vocab_size = self.runner.vocab_size
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if max_model_len is not None:  # a shorter context than the model's (vLLM's --max-model-len)
            if isinstance(max_model_len, bool) or not 1 <= max_model_len <= self.runner.max_context_len:
                raise ValueError(f"max_model_len must be in [1, {self.runner.max_context_len}] (the model's "
                                 f"context), got {max_model_len!r}")
            self.runner.max_context_len = max_model_len
        max_ctx = self.runner.max_context_len
        if kv_tokens is None:
            per_token = 2 * self.runner.num_layers * self.runner.kv_heads * self.runner.head_dim * 4
            kv_tokens = min(max_running * max_ctx, (1 << 30) // per_token)
        if kv_tokens < 2:
            raise ValueError(f"kv_tokens must be >= 2, got {kv_tokens}")
        self.memory = Memory(num_layers=self.runner.num_layers, kv_heads=self.runner.kv_heads,
                             head_dim=self.runner.head_dim, kv_tokens=kv_tokens, max_running=max_running,
                             max_context_len=max_ctx, dtype=self.runner.dtype, device=self.device)
        self.scheduler = Scheduler(self.memory, max_batch_tokens=max_batch_tokens, chunk_size=chunk_size,
                                   max_context_len=max_ctx, enable_mixed=enable_mixed)
        self.sampler = Sampler()
        self.outputs = OutputProcessor(self.tokenizer, max_ctx)
        self.grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.outputs.eos_token_ids)
        self.config = {"model": self.loaded.spec, "device": self.device, "dtype": self.loaded.dtype,
                       "max_batch_tokens": max_batch_tokens, "chunk_size": chunk_size, "kv_tokens": kv_tokens,
                       "max_running": max_running, "enable_mixed": enable_mixed, "trace_topk": trace_topk,
                       "seed": seed, "prefix_sharing": prefix_sharing, "prefix_cache": prefix_cache, "spec": spec if isinstance(spec, (str, dict, type(None))) else getattr(spec, "to_dict", spec.__str__)()}
        # which native paths ran, so a trace says it (a replay elsewhere may take the torch paths)
        cpu_fp32 = self.device == "cpu" and self.runner.dtype == torch.float32
        self.config["cpu_kernels"] = {"decode_attention": cpu_fp32 and cpu_kernels.available(),
                                      "packed_linear_bytes": self.runner.packed_bytes}
        self.trace_topk = trace_topk
        self.prefix_sharing = prefix_sharing
        self.tracer = tracing.make_tracer(trace, trace_level, trace_sinks, self)
        self.spec = None
        if spec is not None:
            from workbench.engine.spec.config import make_spec_worker

            self.spec = make_spec_worker(spec, self)
            self.scheduler.spec_headroom = self.spec.cfg.num_speculative_tokens
        if prefix_cache:
            self.scheduler.prefix_cache = PrefixCache(self.memory.allocator)
        self.step_no = 0
        self.clock = StepClock()
        self.reqs: dict[str, Req] = {}
        self.finished: dict[str, RequestOutput] = {}
        self._inbox: queue.SimpleQueue[Req] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._ids = itertools.count()
        torch.manual_seed(seed)

    # --- admission ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt | list[int]) -> list[int]:
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def add_request(self, prompt: Prompt | list[int], params: SamplingParams | None = None,
                    req_id: str | None = None) -> list[str]:
        """Validate and queue a request (n > 1 queues n); returns the request ids. Thread-safe."""
        arrival = time.perf_counter()
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        prompt_ids = self.tokenize(prompt)
        self.scheduler.check_fits(len(prompt_ids), params.max_new_tokens)
        if params.grammar is not None:
            self.grammars.compile(*params.grammar)  # ValueError now, not a crash mid-step
        base = req_id or f"req-{next(self._ids)}"
        ids = [base] if params.n == 1 else [f"{base}-{i}" for i in range(params.n)]
        if any(rid in self.reqs for rid in ids):
            raise ValueError(f"req_id {base!r} is already in use")
        first = None
        for i, rid in enumerate(ids):
            seed = params.seed + i if params.seed is not None else None
            gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
            req = Req(rid, prompt, prompt_ids, params, generator=gen, parent_id=base if params.n > 1 else None,
                      share_prefix_from=first, arrival_time=arrival, timing=ReqTiming(arrival))
            first = first or req  # siblings copy the first one's prompt KV instead of recomputing it
            req.grammar = self.grammars.new_state(params)
            self.outputs.init_request(req)
            self.reqs[rid] = req
        tokenized = time.perf_counter()
        for rid in ids:
            self.reqs[rid].timing.mark_tokenized(tokenized)
            self._inbox.put(self.reqs[rid])
        return ids

    def abort(self, req_id: str, reason: str = "aborted by caller") -> None:
        """Abort a waiting or running request at the start of the next step. Thread-safe, idempotent."""
        self._aborts.put((req_id, reason))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty() or not self._aborts.empty()

    def forget(self, req_id: str) -> RequestOutput | None:
        """Drop a finished request's bookkeeping and return its output, so a long-running caller (the
        server) does not keep every request forever. Call from the stepping thread."""
        req = self.reqs.get(req_id)
        if req is not None and not req.finished:
            raise ValueError(f"request {req_id!r} has not finished; abort it first")
        self.reqs.pop(req_id, None)
        return self.finished.pop(req_id, None)

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        results = self._drain_inbox()
        if not self.scheduler.has_work():
            return results
        self.step_no += 1
        self.clock = clock = StepClock()
        batch = self.scheduler.schedule()
        clock.scheduled = time.perf_counter()
        if self.spec is not None:
            for req in batch.preempted:
                self.spec.release(req)
        if self.tracer.on:
            tracing.emit_schedule_kv(self, batch)
            self.tracer.emit(tracing.schedule_event(self, batch))
        if batch.mode is ForwardMode.IDLE:
            return results
        # the step's ForwardBatch and whether its KV slots already count in the requests' kv_len:
        # what a failure has to free (set by _run_batch or the speculative worker)
        self._step_fb, self._step_kv_counted = None, False
        try:
            if self.spec is not None and batch.mode is ForwardMode.DECODE:
                return results + self.spec.step(batch)
            return results + self._run_batch(batch, clock)
        except Exception as exc:
            raise self._fail_step(batch, exc) from exc

    def _run_batch(self, batch, clock: StepClock) -> list[StepOutput]:
        """Forward, sample and process one scheduled batch (not speculative)."""
        t0 = time.perf_counter()
        fb = self._step_fb = build_forward_batch(batch.mode, batch.rows(), self.memory, self.device)
        sample_reqs = [batch.reqs[i] for i in fb.logits_owner]
        fb.sampling_info = SamplingBatchInfo.build(sample_reqs, self.vocab_size, self.device,
                                                   eos_token_ids=self.outputs.eos_token_ids)
        if self.tracer.on:
            self.tracer.emit(tracing.forward_batch_event(self, fb))
        logits = self.runner.forward(fb)  # [num_sampled + num_prompt_logprob_rows, vocab]
        t1 = clock.forward_end = time.perf_counter()
        for chunk in batch.prefill:
            chunk.req.kv_len += chunk.length
        for req in batch.decode:
            req.kv_len += 1
        self._step_kv_counted = True
        if self.spec is not None:
            self.spec.on_extend(batch)  # a draft model prefills the same chunks
        logits = self._after_prefill(batch.prefill, fb, logits)  # [num_sampled, vocab]
        for chunk in batch.prefill:
            if not chunk.last_chunk:
                chunk.req.timing.account_chunk(clock)
        if not sample_reqs:  # only mid-prompt chunks ran: nothing to sample this step
            if self.tracer.on:
                self.tracer.emit(tracing.forward_done_event(self, fb, t1 - t0, 0.0))
            return self._finish_scored(batch.prefill)
        sample = self.sampler(logits, fb.sampling_info, self.trace_topk if self.tracer.on else 0)
        t2 = clock.sampled = time.perf_counter()
        if self.tracer.on:
            self.tracer.emit(tracing.forward_done_event(self, fb, t1 - t0, t2 - t1))
            tracing.emit_sampling(self, sample_reqs, logits, sample)
        new_tokens = {req.req_id: [tok] for req, tok in zip(sample_reqs, sample.next_token_ids, strict=True)}
        self.outputs.append_tokens(sample_reqs, sample, self.step_no)
        return self._process_outputs(sample_reqs, new_tokens) + self._finish_scored(batch.prefill)

    def _fail_step(self, batch, exc: Exception) -> StepFailed:
        """End every request of a failed step with an error and free all of its KV, including the
        slots this step allocated but never filled; the engine goes on with the other requests."""
        fb = self._step_fb
        if fb is not None and not self._step_kv_counted:
            self.memory.allocator.free(fb.out_cache_loc)  # not yet part of any request's kv_len
        message = f"the engine failed in step {self.step_no} ({type(exc).__name__})"
        affected = []
        for req in dict.fromkeys(batch.reqs):
            if not req.finished:
                req.error = message
                self._finish(req, "abort", {"type": "error", "message": message}, None)
                affected.append(req.req_id)
        if self.tracer.on:
            self.tracer.emit(tracing.error_event(self, message, affected))
        return StepFailed(message, affected)

    def _after_prefill(self, prefill: list, fb: ForwardBatch, logits: torch.Tensor) -> torch.Tensor:
        """Store prompt logprobs from the extra logits rows; let n > 1 siblings copy a finished prompt's
        KV. Returns the sampling rows of `logits`."""
        num_sampled = len(fb.logits_owner)
        store_prompt_logprobs([c.req for c in prefill], fb.prompt_logprob_rows, logits[num_sampled:])
        for chunk in prefill:
            if not chunk.last_chunk:
                continue
            src = chunk.req
            for sib in [r for r in self.scheduler.waiting if r.share_prefix_from is src]:
                sibling = sib.share_len is None  # n > 1: the same prompt, its prompt logprobs too
                slots = self.scheduler.fork_prefix(src, sib)
                if slots is None:
                    continue
                if sibling:
                    sib.prompt_logprobs, sib.prompt_ranks = list(src.prompt_logprobs), list(src.prompt_ranks)
                    sib.prompt_top_logprobs = list(src.prompt_top_logprobs)
                if self.tracer.on:
                    what = "prompt" if sibling else f"first {len(slots)} prompt tokens'"
                    self.tracer.emit(tracing.kv_event(self, sib.req_id, "alloc", slots.tolist(),
                                                      f"copy of {src.req_id}'s {what} KV"))
        return logits[:num_sampled]

    def _finish_scored(self, prefill: list) -> list[StepOutput]:
        """Requests with max_new_tokens=0 (prompt scoring) finish when their prefill completes."""
        results = []
        for chunk in prefill:
            req = chunk.req
            if chunk.last_chunk and req.params.max_new_tokens == 0 and not req.finished:
                out, tail = self._finish(req, "length", {"type": "length", "length": 0, "cause": "max_new_tokens"},
                                         None)
                results.append(StepOutput(req.req_id, [], tail, True, out))
        return results

    def _process_outputs(self, reqs: list[Req], new_tokens: dict[str, list[int]]) -> list[StepOutput]:
        """Detokenize, decide finish, release finished requests: the tail of the pipeline.

        The new tokens are already appended to each request's output; they go through the checks one
        at a time, and a finish on one of them drops the ones after it (speculative runs).
        """
        results = []
        for req in reqs:
            new = new_tokens[req.req_id]
            first = len(req.output_ids) - len(new) + 1
            delta, kept, final = [], [], None
            for n in range(first, len(req.output_ids) + 1):
                detok, decision = self.outputs.process_token(req, n)
                kept.append(req.output_ids[n - 1])
                delta.append(detok.delta)
                if self.tracer.on:
                    tracing.emit_output_events(self, req, [req.output_ids[n - 1]], detok, decision)
                if decision.finish_reason is not None:
                    self.outputs.truncate(req, n)
                    final = decision
                    break
            stamps = req.timing.account_step(self.clock, time.perf_counter())
            if self.tracer.on:
                self.tracer.emit(tracing.stamp_event(self, req.req_id, "step", stamps))
            out, tail = None, ""
            if final is not None:
                out, tail = self._finish(req, final.finish_reason, final.evidence, final.matched_stop)
            results.append(StepOutput(req.req_id, kept, "".join(delta) + tail, out is not None, out))
        return results

    def _finish(self, req: Req, reason: str, evidence: dict | None, matched_stop: Any) -> tuple[RequestOutput, str]:
        req.finish_reason, req.evidence, req.matched_stop = reason, evidence, matched_stop
        req.status = ReqStatus.FINISHED
        released = self.scheduler.remove(req, cache=reason in ("stop", "length"))
        if self.tracer.on:
            tracing.emit_release_kv(self, req.req_id, released, reason)
        if self.spec is not None:
            self.spec.release(req)
        out, tail = self.outputs.make_output(req)
        self.finished[req.req_id] = out
        if self.tracer.on:
            self.tracer.emit(tracing.finished_event(self, req, out))
        return out, tail

    def flush_prefix_cache(self) -> int:
        """Free every cached prefix (prefix_cache=True); returns the KV slots freed. Call from the
        stepping thread, between steps."""
        cache = self.scheduler.prefix_cache
        evicted = cache.clear() if cache is not None else []
        if self.tracer.on:
            tracing.emit_evicted(self, evicted, "flush")
        return sum(len(e.tokens) for e in evicted)

    def _drain_inbox(self) -> list[StepOutput]:
        while not self._inbox.empty():
            req = self._inbox.get()
            req.arrival_step = self.step_no + 1
            if self.prefix_sharing and req.share_prefix_from is None:
                self.scheduler.share_prompt_prefix(req)
            self.scheduler.add(req)
            if self.tracer.on:
                self.tracer.emit(tracing.request_added_event(self, req))
                # the step the request arrives in, like request.added (the engine has not counted it yet)
                for stage, t in (("arrival", req.timing.arrival), ("tokenized", req.timing.tokenized)):
                    self.tracer.emit(tracing.stamp_event(self, req.req_id, stage, {}, t, step=req.arrival_step))
        results = []
        while not self._aborts.empty():
            rid, reason = self._aborts.get()
            req = self.reqs.get(rid)
            if req is None or req.finished:
                continue  # unknown or already finished: abort is idempotent
            req.abort_reason = reason
            out, tail = self._finish(req, "abort", {"type": "abort", "message": reason}, None)
            results.append(StepOutput(rid, [], tail, True, out))
        return results

    # --- convenience API ---------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Run prompts (a string, a chat, or a list of either) to completion; outputs in input order."""
        prompts = as_prompt_list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: got {len(plist)} for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        flat = [rid for group in ids for rid in group]
        bar = _progress(progress, sum((sp or SamplingParams()).max_new_tokens * (sp or SamplingParams()).n
                                      for sp in plist))
        while any(rid not in self.finished for rid in flat):
            for out in self.step():
                bar.update(len(out.new_token_ids))
        bar.total = bar.n  # requests that stopped early end the bar at 100%, not at n / max_new_tokens
        bar.refresh()
        bar.close()
        self.tracer.flush()
        return [self.finished[rid] for rid in flat]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Yield this request's deltas as the engine steps (other queued requests run alongside)."""
        (rid,) = self.add_request(prompt, (params or SamplingParams()).replace(n=1))
        while True:
            for out in self.step():
                if out.req_id == rid:
                    yield out
                    if out.finished:
                        self.tracer.flush()
                        return

    def close(self) -> None:
        self.tracer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def memory_sink(self) -> MemorySink | None:
        return next((s for s in self.tracer.sinks if isinstance(s, MemorySink)), None)


def _progress(enabled: bool, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="generating", unit="tok")


__all__ = ["Engine", "StepFailed", "Tracer"]
