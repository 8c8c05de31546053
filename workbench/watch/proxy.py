"""The watch's reverse proxy: an ASGI app in front of any OpenAI-compatible server.

Owns: passing every request to the upstream and its answer back (status, headers, bytes: a stream's
chunks are relayed as they arrive, unchanged), the proxy's own paths (`/watch/status`, the live
view's JSON, and `/watch`, its page; `/watch/metrics`, the proxy's Prometheus metrics alone; `/metrics`, the upstream's
metrics with the proxy's appended), and, for a sampled fraction of generation requests, asking the
upstream for what the checker needs and taking it off again (rewrite.py) so the client's bytes are
what they would have been. No failure mode of its own: an unreachable upstream answers 502 with an
OpenAI-shaped error naming it; an upstream that drops a stream drops the client's the same way
(no end of body); a client that disconnects closes the upstream request (the engine aborts it). A
sampled request whose added fields the upstream refuses (HTTP 400) is sent again as the client
sent it, and the proxy stops adding them. The hot path does no parsing for unsampled requests: it
hands the bytes to the recorder (recorder.py) when the request ends. Does not own recording,
checking or the command line.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import httpx

from workbench.watch.exchange import Exchange
from workbench.watch.metrics import LiveStatus, WatchMetrics
from workbench.watch.rewrite import Rewrite, SseRelay, plan_rewrite, strip_json

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
              b"transfer-encoding", b"upgrade", b"host", b"content-length"}
MAX_BODY = 64 << 20  # a request body larger than this is refused (413) rather than held in memory

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class WatchProxy:
    """The ASGI app. `recorder.submit(exchange)` gets every generation request when it ends."""

    def __init__(self, upstream: str, *, recorder: Any, metrics: WatchMetrics, status: LiveStatus,
                 sample: float = 0.1, top: int = 5, seed: int | None = None,
                 status_extra: Callable[[], dict[str, Any]] | None = None) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample must be a fraction in [0, 1], got {sample}")
        if not 1 <= top <= 20:
            raise ValueError(f"top must be in [1, 20], got {top}")
        self.upstream = upstream.rstrip("/")
        self.recorder, self.metrics, self.status = recorder, metrics, status
        self.sample, self.top = sample, top
        self.rng = random.Random(seed)
        self.ids_ok = True  # the upstream takes vLLM's token-id fields (learnt from a 400 otherwise)
        self.logprobs_ok = True  # the upstream takes logprobs on a request that asked none
        self.status_extra = status_extra or (lambda: {})
        self.client: httpx.AsyncClient | None = None
        self.in_flight = 0  # generation requests not yet handed to the recorder

    def _http(self) -> httpx.AsyncClient:
        if self.client is None:  # no timeout of its own beyond connecting: a slow upstream is the client's to judge
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return self.client

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # --- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/watch/status" and method == "GET":
            await _send_json(send, 200, self.status.snapshot(self.status_extra()))
            return
        if path in ("/watch", "/watch/") and method == "GET":
            from workbench.watch.page import PAGE

            await _send_bytes(send, 200, PAGE.encode(), b"text/html; charset=utf-8")
            return
        if path == "/watch/metrics" and method == "GET":
            await _send_bytes(send, 200, self.metrics.render().encode(), b"text/plain; version=0.0.4; charset=utf-8")
            return
        body, too_big = await _read_body(receive)
        if too_big:
            await _send_error(send, 413, f"watch: request body over {MAX_BODY} bytes", "request_too_large")
            return
        url = self.upstream + (scope.get("raw_path") or path.encode()).decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        if path == "/metrics" and method == "GET":
            await self._metrics(url, headers, send, receive)
            return
        ex = self._exchange(method, path, body)
        if ex is None:
            await self._forward(method, url, headers, body, ex, receive, send)
            return
        self.in_flight += 1
        try:
            await self._forward(method, url, headers, body, ex, receive, send)
        finally:
            self.in_flight -= 1

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- generation requests ---------------------------------------------------------------------

    def _exchange(self, method: str, path: str, body: bytes) -> Exchange | None:
        """An Exchange for a generation request (sampled or not); None for anything else."""
        if method != "POST" or path not in GENERATION_PATHS:
            return None
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        chat = path.endswith("/chat/completions")
        sampled = (self.logprobs_ok and self.sample > 0 and self.rng.random() < self.sample and _checkable(obj, chat))
        ex = Exchange(uuid.uuid4().hex, path, obj, sampled, time.perf_counter())
        self.metrics.requests.labels(sampled=str(sampled).lower()).inc()
        return ex

    async def _forward(self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes,
                       ex: Exchange | None, receive: Receive, send: Send) -> None:
        rw: Rewrite | None = None
        try:
            if ex is not None and ex.sampled:
                resp, rw = await self._open_sampled(method, url, headers, body, ex)
            else:
                resp = await self._open(method, url, headers, body)
        except httpx.HTTPError as exc:
            message = f"watch: the upstream {self.upstream} did not answer: {type(exc).__name__}: {exc or 'no detail'}"
            self.metrics.upstream_errors.inc()
            if ex is not None:
                ex.status, ex.error, ex.done = 502, message, time.perf_counter()
                self.recorder.submit(ex)
            await _send_error(send, 502, message, "upstream_unreachable")
            return
        if ex is not None:
            ex.status, ex.headers = resp.status_code, dict(resp.headers)
        try:
            async with anyio.create_task_group() as tg:
                state = {"sending_done": False}
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope, ex, state)
                await self._relay(resp, send, ex, rw, state)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await resp.aclose()  # a client gone: closing the connection makes the engine abort the request
                if ex is not None:
                    ex.done = time.perf_counter()
                    self.recorder.submit(ex)

    async def _open(self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> httpx.Response:
        request = self._http().build_request(method, url, headers=headers, content=body)
        return await self._http().send(request, stream=True)

    async def _open_sampled(self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes,
                            ex: Exchange) -> tuple[httpx.Response, Rewrite | None]:
        """Send the sampled body; a 400 to what was added sends it again with less (learnt for next time)."""
        # the response must come back as the bytes it would have been: nothing compressed to unpack
        headers = [(k, v) for k, v in headers if k.lower() != b"accept-encoding"] + [(b"accept-encoding", b"identity")]
        refused_ids = False
        for ids in ([True, False] if self.ids_ok else [False]):
            sent, rw = plan_rewrite(ex.body, ex.chat, top=self.top, ids=ids)
            resp = await self._open(method, url, headers, json.dumps(sent).encode())
            if resp.status_code not in (400, 422):
                if refused_ids:  # learnt only now: the 400 was to the id fields, not to the client's request
                    self.ids_ok = False
                    self.status.note("the upstream refuses vLLM's token-id fields: ids are recovered from token text")
                ex.sent_body = {k: v for k, v in sent.items() if k not in ex.body or sent[k] != ex.body[k]}
                return resp, rw
            await resp.aread()
            await resp.aclose()
            refused_ids = refused_ids or ids
        resp = await self._open(method, url, headers, body)  # as the client sent it
        if resp.status_code < 400:
            self.logprobs_ok = False
            self.status.note("the upstream refuses logprobs on requests that did not ask for them: "
                             "nothing is sampled for checking")
        ex.sampled = False
        return resp, None

    async def _relay(self, resp: httpx.Response, send: Send, ex: Exchange | None, rw: Rewrite | None,
                     state: dict[str, bool]) -> None:
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP_BY_HOP - {b"content-length"}]
        rewriting = rw is not None and rw.changes and resp.status_code == 200
        if rewriting and not (ex is not None and ex.stream):
            await self._relay_whole(resp, send, ex, rw, headers, state)
            return
        if rewriting:
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
        relay = SseRelay(rw) if rewriting else None
        try:
            async for data in resp.aiter_raw():
                if ex is not None:
                    ex.add(time.perf_counter(), data)
                out = relay.feed(data) if relay is not None else data
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except httpx.HTTPError as exc:
            # the upstream dropped the stream: the client's ends the same way, without an end of body
            self.metrics.upstream_errors.inc()
            if ex is not None:
                ex.error = f"the upstream dropped the stream: {type(exc).__name__}: {exc or 'no detail'}"
            return
        tail = relay.tail() if relay is not None else b""
        state["sending_done"] = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _relay_whole(self, resp: httpx.Response, send: Send, ex: Exchange, rw: Rewrite,
                           headers: list[tuple[bytes, bytes]], state: dict[str, bool]) -> None:
        data = await resp.aread()
        ex.add(time.perf_counter(), data)
        try:
            data = strip_json(data.decode("utf-8"), rw).encode("utf-8")
        except (ValueError, UnicodeDecodeError, IndexError):
            pass  # not JSON after all: passed as it came
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": resp.status_code, "headers": headers})
        state["sending_done"] = True
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope, ex: Exchange | None,
                                state: dict[str, bool]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not state["sending_done"] and ex is not None:
                    ex.client_gone = True
                scope.cancel()
                return

    # --- /metrics ----------------------------------------------------------------------------------

    async def _metrics(self, url: str, headers: list[tuple[bytes, bytes]], send: Send, receive: Receive) -> None:
        """The upstream's /metrics with the proxy's own appended; the upstream's answer as is when it is not 200."""
        try:
            resp = await self._http().get(url, headers=[(k, v) for k, v in headers if k.lower() != b"accept-encoding"])
        except httpx.HTTPError:
            await _send_bytes(send, 200, self.metrics.render().encode(), b"text/plain; version=0.0.4; charset=utf-8")
            return
        if resp.status_code != 200:
            await _send_bytes(send, resp.status_code, resp.content,
                              resp.headers.get("content-type", "text/plain").encode())
            return
        text = resp.text
        ours = self.metrics.render()
        if text.rstrip().endswith("# EOF"):  # OpenMetrics: ours go before its terminator
            head = text.rstrip()[: -len("# EOF")]
            text = head + ours + "# EOF\n"
        else:
            text = text + ("" if text.endswith("\n") or not text else "\n") + ours
        await _send_bytes(send, 200, text.encode(), resp.headers.get("content-type", "text/plain").encode())


def _checkable(body: dict[str, Any], chat: bool) -> bool:
    """One text prompt or one chat, one choice: what the checker can teacher-force."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("echo"):
        return False
    if chat:
        messages = body.get("messages")
        return isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                  for m in messages) and not body.get("tools")
    return isinstance(body.get("prompt"), str)


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return b"", True
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts), False


async def _send_bytes(send: Send, status: int, data: bytes, content_type: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _send_json(send: Send, status: int, obj: Any) -> None:
    await _send_bytes(send, status, json.dumps(obj).encode(), b"application/json")


async def _send_error(send: Send, status: int, message: str, kind: str) -> None:
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`."""
    await _send_json(send, status, {"error": {"message": message, "type": kind, "param": None, "code": status}})

