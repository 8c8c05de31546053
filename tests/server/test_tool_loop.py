"""A LangChain-style tool loop through the official openai client, with two `--tool-call-parser` formats:
tools offered, a call streamed (its arguments arriving in several deltas, joined by index as clients
join them), the tool's result sent back as a `tool` message, and a final answer. The call is forced
with tool_choice (a grammar in that parser's format), so the tiny random model writes a real call."""

from __future__ import annotations

import argparse
import json

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from workbench.server.background import BackgroundServer
from workbench.server.cli_args import add_serve_args, build_server

MODEL = "tiny-random"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}]


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def client(request):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", MODEL, "--device", "cpu", "--trace-level", "off",
                              "--tool-call-parser", request.param, "--enable-auto-tool-choice"])
    engine, app = build_server(args)
    with BackgroundServer(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    engine.close()


def _join_stream(chunks: list[ChatCompletionChunk]) -> tuple[dict[int, dict], int, str | None]:
    """Tool calls joined by index, as LangChain and the openai helpers do; and the argument delta count."""
    calls: dict[int, dict] = {}
    arg_deltas, reason = 0, None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
                    arg_deltas += 1
    return calls, arg_deltas, reason


def test_tool_loop(client) -> None:
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=64, stream=True, store=False)
    calls, arg_deltas, reason = _join_stream(list(stream))
    assert reason == "tool_calls" and list(calls) == [0]
    call = calls[0]
    args = json.loads(call["arguments"])
    assert call["name"] == "get_weather" and call["id"] and set(args) == {"city", "unit"}
    assert arg_deltas > 1, "arguments arrived whole instead of in deltas"

    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=64)
    (same,) = whole.choices[0].message.tool_calls
    assert (same.function.name, json.loads(same.function.arguments)) == ("get_weather", args)

    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call["id"], "type": "function",
                      "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp": 18, "unit": "C"})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto",
                                           temperature=0, max_tokens=8, metadata={"step": "final"})
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content
    assert final.usage.prompt_tokens > whole.usage.prompt_tokens  # the call and its result are in the prompt
