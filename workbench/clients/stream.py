"""The measuring half of `workbench client`: streaming requests that time every frame, and the server's view.

Owns: `StreamRecord` (one streamed request as the client saw it: when it was sent, when each SSE
frame arrived, the text, the finish reason, the `X-Request-Id`), `stream_request` (one request in
one of three modes: `normal`, `slow` (the socket is read at most `read_size` bytes per read with
`read_delay` seconds between reads, through an httpcore network backend, so the server really sees
a slow reader) and `disconnect` (the connection is closed after some content frames)), and
`ServerView` (the server's own stamps and finish records for the same request ids, followed from
`/debug/events`). Does not own: the statistics or the printing (workbench/clients/load.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx

from workbench.trace.events import event_from_json
from workbench.trace.latency import RequestLatency

MODES = ("normal", "slow", "disconnect")


@dataclass(slots=True)
class Frame:
    """One SSE event as the client received it: its index in the response (`seq`, as the server counts)."""

    seq: int
    received: float  # time.perf_counter() when its last byte had been read
    size: int
    content: bool  # it carried output text (or a tool call)


@dataclass(slots=True)
class StreamRecord:
    index: int
    mode: str
    request_id: str | None = None
    sent: float = 0.0
    status: int | None = None
    frames: list[Frame] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    closed_early: bool = False  # disconnect mode: the client hung up

    @property
    def content_frames(self) -> list[Frame]:
        return [f for f in self.frames if f.content]

    @property
    def ttft(self) -> float | None:
        content = self.content_frames
        return content[0].received - self.sent if content else None

    @property
    def itl(self) -> list[float]:
        content = self.content_frames
        return [b.received - a.received for a, b in zip(content, content[1:])]


# --- a slow reader: an httpcore network stream that reads little and late ---------------------------


class _SlowStream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, delay: float, read_size: int) -> None:
        self.inner, self.delay, self.read_size, self.reads = inner, delay, read_size, 0

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self.reads:  # the first read brings the response headers; every later one waits
            await asyncio.sleep(self.delay)
        self.reads += 1
        return await self.inner.read(min(max_bytes, self.read_size), timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self.inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def start_tls(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _SlowStream(await self.inner.start_tls(*args, **kwargs), self.delay, self.read_size)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


class _SlowBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, delay: float, read_size: int) -> None:
        self.inner, self.delay, self.read_size = httpcore.AnyIOBackend(), delay, read_size

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _SlowStream(await self.inner.connect_tcp(*args, **kwargs), self.delay, self.read_size)

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _SlowStream(await self.inner.connect_unix_socket(*args, **kwargs), self.delay, self.read_size)

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def slow_transport(read_delay: float, read_size: int = 65536, recv_buffer: int | None = None) -> httpx.AsyncHTTPTransport:
    """An httpx transport whose connections read at most `read_size` bytes, `read_delay` s apart.

    `recv_buffer` sets SO_RCVBUF, so the kernel does not hide the slowness by buffering megabytes."""
    if read_delay < 0 or read_size < 1:
        raise ValueError(f"read_delay must be >= 0 and read_size >= 1, got {read_delay} and {read_size}")
    opts = [(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)] if recv_buffer else None
    transport = httpx.AsyncHTTPTransport(socket_options=opts)
    # httpx has no public hook for the network backend; its pool is the one place to put it
    transport._pool = httpcore.AsyncConnectionPool(network_backend=_SlowBackend(read_delay, read_size),
                                                   socket_options=opts, max_connections=None)
    return transport


# --- one streamed request ----------------------------------------------------------------------------


def _frame_content(data: dict[str, Any]) -> tuple[bool, str, str | None]:
    """(carries output, its text, finish reason) of one parsed chunk (chat or completions)."""
    text, reason, content = "", None, False
    for choice in data.get("choices") or ():
        delta = choice.get("delta")
        piece = (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
        calls = delta.get("tool_calls") if isinstance(delta, dict) else None
        content = content or bool(piece) or bool(calls)
        text += piece
        reason = choice.get("finish_reason") or reason
    return content, text, reason


def _take_frame(record: StreamRecord, raw: bytes, received: float) -> bool:
    """Record one SSE event; True at `[DONE]`."""
    seq = len(record.frames)
    payload = raw.decode("utf-8", "replace").removeprefix("data: ").strip()
    if payload == "[DONE]":
        record.frames.append(Frame(seq, received, len(raw) + 2, False))
        return True
    try:
        data = json.loads(payload)
    except ValueError:
        data = {}
    if isinstance(data.get("error"), dict):
        record.error = str(data["error"].get("message"))
    content, text, reason = _frame_content(data)
    record.frames.append(Frame(seq, received, len(raw) + 2, content))
    record.text += text
    record.finish_reason = reason or record.finish_reason
    return False


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], *, index: int = 0,
                         mode: str = "normal", disconnect_after: int = 3,
                         record: StreamRecord | None = None) -> StreamRecord:
    """POST one streaming request and time every frame. In `disconnect` mode the client hangs up after
    `disconnect_after` content frames; `slow` mode needs `client` built on `slow_transport`. Pass
    `record` to watch it fill while the request runs."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    record = record or StreamRecord(index, mode)
    record.mode = mode
    record.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            record.status, record.request_id = resp.status_code, resp.headers.get("x-request-id")
            if resp.status_code != 200:
                record.error = (await resp.aread()).decode("utf-8", "replace")[:300]
                return record
            buf = b""
            async for chunk in resp.aiter_raw():
                received = time.perf_counter()
                buf += chunk
                while b"\n\n" in buf:
                    raw, buf = buf.split(b"\n\n", 1)
                    if _take_frame(record, raw, received):
                        return record
                    if mode == "disconnect" and len(record.content_frames) >= disconnect_after:
                        record.closed_early = True
                        return record  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


# --- the server's view of the same requests ---------------------------------------------------------


class ServerView:
    """The server's stamps and finish records for our requests, from `/debug/events` (kind-filtered)."""

    def __init__(self) -> None:
        self.events: dict[str, list[Any]] = {}
        self.ready = asyncio.Event()
        self.dropped = 0
        self.error: str | None = None

    async def follow(self, client: httpx.AsyncClient, base_url: str) -> None:
        params = {"kind": "stamp,request.finished", "buffer": "65536"}
        try:
            async with client.stream("GET", base_url.rstrip("/") + "/debug/events", params=params) as resp:
                if resp.status_code != 200:
                    self.error = f"/debug/events answered {resp.status_code}"
                    return
                from workbench.clients.sse import aiter_sse_json

                async for obj in aiter_sse_json(resp):
                    if obj is not None:
                        self._take(obj)
        except (httpx.HTTPError, ValueError) as exc:
            self.error = f"/debug/events: {type(exc).__name__}"
        finally:
            self.ready.set()  # never leave a waiter hanging

    def _take(self, obj: dict[str, Any]) -> None:
        kind = obj.get("kind")
        if kind in ("server.hello", "server.stats"):
            self.dropped = int(obj.get("dropped") or 0)
            self.ready.set()
            return
        rid = obj.get("req_id")
        if rid:
            try:
                self.events.setdefault(rid, []).append(event_from_json(obj))
            except ValueError:
                pass  # a newer server's event kind: not ours to time

    def complete(self, request_id: str) -> bool:
        """The server has closed its books on this request (its `stream_end` stamp arrived)."""
        return any(getattr(e, "stage", None) == "stream_end" for e in self.events.get(request_id, ()))

    async def wait_for(self, request_ids: list[str], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.error is None and not all(map(self.complete, request_ids)):
            await asyncio.sleep(0.05)

    def latency(self, request_id: str) -> RequestLatency | None:
        events = self.events.get(request_id)
        return RequestLatency.from_events(request_id, events) if events else None
