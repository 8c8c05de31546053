"""The one SSE client of the project's viewers: server-sent events as JSON objects, through httpx-sse.

Owns: decoding an event stream into each event's JSON object (None for OpenAI's `[DONE]`), from an
httpx streaming response (`aiter_sse_json`) or from lines already split (`parse_sse_lines`). Any line
ending works (`\\n`, `\\r\\n` as sse-starlette sends, `\\r`); comments, `event:`/`id:`/`retry:` fields,
events whose data is not a JSON object are skipped. Used by the TUI's live mode (tui/live.py) and by
`workbench client`'s server view (client_stream.py). Does not own: what the objects mean.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any


def _decode(data: str) -> tuple[bool, dict[str, Any] | None]:
    """(keep, object): `[DONE]` is kept as None; anything but a JSON object is dropped."""
    if data.strip() == "[DONE]":
        return True, None
    try:
        obj = json.loads(data)
    except ValueError:
        return False, None
    return isinstance(obj, dict), obj if isinstance(obj, dict) else None


def parse_sse_lines(lines: Iterable[str]) -> Iterator[dict[str, Any] | None]:
    """SSE lines (with or without their line endings) -> each event's JSON object; None for `[DONE]`."""
    from httpx_sse._decoders import SSEDecoder

    decoder = SSEDecoder()
    for line in lines:
        event = decoder.decode(line.rstrip("\r\n"))
        if event is not None and event.data:
            keep, obj = _decode(event.data)
            if keep:
                yield obj


async def aiter_sse_json(response: Any) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON objects of an httpx streaming response's events, as they arrive; None for `[DONE]`."""
    from httpx_sse import EventSource

    async for event in EventSource(response).aiter_sse():
        if event.data:
            keep, obj = _decode(event.data)
            if keep:
                yield obj
