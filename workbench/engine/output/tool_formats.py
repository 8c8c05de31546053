"""Tool-call formats by name, as vLLM's `--tool-call-parser` chooses them: hermes, llama3_json, mistral, pythonic.

Owns: parsing finished text in each format (`parse_tool_text`), a streaming parser per format
(`make_stream_parser`, same interface as tool_parser.StreamingToolParser: content deltas, completed
calls, and OpenAI-style argument chunks), and writing calls back in a format (`render_calls`, for
a conversation's earlier assistant turns and the example in the tools prompt).

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text (tool_parser.py);
- llama3_json: the answer is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
  several separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content;
- pythonic: the answer is a Python list of calls, `[get_weather(city="Oslo"), ...]`, read with `ast`
  (literals only, never evaluated).

Text that does not parse in its format stays content, whole; nothing here raises on model output.
Arguments stream as the longest prefix of their final JSON known so far (llama3_json, mistral) or
whole when each call closes (pythonic). A call whose name was streamed and whose text later turns
out malformed stays in the stream, as in vLLM.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from workbench.engine.output.tool_parser import (
    CLOSE_TAG,
    OPEN_TAG,
    ArgumentStreamer,
    StreamingToolParser,
    ToolCall,
    ToolDelta,
    ToolParseResult,
    _parse_block,
    parse_tool_calls,
    partial_calls,
    partial_json,
)

FORMATS = ("hermes", "llama3_json", "mistral", "pythonic")
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"tool_call_parser must be one of {FORMATS}, got {fmt!r}")


# --- whole text -----------------------------------------------------------------------------------


def _json_calls(region: str) -> list[tuple[str, str]] | None:
    """Calls in `region`: JSON objects or lists separated by whitespace or `;`; None if anything else."""
    dec, pos, calls = json.JSONDecoder(), 0, []
    while True:
        while pos < len(region) and (region[pos].isspace() or region[pos] == ";"):
            pos += 1
        if pos == len(region):
            return calls or None
        try:
            obj, pos = dec.raw_decode(region, pos)
        except ValueError:
            return None
        parsed = _parse_block(json.dumps(obj))
        if parsed is None:
            return None
        calls += parsed


def _python_calls(region: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(region.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def _region_start(fmt: str, text: str) -> tuple[str, int]:
    """("region", i): tool calls start at text[i]; ("hold", i): text[i:] may still start them; ("content", n)."""
    if fmt == "mistral":
        i = text.find(MISTRAL_TAG)
        if i >= 0:
            return "region", i
        for j in range(max(0, len(text) - len(MISTRAL_TAG) + 1), len(text)):
            if MISTRAL_TAG.startswith(text[j:]):
                return "hold", j
        return "content", len(text)
    stripped = text.lstrip()
    i = len(text) - len(stripped)
    if not stripped or (fmt == "llama3_json" and PYTHON_TAG.startswith(stripped)):
        return "hold", 0
    if stripped.startswith("[" if fmt == "pythonic" else ("{", PYTHON_TAG)):
        return "region", i
    return "content", len(text)


def _region_body(fmt: str, region: str) -> str:
    for tag in (MISTRAL_TAG, PYTHON_TAG):
        if region.startswith(tag):
            return region[len(tag):]
    return region


def _parse_region(fmt: str, region: str) -> list[tuple[str, str]] | None:
    body = _region_body(fmt, region)
    return _python_calls(body) if fmt == "pythonic" else _json_calls(body)


def parse_tool_text(fmt: str, text: str, *, id_prefix: str = "call_") -> ToolParseResult:
    """Split finished text into content and tool calls in format `fmt`."""
    _check(fmt)
    if fmt == "hermes":
        return parse_tool_calls(text, id_prefix=id_prefix)
    state, i = _region_start(fmt, text)
    calls = _parse_region(fmt, text[i:]) if state == "region" else None
    if not calls:
        return ToolParseResult(text)
    return ToolParseResult(text[:i], [ToolCall(f"{id_prefix}{k}", n, a) for k, (n, a) in enumerate(calls)])


# --- streaming ------------------------------------------------------------------------------------


class FormatStreamingParser:
    """Streaming parser for llama3_json, mistral and pythonic: content until the calls start, then
    the calls' chunks as they grow; at `finish` the calls, or the held text as content if it did not parse."""

    def __init__(self, fmt: str, *, id_prefix: str = "call_") -> None:
        self.fmt, self.id_prefix = fmt, id_prefix
        self.tool_calls: list[ToolCall] = []
        self._text = ""
        self._sent = 0  # characters of _text already sent as content
        self._region: int | None = None
        self._content_only = False
        self._args = ArgumentStreamer(id_prefix)

    @property
    def has_complete_call(self) -> bool:
        return bool(self.tool_calls)

    @property
    def held_text(self) -> str:
        return self._text[self._sent:]

    def feed(self, delta: str) -> ToolDelta:
        self._text += delta
        if self._region is None and not self._content_only:
            state, i = _region_start(self.fmt, self._text)
            if state == "region":
                self._region = i
            elif state == "content" and self.fmt != "mistral":
                self._content_only = True
            if state != "region":
                upto = len(self._text) if self._content_only else i
                out, self._sent = self._text[self._sent:upto], max(self._sent, upto)
                return ToolDelta(out)
        if self._content_only:
            out, self._sent = self._text[self._sent:], len(self._text)
            return ToolDelta(out)
        content, self._sent = self._text[self._sent:self._region], self._region
        return ToolDelta(content, [], self._args.update(0, self._partial()))

    def _partial(self) -> list[tuple[str, Any]]:
        body = _region_body(self.fmt, self._text[self._region:])
        if self.fmt == "pythonic":
            for end in range(len(body), 0, -1):  # the longest prefix of whole calls
                if body[end - 1] == ")" and (calls := _python_calls(body[:end] + "]")):
                    return [(n, json.loads(a)) for n, a in calls]
            return []
        items, dec, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            try:
                obj, pos = dec.raw_decode(body, pos)
            except ValueError:
                items += partial_calls(partial_json(body[pos:])) if pos < len(body) else []
                break
            items += partial_calls(obj)
        return items

    def finish(self) -> ToolDelta:
        if self._region is None:
            out, self._sent = self._text[self._sent:], len(self._text)
            return ToolDelta(out)
        calls = _parse_region(self.fmt, self._text[self._region:])
        if not calls:
            out, self._sent = self._text[self._sent:], len(self._text)
            return ToolDelta(out)
        self.tool_calls = [ToolCall(f"{self.id_prefix}{k}", n, a) for k, (n, a) in enumerate(calls)]
        self._sent = len(self._text)
        return ToolDelta("", list(self.tool_calls), self._args.complete(0, self.tool_calls))


def make_stream_parser(fmt: str, *, id_prefix: str = "call_") -> StreamingToolParser | FormatStreamingParser:
    _check(fmt)
    return StreamingToolParser(id_prefix=id_prefix) if fmt == "hermes" else FormatStreamingParser(fmt, id_prefix=id_prefix)


# --- writing calls in a format --------------------------------------------------------------------


def render_calls(fmt: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """`(name, arguments)` calls as the model writes them in format `fmt`."""
    _check(fmt)
    if fmt == "hermes":
        return "\n".join(OPEN_TAG + "\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n"
                         + CLOSE_TAG for n, a in calls)
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    if fmt == "mistral":
        return MISTRAL_TAG + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"
