"""`/v1/completions`: prompts in (text, token ids, or a batch of either), legacy completions out.

Owns: the completions-specific rules (echo, `logprobs` as a count, unsupported `suffix` and
`best_of != n`), the non-streaming response and the stream (text deltas with legacy logprobs and
running text offsets, finish reasons, optional usage chunk, an error event if the engine fails,
then `[DONE]`). A request still running when its stream closes is aborted. Choices are numbered
prompt-major: choice `p * n + i` is the i-th sample of prompt p. Does not own: shared request
handling (serving.py) or framing (sse.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from workbench.engine.output.output import RequestOutput
from workbench.server.engine_loop import RequestHandle
from workbench.server.errors import APIError, bad_request, error_body
from workbench.server.logprobs import completion_logprobs
from workbench.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from workbench.server.serving import (
    ServerState,
    build_params,
    check_max_tokens,
    check_model,
    finish_reason,
    new_id,
    prepare_grammar,
    read_request,
    stop_reason,
    submit,
    usage_of,
)
from workbench.server.sse import DONE, EventStreamResponse, sse_frame, until_disconnect

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) on this server, got {req.best_of}", "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported by this server", "echo")


def _prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt)


async def create_completion(state: ServerState, request: Request) -> Response:
    req = await read_request(request, CompletionRequest, state.max_body_bytes)
    check_model(state, req.model)
    _check_unsupported(req)
    top = req.logprobs or 0
    check_max_tokens(state, req.max_tokens or DEFAULT_MAX_TOKENS)
    params = build_params(req, max_tokens=req.max_tokens or DEFAULT_MAX_TOKENS, logprobs=req.logprobs is not None,
                          top_logprobs=top, vocab_size=state.engine.vocab_size, prompt_param="prompt",
                          grammar_limits=state.engine.grammars.limits)
    await prepare_grammar(state, request, params, "prompt")
    req_id = new_id("cmpl")
    handle = await submit(state, list(req.prompt), params, req_id, "prompt", stream=bool(req.stream))
    echoes = [_prompt_text(state, p) if req.echo else "" for p in req.prompt for _ in range(req.n)]
    if req.stream:
        return EventStreamResponse(_stream(state, req, handle, req_id, echoes))
    ok, outputs = await until_disconnect(_collect(handle), request.receive)
    if not ok:
        state.loop.abort(handle)
        return Response(status_code=499)
    choices = []
    for i, rid in enumerate(handle.req_ids):
        out = outputs[rid]
        lp = completion_logprobs(out.logprobs or [], top, len(echoes[i])) if req.logprobs is not None else None
        choices.append(CompletionChoice(index=i, text=echoes[i] + out.text, logprobs=lp,
                                        finish_reason=finish_reason(out), stop_reason=stop_reason(out)))
    usage = usage_of([outputs[r] for r in handle.req_ids], len(req.prompt))
    body = CompletionResponse(id=req_id, model=state.model_name, choices=choices, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))


async def _collect(handle: RequestHandle) -> dict[str, RequestOutput]:
    try:
        return await handle.result()
    except RuntimeError as exc:
        raise APIError(500, str(exc), code="engine_error") from None


async def _stream(state: ServerState, req: CompletionRequest, handle: RequestHandle, req_id: str,
                  echoes: list[str]) -> AsyncIterator[bytes]:
    created, top = int(time.time()), req.logprobs or 0
    offsets = [0] * len(handle.req_ids)  # characters of each choice's text sent so far
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[CompletionChoice], usage: Any = None) -> bytes:
        return sse_frame(CompletionResponse(id=req_id, created=created, model=state.model_name, choices=choices,
                                            usage=usage))

    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield chunk([CompletionChoice(index=i, text=echo)])
                offsets[i] = len(echo)
        failed = False
        async for item in handle.items():
            if item.error is not None:
                yield sse_frame(error_body(item.error, "server_error", code="engine_error"))
                failed = True
                break
            i, step = handle.index(item.req_id), item.step
            lp = None
            if req.logprobs is not None and item.logprobs:
                lp = completion_logprobs(item.logprobs, top, offsets[i])
            reason = finish_reason(step.output) if step.finished else None
            offsets[i] += len(step.delta)
            if step.delta or lp is not None or reason is not None:
                yield chunk([CompletionChoice(index=i, text=step.delta, logprobs=lp, finish_reason=reason,
                                              stop_reason=stop_reason(step.output) if step.finished else None)])
        if include_usage and not failed:
            yield chunk([], usage_of([handle.outputs[r] for r in handle.req_ids], len(req.prompt)))
        yield DONE
    finally:
        if not handle.done:
            state.loop.abort(handle)
