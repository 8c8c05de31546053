"""Batch-invariance results stored beside a trace's events: the `invariance` table of a `.wbtrace` file.

Owns: the table (`invariance(req_id TEXT PRIMARY KEY, payload TEXT)`: one JSON row per request,
from `workbench invariance T`), the run's summary under meta key `invariance`, writing both into an
existing trace (`store_invariance`, replacing an earlier result) and reading them back
(`read_invariance`), and looking up one position (`position_drift`). A trace never measured has no
such table; older readers ignore it, so the schema version is unchanged. Standard library only.
Does not own computing the drift (workbench/invariance.py).

Row payload: `{"req_id", "len_batched", "len_alone", "first_diff", "seeded", "max_delta",
"verdict": {"near_tie", "margin", "text"} | None, "positions": [{"position", "token_batched",
"token_alone", "text_batched", "text_alone", "logprob_batched", "logprob_alone", "delta",
"batch_size"}, ...]}`. `positions` stops at the first differing token (after it the two runs
condition on different text); `delta` is |logprob batched - logprob alone| of the same token.
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from typing import Any

from workbench.trace.format import file_problem, json_dumps

_TABLE = "CREATE TABLE IF NOT EXISTS invariance(req_id TEXT PRIMARY KEY, payload TEXT NOT NULL)"


def store_invariance(path: str | os.PathLike[str], summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write an invariance run's rows and summary into the trace at `path` (an earlier one is replaced)."""
    path = os.fspath(path)
    problem = file_problem(path)
    if problem:
        raise ValueError(f"{os.path.basename(path)}: {problem}")
    conn = sqlite3.connect(path, isolation_level=None, timeout=10.0)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(_TABLE)
        conn.execute("DELETE FROM invariance")
        conn.executemany("INSERT INTO invariance(req_id, payload) VALUES (?, ?)",
                         [(str(r["req_id"]), json_dumps(r)) for r in rows])
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('invariance', ?)", (json_dumps(summary),))
        conn.execute("COMMIT")
    finally:
        conn.close()


def read_invariance(source: Any) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """(summary, `{req_id: payload}`) of a trace's stored invariance run (`source`: a path or an open
    `Trace`); (None, {}) if it was never measured. A malformed row is skipped: the result is an
    annotation, and the trace must still open."""
    path = source if isinstance(source, (str, os.PathLike)) else getattr(source, "path", None)
    if path is None or not os.path.isfile(path):
        return None, {}
    uri = "file:" + urllib.parse.quote(os.path.abspath(os.fspath(path))) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error:
        return None, {}
    try:
        rows = conn.execute("SELECT req_id, payload FROM invariance").fetchall()
        meta = conn.execute("SELECT value FROM meta WHERE key = 'invariance'").fetchone()
    except sqlite3.Error:  # no table: never measured
        return None, {}
    finally:
        conn.close()
    out: dict[str, dict[str, Any]] = {}
    for req_id, payload in rows:
        value = _json(payload)
        if isinstance(value, dict) and isinstance(value.get("positions"), list):
            out[str(req_id)] = value
    summary = _json(meta[0]) if meta else None
    return (summary if isinstance(summary, dict) else {}), out


def _json(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def position_drift(row: dict[str, Any] | None, position: int) -> dict[str, Any] | None:
    """One compared position of a request's row (None: not compared there)."""
    for p in (row or {}).get("positions", []):
        if isinstance(p, dict) and p.get("position") == position:
            return p
    return None
