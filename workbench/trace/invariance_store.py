"""Batch-invariance results stored beside a trace's events: the `invariance` table of a `.wbtrace` file.

Owns: the table (`invariance(req_id TEXT PRIMARY KEY, payload TEXT)`: one JSON row per request,
from `workbench invariance T`), the run's summary under meta key `invariance`, writing both into an
existing trace (`store_invariance`, replacing an earlier result) and reading them back
(`read_invariance`; both through annotations.py), and looking up one position (`position_drift`). A trace never measured has no
such table; older readers ignore it, so the schema version is unchanged. Standard library only.
Does not own computing the drift (workbench/rerun/invariance.py).

Row payload: `{"req_id", "len_batched", "len_alone", "first_diff", "seeded", "max_delta",
"verdict": {"near_tie", "margin", "text"} | None, "positions": [{"position", "token_batched",
"token_alone", "text_batched", "text_alone", "logprob_batched", "logprob_alone", "delta",
"batch_size"}, ...]}`. `positions` stops at the first differing token (after it the two runs
condition on different text); `delta` is |logprob batched - logprob alone| of the same token.
"""

from __future__ import annotations

import os
from typing import Any

from workbench.trace.annotations import read_rows, store_rows


def store_invariance(path: str | os.PathLike[str], summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write an invariance run's rows and summary into the trace at `path` (an earlier one is replaced)."""
    store_rows(path, "invariance", "invariance", summary, rows)


def read_invariance(source: Any) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """(summary, `{req_id: payload}`) of a trace's stored invariance run (`source`: a path or an open
    `Trace`); (None, {}) if it was never measured. A malformed row is skipped: the result is an
    annotation, and the trace must still open."""
    return read_rows(source, "invariance", "invariance")


def position_drift(row: dict[str, Any] | None, position: int) -> dict[str, Any] | None:
    """One compared position of a request's row (None: not compared there)."""
    for p in (row or {}).get("positions", []):
        if isinstance(p, dict) and p.get("position") == position:
            return p
    return None
