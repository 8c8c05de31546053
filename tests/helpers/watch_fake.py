"""A tiny OpenAI-shaped upstream for the watch's robustness tests: deterministic bytes, and faults on demand.

`/v1/completions` and `/v1/chat/completions` stream (or return) the same eight SmolLM2 tokens with
fixed ids, `created` and ids derived from the prompt, so a response straight from it and one through
the proxy can be compared byte for byte. Logprobs, `token_ids` and `token_id:N` strings appear only
when asked, as vLLM does. Headers steer faults: `x-fake-delay` (seconds between chunks),
`x-fake-die-after` (chunks sent before the connection is cut, no end of body), `x-fake-status`
(answer that status with an OpenAI-shaped error), `x-fake-strict` (400 to vLLM's token-id fields). `cancelled` lists the prompts whose client went
away mid-stream; `bodies` every JSON body received.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any

import anyio

TOKENS = [(504, "The"), (3575, " capital"), (282, " of"), (4649, " France"), (314, " is"), (7042, " Paris"),
          (30, "."), (198, "\n")]


class FakeUpstream:
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if path == "/v1/models":
            return await _reply(send, 200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        if path == "/metrics":
            data = b"# HELP fake_up 1\n# TYPE fake_up gauge\nfake_up 1.0\n"
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            return await send({"type": "http.response.body", "body": data})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await _reply(send, 404, {"detail": "Not Found"})
        req = json.loads(body)
        with self.lock:
            self.bodies.append(req)
        if "x-fake-strict" in headers and ("return_token_ids" in req or "return_tokens_as_token_ids" in req):
            return await _reply(send, 400, {"error": {"message": "unknown field return_token_ids", "code": 400}})
        if "x-fake-status" in headers:
            status = int(headers["x-fake-status"])
            return await _reply(send, status, {"error": {"message": f"fake error {status}", "type": "BadRequestError",
                                                         "param": None, "code": status}})
        chat = path.endswith("chat/completions")
        prompt = json.dumps(req.get("messages") if chat else req.get("prompt"))
        n = min(int(req.get("max_tokens") or 8), len(TOKENS))
        rid = ("chatcmpl-" if chat else "cmpl-") + hashlib.sha1(prompt.encode()).hexdigest()[:12]
        chunks = [_chunk(rid, chat, req, i, i == n - 1) for i in range(n)]
        if not req.get("stream"):
            return await _reply(send, 200, _whole(rid, chat, req, n), extra=[(b"x-fake", b"1")])
        delay = float(headers.get("x-fake-delay", "0"))
        die_after = int(headers.get("x-fake-die-after", "-1"))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-fake", b"1")]})
        gone = anyio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            for i, c in enumerate(chunks):
                if i == die_after:
                    raise RuntimeError("fake upstream killed mid-stream")
                if delay:
                    with anyio.move_on_after(delay):
                        await gone.wait()
                if gone.is_set():
                    with self.lock:
                        self.cancelled.append(prompt)
                    tg.cancel_scope.cancel()
                    return
                await send({"type": "http.response.body", "body": b"data: " + c + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            tg.cancel_scope.cancel()


def _logprobs(req: dict[str, Any], chat: bool, i: int) -> Any:
    tid, text = TOKENS[i]
    as_ids = req.get("return_tokens_as_token_ids")
    name = f"token_id:{tid}" if as_ids else text
    alt = f"token_id:{tid + 1}" if as_ids else text + "x"
    lp = -0.25 - 0.01 * i
    if chat:
        if req.get("logprobs") is not True:
            return None
        top = [{"token": name, "logprob": lp, "bytes": list(text.encode())},
               {"token": alt, "logprob": lp - 1.5, "bytes": list(alt.encode())}][: int(req.get("top_logprobs") or 0)]
        return {"content": [{"token": name, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top}]}
    if req.get("logprobs") is None:
        return None
    return {"text_offset": [i], "token_logprobs": [lp], "tokens": [name],
            "top_logprobs": [dict(list({name: lp, alt: lp - 1.5}.items())[: int(req["logprobs"])])]}


def _chunk(rid: str, chat: bool, req: dict[str, Any], i: int, last: bool) -> bytes:
    tid, text = TOKENS[i]
    ids = [tid] if req.get("return_token_ids") else None
    finish = "length" if last else None
    if chat:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": _logprobs(req, True, i), "finish_reason": finish,
                  "token_ids": ids}
        obj = {"id": rid, "object": "chat.completion.chunk", "created": 1700000000, "model": "fake", "choices": [choice]}
    else:
        choice = {"index": 0, "text": text, "logprobs": _logprobs(req, False, i), "finish_reason": finish,
                  "prompt_token_ids": [1, 2, 3] if ids and i == 0 else None, "token_ids": ids}
        obj = {"id": rid, "object": "text_completion", "created": 1700000000, "model": "fake", "choices": [choice]}
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _whole(rid: str, chat: bool, req: dict[str, Any], n: int) -> dict[str, Any]:
    text = "".join(t for _, t in TOKENS[:n])
    lps = [_logprobs(req, chat, i) for i in range(n)]
    if chat:
        lp = {"content": [c for x in lps for c in x["content"]]} if lps[0] else None
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                  "finish_reason": "length", "token_ids": [t for t, _ in TOKENS[:n]] if req.get("return_token_ids") else None}
    else:
        lp = {k: [v for x in lps for v in x[k]] for k in lps[0]} if lps[0] else None
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": "length",
                  "token_ids": [t for t, _ in TOKENS[:n]] if req.get("return_token_ids") else None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": 1700000000,
            "model": "fake", "choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": n}}


async def _reply(send: Any, status: int, obj: Any, extra: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": data})


class FakeServer:
    """uvicorn serving a FakeUpstream on a free port, on a thread."""

    def __init__(self) -> None:
        import uvicorn

        from workbench.external.peers import free_port

        self.app = FakeUpstream()
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="critical",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake upstream did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
