"""Live mode: follow a running server's `/debug/events` SSE stream into an in-memory trace.

Owns: `LiveTrace` (a `TraceSource` that grows as events arrive, keeping the newest `max_steps`
steps), `events_url` (what `--live URL` connects to), `parse_sse` (the `data: <json>` framing) and
`follow_sse` (the async loop a Textual worker runs: connect, parse, hand batches of events over,
reconnect with backoff). Never touches a widget: it calls the callbacks it is given, which post
messages. Does not own the server side (workbench/server) or drawing.
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any

from workbench.trace.events import Event, RequestAdded, RequestFinished, event_from_json
from workbench.trace.format import STEP_COLUMNS, StepSummary
from workbench.trace.reader import RequestInfo, StepInfo

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


class LiveTrace:
    """An in-memory trace that grows as events arrive (thread-safe; the newest `max_steps` steps kept)."""

    finished = False

    def __init__(self, url: str, max_steps: int = 20_000) -> None:
        self.name = url
        self.meta: dict[str, Any] = {"live": url}
        self.max_steps = max_steps
        self.num_events = 0
        self._lock = threading.Lock()
        self._events: dict[int, list[Event]] = {}
        self._summaries: dict[int, StepSummary] = {}
        self._infos: dict[int, StepInfo] = {}
        self._order: list[int] = []  # step numbers, sorted
        self._added: dict[str, RequestAdded] = {}
        self._finished: dict[str, RequestFinished] = {}

    def add(self, events: Iterable[Event]) -> tuple[set[int], set[str]]:
        """Append events; return the steps and requests they touched."""
        steps, reqs = set(), set()
        with self._lock:
            for event in events:
                self.num_events += 1
                self._events.setdefault(event.step, []).append(event)
                summary = self._summaries.setdefault(event.step, StepSummary(step=event.step))
                summary.add(self.num_events, event.kind, float(event.t), event.payload())
                steps.add(event.step)
                if event.req_id is not None:
                    reqs.add(event.req_id)
                if isinstance(event, RequestAdded) and event.req_id is not None:
                    self._added.setdefault(event.req_id, event)
                elif isinstance(event, RequestFinished) and event.req_id is not None:
                    self._finished[event.req_id] = event
            for step in steps:
                if step not in self._infos:
                    bisect.insort(self._order, step)
                self._infos[step] = _step_info(self._summaries[step])
            excess = len(self._order) - self.max_steps
            if excess > 0:
                for old in self._order[:excess]:
                    del self._events[old], self._summaries[old], self._infos[old]
                del self._order[:excess]
        return steps, reqs

    def steps(self) -> list[StepInfo]:
        with self._lock:
            return [self._infos[s] for s in self._order]

    def step(self, n: int) -> list[Event]:
        with self._lock:
            return list(self._events.get(int(n), ()))

    def events(self, kind: str | Sequence[str] | None = None, req_id: str | None = None,
               step_range: tuple[int, int] | None = None, limit: int | None = None) -> Iterator[Event]:
        kinds = None if kind is None else ({kind} if isinstance(kind, str) else set(kind))
        with self._lock:
            numbers = list(self._order)
            if step_range is not None:
                numbers = [s for s in numbers if step_range[0] <= s <= step_range[1]]
            matched = [e for s in numbers for e in self._events[s]
                       if (kinds is None or e.kind in kinds) and (req_id is None or e.req_id == req_id)]
        return iter(matched[:limit] if limit is not None else matched)

    def requests(self) -> list[RequestInfo]:
        with self._lock:
            ids = list(self._added) + [r for r in self._finished if r not in self._added]
            return [RequestInfo(r, self._added.get(r), self._finished.get(r)) for r in ids]

    def refresh(self) -> int:
        return 0  # events are pushed in by `add`

    def close(self) -> None:
        pass


def _step_info(s: StepSummary) -> StepInfo:
    values = dict(zip(STEP_COLUMNS, s.row()))
    values["req_ids"] = tuple(s.req_ids)
    return StepInfo(**values)


def parse_sse(lines: Iterable[str]) -> Iterator[dict[str, Any] | None]:
    """SSE lines -> each event's JSON object; None for `[DONE]` (workbench.sse_client, any line ending)."""
    from workbench.sse_client import parse_sse_lines

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
                    from workbench.sse_client import aiter_sse_json

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
