"""The one environment switch over every checked replacement: `WORKBENCH_REPLACEMENTS`.

Owns: reading the switch (at each use, not at import: a test or a notebook may set it later) and
its values, comma-separated words in any order:

- `on` (the default): each replacement runs where its check passed; verdicts kept on disk.
- `exact`: a replacement checked within a tolerance (multi-row decode attention) must be
  bit-identical too.
- `torch`: no native kernel is loaded (the C kernels and MKL's packed and split GEMMs): torch's
  ops run. The direct forward and the attention probe are torch code and still run.
- `fresh`: nothing is read from or written to the verdict store: every check runs in this process.
- `-NAME` (a registered replacement's name, e.g. `-linear.rowdot`): that one replacement is refused
  (what it replaces runs), the others as the other words say: for measuring one against its absence.

The old variables still work, read only where `WORKBENCH_REPLACEMENTS` is unset:
`WORKBENCH_CPU_KERNELS=0` means `torch`, `=exact` means `exact`; `WORKBENCH_FASTPATH_CACHE=0` and
`WORKBENCH_PROBE_CACHE=0` mean `fresh` (each for every replacement now, not only its own).
"""

from __future__ import annotations

import os

VARIABLE = "WORKBENCH_REPLACEMENTS"
VALUES = ("on", "exact", "torch", "fresh")
ALIASES = {"WORKBENCH_CPU_KERNELS": {"0": "torch", "exact": "exact"},
           "WORKBENCH_FASTPATH_CACHE": {"0": "fresh"}, "WORKBENCH_PROBE_CACHE": {"0": "fresh"}}


def words() -> frozenset[str]:
    """The switch's words now; ValueError naming the variable and its values for anything else."""
    raw = os.environ.get(VARIABLE)
    if raw is None:
        return frozenset(w for name, table in ALIASES.items() if (w := table.get(os.environ.get(name, ""))))
    found = frozenset(w.strip() for w in raw.split(",") if w.strip())
    from workbench.engine.kernels.registry import REGISTRY

    unknown = {w for w in found if w not in VALUES and not (w.startswith("-") and w[1:] in REGISTRY)}
    if unknown:
        raise ValueError(f"{VARIABLE}={raw!r}: expected comma-separated words of {', '.join(VALUES)}, or -NAME "
                         f"for one of {', '.join(REGISTRY)}; got {', '.join(sorted(unknown))}")
    return found - {"on"}


def refused(name: str) -> bool:
    """Is replacement `name` switched off by a `-name` word?"""
    return f"-{name}" in words()


def exact() -> bool:
    return "exact" in words()


def native() -> bool:
    return "torch" not in words()


def fresh() -> bool:
    return "fresh" in words()


def describe() -> str:
    """`WORKBENCH_REPLACEMENTS=<words>` as in effect (aliases resolved), for the report."""
    return f"{VARIABLE}={','.join(sorted(words())) or 'on'}"
