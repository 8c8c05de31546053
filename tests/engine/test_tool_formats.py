"""Tool-call formats as models really write them (hermes, llama3_json, mistral, pythonic): whole-text
parsing, streaming at every split giving the same calls, and arguments streamed in OpenAI-style chunks
that join to exactly the final arguments."""

from __future__ import annotations

import json

import pytest

from workbench.engine.output.tool_formats import make_stream_parser, parse_tool_text, render_calls

ARGS = {"city": "Paris", "unit": "°C", "days": 3, "hourly": False}
# (format, model output, expected content, expected calls)
CASES = [
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C", '
               '"days": 3, "hourly": false}}\n</tool_call>', "Checking.\n", [("get_weather", ARGS)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C", "days": 3, '
                    '"hourly": false}}', "", [("get_weather", ARGS)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"q": "x"}}; {"name": "b", "parameters": {}}', "",
     [("a", {"q": "x"}), ("b", {})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C", '
                '"days": 3, "hourly": false}}, {"name": "b", "arguments": {"n": [1, 2]}}]', "Sure. ",
     [("get_weather", ARGS), ("b", {"n": [1, 2]})]),
    ("pythonic", '[get_weather(city="Paris", unit="°C", days=3, hourly=False), search(q="a, b)")]', "",
     [("get_weather", ARGS), ("search", {"q": "a, b)"})]),
]
NOT_CALLS = [("llama3_json", "The answer is {x}."), ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
             ("mistral", "[TOOL_CALLS][{not json"), ("pythonic", "[1, 2] are numbers"),
             ("pythonic", "[f(__import__('os').system('x'))]"), ("hermes", "<tool_call>{bad</tool_call>")]


def _stream(fmt: str, text: str, cuts: list[int]):
    p = make_stream_parser(fmt)
    content, chunks, start = [], [], 0
    for end in [*cuts, len(text)]:
        d = p.feed(text[start:end])
        content.append(d.content_delta)
        chunks += d.chunks
        start = end
    d = p.finish()
    return "".join(content) + d.content_delta, p.tool_calls, chunks + d.chunks


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_whole_text(fmt, text, content, calls) -> None:
    res = parse_tool_text(fmt, text)
    assert res.content == content
    assert [(c.name, json.loads(c.arguments_json)) for c in res.tool_calls] == calls


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_streaming_at_every_split_matches_and_arguments_join(fmt, text, content, calls) -> None:
    whole = parse_tool_text(fmt, text)
    for step in (1, 3, 7):
        got_content, got_calls, chunks = _stream(fmt, text, list(range(step, len(text), step)))
        assert (got_content, got_calls) == (whole.content, whole.tool_calls)
        for i, call in enumerate(whole.tool_calls):
            mine = [c for c in chunks if c.index == i]
            assert (mine[0].id, mine[0].name, mine[0].arguments) == (call.id, call.name, "")
            assert all(c.id is None and c.name is None for c in mine[1:])
            assert "".join(c.arguments for c in mine) == call.arguments_json
            if fmt != "pythonic" and step == 1 and len(json.loads(call.arguments_json)) > 1:
                assert len(mine) > 3  # arguments arrive in pieces while the model writes them


@pytest.mark.parametrize("fmt,text", NOT_CALLS)
def test_text_that_is_not_a_call_stays_content(fmt, text) -> None:
    assert parse_tool_text(fmt, text).tool_calls == []
    assert parse_tool_text(fmt, text).content == text
    content, calls, _ = _stream(fmt, text, list(range(2, len(text), 2)))
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_rendered_calls_parse_back(fmt) -> None:
    calls = [("get_weather", ARGS), ("b", {"n": [1, 2]})]
    res = parse_tool_text(fmt, render_calls(fmt, calls))
    assert [(c.name, json.loads(c.arguments_json)) for c in res.tool_calls] == calls


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        parse_tool_text("granite", "x")
