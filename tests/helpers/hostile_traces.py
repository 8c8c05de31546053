"""Hostile `.wbtrace` files (issue 36, part 3): crafted to cost a reader memory or time, not merely
damaged (tests/helpers/trace_damage.py has those). Each entry changes a copy of a small good trace in
place and says what a reader must report: the name of the limit it is over (`ReadLimits`), or None
where the file is legal and must simply be shown within bounded time (a long prompt, a long token).

Sizes assume the limits `LIMITS_ENV` sets (4 MB per value, 32 MB per read): small enough for a test
to write its files in seconds, and each case is several times over its limit.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

LIMITS_ENV = {"WORKBENCH_TRACE_MAX_VALUE_MB": "4", "WORKBENCH_TRACE_MAX_READ_MB": "32",
              "WORKBENCH_TRACE_MAX_DEPTH": "64"}
VALUE, DEPTH, READ = "one stored value", "JSON nesting", "memory one read may build"

Craft = Callable[[Path], None]


def _sql(*statements: str, params: tuple = ()) -> Craft:
    def craft(path: Path) -> None:
        with sqlite3.connect(path) as db:
            for s in statements:
                db.execute(s, params if "?" in s else ())
    return craft


def _rows(n: int, step: str, req_id: str, kind: str, payload: str) -> str:
    """SQL inserting `n` events (a recursive CTE: no Python loop, a million rows in a few seconds)."""
    return (f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) "
            f"INSERT INTO events(step, req_id, kind, t, payload) SELECT {step}, {req_id}, '{kind}', 0.0, '{payload}' FROM c")


FIRST_TOKEN = "(SELECT min(id) FROM events WHERE kind = 'token')"
ADDED = "(SELECT min(id) FROM events WHERE kind = 'request.added')"
BIG = 10 << 20  # characters: over the 4 MB value limit
LONG = 3 << 20  # characters: under it, but far longer than anything a viewer shows


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# name -> (craft, the limit a reader must name, or None for a legal file it must show)
HOSTILE: dict[str, tuple[Craft, str | None]] = {
    "a 10 MB payload": (_sql(f"UPDATE events SET payload = ? WHERE id = {FIRST_TOKEN}",
                             params=('{"text": "' + "a" * BIG + '"}',)), VALUE),
    "a 10 MB meta value": (_sql("UPDATE meta SET value = ? WHERE key = 'engine'", params=('"' + "e" * BIG + '"',)), VALUE),
    "a 10 MB request list of a step": (_sql("UPDATE steps SET req_ids = ? WHERE step = 1",
                                            params=('["' + "r" * BIG + '"]',)), VALUE),
    "a million rows in one step": (_sql(_rows(1_000_000, "1", "'req-0'", "kv", "{}")), READ),
    "300,000 requests": (_sql(_rows(300_000, "1", "'r' || x", "request.added", "{}")), READ),
    "300,000 token events of one request": (_sql(_rows(300_000, "2", "'req-0'", "token",
                                                       '{"position": 0, "token_id": 1, "text": "a"}')), READ),
    "300,000 steps": (_sql("WITH RECURSIVE c(x) AS (SELECT 100 UNION ALL SELECT x + 1 FROM c WHERE x < 300100) "
                           "INSERT INTO steps(step, mode, req_ids, num_events) SELECT x, 'DECODE', '[]', 0 FROM c"), READ),
    "a payload nested 100,000 deep": (_sql(f"UPDATE events SET payload = ? WHERE id = {FIRST_TOKEN}",
                                           params=(_nested(100_000),)), DEPTH),
    "top_logprobs nested 5,000 deep": (_sql(f"UPDATE events SET payload = ? WHERE id = {FIRST_TOKEN}",
                                            params=('{"top_logprobs": ' + _nested(5_000) + "}",)), DEPTH),
    "params nested 200 deep": (_sql(f"UPDATE events SET payload = json_set(payload, '$.params.deep', json(?)) WHERE id = {ADDED}",
                                    params=(_nested(200),)), DEPTH),
    "engine meta nested 100,000 deep": (_sql("UPDATE meta SET value = ? WHERE key = 'engine'",
                                             params=(_nested(100_000),)), DEPTH),
    "a step's request list nested 10,000 deep": (_sql("UPDATE steps SET req_ids = ? WHERE step = 1",
                                                      params=(_nested(10_000),)), DEPTH),
    "a 3 MB prompt": (_sql(f"UPDATE events SET payload = json_set(payload, '$.prompt', ?) WHERE id = {ADDED}",
                           params=("p" * LONG + "\n\x01" * 100,)), None),
    "a 3 MB token text": (_sql(f"UPDATE events SET payload = CASE WHEN req_id IS NULL "  # a run row (format.py)
                               f"THEN json_set(payload, '$.\"@rows\"[0].p.text', ?1) ELSE json_set(payload, '$.text', ?1) "
                               f"END WHERE id = {FIRST_TOKEN}", params=("t" * LONG + "\n\x01" * 100,)), None),
    "params nested 40 deep": (_sql(f"UPDATE events SET payload = json_set(payload, '$.params.deep', json(?)) WHERE id = {ADDED}",
                                   params=(_nested(40),)), None),
}
