"""Reference-check results stored beside a trace's events: the `checks` table of a `.wbtrace` file.

Owns: the table (`checks(req_id TEXT PRIMARY KEY, payload TEXT)`: one JSON row per request, from
`workbench check`), the run's summary under meta key `check`, writing both into an existing trace
(`store_checks`, replacing an earlier check) and reading them back (`read_checks`). A trace that
was never checked has no such table; older readers ignore it, so the schema version is unchanged.
Standard library only. Does not own computing the results (workbench/external/check.py).

Row payload: `{"req_id", "greedy", "first_divergence", "divergence_class", "positions": [{"position",
"token_id", "engine_logprob", "ref_logprob", "delta", "ref_argmax", "ref_argmax_text", "ref_margin",
"rank", "topk_kl", "topk_overlap", "verdict"}, ...], ...}`; `verdict` is `ok`, `near_tie`, `real` or
`logprob` (a sampled position whose logprob differs beyond the tolerance).
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from typing import Any

from workbench.trace.format import file_problem, json_dumps

_TABLE = "CREATE TABLE IF NOT EXISTS checks(req_id TEXT PRIMARY KEY, payload TEXT NOT NULL)"


def store_checks(path: str | os.PathLike[str], summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write a check's rows and summary into the trace at `path` (an earlier check is replaced)."""
    path = os.fspath(path)
    problem = file_problem(path)
    if problem:
        raise ValueError(f"{os.path.basename(path)}: {problem}")
    conn = sqlite3.connect(path, isolation_level=None, timeout=10.0)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(_TABLE)
        conn.execute("DELETE FROM checks")
        conn.executemany("INSERT INTO checks(req_id, payload) VALUES (?, ?)",
                         [(str(r["req_id"]), json_dumps(r)) for r in rows])
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('check', ?)", (json_dumps(summary),))
        conn.execute("COMMIT")
    finally:
        conn.close()


def read_checks(source: Any) -> dict[str, dict[str, Any]]:
    """`{req_id: payload}` of a trace's stored check (`source`: a path or an open `Trace`); {} if none.

    A malformed row is skipped: the check is an annotation, and the trace must still open.
    """
    path = source if isinstance(source, (str, os.PathLike)) else getattr(source, "path", None)
    if path is None or not os.path.isfile(path):
        return {}
    uri = "file:" + urllib.parse.quote(os.path.abspath(os.fspath(path))) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error:
        return {}
    out: dict[str, dict[str, Any]] = {}
    try:
        rows = conn.execute("SELECT req_id, payload FROM checks").fetchall()
    except sqlite3.Error:  # no table: never checked
        return {}
    finally:
        conn.close()
    for req_id, payload in rows:
        try:
            value = json.loads(payload)
        except (TypeError, ValueError):
            continue
        if isinstance(value, dict) and isinstance(value.get("positions"), list):
            out[str(req_id)] = value
    return out


def position_map(check: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """One request's checked positions by output position."""
    if not check:
        return {}
    return {int(p["position"]): p for p in check.get("positions", [])
            if isinstance(p, dict) and isinstance(p.get("position"), int)}
