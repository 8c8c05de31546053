"""The Engine: requests in, the pipeline once per `step()`, outputs out.

`Engine.step()` reads as the pipeline (schedule -> ForwardBatch -> ModelRunner -> logits ->
Sampler -> output stage: detokenizer, finish) with one call per stage; each step's state lives in
the `StepContext` it creates and hands down, and the stages report to the trace observer at its
named seams. Owns: building the parts and handing each only what it needs (the scheduler its
prefix cache and speculative headroom, the speculative worker the target's parts and the output
stage), request admission (tokenize, validate, refuse what can never fit), the step loop, abort,
the public API (`generate`, `stream`, `add_request`, `abort`) and the facts a server reads
(`max_context_len`, `kv_used`, ...): api.py's `EngineAPI` lists what outside code may use. Thread-safe entry points (`add_request`, `abort`) queue work
that the stepping thread picks up at the start of its next step.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from workbench.engine import tracing, whatif
from workbench.engine.api import StepFailed
from workbench.engine.config import CpuKernels, EngineArgs, EngineConfig
from workbench.engine.output.finish import FinishResult
from workbench.engine.output.output import RequestOutput, StepOutput
from workbench.engine.output.postprocess import OutputProcessor
from workbench.engine.output.stage import NewTokens, OutputStage
from workbench.engine.prompts import (
    Prompt,
    as_prompt_list,
    check_prompt_chars,
    longest_token_chars,
    tokenize_prompt,
)
from workbench.engine.run import fastmode, variants
from workbench.engine.run.capture import Capturer
from workbench.engine.run.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from workbench.engine.run.model_runner import ModelRunner
from workbench.engine.sample.grammar import GrammarBackend
from workbench.engine.sample.logprobs import store_prompt_logprobs
from workbench.engine.sample.penalties import bias_tensors
from workbench.engine.sample.sampler import Sampler, SamplingBatchInfo
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.sched.batch import PrefillChunk, Released, ScheduleBatch
from workbench.engine.sched.memory import Memory
from workbench.engine.sched.prefix_cache import PrefixCache
from workbench.engine.sched.request import Req
from workbench.engine.sched.scheduler import Scheduler
from workbench.engine.speculative.config import Target
from workbench.engine.speculative.worker import SpecWorker, make_spec_worker
from workbench.engine.step import StepContext
from workbench.engine.timing import ReqTiming, StepClock
from workbench.models.loader import LoadedModel, gc_paused, load_model
from workbench.trace.recorder import MemorySink, Sink, Tracer


class Engine:
    """The engine (what outside code may ask of it: api.py's `EngineAPI`).

    `Engine(model, args)` or `Engine(model, **fields of EngineArgs)`: the defaults are EngineArgs'.
    `trace` (a .wbtrace path), `trace_level`, `trace_sinks` and `capture` say what is recorded.
    """

    def __init__(self, model: str | LoadedModel = "smollm2", args: EngineArgs | None = None, *,
                 trace: str | None = None, trace_level: str = "summary", trace_sinks: list[Sink] | None = None,
                 capture: Any = None, **settings: Any) -> None:
        a = self.args = (args or EngineArgs()).replace(**settings)
        max_running, kernels = a.max_running, a.kernels
        spec, trace_topk = a.spec, a.trace_topk
        fastmode.check(kernels)  # a bad value fails before the model loads
        with gc_paused():  # the load allocates much and frees little (loader.gc_paused)
            self.loaded = model if isinstance(model, LoadedModel) else \
                load_model(model, device=a.device, dtype=a.dtype, huge_pages=a.huge_pages)
            self.runner = ModelRunner(self.loaded, kernels=kernels)
        self.tokenizer = self.loaded.tokenizer
        self.device = self.loaded.device
        self.vocab_size = self.runner.vocab_size
        max_ctx, kv_tokens = self._context_and_pool(a)
        self.memory = Memory(num_layers=self.runner.num_layers, kv_heads=self.runner.kv_heads,
                             head_dim=self.runner.head_dim, kv_tokens=kv_tokens, max_running=max_running,
                             max_context_len=max_ctx, dtype=self.runner.dtype, device=self.device,
                             slot_order=a.kv_slot_order)
        self.sampler = Sampler()
        self.outputs = OutputProcessor(self.tokenizer, max_ctx)
        # structured output: limits and compile budgets (grammar_limits.py), compiles tried in a worker first
        self.grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.outputs.eos_token_ids,
                                       a.grammar_limits)
        self.config = EngineConfig(
            model=self.loaded.spec, device=self.device, dtype=self.loaded.dtype, max_batch_tokens=a.max_batch_tokens,
            chunk_size=a.chunk_size, kv_tokens=kv_tokens, max_running=max_running, enable_mixed=a.enable_mixed,
            trace_topk=trace_topk, seed=a.seed, prefix_sharing=a.prefix_sharing, prefix_cache=a.prefix_cache,
            spec=spec if isinstance(spec, (str, dict, type(None))) else getattr(spec, "to_dict", spec.__str__)(),
            kernels=kernels, cpu_kernels=CpuKernels(**self.runner.kernel_report(counts=False)),  # what the runner chose at load
            kv_slot_order=a.kv_slot_order)
        self.trace_topk = trace_topk
        self.prefix_sharing = a.prefix_sharing
        self.tracer = self._make_tracer(trace, trace_level, trace_sinks)
        self._attention_records: dict[tuple[str, int | None], tuple[Any, list[dict[str, Any]]]] = {}
        self.observer = tracing.TraceObserver(self.tracer, self.memory.allocator, self.outputs.token_text, trace_topk,
                                              attention=self._attention_record, token_texts=self.outputs.token_texts)
        self.capture = Capturer(self.runner.model, capture, spec is not None, self.tracer)  # run/capture.py
        self.output_stage = OutputStage(self.outputs, self._release)
        self.finished: dict[str, RequestOutput] = self.output_stage.finished
        self.spec: SpecWorker | None = None
        if spec is not None:
            target = Target(self.runner, self.memory, self.sampler, self.tokenizer, self.device, self.loaded.dtype,
                            self.vocab_size, self.outputs.eos_token_ids)
            self.spec = make_spec_worker(spec, target, self.output_stage)
        self.scheduler = Scheduler(self.memory, max_batch_tokens=a.max_batch_tokens, chunk_size=a.chunk_size,
                                   max_context_len=max_ctx, enable_mixed=a.enable_mixed,
                                   prefix_cache=PrefixCache(self.memory.allocator) if a.prefix_cache else None,
                                   spec_headroom=self.spec.cfg.num_speculative_tokens if self.spec else 0)
        self._last = StepContext(0, self.observer)  # the last step's record (step 0: none ran yet)
        self.reqs: dict[str, Req] = {}
        self._inbox: queue.SimpleQueue[Req] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._token_chars: int | None = None  # longest vocabulary entry, found on the first prompt
        torch.manual_seed(a.seed)

    def _context_and_pool(self, a: EngineArgs) -> tuple[int, int]:
        """The context length (the model's, or a shorter `max_model_len`, vLLM's --max-model-len) and the
        KV pool's size in tokens (by default `max_running` full contexts, capped at 1 GiB of float32 KV)."""
        if a.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {a.max_running}")
        if a.max_model_len is not None:
            if isinstance(a.max_model_len, bool) or not 1 <= a.max_model_len <= self.runner.max_context_len:
                raise ValueError(f"max_model_len must be in [1, {self.runner.max_context_len}] (the model's "
                                 f"context), got {a.max_model_len!r}")
            self.runner.max_context_len = a.max_model_len
        max_ctx, kv_tokens = self.runner.max_context_len, a.kv_tokens
        if kv_tokens is None:
            per_token = 2 * self.runner.num_layers * self.runner.kv_heads * self.runner.head_dim * 4
            kv_tokens = min(a.max_running * max_ctx, (1 << 30) // per_token)
        if kv_tokens < 2:
            raise ValueError(f"kv_tokens must be >= 2, got {kv_tokens}")
        return max_ctx, kv_tokens

    def _make_tracer(self, path: str | None, level: str, sinks: list[Sink] | None) -> Tracer:
        """The tracer over the given sinks, plus a trace file at `path`, with the run's metadata."""
        all_sinks = list(sinks or [])
        if path is not None and level != "off":
            from workbench.trace.store import TraceWriter

            all_sinks.append(TraceWriter(path))
        # the limits on client constraints in force (issue 36): a trace says what a refused request was over
        return tracing.make_tracer(level, all_sinks, lambda: {**tracing.run_meta(
            self.config.to_dict(), self.loaded.identity(), self.tokenizer, level),
            "grammar_limits": dataclasses.asdict(self.grammars.limits)})

    # --- admission ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt | list[int]) -> list[int]:
        """Token ids of a prompt; a text too long to fit in the context is refused before tokenizing."""
        if self._token_chars is None:
            self._token_chars = longest_token_chars(self.tokenizer)
        check_prompt_chars(prompt, self.runner.max_context_len, self._token_chars)
        return tokenize_prompt(self.tokenizer, self.vocab_size, prompt)

    def add_request(self, prompt: Prompt | list[int], params: SamplingParams | None = None,
                    req_id: str | None = None, capture: Any = None) -> list[str]:
        """Validate and queue a request (n > 1 queues n; `capture`: capture_spec.py); returns its ids. Thread-safe."""
        arrival = time.perf_counter()
        params = params or SamplingParams()
        params.validate(self.vocab_size, self.grammars.limits, parse_grammar=False)  # compile() below parses
        prompt_ids = self.tokenize(prompt)
        self.scheduler.check_fits(len(prompt_ids), params.max_new_tokens)
        if params.grammar is not None:
            self.grammars.compile(*params.grammar)  # ValueError now, not a crash mid-step
        base = req_id or f"req-{next(self._ids)}"
        ids = [base] if params.n == 1 else [f"{base}-{i}" for i in range(params.n)]
        if any(rid in self.reqs for rid in ids):
            raise ValueError(f"req_id {base!r} is already in use")
        self.capture.admit(ids, capture)
        first = None
        for i, rid in enumerate(ids):
            seed = params.seed + i if params.seed is not None else None
            gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
            req = Req(rid, prompt, prompt_ids, params, generator=gen, parent_id=base if params.n > 1 else None,
                      share_prefix_from=first, arrival_time=arrival, timing=ReqTiming(arrival))
            first = first or req  # siblings copy the first one's prompt KV instead of recomputing it
            req.grammar = self.grammars.new_state(params)
            if params.logit_bias:  # its tensors now, on the caller's thread, not per step on the engine's
                req.bias = bias_tensors(params.logit_bias) if first is req else first.bias
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
        """One pass of the pipeline; returns what each request got this step."""
        results = self._drain_inbox()
        if not self.scheduler.has_work():
            return results
        ctx = self._last = StepContext(self._last.step + 1, self.observer)
        batch = self._schedule(ctx)
        if batch.mode is ForwardMode.IDLE:
            return results
        try:
            if self.spec is not None and batch.mode is ForwardMode.DECODE:
                return results + self.spec.step(ctx, batch)  # draft, verify, output stage
            fb = self._build_batch(ctx, batch)
            logits = self._forward(ctx, batch, fb)
            new = self._sample(ctx, batch, fb, logits)
            done = [c.req for c in batch.prefill if c.last_chunk]
            return results + self.output_stage.process(ctx, new) + self.output_stage.finish_scored(ctx, done)
        except Exception as exc:
            raise self._fail_step(ctx, batch, exc) from exc
        finally:
            ctx.fb = None  # `_last` keeps the step's number and clock, not its batch's tensors while idle

    def _schedule(self, ctx: StepContext) -> ScheduleBatch:
        batch = self.scheduler.schedule()
        ctx.clock.scheduled = time.perf_counter()
        if self.spec is not None:
            for req in batch.preempted:
                self.spec.release(req)
        ctx.obs.scheduled(ctx, batch, self.scheduler)
        return batch

    def _build_batch(self, ctx: StepContext, batch: ScheduleBatch) -> ForwardBatch:
        """ScheduleBatch -> ForwardBatch with the sampling info of its sampled rows."""
        ctx.forward_start = time.perf_counter()
        fb = ctx.fb = build_forward_batch(batch.mode, batch.rows(), self.memory, self.device)
        reqs = batch.reqs
        fb.sampling_info = SamplingBatchInfo.build([reqs[i] for i in fb.logits_owner], self.vocab_size,
                                                   self.device, eos_token_ids=self.outputs.eos_token_ids)
        fb.capture = self.capture.plan(fb, reqs)
        ctx.obs.batch_built(ctx, fb)
        return fb

    def _forward(self, ctx: StepContext, batch: ScheduleBatch, fb: ForwardBatch) -> torch.Tensor:
        """Run the model; the step's KV counts from here. Returns the logits of the sampled rows."""
        logits = self.runner.forward(fb)  # [num_sampled + num_prompt_logprob_rows, vocab]
        ctx.clock.forward_end = time.perf_counter()
        for chunk in batch.prefill:
            chunk.req.kv_len += chunk.length
        for req in batch.decode:
            req.kv_len += 1
        ctx.kv_counted = True
        if self.spec is not None:
            self.spec.on_extend(ctx, batch)  # a draft model prefills the same chunks
        logits = self._after_prefill(ctx, batch.prefill, fb, logits)  # [num_sampled, vocab]
        for chunk in batch.prefill:
            if not chunk.last_chunk:
                chunk.req.timing.account_chunk(ctx.clock)
        return logits

    def _sample(self, ctx: StepContext, batch: ScheduleBatch, fb: ForwardBatch, logits: torch.Tensor
                ) -> list[NewTokens]:
        """Sample the step's tokens and append them: from here on they are final."""
        clock, forward_s = ctx.clock, ctx.clock.forward_end - ctx.forward_start
        if not fb.logits_owner:  # only mid-prompt chunks ran: nothing to sample this step
            ctx.obs.forward_done(ctx, fb, forward_s, 0.0)
            return []
        reqs = batch.reqs
        sample_reqs = [reqs[i] for i in fb.logits_owner]
        sample = self.sampler(logits, fb.sampling_info, ctx.obs.topk)
        clock.sampled = time.perf_counter()
        ctx.obs.forward_done(ctx, fb, forward_s, clock.sampled - clock.forward_end)
        ctx.obs.sampled(ctx, sample_reqs, logits, sample)
        if fb.capture is not None:
            ctx.obs.captured(ctx, fb.capture.finish(logits, sample.next_token_ids, sample_reqs))
        self.output_stage.append(ctx, sample_reqs, sample)
        return [NewTokens(req, [tok]) for req, tok in zip(sample_reqs, sample.next_token_ids, strict=True)]

    def _fail_step(self, ctx: StepContext, batch: ScheduleBatch, exc: Exception) -> StepFailed:
        """End every request of a failed step with an error and free all of its KV, including the
        slots this step allocated but never filled; the engine goes on with the other requests."""
        if ctx.fb is not None and not ctx.kv_counted:
            self.memory.allocator.free(ctx.fb.out_cache_loc)  # not yet part of any request's kv_len
        message = f"the engine failed in step {ctx.step} ({type(exc).__name__})"
        affected = []
        for req in dict.fromkeys(batch.reqs):
            if not req.finished:
                req.error = message
                self.output_stage.finish(ctx, req, FinishResult("abort", {"type": "error", "message": message}))
                affected.append(req.req_id)
        ctx.obs.error(ctx, message, affected)
        return StepFailed(message, affected)

    def _after_prefill(self, ctx: StepContext, prefill: list[PrefillChunk], fb: ForwardBatch,
                       logits: torch.Tensor) -> torch.Tensor:
        """Store prompt logprobs from the extra logits rows; requests waiting for a prompt that finished
        its prefill copy its KV. Returns the sampling rows of `logits`."""
        num_sampled = len(fb.logits_owner)
        store_prompt_logprobs([c.req for c in prefill], fb.prompt_logprob_rows, logits[num_sampled:])
        for chunk in prefill:
            if chunk.last_chunk:
                for fork in self.scheduler.fork_waiting(chunk.req):
                    ctx.obs.forked(ctx, fork)
        return logits[:num_sampled]

    def _release(self, req: Req, reason: str) -> Released:
        """A request ended: its KV goes (kept by the prefix cache after stop or length), so does the
        drafter's state for it."""
        released = self.scheduler.remove(req, cache=reason in ("stop", "length"))
        self.capture.forget(req.req_id)
        if self.spec is not None:
            self.spec.release(req)
        return released

    def flush_prefix_cache(self) -> int:
        """Free every cached prefix (prefix_cache=True); returns the KV slots freed. Call from the
        stepping thread, between steps."""
        cache = self.scheduler.prefix_cache
        evicted = cache.clear() if cache is not None else []
        self.observer.evicted(self._last, evicted, "flush")
        return sum(len(e.tokens) for e in evicted)

    def _drain_inbox(self) -> list[StepOutput]:
        ctx = self._last  # between steps: events carry the last step's number, arrivals the next one's
        while not self._inbox.empty():
            req = self._inbox.get()
            req.arrival_step = ctx.step + 1
            if self.prefix_sharing and req.share_prefix_from is None:
                self.scheduler.share_prompt_prefix(req)
            self.scheduler.add(req)
            ctx.obs.request_added(req, req.arrival_step)
        results = []
        while not self._aborts.empty():
            rid, reason = self._aborts.get()
            req = self.reqs.get(rid)
            if req is None or req.finished:
                continue  # unknown or already finished: abort is idempotent
            req.abort_reason = reason
            results.append(self.output_stage.finish(ctx, req, FinishResult("abort", {"type": "abort",
                                                                                     "message": reason})).step_output())
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

    def _attention_record(self, model: str, layer_limit: int | None) -> list[dict[str, Any]]:
        """Per layer of a forward, the attention it ran (a draft model's from its own runner)."""
        draft = getattr(self.spec.drafter, "runner", None) if self.spec is not None else None
        runner = draft if model != "target" and draft is not None else self.runner
        # the runner's variants are fixed at load: built once per (model, layer limit), a copy each step
        known = self._attention_records.get((model, layer_limit))
        if known is None or known[0] is not runner.variants:
            known = self._attention_records[(model, layer_limit)] = (
                runner.variants, variants.trace_record(runner, layer_limit))
        return list(known[1])

    def close(self) -> None:
        self.grammars.close()  # its worker processes
        self.tracer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def memory_sink(self) -> MemorySink | None:
        return next((s for s in self.tracer.sinks if isinstance(s, MemorySink)), None)

    # --- facts between steps (what a server, a metrics exporter or a TUI reads; api.py) ------

    @property
    def step_no(self) -> int:
        """The number of the last step that ran (0 before the first)."""
        return self._last.step

    @property
    def clock(self) -> StepClock:
        """The stage clock of the last step."""
        return self._last.clock

    def max_context_len(self) -> int:
        return self.runner.max_context_len

    def kv_total(self) -> int:
        return self.memory.allocator.size

    def kv_used(self) -> int:
        return self.memory.allocator.used()

    def running_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduler.running]

    def waiting_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduler.waiting]

    def token_text(self, token_id: int) -> str:
        return self.outputs.token_text(token_id)

    def fill_token_text(self) -> int:
        """Decode the whole vocabulary into the token-text table now (a long-running server does
        this at start: OutputProcessor.fill_token_text says why); returns the number of tokens."""
        return self.outputs.fill_token_text()

    def timing(self, req_id: str) -> ReqTiming | None:
        """A live request's latency record (arrival, its stage marks), None once forgotten."""
        req = self.reqs.get(req_id)
        return req.timing if req is not None else None

    def release_buffers(self) -> None:
        """Hand back the sampler's scratch buffer (up to [max running, vocab] floats); an idle
        server calls it. Call from the stepping thread, between steps."""
        self.sampler.release_buffers()

    # --- what-if hooks (workbench fork; logic in whatif.py) -----------------------------------

    def force_token(self, req_id: str, position: int, token: int) -> None:
        """`token` becomes output `position` (0-based) of `req_id`, not the sampler's draw (traced as "forced")."""
        req = whatif.live(self.reqs, req_id, "force_token")
        whatif.force_token(req, position, token, self.vocab_size)

    def use_draws(self, req_id: str, draws: dict[int, float]) -> None:
        """Sample `req_id`'s output position p with the uniform `draws[p]` (a recorded run's) instead of
        a fresh draw: a fork then shares its parent's random numbers at every position."""
        whatif.use_draws(whatif.live(self.reqs, req_id, "use_draws"), draws)

    def update_params(self, req_id: str, **changes: Any) -> SamplingParams:
        """Change a queued or running request's sampling parameters for its following steps."""
        req = whatif.live(self.reqs, req_id, "update_params")
        return whatif.update_params(req, changes, self.vocab_size, self.scheduler.check_fits)


def _progress(enabled: bool, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="generating", unit="tok")


__all__ = ["Engine", "StepFailed", "Tracer"]
