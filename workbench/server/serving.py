"""Serving logic shared by both OpenAI endpoints, apart from the router.

Owns: `ServerState` (everything a handler needs, kept on `app.state.workbench`), reading a request
body under a size limit into a protocol model, the model check (404), turning request fields into
`SamplingParams` (engine ValueErrors become 400 naming the OpenAI parameter), submitting to the
engine loop (503 while shutting down; the HTTP request is then attached to its engine request for
`X-Request-Id` and the frame stamps), finish reasons and usage. Does not own: the endpoint-specific
shapes (serving_chat.py, serving_completion.py) or the routes (routes_openai.py).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from workbench.engine.api import EngineAPI
from workbench.engine.output.output import RequestOutput
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.server.engine_loop import EngineLoop, EngineUnavailable, RequestHandle
from workbench.server.errors import APIError, bad_request, from_validation_error
from workbench.server.event_hub import EventHub
from workbench.server.logprobs import TokenBytes
from workbench.server.metrics import Metrics
from workbench.server.protocol import PromptTokensDetails, Usage
from workbench.server.sse import until_disconnect
from workbench.server.stream_latency import attach

M = TypeVar("M", bound=BaseModel)
DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to here, so the client sees the 413


@dataclass(slots=True)
class ServerState:
    """What the routes share; one per app, on `app.state.workbench` (no module globals)."""

    engine: EngineAPI
    loop: EngineLoop
    hub: EventHub
    metrics: Metrics
    model_name: str
    token_bytes: TokenBytes
    trace_dir: Path | None = None
    trace_writer: Any = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 1024
    created: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, or 413 when it is larger than `max_bytes` (checked before and while reading)."""
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"request body is larger than the limit of {max_bytes} bytes",
                       code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > DRAIN_LIMIT:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= max_bytes:
            chunks.append(chunk)
        elif size > DRAIN_LIMIT:
            break
    if size > max_bytes:
        raise too_big
    return b"".join(chunks)


async def read_request(request: Request, model: type[M], max_bytes: int) -> M:
    """Parse and validate a JSON body strictly; every failure is a 400 (or 413) naming the parameter."""
    check_content_type(request)
    body = await read_body(request, max_bytes)
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at position {exc.start})") from None
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc, model) from None


def check_content_type(request: Request) -> None:
    """415 unless the body is declared `application/json`: a page's `text/plain` POST (no CORS
    preflight) must not start generations."""
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {declared[:60] or 'none'!r}",
                       param="Content-Type", code="unsupported_media_type")


def check_max_tokens(state: ServerState, max_tokens: int) -> None:
    """400 when max_tokens alone exceeds the context length (vLLM refuses it too), instead of clamping."""
    limit = int(state.engine.max_context_len())
    if max_tokens > limit:
        raise bad_request(f"max_tokens ({max_tokens}) exceeds the model's context length of {limit} tokens; "
                          f"max_tokens must be at most {limit}", "max_tokens", code="context_length_exceeded")


def check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{state.model_name}`",
                       param="model", code="model_not_found")


# --- request fields -> SamplingParams -----------------------------------------------------------

_ENGINE_TO_API = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format"}
_LEADING_NAME = re.compile(r"^([a-z_]+)")


def api_error_from_value_error(exc: ValueError, prompt_param: str) -> APIError:
    """400 for an engine ValueError, its message in the API's parameter names."""
    message = str(exc)
    for engine_name, api_name in _ENGINE_TO_API.items():
        message = message.replace(engine_name, api_name)
    m = _LEADING_NAME.match(message)
    param = m.group(1) if m else None
    code = None
    if "context length" in message or "KV pool" in message:
        param, code = prompt_param, "context_length_exceeded"
    elif param == "prompt" or param == "messages":
        param = prompt_param
    return APIError(400, message, param=param, code=code)


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if bias is None:
        return None
    if len(bias) > vocab_size:  # before the loop: a 4 MB body holds ~300,000 entries
        raise bad_request(f"logit_bias has {len(bias)} entries, more than the vocabulary's {vocab_size} tokens "
                          f"(at most one entry per token: {vocab_size})", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not re.fullmatch(r"-?\d{1,12}", key):
            raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key[:40]!r}",
                              "logit_bias")
        tid = int(key)
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias: token id {tid} is out of range [0, {vocab_size})", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"logit_bias[{key}] must be in [-100, 100], got {value!r}", "logit_bias")
        out[tid] = float(value)
    return out


def grammar_fields(req: Any, forced: dict[str, Any] | None = None) -> dict[str, Any]:
    """json_schema / regex / ebnf from `response_format`, the engine's own fields and a constraint the
    server adds (`forced`, e.g. a required tool call); at most one."""
    out: dict[str, Any] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        out["json_schema"] = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        out["json_schema"] = fmt.json_schema.schema_  # checked (limits, jsonschema, compile) by prepare_grammar
    if req.regex is not None:
        out["regex"] = req.regex
    if req.ebnf is not None:
        out["ebnf"] = req.ebnf
    if forced and out:
        raise bad_request(f"tool_choice {req.tool_choice!r} cannot be combined with {' or '.join(out)}",
                          "tool_choice")
    out.update(forced or {})
    if len(out) > 1:
        raise bad_request(f"response_format, regex and ebnf are mutually exclusive; got {' and '.join(out)}",
                          "response_format")
    return out


def build_params(req: Any, *, max_tokens: int, logprobs: bool, top_logprobs: int, vocab_size: int,
                 prompt_param: str, grammar: dict[str, Any] | None = None,
                 grammar_limits: Any = None) -> SamplingParams:
    """SamplingParams from the fields both endpoints share; ValueError -> 400. A constraint is checked
    against `grammar_limits` here (cheap, structural); `prepare_grammar` compiles it."""
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens, min_new_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
            logit_bias=parse_logit_bias(req.logit_bias, vocab_size), seed=req.seed, n=req.n,
            stop=tuple(req.stop), stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            logprobs=logprobs, top_logprobs=top_logprobs, **grammar_fields(req, grammar))
        params.validate(vocab_size, grammar_limits, parse_grammar=False)  # parsed in the budgeted compile
    except ValueError as exc:
        raise api_error_from_value_error(exc, prompt_param) from None
    return params


async def off_loop(state: ServerState, call: Any, kind: str, source: Any, param: str | None = None) -> Any:
    """`call(kind, source, param)` (a GrammarBackend method that may block for up to the compile budget)
    on a thread, never on the event loop, the admission thread or the engine's; a handler cancelled
    meanwhile (its client left) abandons it, which stops the worker's compile if nobody else waits."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(state.engine.grammars.executor, call, kind, source, param)
    except asyncio.CancelledError:
        state.engine.grammars.abandon(kind, source)
        raise


async def prepare_grammar(state: ServerState, request: Request, params: SamplingParams, prompt_param: str,
                          param: str | None = None) -> None:
    """Compile the request's constraint under its time and memory budget before it is submitted
    (grammar_worker.py), so admission finds it compiled; 400 naming `param` (default: the
    constraint's own parameter) and the limit when it is invalid or over budget. A client that
    disconnects meanwhile abandons the compile (499)."""
    constraint = params.grammar
    if constraint is None:
        return
    backend = state.engine.grammars
    try:
        if backend.cached(*constraint):
            return
        done, _ = await until_disconnect(off_loop(state, backend.compile, *constraint, param), request.receive)
    except ValueError as exc:
        raise api_error_from_value_error(exc, prompt_param) from None
    if not done:
        raise APIError(499, "the client disconnected while its grammar compiled", code="client_disconnected")


async def submit(state: ServerState, prompts: list[Any], params: SamplingParams, req_id: str,
                 prompt_param: str, stream: bool = True) -> RequestHandle:
    try:
        handle = await state.loop.submit(prompts, params, req_id, stream=stream)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), code="shutting_down") from None
    except ValueError as exc:
        raise api_error_from_value_error(exc, prompt_param) from None
    attach(req_id, handle)  # X-Request-Id and the frame stamps of this HTTP request (stream_latency.py)
    return handle


# --- results ------------------------------------------------------------------------------------


def finish_reason(output: RequestOutput | None, has_tool_calls: bool = False) -> str:
    if output is None or output.finish_reason is None:
        return "abort"
    if has_tool_calls and output.finish_reason == "stop":
        return "tool_calls"
    return output.finish_reason


def stop_reason(output: RequestOutput | None) -> int | str | None:
    matched = output.matched_stop if output is not None else None
    return matched if isinstance(matched, (int, str)) else None


def usage_of(outputs: list[RequestOutput], num_prompts: int = 1) -> Usage:
    """Prompt tokens counted once per prompt (n choices share it, and the first choice's cached prompt
    tokens count for it), completion tokens summed."""
    per_prompt: dict[int, tuple[int, int]] = {}
    completion = 0
    for i, out in enumerate(outputs):
        per_prompt.setdefault(i * num_prompts // max(len(outputs), 1),
                              (int(out.usage.get("prompt_tokens", 0)), int(out.usage.get("cached_prompt_tokens", 0))))
        completion += int(out.usage.get("completion_tokens", len(out.token_ids)))
    prompt = sum(p for p, _ in per_prompt.values())
    cached = sum(c for _, c in per_prompt.values())
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None)
