"""An upstream server that misbehaves, read by the probe's stream reader (issue 36, part 3): a stream
that never finishes, one 10 MB line, an endless line without a newline, a huge error body, NaN
logprobs and invalid UTF-8. What a user notices: each ends in a clear `StreamError` (or a recorded
stream with the bad values marked "not recorded"), quickly and without taking the memory.
"""

from __future__ import annotations

import asyncio
import json
import resource
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from workbench.external.sse_stream import MAX_EVENT_BYTES, StreamError, stream_request


def _chunk(text: str, finish: str | None = None, logprob: object = -0.5) -> bytes:
    body = {"id": "x", "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                    "logprobs": {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": [{}]}}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def completions(request: Request) -> Response:
    kind = (await request.json())["prompt"]

    async def endless():  # noqa: ANN202
        while True:
            yield _chunk("a")
            await asyncio.sleep(0)

    async def long_line():  # noqa: ANN202
        yield b"data: " + b"x" * (10 << 20) + b"\n\n"
        yield _chunk("", "stop") + b"data: [DONE]\n\n"

    async def no_newline():  # noqa: ANN202
        yield b"data: "
        for _ in range(64):
            yield b"y" * (1 << 20)
            await asyncio.sleep(0)

    async def odd_values():  # noqa: ANN202
        yield b'data: {"id": "x", "choices": [{"index": 0, "text": "b", "finish_reason": null, "logprobs": ' \
              b'{"tokens": ["b"], "token_logprobs": [NaN], "top_logprobs": [{"b": Infinity}]}}]}\n\n'
        yield b'data: {"id": "x", "choices": [{"index": 0, "text": "\xff\xfe", "finish_reason": "stop"}]}\n\n'
        yield b"data: [DONE]\n\n"

    async def huge_error():  # noqa: ANN202
        for _ in range(50):
            yield b"e" * (1 << 20)
            await asyncio.sleep(0)

    if kind == "huge-error":
        return StreamingResponse(huge_error(), status_code=500, media_type="text/plain")
    streams = {"endless": endless, "long-line": long_line, "no-newline": no_newline, "odd-values": odd_values}
    return StreamingResponse(streams[kind](), media_type="text/event-stream")


@pytest.fixture(scope="module")
def upstream():  # noqa: ANN201 - the server's URL
    from workbench.server.background import BackgroundServer

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with BackgroundServer(app) as srv:
        yield srv.url


def _read(url: str, kind: str) -> tuple[list, float]:
    got: list = []

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await stream_request(client, url + "/v1/completions", {"prompt": kind, "max_tokens": 16}, {}, False,
                                 lambda _resp: None, lambda chunk, _t: got.append(chunk))

    t0 = time.perf_counter()
    asyncio.run(go())
    return got, time.perf_counter() - t0


@pytest.mark.parametrize("kind, message", [
    ("endless", r"went on past 128 chunks .* without finishing \(limits: 128 chunks"),
    ("long-line", rf"a stream line of more than {MAX_EVENT_BYTES} characters"),
    ("no-newline", rf"a stream line of more than {MAX_EVENT_BYTES} characters"),
    ("huge-error", r"HTTP 500: e+$"),
])
def test_a_misbehaving_stream_ends_in_one_clear_error_without_taking_the_memory(upstream, kind, message) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    with pytest.raises(StreamError, match=message) as info:
        _read(upstream, kind)
    assert time.perf_counter() - t0 < 20
    assert "\n" not in str(info.value) and len(str(info.value)) < 400
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    assert grown < 48, f"peak memory grew {grown:.0f} MB reading {kind}"  # the 50 MB body, the 64 MB line


def test_nan_logprobs_and_invalid_utf8_are_recorded_as_what_they_are(upstream) -> None:
    chunks, _ = _read(upstream, "odd-values")
    first = chunks[0].tokens[0]
    assert first.text == "b" and first.logprob is None and first.top == [("b", None, None)]  # not recorded
    assert chunks[1].text == "\ufffd\ufffd" and chunks[1].finish_reason == "stop"
