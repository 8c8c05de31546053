"""Results stored beside a trace's events: one table of per-request JSON rows plus a summary meta key.

Owns: writing such a result into an existing `.wbtrace` file (`store_rows`: the table created if
missing, an earlier result replaced, in one transaction) and reading it back (`read_rows`,
read-only, defensively: a malformed row is skipped, a missing table reads as "never measured").
`workbench check` (checks.py) and `workbench invariance` (invariance_store.py) store theirs this
way. Older readers ignore the tables, so the schema version is unchanged. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import urllib.parse
from collections.abc import Iterator
from typing import Any

from workbench.trace.format import file_problem, json_dumps
from workbench.trace.limits import LimitError, ReadBudget, ReadLimits, parse_json
from workbench.trace.records import TraceError


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
    if there is none. Rows that are not objects with a `positions` list are skipped. The read obeys
    the trace's `ReadLimits` (an open Trace's, else the environment's): past one, a TraceError names it."""
    path = source if isinstance(source, (str, os.PathLike)) else getattr(source, "path", None)
    if path is None or not os.path.isfile(path):
        return None, {}
    limits = getattr(source, "limits", None) or ReadLimits.from_env()
    name = os.path.basename(os.fspath(path))
    uri = "file:" + urllib.parse.quote(os.path.abspath(os.fspath(path))) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error:
        return None, {}
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.max_value_bytes)
    budget = ReadBudget(limits, f"the {table} table")
    out: dict[str, dict[str, Any]] = {}
    try:
        meta = conn.execute("SELECT value FROM meta WHERE key = ?", (meta_key,)).fetchone()
        for req_id, payload in conn.execute(f"SELECT req_id, payload FROM {table}"):
            budget.charge_json(payload)
            value = _json(payload, limits)
            if isinstance(value, dict) and isinstance(value.get("positions"), list):
                out[str(req_id)] = value
        summary = _json(meta[0], limits) if meta else None
    except LimitError as exc:
        raise TraceError(f"{name}: {exc}") from None
    except sqlite3.DataError as exc:  # a value over max_value_mb ("string or blob too big")
        raise TraceError(f"{name}: {limits.message('max_value_mb', f'a value of the {table} table')}"
                         if "too big" in str(exc) else f"{name}: corrupt {table} table ({exc})") from None
    except sqlite3.Error:  # no table: never stored
        return None, {}
    finally:
        conn.close()
    return (summary if isinstance(summary, dict) else {}), out


def _json(text: Any, limits: ReadLimits) -> Any:
    try:
        return parse_json(text, limits, "a stored result")
    except (TypeError, ValueError):  # LimitError too: a malformed row is skipped, as any other
        return None
