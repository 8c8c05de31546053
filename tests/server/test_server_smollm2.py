"""Where content matters, on the embedded SmolLM2 through the official `openai` client: a tool call
(and the conversation continuing after the tool's result), a json_schema response, and stop strings."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from workbench.engine.engine import Engine
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer
from workbench.server.event_hub import EventHub

pytestmark = pytest.mark.slow
MODEL = "smollm2"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2):
    hub = EventHub()
    engine = Engine(smollm2, trace_level="summary", trace_sinks=[hub])
    with BackgroundServer(create_app(engine, model_name=MODEL, hub=hub)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    engine.close()


def test_required_tool_call_streaming_and_not(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls"
    (call,) = full.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert full.message.content is None
    streamed, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    # OpenAI's shape: the first delta of a call carries its id and name, later ones argument pieces
    calls: dict[int, list[str]] = {}
    for t in streamed:
        if t.function.name:
            calls[t.index] = [t.function.name, ""]
        calls[t.index][1] += t.function.arguments or ""
    assert [(i, name, json.loads(args)) for i, (name, args) in calls.items()] == [(0, "get_weather", {"city": "Paris"})]
    assert reasons[-1] == "tool_calls"


def test_named_tool_choice_and_the_conversation_continues(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    (call,) = first.message.tool_calls
    assert call.function.name == "get_time" and "city" in json.loads(call.function.arguments)
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"city": "Paris", "time": "14:05"}'},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=40,
                                            temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content


def test_json_schema_response_validates(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
              response_format=fmt, max_tokens=60, temperature=0)
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "stop"
    jsonschema.validate(json.loads(full.message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == full.message.content


def test_stop_string_ends_the_answer(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "List three fruits, one per line."}],
              max_tokens=40, temperature=0)
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert "\n" in free, free
    cut = client.chat.completions.create(stop=["\n"], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == free.split("\n")[0]
    kept = client.chat.completions.create(stop=["\n"], extra_body={"include_stop_str_in_output": True}, **kw)
    assert kept.choices[0].message.content == free.split("\n")[0] + "\n"
