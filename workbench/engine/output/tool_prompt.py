"""Tools in the prompt: the system message that lists the tools in the chosen call format, and earlier
tool calls and tool results written back into message text so a plain chat template renders them.

Owns `inject_tools`. Does not own parsing calls out of the output (tool_parser.py, tool_formats.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from workbench.engine.output.tool_formats import render_calls
from workbench.engine.output.tool_parser import CLOSE_TAG, OPEN_TAG

TOOLS_SYSTEM_PROMPT = (
    "You can call functions to answer the user. The functions you may call are listed as JSON "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call one or more of them, answer with nothing but the calls inside <tool_call></tool_call> "
    "tags, one JSON object per call, like this:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>\n'
    "Use only the functions listed and give every required argument. If no function fits, or an "
    "argument is missing from the question, say so in plain text instead."
)
FORMAT_PROMPT = (  # the other formats (tool_formats.py): the same words, that format's example
    "You can call functions to answer the user. The functions you may call are listed as JSON "
    "inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call one or more of them, answer with nothing but the calls, written like this:\n{example}\n"
    "Use only the functions listed and give every required argument. If no function fits, or an "
    "argument is missing from the question, say so in plain text instead."
)


def _tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tools: each tool needs a function with a name, got {tool!r}")
    return {k: fn[k] for k in ("name", "description", "parameters") if k in fn}


def _message_text(msg: dict[str, Any], fmt: str = "hermes") -> dict[str, Any]:
    """A message the plain chat template can render: tool calls and results written out as text."""
    out = dict(msg)
    calls = msg.get("tool_calls") or []
    if msg.get("role") == "assistant" and calls:
        blocks, pairs = [], []
        for c in calls:
            fn = c.get("function", c)
            args = fn.get("arguments", {})
            try:
                args_obj = json.loads(args) if isinstance(args, str) else args
            except ValueError as exc:
                raise ValueError(f"messages: tool_calls arguments must be a JSON object, got {args!r}") from exc
            blocks.append(OPEN_TAG + "\n" + json.dumps({"name": fn.get("name"), "arguments": args_obj},
                                                       ensure_ascii=False) + "\n" + CLOSE_TAG)
            pairs.append((fn.get("name"), args_obj))
        if fmt != "hermes":
            blocks = [render_calls(fmt, pairs)]
        out["content"] = (msg.get("content") or "") + "\n".join(blocks)
        out.pop("tool_calls", None)
    elif msg.get("role") == "tool":
        out["content"] = f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"
    if out.get("content") is None:
        out["content"] = ""
    return out


def inject_tools(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                 fmt: str = "hermes") -> list[dict[str, Any]]:
    """Chat messages with the tools described in the system message (one is added if none exists).

    `tools` is OpenAI's list (`{"type": "function", "function": {...}}`; bare functions accepted).
    Assistant `tool_calls` and `tool` results are written into message text the way the parser
    reads them, so a plain chat template (SmolLM2's) renders the whole conversation.
    """
    msgs = [_message_text(m, fmt) for m in messages]
    if not tools:
        return msgs
    listing = "\n".join(json.dumps(_tool_function(t), ensure_ascii=False) for t in tools)
    if fmt == "hermes":
        prompt = TOOLS_SYSTEM_PROMPT.format(tools=listing)
    else:
        example = render_calls(fmt, [("function_name", {"argument": "value"})])
        prompt = FORMAT_PROMPT.format(tools=listing, example=example)
    if msgs and msgs[0].get("role") == "system":
        msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{prompt}".lstrip()}
    else:
        msgs.insert(0, {"role": "system", "content": prompt})
    return msgs
