"""Tool calls in SmolLM2's (Hermes-style) format: `<tool_call>{json}</tool_call>` in the output text.

This module owns: parsing finished text (`parse_tool_calls`), parsing a stream of text deltas
(`StreamingToolParser`, which holds back text that could still be the start of `<tool_call>`
and emits each call when its closing tag arrives), and putting OpenAI `tools` definitions into
the chat as a system prompt (`inject_tools`), since SmolLM2's chat template ignores tools. It does
not decide finish reasons (finish.py turns `stop` into `tool_calls` when a call is complete).

Inside the tags the JSON is one object `{"name": ..., "arguments": {...}}` (Hermes) or a list of
them (what SmolLM2 was tuned on). A block whose JSON is invalid, or not of that shape, stays in
the content verbatim, tags included; nothing here raises on model output. The first
`</tool_call>` after `<tool_call>` closes the block. Content is the text with valid blocks
removed, unchanged otherwise (a server may strip it). Streaming and whole-text parsing give the same
content and calls for any split of the text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call, OpenAI-shaped: `arguments_json` is the arguments object as a JSON string."""

    id: str
    name: str
    arguments_json: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True, slots=True)
class ToolParseResult:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ToolCallChunk:
    """One piece of a streamed call, as OpenAI streams them: the first names the call (id, name,
    arguments ""), later ones carry the next characters of its arguments JSON."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolDelta:
    content_delta: str
    tool_calls_completed: list[ToolCall] = field(default_factory=list)
    chunks: list[ToolCallChunk] = field(default_factory=list)


def partial_json(text: str) -> Any:
    """What is complete so far of a JSON prefix (strings, numbers and literals only once closed), or None."""
    from partial_json_parser import Allow, loads

    try:
        return loads(text, Allow.ALL & ~Allow.STR & ~Allow.NUM & ~Allow.SPECIAL)
    except Exception:  # not a JSON prefix at all
        return None


def partial_calls(obj: Any) -> list[tuple[str, Any]]:
    """(name, arguments so far or None) of each call whose name is complete in a partial JSON value."""
    out = []
    for item in obj if isinstance(obj, list) else [obj]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            break
        args = item.get("arguments", item.get("parameters"))
        out.append((item["name"], args if isinstance(args, dict) else None))
    return out


class ArgumentStreamer:
    """Turns growing partial calls into OpenAI-style chunks: each call's arguments are sent as the
    longest prefix of their final JSON known so far (the partial object's JSON without its closing
    brackets), so the chunks of a call always join to exactly its `arguments_json`."""

    def __init__(self, id_prefix: str) -> None:
        self.id_prefix = id_prefix
        self.sent: list[str] = []

    def _start(self, index: int, name: str, out: list[ToolCallChunk]) -> None:
        while len(self.sent) <= index:
            self.sent.append("")
            out.append(ToolCallChunk(len(self.sent) - 1, f"{self.id_prefix}{len(self.sent) - 1}", name, ""))

    def update(self, first: int, calls: list[tuple[str, Any]]) -> list[ToolCallChunk]:
        out: list[ToolCallChunk] = []
        for k, (name, args) in enumerate(calls):
            self._start(first + k, name, out)
            if args is None:
                continue
            prefix = json.dumps(args, ensure_ascii=False).rstrip("}]")
            sent = self.sent[first + k]
            if len(prefix) > len(sent) and prefix.startswith(sent):
                out.append(ToolCallChunk(first + k, None, None, prefix[len(sent):]))
                self.sent[first + k] = prefix
        return out

    def complete(self, first: int, calls: Sequence[ToolCall]) -> list[ToolCallChunk]:
        out: list[ToolCallChunk] = []
        for k, call in enumerate(calls):
            self._start(first + k, call.name, out)
            sent = self.sent[first + k]
            rest = call.arguments_json[len(sent):] if call.arguments_json.startswith(sent) else call.arguments_json
            if rest:
                out.append(ToolCallChunk(first + k, None, None, rest))
            self.sent[first + k] = call.arguments_json
        return out


def _parse_block(body: str) -> list[tuple[str, str]] | None:
    """(name, arguments_json) for each call in a block body; None when the body is not valid."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments already serialised
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append((item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def parse_tool_calls(text: str, *, id_prefix: str = "call_") -> ToolParseResult:
    """Split finished text into content and tool calls; ids are `f"{id_prefix}{index}"`."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        parsed = _parse_block(m.group(1))
        content.append(text[pos:m.start()] if parsed is not None else text[pos:m.end()])
        pos = m.end()
        for name, args in parsed or ():
            calls.append(ToolCall(f"{id_prefix}{len(calls)}", name, args))
    content.append(text[pos:])
    return ToolParseResult("".join(content), calls)


def _partial_tag_start(text: str, tag: str) -> int:
    """Index of the earliest suffix of `text` that is a proper prefix of `tag` (len(text) if none)."""
    for i in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[i:]):
            return i
    return len(text)


class StreamingToolParser:
    """Feeds on text deltas; emits content as soon as it cannot be part of a tool call."""

    def __init__(self, *, id_prefix: str = "call_") -> None:
        self.id_prefix = id_prefix
        self.tool_calls: list[ToolCall] = []
        self._buf = ""  # held text: a possible opening tag, or an open block (tag included)
        self._in_block = False
        self._finished = False
        self._args = ArgumentStreamer(id_prefix)

    @property
    def has_complete_call(self) -> bool:
        """At least one tool call was completed (what finish.py's `has_complete_tool_call` reads)."""
        return bool(self.tool_calls)

    @property
    def held_text(self) -> str:
        return self._buf

    def feed(self, delta: str) -> ToolDelta:
        if self._finished:
            raise RuntimeError("tool parser already finished")
        self._buf += delta
        content: list[str] = []
        done: list[ToolCall] = []
        chunks: list[ToolCallChunk] = []
        while True:
            if not self._in_block:
                i = self._buf.find(OPEN_TAG)
                if i < 0:
                    keep = _partial_tag_start(self._buf, OPEN_TAG)
                    content.append(self._buf[:keep])
                    self._buf = self._buf[keep:]
                    break
                content.append(self._buf[:i])
                self._buf, self._in_block = self._buf[i:], True
            j = self._buf.find(CLOSE_TAG, len(OPEN_TAG))
            if j < 0:  # an open block: stream what is known of its calls
                chunks += self._args.update(len(self.tool_calls), partial_calls(partial_json(self._buf[len(OPEN_TAG):])))
                break
            block, self._buf = self._buf[:j + len(CLOSE_TAG)], self._buf[j + len(CLOSE_TAG):]
            self._in_block = False
            parsed = _parse_block(block[len(OPEN_TAG):j])
            if parsed is None:
                content.append(block)
            first = len(self.tool_calls)
            for name, args in parsed or ():
                call = ToolCall(f"{self.id_prefix}{len(self.tool_calls)}", name, args)
                self.tool_calls.append(call)
                done.append(call)
            chunks += self._args.complete(first, self.tool_calls[first:])
        return ToolDelta("".join(content), done, chunks)

    def finish(self) -> ToolDelta:
        """End of text: whatever is still held (an unclosed block, a partial tag) is content."""
        if self._finished:
            return ToolDelta("")
        self._finished = True
        tail, self._buf = self._buf, ""
        return ToolDelta(tail)
