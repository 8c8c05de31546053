"""The viewers' one SSE client (workbench.clients.sse, on httpx-sse): `\\n`, `\\r\\n` (sse-starlette) and
`\\r` framing give the same events; comments, other fields and non-JSON data are skipped."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from workbench.clients.sse import aiter_sse_json, parse_sse_lines

EVENTS = [b": ping", b"event: x", b'data: {"a":', b"data: 1}", b"", b"id: 3", b"data: not json", b"",
          b'data: {"kind": "server.hello", "step": 2}', b"", b"retry: 10", b"data: [DONE]", b""]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_any_line_ending_over_http(eol: bytes) -> None:
    body = eol.join(EVENTS) + eol

    async def run() -> list:
        transport = httpx.MockTransport(lambda request: httpx.Response(
            200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=body))
        async with httpx.AsyncClient(transport=transport) as client, client.stream("GET", "http://x/e") as resp:
            return [obj async for obj in aiter_sse_json(resp)]

    assert asyncio.run(run()) == [{"a": 1}, {"kind": "server.hello", "step": 2}, None]


@pytest.mark.parametrize("eol", ["\n", "\r\n"])
def test_lines_with_or_without_endings(eol: str) -> None:
    lines = [line.decode() + eol for line in EVENTS]
    assert list(parse_sse_lines(lines)) == [{"a": 1}, {"kind": "server.hello", "step": 2}, None]
