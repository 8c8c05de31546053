"""What reading one untrusted `.wbtrace` file may cost: `ReadLimits`, `ReadBudget` and `parse_json`.

Owns: the three limits every reader of a trace file obeys (the reader, the stored results of
annotations.py, and through them the TUI, replay, check, diff and export), their environment
variables, and the messages that name them. A file over a limit gives a one-line error naming the
limit and how to raise it, never a process that grows without bound or a RecursionError.

- `max_value_mb`: one stored value (an event's payload, a meta value, a step's request list, a
  tensor). Enforced by SQLite itself (`SQLITE_LIMIT_LENGTH` on the reading connection), so a larger
  value is never copied into memory.
- `max_depth`: nesting of the JSON of one payload or meta value. The engine writes at most a few
  levels; a deeper file would otherwise overflow Python's recursion in `json.loads`, or later in
  whatever walks the value (`repr`, `json.dumps`, `dataclasses.asdict`).
- `max_read_mb`: the memory one read may build (`step(n)`, `timeline`, `requests`, `steps`, a
  frame, the recorded side of a replay or a check): a million rows is refused by name, not loaded.
  The cost of a row is estimated from its JSON text before it is parsed (`json_cost`), so the
  check costs a few string scans, not a walk of the parsed value.

Standard library only. Does not own SQL (reader.py) or what the values mean (events.py).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV = {"max_value_mb": "WORKBENCH_TRACE_MAX_VALUE_MB", "max_depth": "WORKBENCH_TRACE_MAX_DEPTH",
       "max_read_mb": "WORKBENCH_TRACE_MAX_READ_MB"}
DESCRIBE = {"max_value_mb": "one stored value", "max_depth": "JSON nesting",
            "max_read_mb": "memory one read may build"}
ROW_COST = 640  # bytes a parsed row may cost beyond its values (an event object with its defaults, its dict)
VALUE_COST = 64  # bytes one parsed JSON value may cost in Python (an empty dict is 64; a small int 28)
MB = 1 << 20


class LimitError(ValueError):
    """A trace over one of its read limits (the reader turns it into a TraceError naming the file)."""


@dataclass(frozen=True, slots=True)
class ReadLimits:
    """Bounds on what reading one trace file may cost (defaults: 64 MB, depth 64, 1024 MB)."""

    max_value_mb: float = 64.0
    max_depth: int = 64
    max_read_mb: float = 1024.0

    def __post_init__(self) -> None:
        for name in ("max_value_mb", "max_read_mb"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1_000_000):
                raise ValueError(f"{name} must be a number in (0, 1000000] (MB), got {value!r}")
        if not (isinstance(self.max_depth, int) and not isinstance(self.max_depth, bool)
                and 2 <= self.max_depth <= 512):
            raise ValueError(f"max_depth must be an integer in [2, 512], got {self.max_depth!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReadLimits:
        """The defaults, each replaced by its environment variable when set (ValueError naming it if bad)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, var in ENV.items():
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            try:
                values[field] = int(raw) if field == "max_depth" else float(raw)
            except ValueError:
                raise ValueError(f"{var} must be a number, got {raw!r}") from None
        try:
            return cls(**values)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise ValueError(f"{ENV.get(field, field)}: {exc}") from None

    @property
    def max_value_bytes(self) -> int:
        return int(self.max_value_mb * MB)

    def message(self, field: str, what: str) -> str:
        """`<what> is over the limit of 64 MB on one stored value (raise it with WORKBENCH_...=N)`."""
        value = getattr(self, field)
        shown = f"{value:g} MB" if field != "max_depth" else f"{value} levels"
        return f"{what} is over the limit of {shown} on {DESCRIBE[field]} (raise it with {ENV[field]}=N)"


def json_cost(text: str) -> int:
    """An upper estimate of the bytes `json.loads(text)` builds: its text plus `VALUE_COST` for each
    value (a value ends at a comma or opens a container; commas in strings only overestimate)."""
    return len(text) + VALUE_COST * (text.count(",") + text.count("[") + text.count("{") + 1)


class ReadBudget:
    """The memory one read has built so far; `charge` raises LimitError naming `what` past the limit."""

    __slots__ = ("limits", "what", "used")

    def __init__(self, limits: ReadLimits, what: str) -> None:
        self.limits, self.what, self.used = limits, what, 0

    def charge(self, cost: int) -> None:
        self.used += cost + ROW_COST
        if self.used > self.limits.max_read_mb * MB:
            raise LimitError(self.limits.message("max_read_mb", self.what))

    def charge_json(self, text: Any) -> None:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        self.charge(json_cost(text) if isinstance(text, str) else 0)


_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def json_depth_over(text: str, max_depth: int) -> bool:
    """True when the JSON `text` nests deeper than `max_depth` (no parse: strings dropped, then the
    innermost bracket pairs peeled off one level per pass; at most `max_depth` passes, each over the
    brackets alone). A text with fewer brackets than the limit cannot be too deep: checked first."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    brackets = _NOT_BRACKET.sub("", _STRINGS.sub("", text))
    for _ in range(max_depth):
        peeled = _INNERMOST.sub("", brackets)
        if not peeled or peeled == brackets:  # all peeled, or unbalanced (json.loads will say so)
            return False
        brackets = peeled
    return True


def parse_json(text: Any, limits: ReadLimits, what: str) -> Any:
    """`json.loads(text)` of an untrusted value; LimitError naming `what` when it nests past the limit.
    Other malformed JSON raises ValueError (or TypeError for a value that is not text), as json does."""
    if isinstance(text, bytes):  # a BLOB where the writer stores text: json.loads would decode it too
        text = text.decode("utf-8")
    if isinstance(text, str) and json_depth_over(text, limits.max_depth):
        raise LimitError(limits.message("max_depth", what))
    try:
        return json.loads(text)
    except RecursionError:  # below the depth limit only if the limit was raised past what Python allows
        raise LimitError(limits.message("max_depth", what)) from None
