"""`tool_choice` "required" or a named function, enforced with a grammar instead of hoped for.

Owns: building the EBNF grammar that makes the model's whole answer one tool call in SmolLM2's
format, `<tool_call>\\n{"name": <one of the tools>, "arguments": <that tool's parameters>}\\n</tool_call>`
(the JSON part comes from each tool's JSON schema through xgrammar, in the engine's grammar worker, joined with the tags by
`Grammar.concat`). The engine applies it as an `ebnf` constraint. Does not own: parsing the call
back out (engine/output/tool_parser.py) or the tool descriptions in the prompt (tool_prompt.inject_tools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


# how each --tool-call-parser format wraps one call object, and its arguments key (tool_formats.py)
WRAPS = {"hermes": (OPEN, CLOSE, "arguments"), "llama3_json": ("", "", "parameters"),
         "mistral": ("[TOOL_CALLS][", "]", "arguments")}


def call_schema(tools: list[dict[str, Any]], name: str | None, args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object: to the named function, or to any of `tools`."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                        "required": ["name", args_key], "additionalProperties": False})
    if not options:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None, build: Callable[[dict[str, Any], str, str], str],
                      fmt: str = "hermes", limits: Any = None) -> str:
    """EBNF for exactly one tool call in format `fmt`; ValueError if the schema is over `limits` (a
    GrammarLimits, its defaults when None) or cannot be parsed. `build(schema, head_regex, tail_regex)`
    makes the EBNF: the engine's `grammars.wrapped`, in the worker process under the compile budget
    (xgrammar's parse of a schema is not bounded by its size)."""
    from workbench.engine.sample.grammar_limits import GrammarLimits, check_limits

    if fmt not in WRAPS:
        raise ValueError(f"tool_choice: forcing a call is not supported with --tool-call-parser {fmt} "
                         f"(supported: {', '.join(WRAPS)})")
    head, tail, args_key = WRAPS[fmt]
    call = call_schema(tools, name, args_key)
    check_limits("json_schema", call, limits or GrammarLimits(), "tools")
    return build(call, _escape(head), _escape(tail))


def _escape(text: str) -> str:
    """A regex matching `text` literally (newlines written as \\n)."""
    out = []
    for ch in text:
        out.append("\\n" if ch == "\n" else "\\" + ch if ch in r"\^$.|?*+()[]{}/" else ch)
    return "".join(out)
