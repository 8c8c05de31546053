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


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` to `path` atomically, best effort (an unwritable cache only means checking again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _entry(v: Any) -> Verdict | None:
    if not (isinstance(v, dict) and isinstance(v.get("ok"), bool) and isinstance(v.get("detail"), str)
            and isinstance(v.get("facts"), dict) and isinstance(v.get("checked_at"), str)):
        return None
    return Verdict(v["ok"], v["detail"], v["facts"], v["checked_at"])


class Store:
    """Verdicts on disk under `folder`: `get` one (with the date it was checked), `put` one."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder if folder is not None else cache_root() / "verdicts"

    def path(self, env: dict[str, str]) -> Path:
        return self.folder / f"{digest(env)}.json"

    def _read(self, env: dict[str, str]) -> dict[str, dict[str, Verdict]]:
        try:
            data = json.loads(self.path(env).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("environment") != env or not isinstance(data.get("verdicts"), dict):
            return {}
        return {name: {k: v for k, raw in entries.items() if (v := _entry(raw)) is not None}
                for name, entries in data["verdicts"].items() if isinstance(entries, dict)}

    def get(self, replacement: str, env: dict[str, str], key: str) -> Verdict | None:
        """The verdict an earlier process kept for this replacement, environment and key, or None
        (read on every ask: the book asks only for what this process has not decided yet)."""
        return self._read(env).get(replacement, {}).get(key)

    def put(self, replacement: str, env: dict[str, str], key: str, verdict: Verdict) -> None:
        """Keep one verdict, dated now, beside what any process wrote to the file before."""
        merged = self._read(env)
        merged.setdefault(replacement, {})[key] = Verdict(verdict.ok, verdict.detail, verdict.facts, now_utc())
        write_json(self.path(env), {"environment": env, "verdicts": {
            name: {k: {"ok": v.ok, "detail": v.detail, "facts": v.facts, "checked_at": v.checked_at}
                   for k, v in entries.items()} for name, entries in merged.items()}})
