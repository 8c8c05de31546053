"""Trace files a server offers for download: listed by id, never addressed by a client's path.

Owns: listing the `.wbtrace` files directly inside the server's trace directory (id = file name
without the suffix), resolving an id only through that listing (so `../` or absolute paths can
never reach a file), and a consistent snapshot of the file still being written (SQLite's online
backup from a read-only connection). Does not own: writing traces (trace/store.py) or the routes.
"""

from __future__ import annotations

import os
import re
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".wbtrace"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


@dataclass(frozen=True, slots=True)
class TraceEntry:
    id: str
    path: Path
    bytes: int
    modified: float
    active: bool

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "object": "trace", "bytes": self.bytes, "modified": self.modified,
                "active": self.active}


def list_traces(trace_dir: Path | None, active_path: str | None = None) -> list[TraceEntry]:
    """Every `*.wbtrace` regular file directly in `trace_dir`, newest first."""
    if trace_dir is None or not trace_dir.is_dir():
        return []
    active = os.path.realpath(active_path) if active_path else None
    out = []
    for entry in os.scandir(trace_dir):
        if not entry.name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
            continue
        trace_id = entry.name[: -len(SUFFIX)]
        if not _ID.match(trace_id):
            continue
        st = entry.stat(follow_symlinks=False)
        out.append(TraceEntry(trace_id, Path(entry.path), st.st_size, st.st_mtime,
                              active is not None and os.path.realpath(entry.path) == active))
    return sorted(out, key=lambda e: e.modified, reverse=True)


def find_trace(trace_dir: Path | None, trace_id: str, active_path: str | None = None) -> TraceEntry | None:
    """The listed trace with this id, or None; the id is only ever compared, never joined to a path."""
    if not _ID.match(trace_id):
        return None
    return next((e for e in list_traces(trace_dir, active_path) if e.id == trace_id), None)


def snapshot(path: Path) -> str:
    """A consistent copy of a trace that may still be written, in a temporary file the caller removes."""
    fd, tmp = tempfile.mkstemp(suffix=SUFFIX)
    os.close(fd)
    src = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        dst = sqlite3.connect(tmp)
        try:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode = DELETE")
        finally:
            dst.close()
    except Exception:
        os.unlink(tmp)
        raise
    finally:
        src.close()
    return tmp
