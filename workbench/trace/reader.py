"""Reading `.wbtrace` files: `open_trace(path) -> Trace`.

Owns: validating an untrusted file (every failure is one `TraceError` with a one-line message;
what a read may cost is bounded by `ReadLimits`, limits.py), lazy access to steps, events, requests, timelines, tensors and pandas frames, and following a file
that is still being written. Never writes: the file is opened read-only. Does not own the layout
(format.py), what events mean (events.py) or the records it returns (records.py). pandas is imported only inside the `*_frame` methods.
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from workbench.trace.events import (
    SCHEMA_VERSION,
    Event,
    RequestAdded,
    RequestFinished,
    TokenChosen,
    event_from_json,
)
from workbench.trace.format import (
    FORMAT,
    GROUP_KEY,
    GROUP_PREFIX,
    STEP_COLUMNS,
    events_sql,
    field_type_problem,
    file_problem,
)
from workbench.trace.inside import InsideReader
from workbench.trace.limits import LimitError, ReadBudget, ReadLimits, json_depth_over, parse_json
from workbench.trace.records import RequestInfo, StepInfo, Timeline, TraceError, _is_version, _step_info

__all__ = ["ReadLimits", "RequestInfo", "StepInfo", "Timeline", "Trace", "TraceError", "open_trace"]

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

_EVENT_COLUMNS = "id, step, req_id, kind, t, payload"
_CHUNK = 2000  # rows fetched per round trip while iterating
_CHUNK_CHARS = 8 << 20  # ... or fewer, once their text passes this (a chunk holds at most this plus one value)
_TOKEN_COLUMNS = ["req_id", "position", "step", "token_id", "text", "logprob", "rank", "source", "t"]


def open_trace(path: str | os.PathLike[str], limits: ReadLimits | None = None) -> Trace:
    """Open a `.wbtrace` file read-only; raise TraceError if it is not a readable workbench trace.

    `limits` bound what reading it may cost (default: `ReadLimits.from_env()`, the
    `WORKBENCH_TRACE_MAX_*` variables); a read past one raises a TraceError naming it."""
    return Trace(path, limits)


class Trace(InsideReader):  # + what capture kept inside the forward (inside.py)
    """A read-only, lazy view of one trace file. Use as a context manager or call `close()`.

    `meta`, `schema_version`, `finished`, `num_steps`, `num_events`, `last_complete_step`; `steps()`,
    `step(n)` (its events), `events(kind, req_id, step_range, limit)`, `requests()`,
    `timeline(req_id)`, `tensor(name)`, `*_frame()` (pandas), `refresh()` / `follow()` for a file
    still being written, `check()` for a full integrity scan. One connection, safe across threads.
    Every read is bounded by `limits` (limits.py): one stored value, JSON nesting, and the memory one
    list-returning read builds; `events()` streams in chunks of bounded size.
    """

    def __init__(self, path: str | os.PathLike[str], limits: ReadLimits | None = None) -> None:
        self.path = os.fspath(path)
        self.name = os.path.basename(self.path)
        self.limits = limits if limits is not None else ReadLimits.from_env()
        problem = file_problem(self.path)
        if problem:
            raise TraceError(f"{self.name}: {problem}")
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
        self._lock = threading.RLock()
        self._steps: list[StepInfo] | None = None
        self._num_steps: int | None = None
        try:
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        except sqlite3.Error as exc:
            raise TraceError(f"{self.name}: cannot open trace file ({exc})") from None
        # SQLite refuses to materialise a larger value ("string or blob too big"), so no read copies one
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.limits.max_value_bytes)
        try:
            self.meta: dict[str, Any] = self._load_meta()
            self.schema_version: int = self._check_meta()
            # rows holding a run of several requests' events (format.py), from schema 3 on
            self._runs = self.schema_version >= 3
            self._last_id = self._query_one("SELECT coalesce(max(id), 0) FROM events")
        except BaseException:
            self._conn.close()
            raise

    # --- opening ---------------------------------------------------------------------------------

    def _load_meta(self) -> dict[str, Any]:
        tables = {r[0] for r in self._query("SELECT name FROM sqlite_master WHERE type = 'table'")}
        columns = {r[1] for r in self._query("PRAGMA table_info(meta)")} if "meta" in tables else set()
        if not {"key", "value"} <= columns:
            raise TraceError(f"{self.name}: not a workbench trace (an SQLite database without a trace meta table)")
        marker = self._query_one("SELECT value FROM meta WHERE key = 'format'", what="the meta value 'format'")
        if marker != json.dumps(FORMAT):
            raise TraceError(f"{self.name}: not a workbench trace (no '{FORMAT}' format marker)")
        budget = self.budget("the trace's meta table")
        meta: dict[str, Any] = {}
        for key, value in self._iter_rows("SELECT key, value FROM meta", (), "a meta value", budget):
            try:
                meta[str(key)] = parse_json(value, self.limits, f"meta value {str(key)[:40]!r}")
            except LimitError as exc:
                raise TraceError(f"{self.name}: {exc}") from None
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{self.name}: corrupt trace file (unreadable meta: {exc})") from None
        missing = {"events", "steps", "tensors"} - tables
        if missing and _is_version(meta.get("schema_version")) and meta["schema_version"] <= SCHEMA_VERSION:
            raise TraceError(f"{self.name}: corrupt trace file (missing tables {sorted(missing)})")
        return meta

    def _check_meta(self) -> int:
        version = self.meta.get("schema_version")
        if not _is_version(version):
            raise TraceError(f"{self.name}: corrupt trace file (schema_version is {version!r})")
        if version > SCHEMA_VERSION:
            raise TraceError(
                f"{self.name}: trace schema version {version} is newer than this workbench reads "
                f"(up to {SCHEMA_VERSION}); upgrade llm-engine-workbench")
        return int(version)

    # --- low level -------------------------------------------------------------------------------

    def budget(self, what: str) -> ReadBudget:
        """A memory budget for one read of this trace (`what` names it in the error past the limit):
        pass one to `step`/`events` to bound what a caller accumulates over several reads."""
        return ReadBudget(self.limits, what)

    @contextmanager
    def _errors(self, what: str = "a value") -> Iterator[None]:
        try:
            with self._lock:
                yield
        except LimitError as exc:
            raise TraceError(f"{self.name}: {exc}") from None
        except sqlite3.DataError as exc:
            if "too big" not in str(exc):
                raise TraceError(f"{self.name}: corrupt trace file ({exc})") from None
            raise TraceError(f"{self.name}: {self.limits.message('max_value_mb', what)}") from None
        except sqlite3.DatabaseError as exc:
            raise TraceError(f"{self.name}: corrupt trace file ({exc})") from None
        except sqlite3.ProgrammingError as exc:
            raise TraceError(f"{self.name}: trace is closed ({exc})") from None

    def _query(self, sql: str, params: Sequence[Any] = (), what: str = "a value") -> list[tuple[Any, ...]]:
        """Every row of a query whose result is small by construction (counts, names, a LIMIT)."""
        with self._errors(what):
            return self._conn.execute(sql, params).fetchall()

    def _query_one(self, sql: str, params: Sequence[Any] = (), what: str = "a value") -> Any:
        rows = self._query(sql, params, what)
        return rows[0][0] if rows else None

    def _rows(self, sql: str, params: Sequence[Any], what: str) -> list[tuple[Any, ...]]:
        """Every row of a query whose last column is JSON text, within one read's memory budget."""
        return list(self._iter_rows(sql, params, what, self.budget(what)))

    def _iter_rows(self, sql: str, params: Sequence[Any], what: str,
                   budget: ReadBudget | None = None) -> Iterator[tuple[Any, ...]]:
        """Rows in chunks of at most `_CHUNK` rows or `_CHUNK_CHARS` of text in their last column;
        each row charged to `budget` (if any) before it is handed out."""
        with self._errors(what):
            cursor = self._conn.execute(sql, params)
        while True:
            with self._errors(what):
                rows, chars = [], 0
                for row in cursor:
                    rows.append(row)
                    if budget is not None:
                        budget.charge_json(row[-1])
                    text = row[-1]
                    chars += len(text) if isinstance(text, (str, bytes)) else 0
                    if len(rows) >= _CHUNK or chars >= _CHUNK_CHARS:
                        break
            if not rows:
                return
            yield from rows

    def _make_event(self, event_id: int, step: Any, req_id: Any, kind: Any, t: Any, payload: dict[str, Any]) -> Event:
        obj = {"kind": kind, "step": step, "req_id": req_id, "t": t, "payload": payload}
        try:
            event = event_from_json(obj)
        except Exception as exc:  # a damaged payload may break an event's own expansion in any way
            raise TraceError(f"{self.name}: corrupt event #{event_id} ({exc})") from None
        problem = field_type_problem(event)
        if problem is not None or not (req_id is None or isinstance(req_id, str)):
            raise TraceError(f"{self.name}: corrupt event #{event_id} ({kind} {problem or 'req_id is not a string'})")
        return event

    def _is_run(self, row: tuple[Any, ...]) -> bool:
        return self._runs and row[2] is None and isinstance(row[5], str) and row[5].startswith(GROUP_PREFIX)

    def _run(self, event_id: Any, payload: dict[str, Any]) -> list[tuple[int, str, Any, dict[str, Any]]]:
        """The (id, req_id, t, payload) of each event of a run row (format.py), checked."""
        members = payload.get(GROUP_KEY)
        if len(payload) != 1 or not isinstance(members, list) or not members or not isinstance(event_id, int):
            raise TraceError(f"{self.name}: corrupt event #{event_id} (a malformed run of events)")
        out = []
        for i, m in enumerate(members, start=event_id - len(members) + 1):
            if not (isinstance(m, dict) and len(m) == 3 and isinstance(m.get("r"), str)
                    and isinstance(m.get("t"), (int, float)) and isinstance(m.get("p"), dict)):
                raise TraceError(f"{self.name}: corrupt event #{i} (a malformed member of a run of events)")
            out.append((i, m["r"], m["t"], m["p"]))
        return out

    def _split(self, row: tuple[Any, ...], payload: dict[str, Any],
               req_id: str | None = None) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """A row and its parsed payload as one (row, payload) pair per event it holds (each member of
        a run row with its own id, req_id and t), those of `req_id` only when it is given."""
        if not self._is_run(row):
            return [(row, payload)] if req_id is None or row[2] == req_id else []
        return [((i, row[1], r, row[3], t, row[5]), p) for i, r, t, p in self._run(row[0], payload)
                if req_id is None or r == req_id]

    def _events_of(self, row: tuple[Any, ...], req_id: str | None = None) -> list[Event]:
        """The events a row holds (one, or a run's), those of `req_id` only when it is given."""
        return [self._make_event(*r[:5], p) for r, p in self._split(row, self._payload(row[0], row[5]), req_id)]

    def _payload(self, event_id: int, text: Any) -> dict[str, Any]:
        try:
            payload = parse_json(text, self.limits, f"event #{event_id}'s payload")
        except LimitError as exc:
            raise TraceError(f"{self.name}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{self.name}: corrupt event #{event_id} ({exc})") from None
        if not isinstance(payload, dict):
            raise TraceError(f"{self.name}: corrupt event #{event_id} (payload is not an object)")
        return payload

    # --- steps -----------------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """How many steps recorded at least one event (as of opening or the last `refresh()`)."""
        if self._num_steps is None:
            self._num_steps = int(self._query_one("SELECT count(*) FROM steps"))
        return self._num_steps

    @property
    def num_events(self) -> int:
        """How many events the file held when it was opened or last refreshed."""
        return int(self._last_id)

    @property
    def finished(self) -> bool:
        """True when the writer closed the file normally (False while live, or after a crash)."""
        return bool(self.meta.get("finished"))

    @property
    def last_complete_step(self) -> int | None:
        """The last step known to be recorded in full: the last step of a finished trace; otherwise
        the one before the last (a live writer, or one that was killed, may have committed only part
        of its newest step)."""
        rows = self._query("SELECT step FROM steps ORDER BY step DESC LIMIT 2")
        if self.finished and rows:
            return int(rows[0][0])
        return int(rows[1][0]) if len(rows) == 2 else None

    def steps(self) -> list[StepInfo]:
        """Every step's summary, in step order (read once, until `refresh()`)."""
        if self._steps is None:
            # req_ids last: the one column of JSON text, which the budget and chunking measure
            columns = [c for c in STEP_COLUMNS if c != "req_ids"] + ["req_ids"]
            at = [columns.index(c) for c in STEP_COLUMNS]
            rows = self._rows(f"SELECT {', '.join(columns)} FROM steps ORDER BY step", (), "the steps table")
            self._steps = [_step_info(tuple(row[i] for i in at), self.name, self.limits) for row in rows]
            self._num_steps = len(self._steps)
        return self._steps

    def step(self, n: int, budget: ReadBudget | None = None) -> list[Event]:
        """The events of step `n`, in emission order (empty if the step recorded nothing), within
        one read's memory limit, or within `budget` when given (one budget over many steps)."""
        what = f"step {int(n)}'s events"
        rows = self._iter_rows(f"SELECT {_EVENT_COLUMNS} FROM events WHERE step = ? ORDER BY id", (int(n),), what,
                               budget if budget is not None else self.budget(what))
        return [e for row in rows for e in self._events_of(row)]

    # --- events ----------------------------------------------------------------------------------

    def events(self, kind: str | Sequence[str] | None = None, req_id: str | None = None,
               step_range: tuple[int, int] | None = None, limit: int | None = None,
               budget: ReadBudget | None = None) -> Iterator[Event]:
        """Typed events matching every filter given, in (step, emission) order.

        `kind`: one kind or a list of kinds; `req_id`: one request; `step_range=(a, b)`: steps a
        through b inclusive; `limit`: at most this many. Rows are read in chunks of bounded size as
        you iterate; a caller that keeps them passes a `budget` (see `budget()`).
        """
        sql, params = events_sql(_EVENT_COLUMNS, kind, req_id, step_range, limit, self._runs)
        found = (e for row in self._iter_rows(sql, params, "an event's payload", budget)
                 for e in self._events_of(row, req_id))
        return itertools.islice(found, limit) if limit is not None else found

    def requests(self) -> list[RequestInfo]:
        """Every request that was added, in arrival order, with its finish record when it has one."""
        added: dict[str, RequestAdded] = {}
        finished: dict[str, RequestFinished] = {}
        budget = self.budget("the requests (their request.added and request.finished events)")
        for event in self.events(kind=["request.added", "request.finished"], budget=budget):
            if event.req_id is None:
                continue
            if isinstance(event, RequestAdded):
                added.setdefault(event.req_id, event)
            elif isinstance(event, RequestFinished):
                finished[event.req_id] = event
        ids = list(added) + [rid for rid in finished if rid not in added]
        return [RequestInfo(rid, added.get(rid), finished.get(rid)) for rid in ids]

    def timeline(self, req_id: str) -> Timeline:
        """One request's events in order, its output tokens by position, and the steps that ran it."""
        events = list(self.events(req_id=req_id, budget=self.budget(f"request {req_id[:60]!r}'s events")))
        tokens = sorted((e for e in events if isinstance(e, TokenChosen)), key=lambda e: e.position)
        added = next((e for e in events if isinstance(e, RequestAdded)), None)
        finished = next((e for e in reversed(events) if isinstance(e, RequestFinished)), None)
        steps = [s.step for s in self.steps() if req_id in s.req_ids]
        return Timeline(req_id, events, tokens, steps, added, finished)

    # --- tensors ---------------------------------------------------------------------------------

    def tensor_names(self, step: int | None = None, req_id: str | None = None) -> list[str]:
        """Names of the stored tensors (level `full`), optionally of one step and/or request."""
        sql, params = "SELECT name FROM tensors WHERE 1", []
        if step is not None:
            sql, params = sql + " AND step = ?", [*params, int(step)]
        if req_id is not None:
            sql, params = sql + " AND req_id = ?", [*params, req_id]
        return [r[0] for r in self._query(sql + " ORDER BY step, name", params)]

    def tensor(self, name: str) -> np.ndarray:
        """Load one stored tensor as a numpy array (KeyError if there is none of that name)."""
        rows = self._query("SELECT data FROM tensors WHERE name = ?", (name,), f"tensor {name[:60]!r}")
        if not rows:
            raise KeyError(name)
        from safetensors.numpy import load

        try:
            arrays = load(bytes(rows[0][0]))
            return arrays["data"] if "data" in arrays else next(iter(arrays.values()))
        except Exception as exc:  # safetensors raises its own error types for malformed bytes
            raise TraceError(f"{self.name}: corrupt tensor {name!r} ({exc})") from None

    # --- frames (pandas imported here only) ------------------------------------------------------

    def steps_frame(self) -> pd.DataFrame:
        """One row per step (the fields of StepInfo)."""
        import pandas as pd

        return pd.DataFrame([asdict(s) for s in self.steps()], columns=list(StepInfo.__slots__))

    def tokens_frame(self) -> pd.DataFrame:
        """One row per generated token: req_id, position, step, token_id, text, logprob, rank, source, t."""
        import pandas as pd

        rows, payloads = self._rows_with_payloads("token", None, None, None)
        frame = pd.DataFrame(
            [(r[2], p.get("position"), r[1], p.get("token_id"), p.get("text"), p.get("logprob"), p.get("rank"),
              p.get("source"), r[4]) for r, p in zip(rows, payloads, strict=True)], columns=_TOKEN_COLUMNS)
        try:
            return frame.astype({"position": "Int64", "step": "int64", "token_id": "Int64", "rank": "Int64",
                                 "logprob": "float64", "t": "float64"})
        except Exception:  # pandas/pyarrow raise their own types: find the event and name it
            for r, p in zip(rows, payloads, strict=True):
                self._make_event(r[0], r[1], r[2], r[3], r[4], p)
            raise TraceError(f"{self.name}: corrupt token events (a field has the wrong type)") from None

    def events_frame(self, kind: str | Sequence[str] | None = None, req_id: str | None = None,
                     step_range: tuple[int, int] | None = None, limit: int | None = None) -> pd.DataFrame:
        """Events as rows (id, step, req_id, kind, t, then each payload field as a column)."""
        import pandas as pd

        rows, payloads = self._rows_with_payloads(kind, req_id, step_range, limit)
        records = [{"id": r[0], "step": r[1], "req_id": r[2], "kind": r[3], "t": r[4], **p}
                   for r, p in zip(rows, payloads, strict=True)]
        return pd.DataFrame.from_records(records, columns=None if records else ["id", "step", "req_id", "kind", "t"])

    def _rows_with_payloads(self, kind: str | Sequence[str] | None, req_id: str | None,
                            step_range: tuple[int, int] | None, limit: int | None,
                            ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
        """Matching rows and their parsed payloads (one json.loads for all: 3x faster than per row),
        a run row (format.py) given as one row per event of it, each with its own id, req_id and t."""
        rows = self._rows(*events_sql(_EVENT_COLUMNS, kind, req_id, step_range, limit, self._runs),
                          "the events of a frame")
        payloads: list[dict[str, Any]] | None = None
        try:
            if any(json_depth_over(r[5], self.limits.max_depth) for r in rows):
                raise ValueError("nested too deep")  # the per-row parse below names the event
            parsed = json.loads("[" + ",".join(r[5] for r in rows) + "]")
            if len(parsed) == len(rows) and all(isinstance(p, dict) for p in parsed):
                payloads = parsed
        except (TypeError, ValueError):
            pass
        if payloads is None:
            payloads = [self._payload(r[0], r[5]) for r in rows]  # names the corrupt event
        pairs = [pair for row, payload in zip(rows, payloads, strict=True) for pair in self._split(row, payload, req_id)]
        pairs = pairs[:limit] if limit is not None else pairs
        return [r for r, _ in pairs], [p for _, p in pairs]

    # --- live files ------------------------------------------------------------------------------

    def refresh(self) -> int:
        """Pick up what a running writer committed since opening; return how many events are new."""
        before = self._last_id
        self.meta = self._load_meta()
        self._last_id = self._query_one("SELECT coalesce(max(id), 0) FROM events")
        self._steps = self._num_steps = None
        return int(self._last_id - before)

    def follow(self, poll: float = 0.2, from_start: bool = False,
               idle_timeout: float | None = None) -> Iterator[Event]:
        """Yield events as the writer commits them (after the current end, or all with `from_start`).

        Ends when the writer has closed the file and every event was yielded, or after
        `idle_timeout` seconds without a new event.
        """
        last = 0 if from_start else self._last_id
        idle_since = time.monotonic()
        while True:
            rows = self._rows(f"SELECT {_EVENT_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?", (last, _CHUNK),
                              "the newest events")
            if rows:
                last = max(last, rows[-1][0])
                self._last_id, idle_since = max(self._last_id, last), time.monotonic()
                self._steps = self._num_steps = None
                yield from (e for row in rows for e in self._events_of(row))
                continue
            finished = self._query_one("SELECT value FROM meta WHERE key = 'finished'")
            if finished == "true":
                if not self._query("SELECT 1 FROM events WHERE id > ? LIMIT 1", (last,)):
                    self.meta["finished"] = True
                    return
                continue
            if idle_timeout is not None and time.monotonic() - idle_since > idle_timeout:
                return
            time.sleep(poll)

    def check(self) -> None:
        """Read the whole file and raise TraceError if SQLite finds it damaged (slow on big files)."""
        problems = [" ".join(str(r[0]).split()) for r in self._query("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise TraceError(f"{self.name}: corrupt trace file ({'; '.join(problems)[:300]})")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Trace {self.name!r} schema={self.schema_version} events={self.num_events}>"
