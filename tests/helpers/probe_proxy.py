"""A proxy in front of an OpenAI-compatible server, for the probe tests: it passes everything through,
or misbehaves the way real servers do.

Modes: `pass`; `tamper` (in the streamed response of the probe's request number `target_index`, the token
at output `position` is replaced by one of its listed alternatives, text and logprob included, as
an engine bug would); `die` (every stream is cut after `position` token chunks and the proxy shuts
down, as a server that crashes mid-run); `refuse` (a request asking for logprobs gets HTTP 400,
as servers without logprob support answer). Runs in this process under uvicorn (BackgroundServer).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workbench.server.background import BackgroundServer

_FORWARD = ("content-type", "authorization", "x-request-id")


class Proxy:
    def __init__(self, upstream: str, mode: str = "pass", target_index: int = 0, position: int = 0) -> None:
        self.upstream, self.mode, self.target_index, self.position = upstream, mode, target_index, position
        self.tampered: str | None = None  # the text put in place of the real token
        self.streams = 0
        app = Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST"])])
        self.server = BackgroundServer(app)

    @property
    def url(self) -> str:
        return self.server.url

    def __enter__(self) -> Proxy:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    async def handle(self, request: Request) -> Response:
        body = await request.body()
        data = json.loads(body) if body else {}
        if self.mode == "refuse" and (data.get("logprobs") or data.get("top_logprobs")):
            return JSONResponse({"error": {"message": "logprobs are not supported by this server",
                                           "type": "invalid_request_error", "param": "logprobs", "code": None}}, 400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}
        client = httpx.AsyncClient(timeout=60)
        upstream = client.build_request(request.method, self.upstream + request.url.path, content=body, headers=headers)
        resp = await client.send(upstream, stream=True)
        if not data.get("stream") or resp.status_code != 200:
            content = await resp.aread()
            await client.aclose()
            return Response(content, resp.status_code, media_type=resp.headers.get("content-type"))
        self.streams += 1
        rid = request.headers.get("x-request-id", "")  # the probe's "<run>-0000-4000-8000-<index>"
        index = int(rid.rsplit("-", 1)[1]) if rid.rsplit("-", 1)[-1].isdigit() else -1
        return StreamingResponse(self._relay(resp, client, index), media_type="text/event-stream",
                                 headers={"x-request-id": resp.headers.get("x-request-id", "")})

    async def _relay(self, resp: httpx.Response, client: httpx.AsyncClient, index: int) -> Any:
        n = 0
        try:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    count = _num_tokens(chunk)  # a chunk may carry several tokens
                    if count:
                        if self.mode == "die" and n + count > self.position:
                            self.server.server.should_exit = True  # no new connections from now on
                            raise ConnectionAbortedError("proxy: the server died")
                        if self.mode == "tamper" and index == self.target_index and n <= self.position < n + count:
                            self.tampered = _replace_token(chunk, self.position - n)
                            line = "data: " + json.dumps(chunk)
                        n += count
                yield line + "\n"
        finally:
            await resp.aclose()
            await client.aclose()


def _num_tokens(chunk: dict[str, Any]) -> int:
    choice = (chunk.get("choices") or [{}])[0]
    lp = choice.get("logprobs") or {}
    return len(lp.get("tokens") or lp.get("content") or ())


def _replace_token(chunk: dict[str, Any], i: int) -> str:
    """Swap the chunk's i-th token for its fifth-best ASCII alternative; returns the new token's text."""
    choice = chunk["choices"][0]
    lp = choice["logprobs"]
    if "content" in lp:  # chat
        item = lp["content"][i]
        alt = [a for a in item["top_logprobs"] if a["token"].isascii() and a["token"] != item["token"]][4]
        item.update(token=alt["token"], logprob=alt["logprob"], bytes=alt["bytes"])
        choice["delta"]["content"] = "".join(c["token"] for c in lp["content"])
        return alt["token"]
    alts = sorted(lp["top_logprobs"][i].items(), key=lambda kv: -kv[1])
    text, value = [(t, v) for t, v in alts if t.isascii() and t != lp["tokens"][i]][4]
    lp["tokens"][i], lp["token_logprobs"][i] = text, value
    choice["text"] = "".join(lp["tokens"])
    return text
