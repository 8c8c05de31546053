"""One streamed request to an OpenAI-compatible server, parsed chunk by chunk.

Owns: the request body (`build_body`: the endpoint's logprob fields, `stream_options.include_usage`,
and the extra fields vLLM understands: `return_tokens_as_token_ids`, `return_token_ids`,
`request_id`), parsing one SSE chunk of either endpoint into `ChunkTokens` (`parse_chunk`), and
`stream_request`, which sends one request with httpx + httpx-sse and hands every token to a callback
the moment its chunk arrives. Errors become `StreamError` with a message a user can act on (HTTP
status and the server's own message, a dropped connection, a server that never answered). Does not
own the run (probe.py) or the trace (probe.py writes it).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from workbench.external.records import ProbeRequest

# Fields vLLM accepts beyond OpenAI's; a server that rejects them gets the request again without.
VLLM_EXTRAS = ("return_tokens_as_token_ids", "return_token_ids", "request_id")
# What one upstream response may send before the probe gives up on it (issue 36): a server that
# streams forever, sends one endless line, or answers an error with a huge body
MAX_EVENT_BYTES = 1 << 20  # one SSE event's data
MAX_STREAM_BYTES = 64 << 20  # one response's events together
MAX_ERROR_BYTES = 64 << 10  # an error body kept for the message


class StreamError(RuntimeError):
    """A request that failed; `status` is the HTTP status when the server answered one."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass(slots=True)
class ReportedToken:
    """One token as a chunk reported it: text, bytes (chat only), logprob and alternatives."""

    text: str
    raw_bytes: list[int] | None
    logprob: float | None
    top: list[tuple[str, list[int] | None, float]]  # (text, bytes, logprob)
    token_id: int | None = None  # from the chunk's `token_ids` (vLLM return_token_ids)


@dataclass(slots=True)
class ChunkTokens:
    """What one SSE chunk carried."""

    text: str = ""
    tokens: list[ReportedToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    response_id: str | None = None


def build_body(req: ProbeRequest, model: str, defaults: dict[str, Any], *, top_logprobs: int, max_tokens: int,
               extras: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """`(path, json body)` for one request: its own params over the run's defaults, logprobs on, streamed."""
    params = {**defaults, **req.params}
    params.setdefault("max_tokens", max_tokens)
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}, **params}
    if req.is_chat:
        body.update(messages=req.messages, logprobs=True, top_logprobs=top_logprobs)
        path = "/v1/chat/completions"
    else:
        body.update(prompt=req.prompt, logprobs=top_logprobs)
        path = "/v1/completions"
    body.update(extras)
    return path, body


def parse_chunk(obj: Any, chat: bool) -> ChunkTokens:
    """Parse one chunk's JSON; ValueError when it is not a chunk of this endpoint."""
    if not isinstance(obj, dict):
        raise ValueError("chunk is not a JSON object")
    if "error" in obj:
        err = obj["error"]
        raise ValueError(f"server error in stream: {err.get('message') if isinstance(err, dict) else err}")
    out = ChunkTokens(usage=obj.get("usage") or None, response_id=obj.get("id"))
    choices = obj.get("choices") or []
    if not choices:
        return out
    choice = choices[0]
    out.finish_reason = choice.get("finish_reason")
    out.stop_reason = choice.get("stop_reason", choice.get("matched_stop"))
    out.prompt_token_ids = choice.get("prompt_token_ids") or obj.get("prompt_token_ids")
    lp = choice.get("logprobs")
    if chat:
        out.text = (choice.get("delta") or {}).get("content") or ""
        for item in (lp or {}).get("content") or []:
            top = [(t.get("token", ""), t.get("bytes"), _num(t.get("logprob"))) for t in item.get("top_logprobs") or []]
            out.tokens.append(ReportedToken(item.get("token", ""), item.get("bytes"), _num(item.get("logprob")), top))
    else:
        out.text = choice.get("text") or ""
        if lp:
            tops = lp.get("top_logprobs") or []
            for i, (text, logprob) in enumerate(zip(lp.get("tokens") or [], lp.get("token_logprobs") or [])):
                alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
                top = sorted(((t, None, _num(v)) for t, v in alts.items()),
                             key=lambda x: -x[2] if x[2] is not None else math.inf)
                out.tokens.append(ReportedToken(text, None, _num(logprob), top))
    ids = choice.get("token_ids")
    if isinstance(ids, list) and len(ids) == len(out.tokens):
        for tok, tid in zip(out.tokens, ids):
            tok.token_id = int(tid)
    return out


def _num(value: Any) -> float | None:
    """A reported logprob; None ("not recorded") for anything but a finite number (a NaN or an infinity
    that a server's JSON carried never reaches a trace or a comparison)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _chunk_limit(body: dict[str, Any]) -> int:
    """Events one response may carry: a few per token it may generate, plus role and usage chunks."""
    tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 4096
    n = body.get("n") or 1
    return 4 * int(tokens) * int(n) + 64 if isinstance(tokens, int) and isinstance(n, int) else 1 << 20


def error_message(response: httpx.Response, text: str) -> str:
    """`HTTP 400: <the server's message>` from an OpenAI-shaped (or any) error body."""
    message = text.strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        message = err.get("message") or err.get("detail") or message if isinstance(err, dict) else str(err)
    except ValueError:
        pass
    return f"HTTP {response.status_code}: {str(message)[:300]}"


async def _bounded_events(response: httpx.Response) -> Any:
    """httpx-sse's events, read with a bound on one line (httpx-sse keeps a line until its newline
    arrives, so one endless line would take all memory); invalid UTF-8 arrives as U+FFFD."""
    from httpx_sse import SSEError
    from httpx_sse._decoders import SSEDecoder

    ctype = response.headers.get("content-type", "").partition(";")[0]
    if "text/event-stream" not in ctype:
        raise SSEError(f"Expected response header Content-Type to contain 'text/event-stream', got {ctype!r}")
    decoder, pending = SSEDecoder(), ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        if len(pending) > MAX_EVENT_BYTES:
            raise StreamError(f"a stream line of more than {MAX_EVENT_BYTES} characters (no newline), over the limit")
        for line in lines:
            event = decoder.decode(line.rstrip("\r"))
            if event is not None:
                yield event
    for line in (pending.rstrip("\r"), ""):
        event = decoder.decode(line)
        if event is not None:
            yield event


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                         chat: bool, on_open: Callable[[httpx.Response], None],
                         on_chunk: Callable[[ChunkTokens, float], None]) -> None:
    """POST `body` to `url` and call `on_chunk(parsed, arrival_time)` for every data chunk.

    Raises StreamError for an error status (with the server's message), a connection that fails or
    drops, an unparsable chunk, or a stream that ends without `[DONE]` and without a finish reason.
    """
    from httpx_sse import SSEError, aconnect_sse

    finished, chunks = False, 0
    opened = False
    try:
        async with aconnect_sse(client, "POST", url, json=body, headers=headers) as source:
            response = source.response
            if response.status_code != 200:
                raw = bytearray()
                async for part in response.aiter_bytes():
                    raw += part[:MAX_ERROR_BYTES - len(raw)]
                    if len(raw) >= MAX_ERROR_BYTES:
                        break
                text = raw.decode("utf-8", "replace")
                raise StreamError(error_message(response, text), response.status_code, text)
            on_open(response)
            opened = True
            total, limit = 0, _chunk_limit(body)
            async for sse in _bounded_events(response):
                now = time.perf_counter()
                total += len(sse.data)
                if len(sse.data) > MAX_EVENT_BYTES:
                    raise StreamError(f"a stream event of {len(sse.data)} bytes is over the limit of "
                                      f"{MAX_EVENT_BYTES} after {chunks} chunks")
                if total > MAX_STREAM_BYTES or chunks >= limit:
                    raise StreamError(f"the stream went on past {chunks} chunks and {total} bytes without "
                                      f"finishing (limits: {limit} chunks for this request's max_tokens, "
                                      f"{MAX_STREAM_BYTES} bytes)")
                if sse.data.strip() == "[DONE]":
                    finished = True
                    break
                if not sse.data.strip():
                    continue
                try:
                    parsed = parse_chunk(json.loads(sse.data), chat)
                except ValueError as exc:
                    raise StreamError(f"unreadable stream chunk: {exc}") from None
                finished = finished or parsed.finish_reason is not None
                chunks += 1
                on_chunk(parsed, now)
    except SSEError as exc:
        raise StreamError(f"not an event stream: {exc}") from None
    except httpx.ConnectError as exc:
        raise StreamError(f"cannot connect to {url} ({exc})") from None
    except httpx.TimeoutException as exc:
        raise StreamError(f"server did not answer in time ({type(exc).__name__})") from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        if not opened:
            raise StreamError(f"the server closed the connection before answering ({exc or type(exc).__name__})") \
                from None
        raise StreamError(f"connection dropped mid-stream after {chunks} chunks ({exc or type(exc).__name__})") \
            from None
    if not finished:
        raise StreamError("stream ended without a finish reason or [DONE] (server died or cut the connection)")
