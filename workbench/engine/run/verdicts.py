"""The packed-GEMM self-check's verdicts kept on disk, so a second load on the same machine reuses them.

Owns: the environment key the verdicts are valid for, the JSON file under the kernel cache
(`~/.cache/workbench/fastpath/verdicts-<key>.json`), reading it defensively and writing it
atomically. Does not own the check itself (fastpath.py).

A verdict ("the packed GEMM is bit-identical to `F.linear` for this shape at this row count and
thread count") depends on the kernel MKL picks, which depends on the CPU (model and feature flags),
MKL's version and torch's build (both in `torch.__config__.show()`), the thread count (in the
verdict's own key) and on how cpu_kernels.py calls MKL. All of these go into the file's key, so a
different machine, a torch upgrade or an edit of the kernel code starts a new file and is checked
afresh. `WORKBENCH_FASTPATH_CACHE=0` turns the file off (every process checks for itself).

Beside the identity verdicts the file keeps the races (fastpath.FastPathChecks.fastest): which of
the identical kernels and `F.linear` ran fastest for a shape at a row count, with the times, so a
warm load times nothing either. Speed, unlike identity, also depends on the load the race ran
under; the entry says when it ran and the report shows the times.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

ENV_SWITCH = "WORKBENCH_FASTPATH_CACHE"
LinearKey = tuple[int, int, bool, int, int, str]  # (out_features, in_features, bias, rows, threads, kind)


def _cpu() -> tuple[str, str]:
    """The CPU's model name and feature flags (Linux /proc/cpuinfo; platform strings elsewhere)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        import platform

        model = platform.processor() or platform.machine()
    return model, flags


def environment() -> dict[str, str]:
    """What a verdict is valid for, readable (the file's key is its hash)."""
    import torch

    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / n).read_bytes() for n in ("cpu_kernels.py", "fastpath.py")))
    model, flags = _cpu()
    return {"cpu": model, "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "torch": torch.__version__,
            "torch_build_sha256": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
            "kernel_code_sha256": code.hexdigest()[:16]}


def default_path() -> Path:
    """`~/.cache/workbench/fastpath/verdicts-<key>.json` (beside cpu_kernels.py's built kernels)."""
    env = environment()
    key = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench" / "fastpath" / f"verdicts-{key}.json"


def _name(key: LinearKey) -> str:
    n, k, bias, rows, threads, kind = key
    return f"{n}x{k}{'+bias' if bias else ''}@{rows}r{threads}t{'' if kind == 'packed' else '/' + kind}"


class VerdictStore:
    """Linear verdicts on disk: `get` one (with the date it was checked), `put` one."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._entries: dict[str, dict[str, dict[str, Any]]] | None = None  # section -> name -> entry

    @property
    def path(self) -> Path:
        if self._path is None:  # computed on first use: nothing is read when the module is imported
            self._path = default_path()
        return self._path

    def _load(self) -> dict[str, dict[str, dict[str, Any]]]:
        if self._entries is None:
            try:
                data = json.loads(self.path.read_text())
                data = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                data = {}
            linear, race = data.get("linear"), data.get("race")
            self._entries = {
                "linear": {k: v for k, v in (linear if isinstance(linear, dict) else {}).items()
                           if isinstance(v, dict) and isinstance(v.get("identical"), bool)
                           and isinstance(v.get("max_abs_diff"), (int, float)) and isinstance(v.get("checked_at"), str)},
                "race": {k: v for k, v in (race if isinstance(race, dict) else {}).items()
                         if isinstance(v, dict) and isinstance(v.get("winner"), str) and isinstance(v.get("ms"), dict)
                         and all(isinstance(t, (int, float)) for t in v["ms"].values())
                         and isinstance(v.get("checked_at"), str)}}
        return self._entries

    def get(self, key: LinearKey) -> tuple[bool, float, str] | None:
        """(identical, max_abs_diff, checked_at) of a verdict found on this machine before, or None."""
        v = self._load()["linear"].get(_name(key))
        return None if v is None else (v["identical"], float(v["max_abs_diff"]), v["checked_at"])

    def put(self, key: LinearKey, identical: bool, max_abs_diff: float) -> None:
        """Keep one verdict (best effort: an unwritable cache only means the next process checks again)."""
        self._put("linear", key, {"identical": identical, "max_abs_diff": max_abs_diff})

    def get_race(self, key: LinearKey) -> tuple[str, dict[str, float], str] | None:
        """(winner, best ms per entrant, checked_at) of a race run on this machine before, or None."""
        v = self._load()["race"].get(_name(key))
        return None if v is None else (v["winner"], {k: float(t) for k, t in v["ms"].items()}, v["checked_at"])

    def put_race(self, key: LinearKey, winner: str, ms: dict[str, float]) -> None:
        self._put("race", key, {"winner": winner, "ms": ms})

    def _put(self, section: str, key: LinearKey, entry: dict[str, Any]) -> None:
        mine = self._load()
        mine[section][_name(key)] = {**entry, "checked_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self._entries = None
        theirs = self._load()  # what another process wrote meanwhile, plus ours
        merged = {name: {**theirs[name], **mine[name]} for name in mine}
        self._entries = merged
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=self.path.parent)
        except OSError:
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"environment": environment(), **merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)


def default_store() -> VerdictStore | None:
    return None if os.environ.get(ENV_SWITCH, "1") == "0" else VerdictStore()
