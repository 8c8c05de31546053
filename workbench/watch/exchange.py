"""One proxied generation request as the proxy saw it: the hand-off from the hot path to the recorder.

Owns: `Exchange` (the client's body, what was sent upstream, the upstream's status and headers,
every byte it sent with its arrival time, how it ended) and turning those bytes back into parsed
chunks (`Exchange.chunks`: SSE data payloads, or a whole JSON body). The proxy only appends bytes
(no parsing on the hot path); the recorder's thread does the rest. Standard library plus the
chunk parser of workbench/external/sse_stream.py. Does not own the trace (recorder.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from workbench.external.sse_stream import ChunkTokens, parse_chunk
from workbench.watch.rewrite import event_end

MAX_RECORDED_BYTES = 16 << 20  # per request: what a response holds beyond this is not recorded
SECRET_FIELDS = ("api_key", "apikey", "authorization", "password", "secret")


@dataclass(slots=True)
class Exchange:
    """One generation request through the proxy."""

    req_id: str
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # the client's JSON body (fields naming credentials removed)
    sampled: bool
    sent: float  # perf_counter() when it was sent upstream
    sent_body: dict[str, Any] | None = None  # what went upstream when it differs from `body`
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    received: list[tuple[float, bytes]] = field(default_factory=list)  # the upstream's bytes, as they came
    received_bytes: int = 0
    truncated: bool = False  # more than MAX_RECORDED_BYTES came; the rest was passed on, not recorded
    error: str | None = None  # the upstream failed (unreachable, dropped mid-stream)
    client_gone: bool = False  # the client disconnected first; the upstream request was cancelled
    done: float | None = None

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def add(self, now: float, data: bytes) -> None:
        """Keep `data` for the recorder (the hot path's only bookkeeping)."""
        if self.received_bytes + len(data) > MAX_RECORDED_BYTES:
            self.truncated = True
            return
        self.received.append((now, data))
        self.received_bytes += len(data)

    def chunks(self) -> Iterator[tuple[float, ChunkTokens]]:
        """The parsed chunks with their arrival times (a whole response body is one chunk).

        ValueError for a chunk that is not one of this endpoint (an error in the stream)."""
        if not self.stream:
            if self.received:
                obj = json.loads(b"".join(d for _, d in self.received))
                for choice in obj.get("choices") or [] if isinstance(obj, dict) else []:
                    if isinstance(choice, dict) and "message" in choice:  # a chat body: read it as a delta
                        choice["delta"] = choice["message"]
                yield self.received[-1][0], parse_chunk(obj, self.chat)
            return
        buf = b""
        for now, data in self.received:
            buf += data
            while (cut := event_end(buf)) is not None:
                event, buf = buf[:cut], buf[cut:]
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        payload = line[5:].strip()
                        if payload and payload != b"[DONE]":
                            yield now, parse_chunk(json.loads(payload), self.chat)


def safe_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body without fields that name credentials (never written to a trace)."""
    return {k: v for k, v in body.items() if not any(s in k.lower() for s in SECRET_FIELDS)}
