"""Debug routes: live trace events over SSE, trace downloads by id, and the live page.

Owns: `/debug/events` (filter `kind=a,b` and `request=<id>`; each subscriber gets a bounded buffer,
and the stream carries a `server.stats` record about once a second with the subscriber's drop
count and the engine gauges), `/debug/traces` and `/debug/traces/{id}`, and `/` (static/index.html).
Does not own: the fan-out (event_hub.py), trace listing rules (traces.py) or the page's logic
(static/app.js).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.background import BackgroundTask

from workbench.server.errors import APIError, bad_request
from workbench.server.event_hub import Subscriber, TooManySubscribers
from workbench.server.serving import ServerState
from workbench.server.sse import EventStreamResponse, sse_frame
from workbench.server.traces import find_trace, list_traces, snapshot
from workbench.trace.events import EVENT_TYPES

STATIC_DIR = Path(__file__).parent / "static"
STATS_EVERY = 1.0  # seconds between server.stats records on an event stream
BATCH_EVERY = 0.05  # seconds a subscriber waits after sending a batch, so that the next one gathers more

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.workbench


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@router.get("/debug/events")
async def debug_events(request: Request, kind: str | None = None, request_id: str | None = Query(None, alias="request"),
                       buffer: int = Query(4096, ge=1, le=65536)) -> Response:
    state = _state(request)
    kinds = _split(kind)
    unknown = sorted(set(kinds) - set(EVENT_TYPES))
    if unknown:
        raise bad_request(f"kind: unknown event kinds {unknown}; known kinds are {sorted(EVENT_TYPES)}", "kind")
    try:
        sub = state.hub.subscribe(asyncio.get_running_loop(), kinds or None, _split(request_id) or None, buffer)
    except TooManySubscribers as exc:
        raise APIError(503, str(exc), code="too_many_subscribers") from None
    return EventStreamResponse(_event_frames(state, sub))


def _stats(state: ServerState, sub: Subscriber) -> dict[str, object]:
    s = state.loop.stats
    return {"kind": "server.stats", "step": s.step, "running": s.running, "waiting": s.waiting,
            "kv_used": s.kv_used, "kv_total": s.kv_total, "dropped": sub.dropped, "delivered": sub.delivered}


async def _event_frames(state: ServerState, sub: Subscriber) -> AsyncIterator[bytes]:
    try:
        yield sse_frame({**_stats(state, sub), "kind": "server.hello", "model": state.model_name,
                         "engine": state.hub.meta.get("engine"), "trace_level": state.engine.tracer.level})
        last = time.monotonic()
        while state.loop.accepting:  # a draining server ends its debug streams so shutdown can finish
            events = await sub.next_batch(timeout=STATS_EVERY)
            frames = [state.hub.frame(e) for e in events]
            if time.monotonic() - last >= STATS_EVERY:
                frames.append(sse_frame(_stats(state, sub)))
                last = time.monotonic()
            if frames:
                yield b"".join(frames)
                # at most BATCH_EVERY batches a second per subscriber: a hundred of them then cost a
                # hundred wake-ups per interval, not a hundred per engine step
                await asyncio.sleep(BATCH_EVERY)
    finally:
        state.hub.unsubscribe(sub)


def _active_path(state: ServerState) -> str | None:
    return getattr(state.trace_writer, "path", None)


@router.get("/debug/traces")
async def debug_traces(request: Request) -> JSONResponse:
    state = _state(request)
    entries = list_traces(state.trace_dir, _active_path(state))
    return JSONResponse({"object": "list", "data": [e.to_json() for e in entries]})


@router.get("/debug/traces/{trace_id}")
async def debug_trace_download(trace_id: str, request: Request) -> Response:
    state = _state(request)
    entry = find_trace(state.trace_dir, trace_id, _active_path(state))
    if entry is None:
        raise APIError(404, "no trace with that id; GET /debug/traces lists them", param="trace_id",
                       code="trace_not_found")
    filename = f"{entry.id}.wbtrace"
    if not entry.active:
        return FileResponse(entry.path, media_type="application/vnd.sqlite3", filename=filename)
    # the live file: flush what the engine has emitted so far, then copy it consistently (no torn pages)
    await asyncio.to_thread(state.trace_writer.flush)
    tmp = await asyncio.to_thread(snapshot, entry.path)
    return FileResponse(tmp, media_type="application/vnd.sqlite3", filename=filename,
                        background=BackgroundTask(os.unlink, tmp))


@router.get("/", include_in_schema=False)
async def live_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")
