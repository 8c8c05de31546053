"""Live trace events for HTTP subscribers: a tracer sink that never slows the engine.

Owns: `EventHub` (a `workbench.trace.recorder.Sink` the engine's tracer writes into) and its
`Subscriber`s, each with a filter (kinds, requests) and a bounded buffer (all of them share one budget). The engine thread only
appends to a buffer under a short lock, or counts a drop when the buffer is full; it never waits
on a slow client. The asyncio side is woken at most once per drained batch through
`loop.call_soon_threadsafe`. Does not own: JSON framing or the HTTP route (routes_debug.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from workbench.server.sse import sse_frame
from workbench.trace.events import Event

FRAME_CACHE = 16384  # serialized events kept for the subscribers that have not sent them yet


class TooManySubscribers(RuntimeError):
    """The hub has its maximum number of subscribers (HTTP 503)."""


class Subscriber:
    """One live consumer: a bounded buffer filled by the engine thread, drained by asyncio."""

    def __init__(self, loop: asyncio.AbstractEventLoop, kinds: Iterable[str] | None = None,
                 requests: Iterable[str] | None = None, maxsize: int = 4096) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.kinds = frozenset(kinds) if kinds else None
        self.requests = frozenset(requests) if requests else None
        self.maxsize = maxsize
        self.limit = maxsize  # lowered by the hub while many subscribers share its budget
        self.dropped = 0  # events lost because the buffer was full (only ever grows)
        self.delivered = 0
        self._loop = loop
        self._buf: deque[Event] = deque()
        self._lock = threading.Lock()
        self._notified = False
        self._ready = asyncio.Event()

    def wants(self, event: Event) -> bool:
        if self.kinds is not None and event.kind not in self.kinds:
            return False
        if self.requests is None:
            return True
        rid = event.req_id
        # n > 1 and multi-prompt requests are "<id>-<i>": a filter on the parent id follows them
        return rid is not None and (rid in self.requests or any(rid.startswith(f + "-") for f in self.requests))

    def offer(self, event: Event) -> None:
        """Engine thread: keep the event if it matches and there is room, else count the drop."""
        if not self.wants(event):
            return
        if len(self._buf) >= self.limit:  # full: count and move on without the lock (only this thread adds)
            self.dropped += 1
            return
        with self._lock:
            self._buf.append(event)
            notify, self._notified = not self._notified, True
        if notify:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the event loop is closed: the server is going away
                pass

    async def next_batch(self, timeout: float) -> list[Event]:
        """Wait up to `timeout` seconds for events; return everything buffered (maybe nothing)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        self._ready.clear()
        with self._lock:
            out = list(self._buf)
            self._buf.clear()
            self._notified = False
        self.delivered += len(out)
        return out


class EventHub:
    """A tracer sink fanning events out to subscribers; a no-op loop when nobody listens.

    All subscribers together hold at most `budget` events: each gets `budget / subscribers` (or the
    buffer it asked for, if smaller), so a hundred clients that never read cost a bounded amount of
    memory (and garbage-collector time) instead of a hundred full buffers.
    """

    def __init__(self, budget: int = 65536, max_subscribers: int = 32) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if max_subscribers < 1:
            raise ValueError(f"max_subscribers must be >= 1, got {max_subscribers}")
        self.budget = budget
        self.max_subscribers = max_subscribers  # each one costs the event loop its sends: a few viewers, not 100
        self._subs: tuple[Subscriber, ...] = ()
        self._lock = threading.Lock()
        self._dropped_gone = 0  # drops of subscribers that have left
        self._frames: OrderedDict[int, tuple[Event, bytes]] = OrderedDict()  # id(event) -> its SSE frame
        self.meta: dict[str, Any] = {}

    @property
    def dropped_total(self) -> int:
        """Events dropped for slow subscribers since start (a counter for /metrics)."""
        return self._dropped_gone + sum(s.dropped for s in self._subs)

    @property
    def subscribers(self) -> tuple[Subscriber, ...]:
        return self._subs

    def subscribe(self, loop: asyncio.AbstractEventLoop, kinds: Iterable[str] | None = None,
                  requests: Iterable[str] | None = None, maxsize: int = 4096) -> Subscriber:
        sub = Subscriber(loop, kinds, requests, maxsize)
        with self._lock:
            if len(self._subs) >= self.max_subscribers:
                raise TooManySubscribers(f"already {len(self._subs)} /debug/events subscribers, the limit "
                                         f"(workbench serve --max-debug-subscribers)")
            self._subs = (*self._subs, sub)
            self._share()
        return sub

    def _share(self) -> None:
        share = max(1, self.budget // max(1, len(self._subs)))
        for s in self._subs:
            s.limit = min(s.maxsize, share)

    def frame(self, event: Event) -> bytes:
        """The SSE frame of `event`, serialized once however many subscribers send it (event loop only:
        100 subscribers used to cost 100 serializations of every event)."""
        hit = self._frames.get(id(event))
        if hit is not None and hit[0] is event:  # the cache holds the event, so its id is not reused
            return hit[1]
        data = sse_frame(event.to_json())
        self._frames[id(event)] = (event, data)
        if len(self._frames) > FRAME_CACHE:
            self._frames.popitem(last=False)
        return data

    @property
    def buffered(self) -> int:
        """Events waiting in all subscribers' buffers."""
        return sum(len(s._buf) for s in self._subs)

    def unsubscribe(self, sub: Subscriber) -> None:
        with self._lock:
            if sub in self._subs:
                self._dropped_gone += sub.dropped
            self._subs = tuple(s for s in self._subs if s is not sub)
            self._share()

    # --- the Sink protocol (engine thread) -------------------------------------------------------

    def write(self, event: Event) -> None:
        for sub in self._subs:  # a tuple replaced on (un)subscribe: no lock on the hot path
            sub.offer(event)

    def write_tensor(self, name: str, step: int, req_id: str | None, array: Any) -> None:
        pass  # tensors stay in the trace file; the live stream carries events only

    def set_meta(self, key: str, value: Any) -> None:
        if key in ("engine", "model", "tokenizer", "trace_level"):
            self.meta[key] = value

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
