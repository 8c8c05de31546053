"""`TraceWriter`: the sink that writes one `.wbtrace` file (layout: format.py) from a background
thread, so the engine thread never waits on disk.

Every queued batch is committed in one transaction (WAL, synchronous=NORMAL): a process killed with
SIGKILL leaves a file holding every batch committed before the kill. Does not own the layout
(format.py), what events mean (events.py) or the reader's API (reader.py).
"""

from __future__ import annotations

import atexit
import os
import queue
import sqlite3
import threading
from typing import Any

from workbench.trace.events import Event
from workbench.trace.format import (
    GROUP_KEY,
    STEP_COLUMNS,
    StepSummary,
    create_schema,
    json_dumps,
    tensor_bytes,
    to_numpy,
    upsert_steps,
)

MAX_BATCH = 4096  # queue items per transaction, so one commit never grows without bound
# after the first queued item the writer waits this long for more (cut short by flush and close):
# one transaction per ~0.1 s instead of one per decode step, whose fixed cost competed with the
# engine's threads for the CPU at batch 1
COALESCE_S = 0.1


class TraceWriter:
    """A `Sink` that writes one `.wbtrace` file from a background thread.

    `write`, `write_tensor` and `set_meta` only enqueue (tensors are copied first, so the engine may
    reuse its buffers). `flush()` blocks until everything queued is committed; `close()` flushes,
    marks the trace `finished` and closes the file. An existing file at `path` is replaced.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> None:
        self.path = os.fspath(path)
        for suffix in ("", "-wal", "-shm", "-journal"):
            if os.path.exists(self.path + suffix):
                os.remove(self.path + suffix)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        create_schema(conn, dict(meta or {}))
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._urgent = threading.Event()  # a flush or close is waiting: commit now
        self._closed = False
        self.error: BaseException | None = None
        self.num_events = 0
        self.dropped = 0  # malformed items skipped (see meta "dropped" in the file)
        self.last_drop = ""
        self._next_id = 1
        self._steps: dict[int, StepSummary] = {}
        self._forgot: int | None = None  # the last step `_forget_old_steps` took out of `_steps`
        self._thread = threading.Thread(target=self._run, name="wbtrace-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # --- the Sink protocol (engine thread) -------------------------------------------------------

    def write(self, event: Event) -> None:
        self._check_open()
        if self.error is None:  # after a disk failure, events are dropped rather than queued forever
            self._queue.put(("event", event))

    def write_tensor(self, name: str, step: int, req_id: str | None, array: Any) -> None:
        self._check_open()
        try:
            self._queue.put(("tensor", str(name), int(step), req_id, to_numpy(array)))
        except Exception as exc:  # counted by the writer thread like any malformed item
            self._queue.put(("error", name, f"cannot copy tensor: {exc}"))

    def set_meta(self, key: str, value: Any) -> None:
        self._check_open()
        self._queue.put(("meta", str(key), value))

    def flush(self) -> None:
        """Block until every queued item is committed; raise RuntimeError if the writer failed."""
        if not self._closed:
            done = threading.Event()
            self._queue.put(("flush", done))
            self._urgent.set()
            while not done.wait(0.05):
                if not self._thread.is_alive():
                    break
        self._raise_error()

    def close(self) -> None:
        """Flush, mark the trace finished and close the file (idempotent); RuntimeError if writing failed."""
        if self._closed:
            return
        self.set_meta("finished", True)
        self._closed = True
        self._queue.put(("stop",))
        self._urgent.set()
        self._thread.join()
        atexit.unregister(self.close)
        self._finish_file()
        self._raise_error()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"trace writer for {self.path} is closed")

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"trace writer for {self.path} failed: {self.error}") from self.error

    # --- the writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            if items[0][0] not in ("flush", "stop"):
                self._urgent.wait(COALESCE_S)
            self._urgent.clear()
            while len(items) < MAX_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            waiters = [it[1] for it in items if it[0] == "flush"]
            if self.error is None:
                try:
                    self._commit(items)
                except Exception as exc:  # disk full, unwritable file: stop writing, keep the engine alive
                    self.error = exc
            for done in waiters:
                done.set()
            if any(it[0] == "stop" for it in items):
                return

    def _commit(self, items: list[tuple[Any, ...]]) -> None:
        rows: list[tuple[Any, ...]] = []
        members: set[tuple[str, int]] = set()
        touched: dict[int, StepSummary] = {}
        conn, dropped = self._conn, self.dropped
        run: list[tuple[Event, int, float, dict[str, Any]]] = []  # consecutive events of one step and kind
        conn.execute("BEGIN")
        for item in items:
            try:
                if item[0] == "event":
                    event = item[1]
                    step, t, payload = self._event_parts(event)
                    # a run groups only requests' events (a string req_id, as the reader requires)
                    if run and (type(event.req_id) is not str or type(run[0][0].req_id) is not str
                                or step != run[0][1] or event.kind != run[0][0].kind):
                        self._add_run(run, rows, members, touched)
                        run = []
                    run.append((event, step, t, payload))
                    continue
                self._add_run(run, rows, members, touched)
                run = []
                if item[0] == "tensor":
                    _, name, step, req_id, array = item
                    conn.execute("INSERT OR REPLACE INTO tensors VALUES (?, ?, ?, ?)",
                                 (name, step, req_id, tensor_bytes(array)))
                elif item[0] == "meta":
                    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (item[1], json_dumps(item[2])))
                elif item[0] == "error":
                    raise ValueError(item[2])
            except sqlite3.Error:
                raise  # the file itself is failing: stop writing
            except Exception as exc:  # one malformed item is dropped (and counted), never the whole run
                self._drop(item[0], getattr(item[1], "kind", item[1]), exc)
        self._add_run(run, rows, members, touched)
        if rows:
            conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", rows)
            conn.executemany("INSERT OR IGNORE INTO members VALUES (?, ?)", sorted(members))
            upsert_steps(conn, list(touched.values()))
        if self.dropped != dropped:
            note = json_dumps({"count": self.dropped, "last_error": self.last_drop})
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('dropped', ?)", (note,))
        conn.execute("COMMIT")
        self.num_events = self._next_id - 1
        self._forget_old_steps()

    def _drop(self, what: str, name: Any, exc: Exception) -> None:
        self.dropped += 1
        self.last_drop = f"{what} {name!s:.40}: {exc!s:.200}"

    @staticmethod
    def _event_parts(event: Event) -> tuple[int, float, dict[str, Any]]:
        """(step, t, payload) of an event as stored; ValueError for a step SQLite cannot hold."""
        step, t, payload = int(event.step), float(event.t), event.stored_payload()
        if not -(2**63) <= step < 2**63:
            raise ValueError(f"step {step} does not fit in 64 bits")
        return step, (0.0 if t != t else t), payload  # SQLite would store NaN as NULL

    def _add_run(self, run: list[tuple[Event, int, float, dict[str, Any]]], rows: list[tuple[Any, ...]],
                 members: set[tuple[str, int]], touched: dict[int, StepSummary]) -> None:
        """Rows for a run of consecutive events of one step and kind: one row for a run of several
        requests' events (format.GROUP_KEY), else one row per event. A run that will not encode as
        one row is written event by event, so a malformed event costs only itself."""
        if len(run) > 1:
            step, kind, first = run[0][1], run[0][0].kind, self._next_id
            try:
                text = json_dumps({GROUP_KEY: [{"r": e.req_id, "t": t, "p": p} for e, _, t, p in run]})
                summary = self._summary(step)
                for e, _, t, p in run:
                    summary.add(self._next_id, kind, t, p, e.req_id)
                    self._next_id += 1
            except Exception:
                self._next_id = first
            else:
                members.update((e.req_id, step) for e, *_ in run)
                touched[step] = summary
                rows.append((self._next_id - 1, step, None, kind, run[0][2], text))
                return
        for e, step, t, p in run:
            try:
                text = json_dumps(p)
                summary = self._summary(step)
                summary.add(self._next_id, e.kind, t, p, e.req_id)
            except Exception as exc:
                self._drop("event", e.kind, exc)
                continue
            touched[step] = summary
            rows.append((self._next_id, step, e.req_id, e.kind, t, text))
            self._next_id += 1

    def _summary(self, step: int) -> StepSummary:
        if step not in self._steps:
            row = None
            if self._forgot is not None and step <= self._forgot:  # a later step was never summarised
                cols = ", ".join(STEP_COLUMNS)
                row = self._conn.execute(f"SELECT {cols} FROM steps WHERE step = ?", (step,)).fetchone()
            self._steps[step] = StepSummary.from_row(row) if row else StepSummary(step=step)
        return self._steps[step]

    def _forget_old_steps(self) -> None:
        if len(self._steps) > 64:  # keep the few recent steps in memory; older ones reload on demand
            old = sorted(self._steps)[:-16]
            for step in old:
                del self._steps[step]
            self._forgot = max(old[-1], self._forgot if self._forgot is not None else old[-1])

    def _finish_file(self) -> None:
        """Fold the WAL into the file and leave one self-contained file when no reader holds it."""
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.execute("PRAGMA journal_mode = DELETE")
        except sqlite3.Error:
            pass  # a live reader keeps the WAL; the file is complete either way
        finally:
            self._conn.close()
