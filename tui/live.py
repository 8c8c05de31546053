"""Live mode: follow a running server's `/debug/events` SSE stream into an in-memory trace.

Owns: `LiveTrace` (the shared in-memory trace model of `workbench.trace.live`, named after the URL,
keeping the newest `max_steps` steps), `events_url` (what `--live URL` connects to), `parse_sse` (the `data: <json>` framing) and
`follow_sse` (the async loop a Textual worker runs: connect, parse, hand batches of events over,
reconnect with backoff). Never touches a widget: it calls the callbacks it is given, which post
messages. Does not own the server side (workbench/server) or drawing.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from workbench.trace.events import Event, event_from_json
from workbench.trace.live import LiveEvents

EVENTS_PATH = "/debug/events"
FLUSH_SECONDS = 0.05  # hand events to the UI at least this often while they arrive


def events_url(url: str) -> str:
    """`http://host:port` (or any path on it) -> the server's `/debug/events` URL; ValueError otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--live must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(EVENTS_PATH):
        path += EVENTS_PATH
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class LiveTrace(LiveEvents):
    """The live server's trace: an in-memory trace (`workbench.trace.live.LiveEvents`) named after the
    URL, keeping the newest `max_steps` steps."""

    def __init__(self, url: str, max_steps: int = 20_000) -> None:
        super().__init__(name=url, meta={"live": url}, max_steps=max_steps)


def parse_sse(lines: Iterable[str]) -> Iterator[dict[str, Any] | None]:
    """SSE lines -> each event's JSON object; None for `[DONE]` (workbench.clients.sse, any line ending)."""
    from workbench.clients.sse import parse_sse_lines

    return parse_sse_lines(lines)


def describe_server(info: dict[str, Any]) -> str:
    """A `server.hello` / `server.stats` record as a status-line fragment."""
    parts = [f"server step {info.get('step', '?')}", f"running {info.get('running', '?')}",
             f"waiting {info.get('waiting', '?')}", f"KV {info.get('kv_used', '?')}/{info.get('kv_total', '?')}"]
    if info.get("dropped"):
        parts.append(f"{info['dropped']} events dropped (client too slow)")
    return " · ".join(parts)


async def follow_sse(url: str, on_events: Callable[[list[Event]], None], on_status: Callable[[str], None],
                     on_info: Callable[[dict[str, Any]], None] | None = None, api_key: str | None = None,
                     retry_max: float = 5.0) -> None:
    """Stream events from `url` forever (until cancelled), reconnecting with backoff on failure.

    Trace events go to `on_events` in batches; the server's own records (`server.hello`,
    `server.stats`) go to `on_info`; connection changes go to `on_status` as text.
    """
    import httpx

    headers = {"Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    delay = 0.25
    while True:
        try:
            on_status("connecting")
            async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as client:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        await response.aread()
                        raise ConnectionError(f"HTTP {response.status_code}: {_error_message(response)}")
                    on_status("connected")
                    delay = 0.25
                    from workbench.clients.sse import aiter_sse_json

                    await _pump(aiter_sse_json(response), on_events, on_info or (lambda info: None))
            on_status("stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # refused, reset, bad status: tell the user and retry
            reason = str(exc) if isinstance(exc, ConnectionError) else type(exc).__name__
            on_status(f"disconnected ({reason}); retrying in {delay:.1f}s")
        await asyncio.sleep(delay)
        delay = min(delay * 2, retry_max)


def _error_message(response: Any) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the reason phrase."""
    try:
        return str(response.json()["error"]["message"])[:200]
    except Exception:  # not JSON, or not that shape
        return str(response.reason_phrase)


async def _pump(objects: AsyncIterator[dict[str, Any] | None], on_events: Callable[[list[Event]], None],
                on_info: Callable[[dict[str, Any]], None]) -> None:
    """Take the stream's objects; a flusher hands what arrived over every FLUSH_SECONDS (one loop: no races)."""
    batch: list[Event] = []

    def flush() -> None:
        if batch:
            out = batch[:]
            batch.clear()
            on_events(out)

    async def flusher() -> None:
        while True:
            await asyncio.sleep(FLUSH_SECONDS)
            flush()

    task = asyncio.create_task(flusher())
    try:
        async for obj in objects:
            if obj is None:
                return  # [DONE]
            if str(obj.get("kind", "")).startswith("server."):
                on_info(obj)
                continue
            try:
                batch.append(event_from_json(obj))
            except (TypeError, ValueError, KeyError):
                continue  # an event this viewer does not know: skip it, keep following
            if len(batch) >= 1024:
                flush()
    finally:
        task.cancel()
        flush()
