"""Tool-call parsing in SmolLM2's <tool_call> format, whole-text and streaming, and tools in the prompt."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.engine.output.tool_parser import StreamingToolParser, ToolParseResult, parse_tool_calls
from workbench.engine.output.tool_prompt import inject_tools

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
FRAGMENTS = [
    "Sure, let me check. ", "\n", " plain text ", "<", "<tool", "</tool_call>", "<tool_call>", "tool_call>",
    WEATHER, '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]</tool_call>',
    "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', '{"name": "x"}', "世界 😀",
]


def stream(text: str, cuts: list[int]) -> tuple[str, list[Any], StreamingToolParser]:
    """Feed `text` split at `cuts`; return the streamed content and the completed calls."""
    p = StreamingToolParser()
    content, calls, start = [], [], 0
    for end in [*sorted(set(cuts)), len(text)]:
        d = p.feed(text[start:end])
        content.append(d.content_delta)
        calls += d.tool_calls_completed
        start = end
    content.append(p.finish().content_delta)
    return "".join(content), calls, p


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8), data=st.data())
def test_streaming_equals_whole_text_for_any_split(parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    content, calls, _ = stream(text, cuts)
    assert ToolParseResult(content, calls) == parse_tool_calls(text)


def test_call_is_parsed_and_removed_from_content() -> None:
    res = parse_tool_calls("Let me look.\n" + WEATHER)
    assert res.content == "Let me look.\n"
    [call] = res.tool_calls
    assert (call.id, call.name, json.loads(call.arguments_json)) == ("call_0", "get_weather",
                                                                     {"city": "Paris", "unit": "°C"})
    assert call.to_openai()["function"]["name"] == "get_weather"


def test_smollm2_list_form_gives_several_calls() -> None:
    res = parse_tool_calls('<tool_call>[{"name": "a", "arguments": {"q": 1}}, {"name": "b"}]</tool_call>',
                           id_prefix="call_r1_")
    assert [(c.id, c.name, c.arguments_json) for c in res.tool_calls] == [
        ("call_r1_0", "a", '{"q": 1}'), ("call_r1_1", "b", "{}")]
    assert res.content == ""


def test_tags_split_across_deltas_char_by_char() -> None:
    text = "Checking." + WEATHER + " Done."
    content, calls, _ = stream(text, list(range(len(text))))
    assert content == "Checking. Done." and [c.name for c in calls] == ["get_weather"]


def test_streamed_content_never_shows_a_valid_call() -> None:
    p = StreamingToolParser()
    shown = ""
    for ch in "Hi " + WEATHER:
        d = p.feed(ch)
        shown += d.content_delta
        assert "<tool" not in shown and "get_weather" not in shown
        if d.tool_calls_completed:
            assert p.has_complete_call
    assert shown == "Hi " and p.has_complete_call


@pytest.mark.parametrize("bad", ["<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                                 '<tool_call>["x"]</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
                                 "<tool_call>" + "[" * 5000 + "</tool_call>", "<tool_call>{\"name\": \"f\""])
def test_bad_json_stays_content(bad: str) -> None:
    text = "before " + bad + " after"
    assert parse_tool_calls(text) == ToolParseResult(text, [])
    content, calls, p = stream(text, [3, 11, 20])
    assert (content, calls, p.has_complete_call) == (text, [], False)


def test_bad_block_does_not_hide_a_good_one() -> None:
    res = parse_tool_calls("<tool_call>{oops}</tool_call>" + WEATHER)
    assert res.content == "<tool_call>{oops}</tool_call>" and [c.name for c in res.tool_calls] == ["get_weather"]


def test_unclosed_call_is_released_as_content_at_the_end() -> None:
    p = StreamingToolParser()
    assert p.feed('ok <tool_call>{"name": "f"').content_delta == "ok "
    assert p.finish().content_delta == '<tool_call>{"name": "f"'


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tools_go_into_the_system_prompt_smollm2_renders(smollm2_tokenizer: Any) -> None:
    msgs = inject_tools([{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    assert msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    prompt = smollm2_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    assert "named SmolLM" not in prompt  # our system message replaces the template's default one
    assert prompt.endswith("<|im_start|>assistant\n")


def test_existing_system_message_is_kept_and_extended() -> None:
    msgs = inject_tools([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS)
    assert len(msgs) == 2 and msgs[0]["content"].startswith("Be brief.\n\n") and "get_weather" in msgs[0]["content"]
    assert inject_tools(msgs[1:], None) == msgs[1:]


def test_tool_turns_are_written_out_so_the_call_parses_back(smollm2_tokenizer: Any) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 C, sunny"},
    ]
    msgs = inject_tools(history, TOOLS)
    assistant = msgs[2]["content"]
    assert [c.name for c in parse_tool_calls(assistant).tool_calls] == ["get_weather"]
    assert "<tool_response>\n18 C, sunny\n</tool_response>" == msgs[3]["content"]
    smollm2_tokenizer.apply_chat_template(msgs, tokenize=False)  # renders without error


def test_bad_tool_definitions_raise_value_error() -> None:
    with pytest.raises(ValueError, match="tools"):
        inject_tools([{"role": "user", "content": "x"}], [{"type": "function", "function": {"description": "no name"}}])
