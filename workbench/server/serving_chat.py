"""`/v1/chat/completions`: chat messages and tools in, OpenAI chat responses or chunks out.

Owns: turning OpenAI messages and `tools` into the chat the engine renders (tool definitions go
into the system prompt through `tool_prompt.inject_tools`), the non-streaming response (tool calls
parsed from the final text) and the stream (role chunk, content deltas with logprobs, tool calls
as each completes, finish reason, optional usage chunk, an error event if the engine fails, then
`[DONE]`). tool_choice "required" or a named function is enforced with a grammar
(tool_grammar.py). A request still running when its stream closes is aborted. Does not own: shared
request handling (serving.py) or framing (sse.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from workbench.engine.output.output import RequestOutput
from workbench.engine.output.tool_formats import make_stream_parser, parse_tool_text
from workbench.engine.output.tool_prompt import inject_tools
from workbench.server.engine_loop import RequestHandle, StreamItem
from workbench.server.errors import APIError, bad_request, error_body
from workbench.server.logprobs import chat_logprobs
from workbench.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCallDelta,
    ToolCallOut,
)
from workbench.server.serving import (
    ServerState,
    build_params,
    check_max_tokens,
    check_model,
    finish_reason,
    new_id,
    off_loop,
    prepare_grammar,
    read_request,
    stop_reason,
    submit,
    usage_of,
)
from workbench.server.sse import DONE, EventStreamResponse, sse_frame, until_disconnect
from workbench.server.tool_grammar import tool_call_grammar


def tool_format(state: ServerState) -> str:
    """The server's --tool-call-parser (hermes by default)."""
    return state.extra.get("tool_call_parser", "hermes")


async def forced_tool_grammar(state: ServerState, req: ChatCompletionRequest, fmt: str = "hermes"
                              ) -> dict[str, Any] | None:
    """An `ebnf` constraint making the answer one tool call, for tool_choice "required" or a named one."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    try:
        backend = state.engine.grammars

        def build(schema: dict[str, Any], head: str, tail: str) -> str:  # on the grammar threads, in the worker
            return backend.wrapped(schema, head, tail, "tools")

        def make(_kind: str, _source: Any, _param: Any) -> str:
            return tool_call_grammar(tools, name, build, fmt, backend.limits)

        return {"ebnf": await off_loop(state, make, "wrapped", None)}
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice" if "tool_choice" in str(exc) else "tools") from None


async def check_tool_schemas(state: ServerState, req: ChatCompletionRequest) -> None:
    """400 naming the tool when a function's `parameters` is over the grammar limits or not a valid
    JSON schema, whatever the tool_choice (with "auto" the model is shown it; a broken one must not
    pass silently). jsonschema's check runs in the grammar worker, under the compile budget."""
    from workbench.engine.sample.grammar_limits import check_limits

    backend = state.engine.grammars
    for i, tool in enumerate(req.tools or ()):
        params = tool.model_dump(exclude_none=True)["function"].get("parameters")
        if params is None:
            continue
        where = f"tools[{i}].function.parameters"
        try:
            check_limits("json_schema", params, backend.limits, where)
            await off_loop(state, lambda _kind, schema, name: backend.check_schema(schema, name), "schema", params,
                           where)
        except ValueError as exc:
            raise bad_request(str(exc), "tools") from None


def chat_messages(req: ChatCompletionRequest, fmt: str = "hermes") -> list[dict[str, Any]]:
    """The engine's chat: roles and text, with tool definitions, calls and results written in."""
    if req.tool_choice not in (None, "none") and not req.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    messages = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        messages.append(msg)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    try:
        return inject_tools(messages, tools, fmt)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    req = await read_request(request, ChatCompletionRequest, state.max_body_bytes)
    check_model(state, req.model)
    messages = chat_messages(req, tool_format(state))
    max_tokens = req.max_completion_tokens or req.max_tokens or state.default_max_tokens
    if req.max_completion_tokens or req.max_tokens:  # the server's own default is clamped by the engine
        check_max_tokens(state, max_tokens)
    await check_tool_schemas(state, req)
    limits = state.engine.grammars.limits
    forced = await forced_tool_grammar(state, req, tool_format(state))
    params = build_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                          top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
                          vocab_size=state.engine.vocab_size, prompt_param="messages",
                          grammar=forced, grammar_limits=limits)
    await prepare_grammar(state, request, params, "messages", "tools" if forced else None)
    req_id = new_id("chatcmpl")
    handle = await submit(state, [messages], params, req_id, "messages", stream=bool(req.stream))
    use_tools = bool(req.tools) and req.tool_choice != "none"
    if req.stream:
        return EventStreamResponse(_stream(state, req, handle, req_id, use_tools))
    ok, outputs = await until_disconnect(_collect(state, handle), request.receive)
    if not ok:  # the client left: nobody to answer
        state.loop.abort(handle)
        return Response(status_code=499)
    choices = [_choice(state, req, i, outputs[rid], use_tools) for i, rid in enumerate(handle.req_ids)]
    body = ChatCompletionResponse(id=req_id, model=state.model_name, choices=choices,
                                  usage=usage_of([outputs[r] for r in handle.req_ids]))
    return JSONResponse(body.model_dump(mode="json"))


async def _collect(state: ServerState, handle: RequestHandle) -> dict[str, RequestOutput]:
    try:
        return await handle.result()
    except RuntimeError as exc:
        raise APIError(500, str(exc), code="engine_error") from None


def _tool_id_prefix() -> str:
    return f"call_{uuid.uuid4().hex[:12]}_"


def _choice(state: ServerState, req: ChatCompletionRequest, index: int, out: RequestOutput,
            use_tools: bool) -> ChatChoice:
    content: str | None = out.text
    calls: list[ToolCallOut] = []
    if use_tools:
        parsed = parse_tool_text(tool_format(state), out.text, id_prefix=_tool_id_prefix())
        calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments_json))
                 for c in parsed.tool_calls]
        content = parsed.content if (parsed.content.strip() or not calls) else None
    logprobs = chat_logprobs(out.logprobs or [], state.token_bytes) if req.logprobs else None
    return ChatChoice(index=index, message=ChatMessageOut(content=content, tool_calls=calls), logprobs=logprobs,
                      finish_reason=finish_reason(out, bool(calls)), stop_reason=stop_reason(out))


class _ChoiceStream:
    """Per-choice streaming state: the tool parser, whose chunks become OpenAI tool-call deltas."""

    def __init__(self, use_tools: bool, fmt: str = "hermes") -> None:
        self.parser = make_stream_parser(fmt, id_prefix=_tool_id_prefix()) if use_tools else None

    def delta(self, item: StreamItem) -> tuple[str, list[ToolCallDelta], str | None]:
        """(content, tool-call deltas, finish reason or None) for one step of this choice."""
        step = item.step
        text, chunks = step.delta, []
        if self.parser is not None:
            fed = self.parser.feed(step.delta)
            text, chunks = fed.content_delta, list(fed.chunks)
        reason = None
        if step.finished:
            if self.parser is not None:
                end = self.parser.finish()
                text, chunks = text + end.content_delta, chunks + end.chunks
            reason = finish_reason(step.output, bool(self.parser and self.parser.tool_calls))
        calls = [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                               function=FunctionCallDelta(name=c.name, arguments=c.arguments)) for c in chunks]
        return text, calls, reason


async def _stream(state: ServerState, req: ChatCompletionRequest, handle: RequestHandle, req_id: str,
                  use_tools: bool) -> AsyncIterator[bytes]:
    created, n = int(time.time()), len(handle.req_ids)
    choices = [_ChoiceStream(use_tools, tool_format(state)) for _ in range(n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(parts: list[ChatChunkChoice], usage: Any = None) -> bytes:
        return sse_frame(ChatCompletionChunk(id=req_id, created=created, model=state.model_name, choices=parts,
                                             usage=usage))

    try:
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)])
        failed = False
        async for item in handle.items():
            if item.error is not None:
                yield sse_frame(error_body(item.error, "server_error", code="engine_error"))
                failed = True
                break
            i = handle.index(item.req_id)
            text, calls, reason = choices[i].delta(item)
            lp = chat_logprobs(item.logprobs, state.token_bytes) if req.logprobs and item.logprobs else None
            if text or calls or lp is not None or reason is not None:
                delta = DeltaMessage(content=text or None, tool_calls=calls or None)
                yield chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lp, finish_reason=reason)])
        if include_usage and not failed:
            yield chunk([], usage_of([handle.outputs[r] for r in handle.req_ids]))
        yield DONE
    finally:
        if not handle.done:
            state.loop.abort(handle)
