"""The records of a probe: what is asked of an external server, and what came back.

Owns: `ProbeRequest` (one request: a prompt or chat messages, and its sampling fields),
`load_prompts_jsonl` (a prompts file, one request a line), `ProbeToken` (one output token as the
server reported it, with how its id was obtained), `RequestRecord` (everything received for one
request, in arrival order) and `ProbeResult` (the run). Standard library only. Does not own
talking to the server (sse_stream.py) or writing the trace (probe.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Sampling fields a prompts file (or the command line) may set per request, as the OpenAI/vLLM names.
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "max_tokens", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "logit_bias",
    "repeat_penalty",  # llama.cpp's name (it ignores repetition_penalty; its default is 1.1)
)

# How a token's id was obtained: the server said it, or it was recovered from the token's bytes/text.
ID_SERVER = "server"
ID_RECOVERED = "recovered"
ID_UNKNOWN = "unknown"  # the bytes match no token of the reference tokenizer (id is -1)


@dataclass(slots=True)
class ProbeRequest:
    """One request: a `prompt` (completions) or `messages` (chat), and its sampling fields."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("ProbeRequest needs exactly one of prompt (a string) or messages (a chat)")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise ValueError(f"prompt must be a non-empty string, got {self.prompt!r:.60}")
        if self.messages is not None:
            ok = isinstance(self.messages, list) and self.messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in self.messages)
            if not ok:
                raise ValueError("messages must be a non-empty list of {'role': str, 'content': str}")
        unknown = set(self.params) - set(SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"unknown sampling fields {sorted(unknown)}; allowed: {', '.join(SAMPLING_FIELDS)}")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def load_prompts_jsonl(path: str | Path, *, chat: bool = False) -> list[ProbeRequest]:
    """Read a prompts file: one JSON value a line (blank lines skipped).

    A line is a string (a prompt; with `chat` it becomes one user message), a list of messages, or
    an object with `prompt` or `messages` and any sampling fields of `SAMPLING_FIELDS` (at top level
    or under `params`). ValueError names the line that is wrong.
    """
    out: list[ProbeRequest] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_request_from_json(json.loads(line), chat))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}: line {n}: {exc}") from None
    if not out:
        raise ValueError(f"{path}: no requests in the file")
    return out


def _request_from_json(obj: Any, chat: bool) -> ProbeRequest:
    if isinstance(obj, str):
        return ProbeRequest(messages=[{"role": "user", "content": obj}]) if chat else ProbeRequest(prompt=obj)
    if isinstance(obj, list):
        return ProbeRequest(messages=obj)
    if not isinstance(obj, dict):
        raise ValueError("expected a string, a list of messages or an object")
    params = dict(obj.get("params") or {})
    params.update({k: v for k, v in obj.items() if k in SAMPLING_FIELDS})
    extra = set(obj) - set(SAMPLING_FIELDS) - {"prompt", "messages", "params"}
    if extra:
        raise ValueError(f"unknown fields {sorted(extra)}")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if chat and prompt is not None and messages is None:
        prompt, messages = None, [{"role": "user", "content": prompt}]
    return ProbeRequest(prompt=prompt, messages=messages, params=params)


@dataclass(slots=True)
class ProbeToken:
    """One output token as the server reported it."""

    position: int
    token_id: int  # -1 when it could not be recovered
    text: str
    logprob: float | None
    top: list[list[Any]]  # [[token_id, logprob, text], ...] as reported (ids recovered like token_id)
    id_source: str  # ID_SERVER | ID_RECOVERED | ID_UNKNOWN
    received: float  # perf_counter() when its chunk arrived
    chunk: int  # index of the SSE chunk that carried it (several tokens may share one)


@dataclass(slots=True)
class RequestRecord:
    """Everything received for one request, in arrival order."""

    req_id: str
    index: int
    request: ProbeRequest
    body: dict[str, Any]  # the JSON sent (never holds credentials)
    prompt_ids: list[int]  # the reference tokenizer's ids of the prompt (chat: rendered with its template)
    sent: float = 0.0
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    tokens: list[ProbeToken] = field(default_factory=list)
    text: str = ""
    chunks: list[float] = field(default_factory=list)  # arrival time of every SSE data chunk
    finish_reason: str | None = None
    stop_reason: Any = None
    usage: dict[str, Any] = field(default_factory=dict)
    server_prompt_ids: list[int] | None = None  # when the server returned them (vLLM return_token_ids)
    server_request_id: str | None = None
    error: str | None = None
    spans: Any = None  # what the OTLP receiver joined to this request (None: no receiver)
    done: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.tokens[0].received - self.sent if self.tokens else None

    def timings(self) -> dict[str, Any]:
        """Client-side timings: TTFT, inter-token gaps (per token), end-to-end, in seconds; under
        `server`, the server's own (queue_s, prefill_s, ...) when an OTLP receiver joined its spans."""
        times = [t.received for t in self.tokens]
        gaps = [b - a for a, b in zip(times, times[1:])]
        end = self.done if self.done is not None else (times[-1] if times else self.sent)
        out = {"arrival": self.sent, "ttft": self.ttft, "itl": gaps, "e2e": end - self.sent,
               "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
               "chunks": len(self.chunks), "clock": "client"}
        if isinstance(self.spans, dict):  # the server's own timings (OTLP), beside the client's
            out["server"] = {k: v for k, v in self.spans.items() if k.endswith("_s")}
        return out


@dataclass(slots=True)
class ProbeResult:
    """A finished probe: the trace written, each request's record, and what went wrong."""

    path: Path
    url: str
    model: str
    records: list[RequestRecord]
    errors: list[str] = field(default_factory=list)  # one line per failed request or run-level problem
    fallbacks: list[str] = field(default_factory=list)  # extra fields the server refused and we dropped

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def num_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.records)
