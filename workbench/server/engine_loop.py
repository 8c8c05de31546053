"""The engine beside the event loop: one thread steps the engine, asyncio handlers never block on it.

Owns: the engine thread (the only caller of `Engine.step()`), submitting requests from handlers
(`submit` -> `RequestHandle` with a bounded, coalescing output buffer per prompt), abort (once per
handle, whoever asks first), handing each step's outputs to the handles with one
`loop.call_soon_threadsafe` per step with their hand-off times, per-step logprobs for streaming,
a snapshot of engine gauges for /metrics, failures inside a step (the requests that were running
get an error and are aborted; the engine keeps serving) and an orderly stop. Does not own:
OpenAI shapes (serving.py) or the live trace fan-out (event_hub.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from workbench.engine.api import EngineAPI, StepFailed
from workbench.engine.output.output import RequestOutput, StepOutput, TokenLogprob
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.server.admission import AdmissionLimits, Admitter, Job
from workbench.server.heap import IdleSchedule, release_idle_memory
from workbench.server.output_buffer import OutputBuffer, StreamLimits
from workbench.trace.events import Stamp
from workbench.trace.latency import Handoff

log = logging.getLogger("workbench.server")


class EngineUnavailable(RuntimeError):
    """The loop is draining or stopped: new requests are refused (HTTP 503)."""


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One request's part of one step as a handler receives it, or an error that ends the request."""

    req_id: str
    step: StepOutput | None
    logprobs: list[TokenLogprob] | None = None  # of step.new_token_ids, when the request asked
    error: str | None = None
    handoff: Handoff | None = None  # when the engine produced it and handed it over (latency stamps)

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.step is not None and self.step.finished)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Engine gauges as of the end of the last step (read by /metrics and /health)."""

    step: int = 0
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_total: int = 0
    step_time: float = 0.0


class RequestHandle:
    """One submitted prompt: its request ids (n of them) and the bounded buffer their outputs arrive in."""

    def __init__(self, req_ids: list[str], limits: StreamLimits | None = None) -> None:
        self.req_ids = req_ids
        self.queue = OutputBuffer(limits)  # coalesces deltas while the reader is behind (output_buffer.py)
        self.open = set(req_ids)
        self.outputs: dict[str, RequestOutput] = {}
        self.error: str | None = None
        self.aborted: str | None = None  # the reason of the one abort that took effect
        self.job: Job | None = None  # its prompts on their way into the engine (admission.py)
        self._abort_lock = threading.Lock()

    def claim_abort(self, reason: str) -> bool:
        """True for the first abort of a still-open handle (disconnect, timeout and shutdown may race)."""
        with self._abort_lock:
            if self.aborted is not None or not self.open:
                return False
            self.aborted = reason
            return True

    @property
    def done(self) -> bool:
        return not self.open

    def index(self, req_id: str) -> int:
        return self.req_ids.index(req_id)

    async def items(self) -> AsyncIterator[StreamItem]:
        """Yield items until every request of this prompt finished, or one failed."""
        while self.open:
            item = await self.queue.get()
            if item.error is not None:
                self.error = item.error
                self.open.clear()
            elif item.step is not None and item.step.finished:
                self.open.discard(item.req_id)
                if item.step.output is not None:
                    self.outputs[item.req_id] = item.step.output
            yield item

    async def result(self) -> dict[str, RequestOutput]:
        """Wait for every request; the outputs by request id (raises RuntimeError on an engine error)."""
        async for _ in self.items():
            pass
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.outputs


class EngineLoop:
    """Runs `engine.step()` on its own thread while there is work, and routes outputs to handles."""

    def __init__(self, engine: EngineAPI, *, on_finished: Callable[[RequestOutput], None] | None = None,
                 idle_wait: float = 0.1, limits: StreamLimits | None = None,
                 admission: AdmissionLimits | None = None) -> None:
        self.engine = engine
        self.on_finished = on_finished
        self.idle_wait = idle_wait
        self.limits = limits or StreamLimits()
        self.stats = EngineStats(kv_total=engine.kv_total())
        self.accepting = True
        self.recent_aborts: deque[tuple[str, int]] = deque(maxlen=1024)  # (req_id, engine step when asked)
        self.failures = 0
        self._handles: dict[str, RequestHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.admission_limits = admission or AdmissionLimits()
        max_running = engine.config.max_running
        # one request holds at most a quarter of the running slots: the rest stay free for others, and
        # the steps they all share stay short, so a small request is not held behind a big one
        self._admitter = Admitter(engine, self.admission_limits.window(max_running), self._job_failed)
        self._stop = threading.Event()
        self._wake = threading.Event()

    # --- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="workbench-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    async def submit(self, prompts: list[Any], params: SamplingParams, req_id: str,
                     stream: bool = True) -> RequestHandle:
        """Validate and queue prompts (n choices each) as one handle; ValueError before any work starts.

        The prompts are admitted by the admission thread (admission.py: round robin between
        requests, each under its window of unfinished requests), so the event loop never waits for
        tokenizing or compiling a grammar and one large request cannot hold others behind it. This
        returns once the first window is in: a refused prompt among those is a ValueError (the
        others are aborted); one refused later ends the request with an error item. The handle is
        registered first: outputs can arrive before this returns.
        """
        if not self.accepting or not self.running:
            raise EngineUnavailable("the server is shutting down")
        self.admission_limits.check(len(prompts), params.n, params.max_new_tokens)
        bases = [req_id] if len(prompts) == 1 else [f"{req_id}-{j}" for j in range(len(prompts))]
        ids = [b if params.n == 1 else f"{b}-{i}" for b in bases for i in range(params.n)]
        handle = RequestHandle(ids, self.limits)
        handle.queue.bounded = stream  # the buffer limit guards against slow clients: streams only
        # weak references back to the handle: no reference cycle, so the handle (for a 5,000-prompt x n=16
        # request, 80,000 ids) is freed when its handler ends, not at some later full collection
        ref = weakref.ref(handle)
        handle.queue.on_overflow = lambda reason: self._overflowed(ref, reason)
        handle.job = Job(list(prompts), bases, params, owner=ref)
        for rid in ids:
            self._handles[rid] = handle
        try:
            await asyncio.shield(asyncio.wrap_future(self._admitter.submit(handle.job)))
        except asyncio.CancelledError:  # the client left while we were admitting: stop, abort what got in
            self.abort(handle, "client disconnected")
            raise
        except BaseException:
            for rid in self._admitter.cancel(handle.job):
                self.engine.abort(rid, "a sibling prompt was rejected")
            for rid in ids:
                self._forget(rid, handle)
            raise
        self._wake.set()
        return handle

    def _overflowed(self, ref: weakref.ref[RequestHandle], reason: str) -> None:
        handle = ref()
        if handle is not None:
            self.abort(handle, reason)

    def _job_failed(self, job: Job, message: str) -> None:
        """Admission thread: a later prompt was refused; end the request with an error item."""
        for rid in job.admitted:
            self.engine.abort(rid, "a sibling prompt was rejected")
        handle = job.owner()
        if handle is None:  # its handler has ended: nobody is left to tell
            return
        try:
            self._loop.call_soon_threadsafe(self._fail_handle, handle, message)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _fail_handle(self, handle: RequestHandle, message: str) -> None:
        for rid in handle.req_ids:
            self._forget(rid, handle)
        handle.queue.put_nowait(StreamItem(handle.req_ids[0], None, error=message))

    def abort(self, handle: RequestHandle, reason: str = "client disconnected") -> bool:
        """Abort every unfinished request of `handle` once; the engine frees their KV at its next step.
        Prompts not admitted yet are dropped: admission of this request stops at once.

        Idempotent and thread-safe: when disconnect, send timeout and shutdown race, the first reason
        wins (an `aborted` stamp records it) and the others return False.
        """
        if not handle.claim_abort(reason):
            return False
        admitted = set(self._admitter.cancel(handle.job)) if handle.job is not None else set(handle.open)
        tracer, step = self.engine.tracer, self.engine.step_no
        for rid in list(handle.open):
            if rid not in admitted:  # never reached the engine: nothing will ever arrive for it
                handle.open.discard(rid)
                self._forget(rid, handle)
                continue
            self.recent_aborts.append((rid, step))
            self.engine.abort(rid, reason)
            if tracer.on:
                tracer.emit(Stamp(step=step, req_id=rid, t=time.perf_counter(), stage="aborted",
                                  detail={"reason": reason}))
        self._wake.set()
        return True

    @property
    def pending_prompts(self) -> int:
        """Prompts of running requests not admitted into the engine yet."""
        return self._admitter.pending_prompts

    @property
    def open_requests(self) -> int:
        """HTTP requests (handles) not finished yet."""
        return len({id(h) for h in self._handles.values()})

    def end_all(self, message: str) -> None:
        """Abort every open handle and end it with an error item now (the drain time ran out)."""
        for handle in {id(h): h for h in self._handles.values()}.values():
            self.abort(handle, "server shutting down")
            self._fail_handle(handle, message)

    def begin_drain(self) -> None:
        """Refuse new requests (503); requests already running continue."""
        self.accepting = False

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop the engine thread; requests still open are aborted (reason "server shutting down", their
        KV freed by one last pass of the engine thread) and end with an error item."""
        self.accepting = False
        for handle in {id(h): h for h in self._handles.values()}.values():
            self.abort(handle, "server shutting down")
        self._admitter.stop()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        for rid, handle in list(self._handles.items()):
            handle.queue.put_nowait(StreamItem(rid, None, error="the server is shutting down"))
        self._handles = {}

    def _forget(self, rid: str, handle: RequestHandle) -> None:
        """Unregister `rid` if `handle` holds it; an emptied table is replaced, since a dict never
        shrinks (after a 5,000-prompt x n=16 request its 80,000 slots, 1.9 MB, would stay)."""
        if self._handles.get(rid) is handle:
            del self._handles[rid]
            if not self._handles:
                self._handles = {}

    def _deliver(self, items: list[StreamItem]) -> None:
        for item in items:
            handle = self._handles.get(item.req_id)
            if handle is None:
                continue
            handle.queue.put_nowait(item)
            if item.finished:
                self._forget(item.req_id, handle)
                if handle.job is not None:
                    self._admitter.finished(handle.job)

    # --- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine, schedule, busy = self.engine, IdleSchedule(), False
        while not self._stop.is_set():
            if not engine.has_work():
                now = time.perf_counter()
                if busy:
                    busy = False
                    schedule.went_idle(now)
                if schedule.due(now):
                    # idle a while: what the finished requests left goes back to the OS. Not at every
                    # idle moment: a bulk request whose window all finished together leaves the engine
                    # idle for a step, and a collection, a heap trim (whose pages fault back in) and
                    # fresh sampler buffers there cost every request a step's worth (py-spy: 3% of the
                    # engine thread under a 5,000-prompt request)
                    engine.release_buffers()  # the sampler's [max running, vocab] scratch
                    release_idle_memory()
                self._wake.wait(schedule.wait(now, self.idle_wait))
                self._wake.clear()
                continue
            busy = True
            self._step()
        self._drain_aborts()

    def _step(self) -> None:
        """One engine step, its outputs posted to the event loop. A method of its own so that nothing
        of the step stays referenced from `_run`'s frame while the engine sits idle (issue 19)."""
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as exc:  # a failure inside a step: end the affected requests, keep serving
            self._post(self._fail_running(exc))
            return
        items = [self._item(o) for o in outs]
        self.stats = self._snapshot(time.perf_counter() - t0)
        if items:
            self._post(items)

    def _drain_aborts(self) -> None:
        """On stop: let the engine act on aborts asked for (shutdown's own among them) before the thread ends."""
        if not self.engine.has_work():
            return
        try:
            outs = self.engine.step()
        except Exception:
            log.exception("engine step failed while stopping")
            return
        self._post([self._item(o) for o in outs])

    def _post(self, items: list[StreamItem]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, items)
        except RuntimeError:  # event loop closed under us: nobody is left to deliver to
            self._stop.set()

    def _item(self, out: StepOutput) -> StreamItem:
        timing = self.engine.timing(out.req_id)
        handoff = None
        if timing is not None and out.new_token_ids:
            clock = self.engine.clock
            handoff = Handoff(self.engine.step_no, clock.start, clock.scheduled, clock.forward_end, clock.sampled,
                              timing.last_mark, time.perf_counter(), timing.arrival)
        if out.finished:
            self.engine.forget(out.req_id)
            if self.on_finished is not None and out.output is not None:
                try:
                    self.on_finished(out.output)
                except Exception:
                    log.exception("on_finished callback failed")
        return StreamItem(out.req_id, out, out.logprobs, handoff=handoff)

    def _fail_running(self, exc: Exception) -> list[StreamItem]:
        self.failures += 1
        log.error("engine step failed", exc_info=exc)
        if isinstance(exc, StepFailed):  # the engine already ended that step's requests and freed their KV
            affected = exc.affected
            exc = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
        else:
            affected = self.engine.running_ids() or self.engine.waiting_ids()
        message = f"the engine failed while running this request ({type(exc).__name__})"
        for rid in affected:
            self.engine.abort(rid, "engine error")
        return [StreamItem(rid, None, error=message) for rid in affected]

    def _snapshot(self, step_time: float) -> EngineStats:
        engine = self.engine
        return EngineStats(step=engine.step_no, running=len(engine.running_ids()), waiting=len(engine.waiting_ids()),
                           kv_used=engine.kv_used(), kv_total=engine.kv_total(), step_time=step_time)


