"""The one store of verdicts on disk, so a second load on the same machine checks nothing again.

Owns: the cache root (`WORKBENCH_CACHE`, default `~/.cache/workbench`; verdicts under `verdicts/`,
built C kernels under `kernels/`), one JSON file per environment (`verdicts/<hash>.json`: the
environment dict, then per replacement its verdicts by key), reading it defensively (anything not
shaped as written is ignored, and checked again) and the one atomic writer (`write_json`: a
temporary file renamed over the old, merged with what another process wrote meanwhile). Does not
own: which verdicts are kept (the replacement says, book.py asks).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from workbench.engine.kernels.environment import digest
from workbench.engine.kernels.verdict import Verdict


def cache_root() -> Path:
    """`WORKBENCH_CACHE`, default `~/.cache/workbench` (the model cache's root too)."""
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def write_json(path: Path, data: dict[str, Any]) -> tuple[int, int, int] | None:
    """Write `data` to `path` atomically, best effort (an unwritable cache only means checking again).
    Returns the written file's `_stamp`, or None where nothing was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            stamp = _stamp(os.fstat(f.fileno()))
        os.replace(tmp, path)  # a rename keeps the inode, size and mtime the stamp was taken of
        return stamp
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return None


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one version of a store file from the next: each write renames a new file over the
    old, so its inode changes even where the clock's grain hides the change of mtime."""
    return st.st_ino, st.st_mtime_ns, st.st_size


def _entry(v: Any) -> Verdict | None:
    if not (isinstance(v, dict) and isinstance(v.get("ok"), bool) and isinstance(v.get("detail"), str)
            and isinstance(v.get("facts"), dict) and isinstance(v.get("checked_at"), str)):
        return None
    return Verdict(v["ok"], v["detail"], v["facts"], v["checked_at"])


# path -> (the file's stamp, its verdicts as read): a file is parsed again only once it changed
# (a machine's file grows to thousands of verdicts, ~1 MB, 30 ms to parse and check; a first
# decode step asked for 16 of them, 0.5 s)
_PARSED: dict[Path, tuple[tuple[int, int, int], dict[str, dict[str, Verdict]]]] = {}


class Store:
    """Verdicts on disk under `folder`: `get` one (with the date it was checked), `put` one."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder if folder is not None else cache_root() / "verdicts"

    def path(self, env: dict[str, str]) -> Path:
        return self.folder / f"{digest(env)}.json"

    def _read(self, env: dict[str, str]) -> dict[str, dict[str, Verdict]]:
        """The file's verdicts (never to be changed: the same dict serves the next ask while the
        file is unchanged)."""
        path = self.path(env)
        try:
            parsed = _PARSED.get(path)
            if parsed is not None and parsed[0] == _stamp(path.stat()):
                return parsed[1]
            with open(path, "rb") as f:
                stamp, text = _stamp(os.fstat(f.fileno())), f.read()
            data = json.loads(text)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("environment") != env or not isinstance(data.get("verdicts"), dict):
            return {}
        verdicts = {name: {k: v for k, raw in entries.items() if (v := _entry(raw)) is not None}
                    for name, entries in data["verdicts"].items() if isinstance(entries, dict)}
        _PARSED[path] = (stamp, verdicts)
        return verdicts

    def get(self, replacement: str, env: dict[str, str], key: str) -> Verdict | None:
        """The verdict an earlier process kept for this replacement, environment and key, or None
        (the file is looked at on every ask, and read again when another process wrote it since:
        the book asks only for what this process has not decided yet)."""
        return self._read(env).get(replacement, {}).get(key)

    def put(self, replacement: str, env: dict[str, str], key: str, verdict: Verdict) -> None:
        """Keep one verdict, dated now, beside what any process wrote to the file before."""
        merged = {name: dict(entries) for name, entries in self._read(env).items()}
        merged.setdefault(replacement, {})[key] = Verdict(verdict.ok, verdict.detail, verdict.facts, now_utc())
        path = self.path(env)
        stamp = write_json(path, {"environment": env, "verdicts": {
            name: {k: {"ok": v.ok, "detail": v.detail, "facts": v.facts, "checked_at": v.checked_at}
                   for k, v in entries.items()} for name, entries in merged.items()}})
        if stamp is not None:  # what was just written is what a read would find (until another write)
            _PARSED[path] = (stamp, merged)
