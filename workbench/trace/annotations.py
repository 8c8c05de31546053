"""Results stored beside a trace's events: one table of per-request JSON rows plus a summary meta key.

Owns: writing such a result into an existing `.wbtrace` file (`store_rows`: the table created if
missing, an earlier result replaced, in one transaction) and reading it back (`read_rows`,
read-only, defensively: a malformed row is skipped, a missing table reads as "never measured").
`workbench check` (checks.py) and `workbench invariance` (invariance_store.py) store theirs this
way. Older readers ignore the tables, so the schema version is unchanged. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import urllib.parse
from collections.abc import Iterator
from typing import Any

from workbench.trace.format import file_problem, json_dumps


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[sqlite3.Connection]:
    """One write transaction on an existing trace file (a damaged file is refused by name first)."""
    path = os.fspath(path)
    problem = file_problem(path)
    if problem:
        raise ValueError(f"{os.path.basename(path)}: {problem}")
    conn = sqlite3.connect(path, isolation_level=None, timeout=10.0)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
        conn.execute("COMMIT")
    finally:
        conn.close()


def store_rows(path: str | os.PathLike[str], table: str, meta_key: str, summary: dict[str, Any],
               rows: list[dict[str, Any]], *, replace: bool = True) -> None:
    """Write `rows` (each with a `req_id`) into `table` and `summary` under meta `meta_key`. With
    `replace=False` the rows are added to what the table holds (a row of the same `req_id` replaced):
    for a result that grows while the trace is written (`workbench watch`)."""
    with writing(path) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {table}(req_id TEXT PRIMARY KEY, payload TEXT NOT NULL)")
        if replace:
            conn.execute(f"DELETE FROM {table}")
        verb = "INSERT" if replace else "INSERT OR REPLACE"  # replace: a repeated req_id is an error, as ever
        conn.executemany(f"{verb} INTO {table}(req_id, payload) VALUES (?, ?)",
                         [(str(r["req_id"]), json_dumps(r)) for r in rows])
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (meta_key, json_dumps(summary)))


def upsert_rows(path: str | os.PathLike[str], table: str, meta_key: str, summary: dict[str, Any],
                rows: list[dict[str, Any]]) -> None:
    """`store_rows` that keeps the rows already stored (a row of the same `req_id` is replaced)."""
    store_rows(path, table, meta_key, summary, rows, replace=False)


def read_rows(source: Any, table: str, meta_key: str) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """(summary, `{req_id: row}`) of a stored result (`source`: a path or an open `Trace`); (None, {})
    if there is none. Rows that are not objects with a `positions` list are skipped."""
    path = source if isinstance(source, (str, os.PathLike)) else getattr(source, "path", None)
    if path is None or not os.path.isfile(path):
        return None, {}
    uri = "file:" + urllib.parse.quote(os.path.abspath(os.fspath(path))) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error:
        return None, {}
    try:
        rows = conn.execute(f"SELECT req_id, payload FROM {table}").fetchall()
        meta = conn.execute("SELECT value FROM meta WHERE key = ?", (meta_key,)).fetchone()
    except sqlite3.Error:  # no table: never stored
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
