"""A request's bounded output buffer between the engine thread and the client's socket.

Owns: `StreamLimits` (how much unsent output one request may hold and how long one write may
block), `OutputBuffer` (what a `RequestHandle` queues its `StreamItem`s in: while the client keeps
up, every delta is its own item; when it falls behind, the deltas waiting for the same request
are coalesced into one item, so the concatenated text is unchanged and the frame count shrinks;
past `max_buffer_bytes` the pending output is dropped, the request is aborted through
`on_overflow` and the reader gets one error item) and the record of which deltas each frame
carried (`take_chunks`, read by the socket writer to stamp its frames). Runs on the event loop
only. Does not own: the engine thread's hand-off (engine_loop.py), framing (sse.py) or the
stamps (latency.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workbench.engine.output.output import StepOutput
from workbench.trace.latency import Handoff

OVERFLOW = "output buffer overflow"


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """Per-request limits on output the client has not read yet."""

    max_buffer_bytes: int = 4 << 20  # unsent output (text, logprobs) held for one request
    send_timeout: float | None = 60.0  # one write blocked longer than this aborts the request

    def __post_init__(self) -> None:
        if isinstance(self.max_buffer_bytes, bool) or not isinstance(self.max_buffer_bytes, int) \
                or self.max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes must be an integer >= 1, got {self.max_buffer_bytes!r}")
        t = self.send_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
            raise ValueError(f"send_timeout must be a number of seconds > 0 (or None for no limit), got {t!r}")


def item_bytes(item: Any) -> int:
    """What holding `item` costs, roughly in the bytes it will take on the wire (text and logprobs)."""
    step = item.step
    if step is None:
        return len((item.error or "").encode("utf-8"))
    n = len(step.delta.encode("utf-8")) + 4 * len(step.new_token_ids)
    for lp in item.logprobs or ():
        n += 32 + len(lp.token.encode("utf-8")) + sum(32 + len(str(t[1]).encode("utf-8")) for t in lp.top_logprobs)
    return n


@dataclass(slots=True)
class TakenChunk:
    """The deltas of one request the writer took since its last frame, with their hand-offs."""

    tokens: int = 0
    deltas: int = 0
    first: Handoff | None = None
    last: Handoff | None = None
    taken: float = 0.0


@dataclass(slots=True)
class _Pending:
    """The coalesced, not yet taken output of one request."""

    req_id: str
    ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finished: bool = False
    output: Any = None
    deltas: int = 0
    first: Handoff | None = None
    last: Handoff | None = None
    bytes: int = 0
    cls: Any = None  # the StreamItem class (engine_loop.py), to rebuild one
    original: Any = None  # the item itself while nothing was merged into it

    def add(self, item: Any, size: int) -> None:
        step = item.step
        self.cls = type(item)
        self.original = item if self.deltas == 0 else None
        self.ids += step.new_token_ids
        self.parts.append(step.delta)
        if item.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(item.logprobs)
        self.finished, self.output = step.finished, step.output
        self.deltas += 1
        handoff = getattr(item, "handoff", None)
        if handoff is not None:
            self.first = self.first or handoff
            self.last = handoff
        self.bytes += size

    def item(self) -> Any:
        if self.original is not None:
            return self.original
        step = StepOutput(self.req_id, self.ids, "".join(self.parts), self.finished, self.output)
        return self.cls(self.req_id, step, self.logprobs, handoff=self.last)


class OutputBuffer:
    """`put_nowait` / `get` like an `asyncio.Queue` of StreamItems, bounded and coalescing (event loop only)."""

    def __init__(self, limits: StreamLimits | None = None, on_overflow: Callable[[str], None] | None = None) -> None:
        self.limits = limits or StreamLimits()
        self.on_overflow = on_overflow
        self.pending_bytes = 0
        self.max_pending_bytes = 0  # the most this buffer ever held (what "memory stays bounded" checks)
        self.coalesced = 0  # deltas merged into an earlier one because the reader was behind
        self.overflowed = False
        self.bounded = True  # False for a non-streaming request: its reader is the server, never slow
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._error: Any = None
        self._ready = asyncio.Event()
        self._taken: dict[str, TakenChunk] = {}

    def qsize(self) -> int:
        return len(self._pending) + (self._error is not None)

    def empty(self) -> bool:
        return self.qsize() == 0

    def put_nowait(self, item: Any) -> None:
        if self.overflowed:
            return  # the request was aborted for this reader: nothing more is kept for it
        if item.step is None:  # an error ends the request after what is already pending
            self._error = item
            self._ready.set()
            return
        size = item_bytes(item)
        pending = self._pending.get(item.req_id)
        if pending is None:
            pending = self._pending[item.req_id] = _Pending(item.req_id)
        else:
            self.coalesced += 1
        pending.add(item, size)
        self.pending_bytes += size
        self.max_pending_bytes = max(self.max_pending_bytes, self.pending_bytes)
        if self.bounded and self.pending_bytes > self.limits.max_buffer_bytes:
            self._overflow(type(item))
        self._ready.set()

    def _overflow(self, cls: type) -> None:
        held = self.pending_bytes
        first = next(iter(self._pending))
        self._pending.clear()
        self.pending_bytes = 0
        self.overflowed = True
        message = (f"{OVERFLOW}: the client read too slowly ({held} bytes waiting, limit "
                   f"{self.limits.max_buffer_bytes}); the request was aborted")
        self._error = cls(first, None, error=message)
        if self.on_overflow is not None:
            self.on_overflow(OVERFLOW)

    async def get(self) -> Any:
        """The oldest request's coalesced output, or the error item once nothing else is pending."""
        while not self._pending and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if not self._pending:
            return self._error
        rid, pending = self._pending.popitem(last=False)
        self.pending_bytes -= pending.bytes
        taken = self._taken.setdefault(rid, TakenChunk())
        taken.tokens += len(pending.ids)
        taken.deltas += pending.deltas
        taken.first = taken.first or pending.first
        taken.last = pending.last or taken.last
        taken.taken = time.perf_counter()
        return pending.item()

    def take_chunks(self) -> dict[str, TakenChunk]:
        """What was taken since the last call, per request (the writer calls this once per frame)."""
        taken, self._taken = self._taken, {}
        return taken

