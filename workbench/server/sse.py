"""Server-sent events: the one framing helper, and responses that notice a client going away.

Owns: `sse_frame` (every stream in the server is framed by it: `data: <json>\\n\\n`), `DONE` (the
`data: [DONE]` terminator), `EventStreamResponse` (streams frames while watching for the client's
disconnect, and always closes the frame generator so its `finally` runs: that is where a request
is aborted and its KV slots freed) and `until_disconnect` (the same watch for non-streaming
handlers). Does not own: what goes in the frames (serving.py, routes_debug.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("workbench.server")
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats replaced by None (JSON has no NaN; browsers reject it)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """Strict JSON (no NaN/Infinity), compact; a non-finite float becomes null."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False, default=str)
    except ValueError:
        return json.dumps(json_safe(value), separators=(",", ":"), allow_nan=False, ensure_ascii=False,
                          default=str)


def sse_frame(data: str | dict[str, Any] | BaseModel) -> bytes:
    """One SSE event: `data: <payload>\\n\\n`. A str is sent as is (it must not contain newlines)."""
    if isinstance(data, BaseModel):
        payload = data.model_dump_json()
    elif isinstance(data, str):
        payload = data
    else:
        payload = dumps(data)
    return b"data: " + payload.encode("utf-8") + b"\n\n"


DONE = sse_frame("[DONE]")


async def _watch_disconnect(receive: Receive) -> None:
    """Return when the client has gone (the request body was read before, so only disconnect remains)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStreamResponse(Response):
    """A `text/event-stream` response fed by an async iterator of frames.

    The frames are pumped while a second task waits for the client's disconnect; whichever ends
    first cancels the other, and the frame generator is always closed (`aclose`), so cleanup in
    its `finally` runs promptly even when the client vanished between two frames.
    """

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], status_code: int = 200) -> None:
        self.frames = frames
        self.status_code = status_code
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_watch_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            results = await asyncio.gather(pump, watch, return_exceptions=True)
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                await aclose()
        if isinstance(results[0], Exception) and not isinstance(results[0], OSError):
            log.error("event stream failed", exc_info=results[0])

    async def _pump(self, send: Send) -> None:
        async for frame in self.frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(work: Awaitable[T], receive: Receive) -> tuple[bool, T | None]:
    """Await `work` unless the client disconnects first: (True, result) or (False, None).

    On disconnect `work` is cancelled; the caller aborts whatever it started.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_watch_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()
