"""What a checked replacement is, and what its check decides: the two records of the mechanism.

Owns: `Replacement` (what replaces what, how it is checked, what its verdict depends on and where
the verdict is kept), the two kinds of check (`IDENTICAL`, `Within`), `Verdict` (one check's
outcome, the only verdict type the engine has) and the one wording of where a verdict came from
(`CHECKED_NOW`, `cached_from`). Does not own: the table of replacements (registry.py), deciding
and keeping verdicts (book.py, store.py) or any kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHECKED_NOW = "checked in this process"
CACHED_FROM = "cached from "  # + the UTC date the check ran in an earlier process


def cached_from(date: str) -> str:
    return CACHED_FROM + date


@dataclass(frozen=True, slots=True)
class Identical:
    """The replacement's result must be the replaced op's, bit for bit."""

    def describe(self) -> str:
        return "bit-identical"


@dataclass(frozen=True, slots=True)
class Within:
    """The replacement's result must be within `bound` of a reference, because `reason` (where the
    replaced op itself has no single result to be identical to). With the switch's `exact` value a
    Within check demands identity instead."""

    bound: str
    reason: str

    def describe(self) -> str:
        return f"within {self.bound} ({self.reason})"


IDENTICAL = Identical()

# where a verdict lives once decided
PROCESS = "process"  # a table for the whole process, keyed by the verdict's key
PER_OBJECT = "object"  # a table per object it is about (a model: its modules can be swapped later)
PER_LOAD = "load"  # asked again on every load (from disk when kept there): nothing in the process


@dataclass(frozen=True, slots=True)
class Replacement:
    """One thing the engine runs in place of another, and how it earns the right to.

    `key` names the parts of a verdict's key the caller passes (shapes, row counts, threads, the
    model...); `depends_on` the parts of the environment that hold for the whole file on disk
    (CPU, library builds, code). `code` lists the modules whose source is hashed into that
    environment, so an edit of the kernel or its check starts afresh."""

    name: str
    replaces: str
    by: str
    check: Identical | Within
    key: tuple[str, ...]
    depends_on: tuple[str, ...]
    code: tuple[str, ...] = ()
    native: bool = False  # a C or MKL kernel: the switch's `torch` value turns it off
    lives: str = PROCESS  # PROCESS, PER_OBJECT or PER_LOAD
    on_disk: str = "all"  # which verdicts the store keeps: "all", "passed" or "none"
    note: str = ""  # anything a reader of the report needs besides the above

    def describe(self) -> dict[str, Any]:
        return {"replaces": self.replaces, "by": self.by, "check": self.check.describe(),
                "key": list(self.key), "depends_on": list(self.depends_on),
                "kept": {PROCESS: "for the process", PER_OBJECT: "per model object",
                         PER_LOAD: "asked on every load"}[self.lives]
                + {"all": ", and on disk", "passed": ", and on disk when passed", "none": ""}[self.on_disk]
                + (f"; {self.note}" if self.note else "")}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One check's outcome for one key: may the replacement run (`ok`), what the check found
    (`detail`, one sentence; `facts`, its numbers, JSON values), and where the verdict came from
    (`checked_at` None: checked in this process; else the UTC date of the earlier process)."""

    ok: bool
    detail: str
    facts: dict[str, Any] = field(default_factory=dict)
    checked_at: str | None = None

    @property
    def source(self) -> str:
        return CHECKED_NOW if self.checked_at is None else cached_from(self.checked_at)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail, "facts": self.facts, "source": self.source}
