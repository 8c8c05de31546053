"""What one structured-output constraint may ask of the server, checked before anything compiles it.

Owns: `GrammarLimits` (the structural limits on a constraint's source, and the time, memory and
cache budgets of compiling it, each with the `workbench serve` flag that changes it) and
`check_limits(kind, source, limits)`, a walk of a JSON schema (or a scan of a regex / EBNF) whose
cost is bounded by the limits themselves: it stops at the first one exceeded. It refuses, with a
ValueError naming the parameter and the limit:

- a source larger than `max_bytes`, a schema nested deeper than `max_depth` JSON containers, with
  more than `max_nodes` JSON values or `max_properties` object properties in all;
- a `$ref` (or `$dynamicRef`, `$recursiveRef`) that does not point inside the schema itself (`#` or
  `#/...`): remote (`http:`, `https:`) and `file:` references are refused by name, never fetched;
- in a regex, a JSON schema `pattern` or `patternProperties` key: lookaround, back-references,
  atomic groups and conditionals (xgrammar does not support them: in a schema's `pattern` it
  silently ignores a lookahead, so the output would not match), and a quantifier `{m,n}` or a
  `minLength` / `maxLength` / `minItems` / `maxItems` above `max_repeat`.

Recursion inside the schema (`#/$defs/node` whose children are nodes, `{"$ref": "#"}` below a
property) is allowed, as in xgrammar and vLLM: the output's depth is bounded by `max_new_tokens`.
Does not own: compiling (grammar.py) or the worker process that enforces the time and memory
budgets (grammar_worker.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
_BOUND_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_QUANT = re.compile(r"\{(\d*)(?:,(\d*))?\}")
_EBNF_QUANT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_EBNF_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')
FLAGS = {"max_bytes": "--grammar-max-bytes", "max_depth": "--grammar-max-depth",
         "max_nodes": "--grammar-max-nodes", "max_properties": "--grammar-max-properties",
         "max_repeat": "--grammar-max-repeat", "compile_timeout": "--grammar-compile-timeout",
         "compile_memory_mb": "--grammar-compile-memory-mb", "workers": "--grammar-workers",
         "cache_mb": "--grammar-cache-mb"}


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Limits on one constraint (json_schema, regex, ebnf, a forced tool call's schema)."""

    max_bytes: int = 256 << 10  # the constraint's source (a schema as JSON text)
    max_depth: int = 64  # nested JSON objects and arrays in a schema
    max_nodes: int = 20_000  # JSON values in a schema
    max_properties: int = 500  # object properties, summed over the whole schema
    max_repeat: int = 1000  # largest {m,n} bound, minLength/maxLength/minItems/maxItems
    compile_timeout: float = 10.0  # seconds a compile may take (in the worker process)
    compile_memory_mb: int = 1024  # memory a compile may add (the worker is killed past it)
    workers: int = 1  # worker processes that compile at once
    cache_mb: int = 256  # compiled grammars kept in the engine's process, least recently used dropped

    def __post_init__(self) -> None:
        for name in FLAGS:
            value = getattr(self, name)
            lo = 0.1 if name == "compile_timeout" else 1
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= lo or (
                    name != "compile_timeout" and not isinstance(value, int)):
                what = "a number >= 0.1 (seconds)" if name == "compile_timeout" else "an integer >= 1"
                raise ValueError(f"{name} must be {what}, got {value!r}")


def over(param: str, what: str, value: Any, limits_field: str, limit: Any) -> ValueError:
    """The one message shape of a limit: the parameter, what was too much, the limit and its flag."""
    return ValueError(f"{param}: {what} {value} is above the limit of {limit} "
                      f"(workbench serve {FLAGS[limits_field]})")


def check_limits(kind: str, source: Any, limits: GrammarLimits, param: str | None = None) -> None:
    """ValueError naming `param` (default: `kind`) when the constraint is over a structural limit."""
    param = param or kind
    if kind == "json_schema":
        if isinstance(source, str):
            _check_size(param, source, limits)
            import json

            try:
                source = json.loads(source)
            except (json.JSONDecodeError, RecursionError):
                return  # grammar_source reports the syntax error
        check_schema_limits(source, limits, param)
    elif isinstance(source, str):
        _check_size(param, source, limits)
        if kind == "regex":
            check_pattern(source, limits, param)
        elif kind == "ebnf":
            _check_ebnf_bounds(source, limits, param)


def _check_size(param: str, text: str, limits: GrammarLimits) -> None:
    if len(text) > limits.max_bytes:  # characters; a cheap stand-in for bytes that never under-counts by more than 4x
        raise over(param, "the constraint's size in characters", len(text), "max_bytes", limits.max_bytes)


def check_schema_limits(schema: Any, limits: GrammarLimits, param: str) -> None:
    """Walk a JSON schema once (iteratively, stopping at the first limit exceeded)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = properties = size = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise ValueError(f"{param}: the schema has more than {limits.max_nodes} JSON values, above the "
                             f"limit of {limits.max_nodes} (workbench serve {FLAGS['max_nodes']})")
        if isinstance(node, dict):
            if depth > limits.max_depth:
                raise over(param, "the schema's nesting depth (JSON objects and arrays)", depth, "max_depth",
                           limits.max_depth)
            size += sum(len(k) + 4 for k in node)
            _check_keywords(node, limits, param)
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > limits.max_properties:
                    raise over(param, "the schema's number of object properties (over all objects)",
                               properties, "max_properties", limits.max_properties)
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            if depth > limits.max_depth:
                raise over(param, "the schema's nesting depth (JSON objects and arrays)", depth, "max_depth",
                           limits.max_depth)
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, str):
            size += len(node) + 2
        else:
            size += 8
        if size > limits.max_bytes:
            raise over(param, "the schema's size in characters", f"(at least {size})", "max_bytes",
                       limits.max_bytes)


def _check_keywords(node: dict[str, Any], limits: GrammarLimits, param: str) -> None:
    for key in _REF_KEYS:
        ref = node.get(key)
        if ref is not None:
            check_ref(ref, param, key)
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        check_pattern(pattern, limits, f"{param}: pattern")
    pattern_props = node.get("patternProperties")
    if isinstance(pattern_props, dict):
        for key in pattern_props:
            check_pattern(key, limits, f"{param}: patternProperties")
    for key in _BOUND_KEYS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.max_repeat:
            raise over(param, key, value if abs(value) < 1e18 else "(huge)", "max_repeat", limits.max_repeat)


def check_ref(ref: Any, param: str, key: str = "$ref") -> None:
    """Only references inside the schema: `#` or a JSON pointer `#/...`."""
    if not isinstance(ref, str):
        raise ValueError(f"{param}: {key} must be a string, got {type(ref).__name__}")
    if ref == "#" or ref.startswith("#/"):
        return
    scheme = ref.split(":", 1)[0].lower() if ":" in ref else ""
    if scheme in ("http", "https"):
        why = "remote references are never fetched"
    elif scheme == "file":
        why = "file references are never read"
    else:
        why = "references outside the schema are not resolved"
    raise ValueError(f"{param}: {key} {ref[:80]!r} does not point inside the schema ({why}); "
                     f"only '#' and '#/...' references are allowed")


def check_pattern(pattern: str, limits: GrammarLimits, param: str) -> None:
    """Refuse regex features xgrammar does not support and quantifier bounds above `max_repeat`."""
    if len(pattern) > limits.max_bytes:
        raise over(param, "the pattern's length", len(pattern), "max_bytes", limits.max_bytes)
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1:i + 2]
            backref = (nxt != "" and nxt in "123456789") or (nxt == "k" and pattern[i + 2:i + 3] in ("<", "{", "'"))
            if backref and not in_class:
                raise ValueError(f"{param}: a back-reference ({pattern[i:i + 3]!r} at position {i}) is not supported "
                                 f"by the grammar engine")
            i += 2
            continue
        if in_class:
            in_class = c != "]"
            i += 1
            continue
        if c == "[":
            i += 1
            i += pattern[i:i + 1] == "^"
            i += pattern[i:i + 1] == "]"  # a literal ] first in a class
            in_class = True
            continue
        if c == "(" and pattern[i + 1:i + 2] == "?":
            head = pattern[i + 2:i + 4]
            feature = ("a lookahead" if head[:1] in ("=", "!") else "a lookbehind" if head in ("<=", "<!")
                       else "an atomic group" if head[:1] == ">" else "a conditional" if head[:1] == "("
                       else "a back-reference" if head == "P=" else None)
            if feature:
                raise ValueError(f"{param}: {feature} ({pattern[i:i + 4]!r} at position {i}) is not supported "
                                 f"by the grammar engine")
        if c == "{":
            m = _QUANT.match(pattern, i)
            if m and (m.group(1) or m.group(2)):
                for bound in (m.group(1), m.group(2)):
                    if bound and (len(bound) > 9 or int(bound) > limits.max_repeat):
                        raise over(param, "the quantifier bound in", repr(m.group(0)[:24]), "max_repeat",
                                   limits.max_repeat)
                i = m.end()
                continue
        i += 1


def _check_ebnf_bounds(text: str, limits: GrammarLimits, param: str) -> None:
    bare = _EBNF_STRINGS.sub('""', text)  # quantifiers inside string literals and classes are text
    for m in _EBNF_QUANT.finditer(bare):
        for bound in m.groups():
            if bound and (len(bound) > 9 or int(bound) > limits.max_repeat):
                raise over(param, "the repetition bound in", repr(m.group(0)[:24]), "max_repeat", limits.max_repeat)
