"""The official `openai` client against `workbench serve`: current fields agent frameworks send (store,
metadata, service_tier, reasoning_effort, prompt_cache_key, safety_identifier,
stream_options.include_obfuscation) are accepted and noted in the log, legacy `functions` map to tools,
unknown fields are still refused, and every response validates against the openai package's own types."""

from __future__ import annotations

import argparse
import json
import logging

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from workbench.server.background import BackgroundServer
from workbench.server.cli_args import add_serve_args, build_server

MODEL = "tiny-random"
MESSAGES = [{"role": "user", "content": "Say hello."}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine, app = build_server(parser.parse_args(["--model", MODEL, "--device", "cpu", "--trace-level", "off"]))
    with BackgroundServer(app) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    engine.close()


def test_current_openai_fields_are_accepted_and_noted(client, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="workbench.server"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, store=False,
            metadata={"run": "test", "user_tier": "free"}, service_tier="auto", reasoning_effort="low",
            prompt_cache_key="conversation-1", safety_identifier="user-1", user="user-1")
    body = json.loads(raw.text)
    ChatCompletion.model_validate(body, strict=False)  # the shape the openai package expects
    chat = raw.parse()
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    notes = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert notes and all(f in notes[0] for f in ("store", "metadata", "service_tier", "reasoning_effort",
                                                  "prompt_cache_key", "safety_identifier"))


def test_stream_with_include_obfuscation_validates_chunk_by_chunk(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, stream=True, store=False,
        stream_options={"include_usage": True, "include_obfuscation": False})
    chunks = list(stream)
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump(exclude_unset=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_completions_and_models_validate(client) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="One two", max_tokens=3, temperature=0,
                                                       extra_body={"metadata": {"k": "v"}, "store": True})
    Completion.model_validate(json.loads(raw.text))
    assert raw.parse().usage.completion_tokens == 3
    (card,) = client.models.list().data
    Model.model_validate(card.model_dump())
    assert card.id == MODEL


def test_legacy_functions_become_a_tool_call(client) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          functions=[WEATHER], function_call={"name": "get_weather"}, max_tokens=48,
                                          temperature=0)
    (call,) = chat.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert chat.choices[0].finish_reason == "tool_calls"


def test_unknown_fields_are_still_refused(client) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"stor": False})
    assert "stor" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, reasoning_effort="extreme")
