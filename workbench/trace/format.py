"""The `.wbtrace` file layout: an SQLite database (schema version `events.SCHEMA_VERSION`).

Owns: the tables, their indexes and the SQL that uses them, the per-step summaries the reader uses
to open large traces instantly, and how tensors are encoded. `store.TraceWriter` writes this
layout; `reader.Trace` reads it. Does not own what events mean (events.py).

- `meta(key, value)`: JSON values. Always `format` (= "wbtrace"), `schema_version`, `created`,
  `finished` (false until the writer closes); then whatever the engine sets (config, model, ...).
- `events(id, step, req_id, kind, t, payload)`: events as JSON, in emission order. A row holds one
  event, or a run of consecutive events of one step and kind about different requests (a decode
  step's `logits`, `token`, `detok` ... of every row of its batch): then `req_id` is NULL, `payload`
  is `{"@rows": [{"r": req_id, "t": t, "p": payload}, ...]}` and the run's events take the ids
  `id - n + 1` through `id`. Ids stay dense, so `max(id)` counts the events; one row per run
  instead of per event is most of what a trace writer saves at large batches.
- `members(req_id, step)`: the requests that have events inside a run row of that step, so a
  request's events are found by index.
- `steps(step, mode, batch_size, num_tokens, ...)`: one summary row per step, kept in the same
  transaction as its events, so a committed file is always self-consistent.
- `tensors(name, step, req_id, data)`: safetensors bytes (one array under the key "data"). Never pickle.
"""


from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import itertools
import json
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workbench.trace.events import SCHEMA_VERSION

try:
    import orjson
except ImportError:  # an optional speed-up: the standard library encodes the same values
    orjson = None

if TYPE_CHECKING:
    import numpy as np

FORMAT = "wbtrace"
GROUP_KEY = "@rows"  # the payload key of a row holding a run of events (no event field has this name)
GROUP_PREFIX = '{"' + GROUP_KEY + '":'  # how such a row's JSON text starts
SQLITE_MAGIC = b"SQLite format 3\x00"
APPLICATION_ID = 0x57425452  # "WBTR": lets tools recognise the file from its SQLite header

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events(
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, req_id TEXT, kind TEXT NOT NULL,
    t REAL NOT NULL, payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS steps(
    step INTEGER PRIMARY KEY, mode TEXT, batch_size INTEGER, num_tokens INTEGER,
    output_tokens INTEGER, forward_ms REAL, kv_used INTEGER, kv_total INTEGER, req_ids TEXT,
    t_start REAL, t_end REAL, first_id INTEGER, last_id INTEGER, num_events INTEGER,
    spec_proposed INTEGER, spec_accepted INTEGER);
CREATE TABLE IF NOT EXISTS tensors(name TEXT PRIMARY KEY, step INTEGER, req_id TEXT, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS members(req_id TEXT NOT NULL, step INTEGER NOT NULL, PRIMARY KEY(req_id, step))
    WITHOUT ROWID;
"""
_INDEXES = """
CREATE INDEX IF NOT EXISTS events_step ON events(step);
CREATE INDEX IF NOT EXISTS events_req ON events(req_id, step);
CREATE INDEX IF NOT EXISTS events_kind ON events(kind, step);
"""

STEP_COLUMNS = (
    "step", "mode", "batch_size", "num_tokens", "output_tokens", "forward_ms", "kv_used", "kv_total",
    "req_ids", "t_start", "t_end", "first_id", "last_id", "num_events", "spec_proposed", "spec_accepted",
)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):  # numpy scalars and arrays, CPU tensors
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


# One encoder for every payload: json.dumps(**kwargs) would build a new one per call (2x slower).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=True, default=_json_default)
# orjson where it encodes as the standard library does: dataclasses and datetimes go through
# `_json_default` as they do there, and what orjson leaves to its default that the standard
# library encodes itself (a namedtuple, a float subclass; dict and list subclasses orjson encodes)
# is turned into the plain type first
_ORJSON_OPTIONS = (orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
                   | orjson.OPT_PASSTHROUGH_DATETIME) if orjson is not None else 0


def _orjson_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, float):
        return float(obj)
    return _json_default(obj)


def json_dumps(value: Any) -> str:
    """Compact JSON; numpy values become lists, dataclasses dicts, enums their value, the rest str().

    The same values as `json.dumps(value, allow_nan=True)` reads back, by orjson where that is safe
    (a trace writer's cost is mostly this call: 6-12x faster on the engine's events). orjson writes
    NaN and infinities as null; so its text is kept only where every null in it is one of the None
    values `_nulls` counts, and anything else (a NaN, a None deeper down, the word inside a string,
    an integer past 64 bits) is encoded by the standard library instead."""
    if orjson is not None:
        try:
            text = orjson.dumps(value, default=_orjson_default, option=_ORJSON_OPTIONS)
        except (TypeError, ValueError):  # orjson.JSONEncodeError is a TypeError; big ints, surrogates
            pass
        else:
            nulls = text.count(b"null")
            try:  # no null at all (most events hold some None) needs no count of the Nones
                plain = nulls == 0 or nulls == _nulls(value)
            except ValueError:  # a numpy array compared with None inside a list
                plain = False
            if plain:
                return text.decode()
    return _ENCODER.encode(value)


_NONES = itertools.repeat(None)


def _nulls(value: Any) -> int:
    """How many None values `value` holds, counted through dicts and through lists and tuples that
    start with a dict or tuple; the rows of a list that starts with a list, and every other list,
    are counted at their own level only. It may count fewer than there are (a container after a
    scalar in one list, a list inside a row of rows, a dataclass's fields), never more
    for the plain values events hold: a short count only sends `json_dumps` the standard library's way."""
    if value is None:
        return 1
    kind = type(value)
    if kind is dict:
        n = 0
        for v in value.values():
            kind = type(v)
            if kind is dict or kind is list or kind is tuple:
                n += _nulls(v)
            elif v is None:
                n += 1
        return n
    if kind is list or kind is tuple:
        if not value:
            return 0
        kind = type(value[0])
        if kind is list:  # rows of scalars ([id, logprob, text]): each row's Nones counted in C
            try:
                return sum(map(list.count, value, _NONES))
            except TypeError:  # a row that is not a list
                return sum(map(_nulls, value))
        if kind is dict or kind is tuple:
            return sum(map(_nulls, value))
        return value.count(None)
    return 0


def create_schema(conn: sqlite3.Connection, meta: dict[str, Any], indexes: bool = True) -> None:
    """Create the tables in an empty database and write the format marker and the given meta.

    A bulk loader passes `indexes=False` and calls `create_indexes` after inserting (faster).
    """
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.executescript(f"BEGIN; {_SCHEMA} {_INDEXES if indexes else ''} COMMIT;")
    base = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "finished": False,
    }
    rows = [(k, json_dumps(v)) for k, v in {**meta, **base}.items()]
    conn.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", rows)


def create_indexes(conn: sqlite3.Connection) -> None:
    conn.executescript(f"BEGIN; {_INDEXES} COMMIT;")


def file_problem(path: str) -> str | None:
    """Why `path` cannot be a trace, for what SQLite would misreport (missing, empty, foreign, truncated)."""
    if not os.path.exists(path):
        return "no such trace file"
    if os.path.isdir(path):
        return "is a directory, not a trace file"
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(100)
    if size == 0:
        return "empty file, not a workbench trace"
    if not header.startswith(SQLITE_MAGIC):
        return "not a workbench trace (not an SQLite database)"
    if len(header) < 100:
        return f"truncated trace file ({size} bytes)"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    header_size_valid = header[24:28] == header[92:96]
    live = os.path.exists(path + "-wal")  # a live writer may be mid-checkpoint; SQLite checks then
    if header_size_valid and not live and size < pages * page_size:
        return f"truncated trace file ({size} of {pages * page_size} bytes)"
    return None


def events_sql(columns: str, kind: str | Sequence[str] | None, req_id: str | None,
               step_range: tuple[int, int] | None, limit: int | None, runs: bool = False) -> tuple[str, list[Any]]:
    """SQL for the event filters, ordered (step, id) so that each index also gives the order.

    `runs`: the file may hold rows of several requests' events (schema 3); with `req_id` the rows
    of the steps `members` lists for it are selected too, and the caller keeps that request's
    events from them and applies `limit` itself (it is left out of the SQL)."""
    where, params = [], []
    # With a request given, its index (a few hundred rows) beats the kind index (a share of all
    # rows): `+kind` keeps SQLite's planner off the kind index.
    col = "+kind" if req_id is not None else "kind"
    if isinstance(kind, str):
        where, params = [f"{col} = ?"], [kind]
    elif kind is not None:
        kinds = list(kind)
        where, params = [f"{col} IN ({', '.join('?' * len(kinds))})"], kinds
    if req_id is not None and runs:
        where.append("(req_id = ? OR (req_id IS NULL AND step IN (SELECT step FROM members WHERE req_id = ?)))")
        params += [req_id, req_id]
    elif req_id is not None:
        where.append("req_id = ?")
        params.append(req_id)
    if step_range is not None:
        lo, hi = step_range
        where.append("step BETWEEN ? AND ?")
        params += [int(lo), int(hi)]
    sql = f"SELECT {columns} FROM events" + (" WHERE " + " AND ".join(where) if where else "")
    sql += " ORDER BY step, id"
    if limit is not None and not (runs and req_id is not None):
        sql += " LIMIT ?"
        params.append(int(limit))
    return sql, params


_SUMMARY_KINDS = frozenset(("schedule", "forward_batch", "forward", "kv", "token", "spec.verify"))


@dataclass(slots=True)
class StepSummary:
    """The running summary of one step, folded from its events (a row of the `steps` table)."""

    step: int
    mode: str | None = None
    batch_size: int = 0
    num_tokens: int = 0
    output_tokens: int = 0
    forward_ms: float = 0.0
    kv_used: int | None = None
    kv_total: int | None = None
    req_ids: list[str] = field(default_factory=list)
    t_start: float | None = None
    t_end: float | None = None
    first_id: int | None = None
    last_id: int | None = None
    num_events: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    _batch_ids_from_forward: bool = field(default=False, repr=False)

    def add(self, event_id: int, kind: str, t: float, p: dict[str, Any], req_id: str | None = None) -> None:
        """Fold one event (its kind, time, payload dict and request) into the summary."""
        self.num_events += 1
        # comparisons rather than min/max calls: a trace writer folds every event it writes
        if self.first_id is None or event_id < self.first_id:
            self.first_id = event_id
        if self.last_id is None or event_id > self.last_id:
            self.last_id = event_id
        if self.t_start is None or t < self.t_start:
            self.t_start = t
        if self.t_end is None or t > self.t_end:
            self.t_end = t
        if kind not in _SUMMARY_KINDS:
            return
        if kind == "schedule":
            self.mode = p.get("mode", self.mode)
            self.num_tokens = max(self.num_tokens, int(p.get("tokens_scheduled") or 0))
            self.kv_used, self.kv_total = p.get("kv_used"), p.get("kv_total")
            if not self._batch_ids_from_forward:
                prefill = [c.get("req_id") for c in p.get("prefill", []) if isinstance(c, dict)]
                self._merge_ids(prefill + list(p.get("decode", [])))
        elif kind == "forward_batch":
            # a speculative step is scheduled as DECODE but its target forward verifies: that is its mode
            verify = p.get("forward_mode") == "TARGET_VERIFY" and p.get("model", "target") == "target"
            self.mode = "TARGET_VERIFY" if verify else (self.mode or p.get("forward_mode"))
            # requests, not rows: a verify forward packs each request's k+1 positions as k+1 rows
            ids = p.get("req_ids")
            rows = len(set(map(str, ids))) if isinstance(ids, list) and ids else int(p.get("batch_size") or 0)
            self.batch_size = max(self.batch_size, rows)
            self.num_tokens = max(self.num_tokens, len(p.get("input_ids") or ()))
            if not self._batch_ids_from_forward:
                self.req_ids, self._batch_ids_from_forward = [], True
            self._merge_ids(p.get("req_ids") or [])
        elif kind == "forward":
            self.mode = self.mode or p.get("forward_mode")
            self.forward_ms += float(p.get("forward_ms") or 0.0)
            if not self._batch_ids_from_forward:  # the ForwardBatch's request ids count better than rows
                self.batch_size = max(self.batch_size, int(p.get("batch_size") or 0))
            self.num_tokens = max(self.num_tokens, int(p.get("num_tokens") or 0))
        elif kind == "kv":
            self.kv_used, self.kv_total = p.get("kv_used"), p.get("kv_total")
        elif kind == "token":
            self.output_tokens += 1
            if req_id is not None and not self._batch_ids_from_forward:  # a step with no batch: an external
                self._merge_ids([req_id])  # engine's chunk (workbench probe) still names its request
        elif kind == "spec.verify":
            self.spec_proposed += len(p.get("draft_tokens") or ())
            self.spec_accepted += int(p.get("num_accepted") or 0)

    def _merge_ids(self, ids: list[Any]) -> None:
        for rid in ids:
            if rid is not None and rid not in self.req_ids:
                self.req_ids.append(str(rid))

    def row(self) -> tuple[Any, ...]:
        values = [getattr(self, c) for c in STEP_COLUMNS]
        values[STEP_COLUMNS.index("req_ids")] = json_dumps(self.req_ids)
        return tuple(values)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> StepSummary:
        values = dict(zip(STEP_COLUMNS, row, strict=True))
        values["req_ids"] = json.loads(values["req_ids"] or "[]")
        out = cls(**values)
        out._batch_ids_from_forward = True  # a reloaded step keeps the batch it already had
        return out


def shown_mode(mode: str | None, spec_proposed: int) -> str | None:
    """The mode a viewer shows for a step. A speculative step is scheduled as DECODE but its target
    forward verifies the drafts (TARGET_VERIFY); summaries written before StepSummary knew that say
    DECODE, and a step with proposed drafts is such a step (the spec worker verifies exactly when
    some request of the batch has drafts)."""
    return "TARGET_VERIFY" if mode == "DECODE" and spec_proposed > 0 else mode


def upsert_steps(conn: sqlite3.Connection, summaries: list[StepSummary]) -> None:
    marks = ", ".join("?" * len(STEP_COLUMNS))
    conn.executemany(f"INSERT OR REPLACE INTO steps VALUES ({marks})", [s.row() for s in summaries])


def tensor_bytes(array: Any) -> bytes:
    """Safetensors bytes of one array under the key "data"."""
    import numpy as np
    from safetensors.numpy import save

    return save({"data": np.ascontiguousarray(array)})


def to_numpy(array: Any) -> np.ndarray:
    """A private numpy copy of an array or a CPU/GPU tensor (duck-typed: torch is never imported)."""
    import numpy as np

    if hasattr(array, "detach"):
        tensor = array.detach()
        if str(tensor.dtype) in ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2"):
            tensor = tensor.float()  # numpy has no bfloat16/float8
        return np.array(tensor.cpu().numpy(), copy=True)
    return np.array(array, copy=True)


# --- field types of events read back (the file is untrusted) --------------------------------------

_Check = tuple[str, tuple[type, ...], bool, tuple[type, ...] | None]
_CHECKS: dict[type, list[_Check]] = {}
_SIMPLE_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
                                              "list": (list,), "dict": (dict,)}


def _checks(cls: type) -> list[_Check]:
    """(field, allowed types, None allowed, element types of a list) for the payload fields of an event
    class whose annotation is a plain type (`int`, `float | None`, `list[int]`, ...); `Any` is not checked.
    A list of floats may hold None (how a non-finite value is written)."""
    found = _CHECKS.get(cls)
    if found is None:
        found = []
        for f in dataclasses.fields(cls):
            if f.name in ("step", "req_id", "t"):
                continue
            text = str(f.type).replace(" ", "")
            options = [o.split("[", 1)[0] for o in text.split("|")]
            optional = "None" in options
            options = [o for o in options if o != "None"]
            if options and all(o in _SIMPLE_TYPES for o in options):
                inner = text.split("[", 2)[1].rstrip("]") if text.startswith("list[") else None
                items = _SIMPLE_TYPES.get(inner) if inner is not None else None
                found.append((f.name, tuple(t for o in options for t in _SIMPLE_TYPES[o]), optional, items))
        _CHECKS[cls] = found
    return found


def _is(value: Any, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def field_type_problem(event: Any) -> str | None:
    """What is wrong with the types of an event's fields (`position is str, expected int`), or None."""
    for name, types, optional, items in _checks(type(event)):
        value = getattr(event, name)
        if value is None and optional:
            continue
        if not _is(value, types):
            return f"field {name} is {type(value).__name__}, expected {' or '.join(t.__name__ for t in types)}"
        if items is not None and not all(_is(v, items) or (v is None and float in items) for v in value):
            return f"field {name} has an item that is not {' or '.join(t.__name__ for t in items)}"
    return None
