"""The hostile structured-output catalogue of issue 36, shared by tests/server/test_hostile_inputs.py and
benchmarks/hardening_sweep.py: each case is a request body's extra fields and what it must get
(400 naming a parameter, or a 200 where the constraint is legitimate and cheap)."""

from __future__ import annotations

from typing import Any

# the six requests of the issue, as a hostile client sent them
NODE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value", "children"]}}, "$ref": "#/$defs/node"}
SELF_PROP = {"type": "object", "properties": {"name": {"type": "string"}, "next": {"$ref": "#"}},
             "required": ["name"]}


def schema(s: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": s}}}


def props(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def nested(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def pattern(p: str) -> dict[str, Any]:
    return schema({"type": "object", "properties": {"a": {"type": "string", "pattern": p}}, "required": ["a"]})


SIX: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("20,000 properties", schema(props(20_000)), 400, "response_format"),
    ("recursive $ref node", schema(NODE), 200, None),
    ('{"$ref": "#"}', schema({"$ref": "#"}), 400, "response_format"),
    ("remote $ref", schema({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}),
     400, "response_format"),
    ("lookahead pattern", pattern("^(?=.*[0-9])[a-z0-9]{3,8}$"), 400, "response_format"),
    ("a{1,100000}", pattern("^a{1,100000}$"), 400, "response_format"),
]


def variants(listener: str = "http://127.0.0.1:9", secret: str = "/etc/passwd") -> list[tuple[str, dict, int, str | None]]:
    """Neighbours of the six: size, depth, fan-out, references, pattern features, quantifier bounds.
    `listener` and `secret` are a URL and a file that a test watches: nothing may reach them."""
    out: list[tuple[str, dict, int, str | None]] = []
    for n in (501, 600, 1000, 2000, 5000, 10_000, 50_000):
        out.append((f"{n} properties", schema(props(n)), 400, "response_format"))
    for n in (1, 10, 50, 100):
        out.append((f"{n} properties (legitimate)", schema(props(n)), 200, None))
    for d in (40, 64, 100, 300):  # past ~99 levels the body's JSON parser refuses it (recursion limit)
        out.append((f"nesting {d}", schema(nested(d)), 400, "response_format" if d < 99 else None))
    for d in (2, 5, 10):
        out.append((f"nesting {d} (legitimate)", schema(nested(d)), 200, None))
    for n in (25_000, 100_000):
        out.append((f"enum of {n}", schema({"enum": list(range(n))}), 400, "response_format"))
    out.append(("properties over many objects", schema({"type": "object", "properties": {
        f"o{j}": props(100) for j in range(6)}}), 400, "response_format"))
    for ref in (listener + "/schema.json", listener.replace("http:", "https:") + "/s.json", f"file://{secret}",
                "file:relative.json", "other.json", "other.json#/defs/a", "#anchor", "urn:x:y", "//host/x",
                "ftp://example.com/x"):
        out.append((f"$ref {ref[:40]}", schema({"type": "object", "properties": {"a": {"$ref": ref}}}),
                    400, "response_format"))
        out.append((f"$defs -> $ref {ref[:32]}", schema({"$defs": {"a": {"$ref": ref}}, "$ref": "#/$defs/a"}),
                    400, "response_format"))
    out.append(("$dynamicRef remote", schema({"$dynamicRef": listener + "/x"}), 400, "response_format"))
    out.append(("$ref missing definition", schema({"$ref": "#/$defs/nope"}), 400, "response_format"))
    out.append(("$ref loop a->b->a", schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                             "$ref": "#/$defs/a"}), 400, "response_format"))
    out.append(("$ref # below a property", schema(SELF_PROP), 200, None))
    for p in ("(?=a)a", "(?!a)b", "(?<=a)b", "(?<!a)b", "(a)\\1", "(?P<x>a)(?P=x)", "(?>a)", "a{1,10001}",
              "a{100000}", "[a-z]{1,99999999999999}", "(a{1,20000})", "x{0,1000000}"):
        out.append((f"pattern {p}", pattern(p), 400, "response_format"))
        out.append((f"regex {p}", {"regex": p}, 400, "regex"))
    for p in ("[a-z]{1,8}", "a{2,5}", "\\d{3}-\\d{4}", "[{]x[}]"):
        out.append((f"pattern {p} (legitimate)", pattern(p), 200, None))
        out.append((f"regex {p} (legitimate)", {"regex": p}, 200, None))
    for key, value in (("maxLength", 100_000), ("minItems", 10**9), ("maxItems", 10**6)):
        out.append((f"{key} {value}", schema({"type": "array" if "Items" in key else "string", key: value}),
                    400, "response_format"))
    out.append(("ebnf a{1,100000}", {"ebnf": 'root ::= "a"{1,100000}'}, 400, "ebnf"))
    out.append(("ebnf of 300,000 chars", {"ebnf": "root ::= " + " | ".join(f'"w{i}"' for i in range(40_000))},
                400, "ebnf"))
    out.append(("regex of 300,000 chars", {"regex": "a" * 300_000}, 400, "regex"))
    return out
