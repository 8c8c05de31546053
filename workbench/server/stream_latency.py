"""Latency at the socket: `X-Request-Id`, a stamp per frame, the send timeout and the per-request summary.

Owns: `RequestContext` (one per HTTP request, in a ContextVar, so `serving.submit` can `attach`
the engine request without threading a parameter through every handler) and `LatencyMiddleware`,
a pure ASGI middleware around the whole app that
- puts `X-Request-Id` on every response: the engine's request id (the id in the body, every chunk
  and the trace) once the request was submitted, else the client's own `X-Request-Id`, else a
  fresh one;
- for a request attached to an engine handle, stamps each body frame `serialized` (the frame's
  bytes reach the writer) and `written` (the write returned: the bytes are in the socket's
  buffers), with the hand-off times of the deltas the frame carries, through the engine's tracer;
- bounds every write by `StreamLimits.send_timeout`: a client that stops reading is aborted with
  reason "send timeout" (its KV freed) instead of holding the request forever;
- emits one `stream_end` stamp per request (`workbench.trace.latency.socket_summary`) and feeds
  the stream metrics.
Emitting from the event loop while the engine thread emits is safe: every sink the server
attaches locks (EventHub, MemorySink) or queues (TraceWriter). Does not own: the buffer
(output_buffer.py), the frames (serving_*.py, sse.py) or the arithmetic (workbench.trace.latency).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from workbench.trace.events import Stamp
from workbench.trace.latency import ChunkTiming, socket_summary

log = logging.getLogger("workbench.server")
HEADER = b"x-request-id"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class SendTimeout(TimeoutError):
    """A write to the client blocked longer than the send timeout (an OSError: streams end quietly)."""


@dataclass(slots=True)
class RequestContext:
    """One HTTP request's link to the engine: its request id, handle and the frames written so far."""

    request_id: str | None = None
    handle: Any = None  # engine_loop.RequestHandle
    received: float = field(default_factory=time.perf_counter)  # the request entered the server
    frames: int = 0  # body frames sent (a frame's index is its `seq`, as a client counts `data:` events)
    chunks: dict[str, list[ChunkTiming]] = field(default_factory=dict)


_CURRENT: ContextVar[RequestContext | None] = ContextVar("workbench_request_context", default=None)


def attach(request_id: str, handle: Any) -> None:
    """Tie the running HTTP request to its engine request (called once the engine accepted it)."""
    ctx = _CURRENT.get()
    if ctx is not None:
        ctx.request_id, ctx.handle = request_id, handle


def _client_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            text = value.decode("latin-1").strip()
            return text if _CLIENT_ID.fullmatch(text) else None
    return None


class LatencyMiddleware:
    """See the module docstring. `state` is the app's `ServerState` (engine, loop, metrics)."""

    def __init__(self, app: ASGIApp, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ctx = RequestContext()
        token = _CURRENT.set(ctx)
        fallback = _client_id(scope) or f"req-{uuid.uuid4().hex[:24]}"

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = (ctx.request_id or fallback).encode("latin-1")
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid)]}
            elif ctx.handle is not None and message["type"] == "http.response.body" and message.get("body"):
                await self._frame(ctx, send, message)
                return
            await self._send(ctx, send, message)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            _CURRENT.reset(token)
            if ctx.handle is not None:
                self._finish(ctx)

    async def _send(self, ctx: RequestContext, send: Send, message: Message) -> None:
        timeout = self.state.loop.limits.send_timeout
        if ctx.handle is None or timeout is None:
            await send(message)
            return
        try:
            async with asyncio.timeout(timeout):
                await send(message)
        except TimeoutError:
            self.state.loop.abort(ctx.handle, "send timeout")
            raise SendTimeout(f"a write to the client blocked for more than {timeout} s") from None

    async def _frame(self, ctx: RequestContext, send: Send, message: Message) -> None:
        """Write one body frame between its `serialized` and `written` stamps."""
        serialized = time.perf_counter()
        seq, size = ctx.frames, len(message["body"])
        ctx.frames += 1
        chunks = []
        for rid, taken in ctx.handle.queue.take_chunks().items():
            if taken.last is None:  # no tokens in it (an abort, a finish without text): nothing to time
                continue
            first = taken.first or taken.last
            chunk = ChunkTiming(seq, taken.tokens, taken.deltas, first, taken.last, taken.taken, serialized, None, size)
            recorded = ctx.chunks.setdefault(rid, [])
            recorded.append(chunk)  # written=None until the write returns (a stuck write stays visible)
            chunks.append((rid, recorded, len(recorded) - 1))
            self._emit(Stamp(step=taken.last.step, req_id=rid, t=serialized, stage="serialized", detail={
                "seq": seq, "step": taken.last.step, "tokens": taken.tokens, "deltas": taken.deltas, "bytes": size,
                "first_ready": first.ready, "output_done": taken.last.output_done, "ready": taken.last.ready,
                "taken": taken.taken}))
        await self._send(ctx, send, message)
        written = time.perf_counter()
        for rid, recorded, i in chunks:
            chunk = recorded[i] = replace(recorded[i], written=written)
            self._emit(Stamp(step=chunk.last.step, req_id=rid, t=written, stage="written",
                             detail={"seq": seq, "step": chunk.last.step, "bytes": size}))

    def _finish(self, ctx: RequestContext) -> None:
        """The request's `stream_end` summaries (one per choice) and its stream metrics."""
        handle = ctx.handle
        for rid in handle.req_ids:
            out = handle.outputs.get(rid)
            chunks = ctx.chunks.get(rid, [])
            summary = socket_summary(out.timings if out is not None else None, chunks, aborted=handle.aborted,
                                     max_pending_bytes=handle.queue.max_pending_bytes, received=ctx.received)
            step = chunks[-1].last.step if chunks else self.state.engine.step_no
            self._emit(Stamp(step=step, req_id=rid, t=time.perf_counter(), stage="stream_end", detail=summary))
            observe = getattr(self.state.metrics, "observe_stream", None)
            if observe is not None:
                observe(summary)

    def _emit(self, stamp: Stamp) -> None:
        tracer = self.state.engine.tracer
        if not tracer.on:
            return
        try:
            tracer.emit(stamp)
        except Exception:  # a closed trace file at shutdown must not fail the response
            log.debug("could not record a latency stamp", exc_info=True)


def wrap_app(app: Any, state: Any) -> None:
    """Put `LatencyMiddleware` outside Starlette's whole stack (outside ServerErrorMiddleware too), so
    even an unexpected 500 carries `X-Request-Id`."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: LatencyMiddleware(build(), state)
