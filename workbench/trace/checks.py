"""Reference-check results stored beside a trace's events: the `checks` table of a `.wbtrace` file.

Owns: the table (`checks(req_id TEXT PRIMARY KEY, payload TEXT)`: one JSON row per request, from
`workbench check`), the run's summary under meta key `check`, writing both into an existing trace
(`store_checks`, replacing an earlier check) and reading them back (`read_checks`), both through
annotations.py. A trace that
was never checked has no such table; older readers ignore it, so the schema version is unchanged.
Standard library only. Does not own computing the results (workbench/external/check.py).

Row payload: `{"req_id", "greedy", "first_divergence", "divergence_class", "positions": [{"position",
"token_id", "engine_logprob", "ref_logprob", "delta", "ref_argmax", "ref_argmax_text", "ref_margin",
"rank", "topk_kl", "topk_overlap", "verdict"}, ...], ...}`; `verdict` is `ok`, `near_tie`, `real` or
`logprob` (a sampled position whose logprob differs beyond the tolerance).
"""

from __future__ import annotations

import os
from typing import Any

from workbench.trace.annotations import read_rows, store_rows, upsert_rows


def store_checks(path: str | os.PathLike[str], summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write a check's rows and summary into the trace at `path` (an earlier check is replaced)."""
    store_rows(path, "checks", "check", summary, rows)


def add_checks(path: str | os.PathLike[str], summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Add rows to a trace's check (rows of other requests kept) and replace its summary: `watch`
    checks a live trace's requests a batch at a time."""
    upsert_rows(path, "checks", "check", summary, rows)


def read_checks(source: Any) -> dict[str, dict[str, Any]]:
    """`{req_id: payload}` of a trace's stored check (`source`: a path or an open `Trace`); {} if none.

    A malformed row is skipped: the check is an annotation, and the trace must still open.
    """
    return read_rows(source, "checks", "check")[1]


def position_map(check: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """One request's checked positions by output position."""
    if not check:
        return {}
    return {int(p["position"]): p for p in check.get("positions", [])
            if isinstance(p, dict) and isinstance(p.get("position"), int)}
