"""The batch-invariance lines of the Tokens pane: what `workbench invariance T` measured for a request.

Owns: the selected position's line (|Δlogprob| of the same token alone vs in its recorded batch and
its flip risk, drift / top-2 margin, or the first token that differs and whether it was a near tie), a table of the positions around
the selection with both logprobs, and the pane subtitle's summary. Reads the stored result only
(workbench/trace/invariance_store.py); draws nothing for a trace that was never measured, and
"not measured" for a request or position the run did not compare.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from tui.fmt import num, quote
from tui.stepview import RequestData
from workbench.trace.invariance_store import position_drift

DIFFERS_STYLE = {True: "black on yellow", False: "bold white on red", None: "bold white on red"}


def _exp(value: Any) -> str:
    return f"{value:.2e}" if isinstance(value, (int, float)) else "—"


def _differs(row: dict[str, Any], p: dict[str, Any]) -> Text:
    verdict = row.get("verdict") or {}
    out = Text(f"differs: {quote(str(p.get('text_batched')), 14)} batched, {quote(str(p.get('text_alone')), 14)} "
               "alone: ")
    out.append(str(verdict.get("text") or "no verdict"), DIFFERS_STYLE.get(verdict.get("near_tie")))
    return out


def invariance_line(data: RequestData, position: int) -> Text | None:
    """`invariance  alone vs batched (batch 4): |Δlogprob| 1.2e-07` for one position, if measured."""
    row = data.invariance
    if row is None:
        return None  # the trace was never measured
    head = Text("invariance ", style="bold")
    if not row:
        return head.append("not measured for this request (workbench invariance FILE --request ID)", "dim")
    p = position_drift(row, position)
    if p is None:
        first = row.get("first_diff")
        why = f"the runs differ from position {first} on" if first is not None else "past the compared tokens"
        return head.append(f"not measured at this position ({why})", "dim")
    head.append(f"alone vs batched (batch {p.get('batch_size') or '—'}): ")
    if p.get("token_batched") != p.get("token_alone"):
        return head.append_text(_differs(row, p))
    head.append(f"|Δlogprob| {_exp(p.get('delta'))}", "green" if not p.get("delta") else "yellow")
    risk = p.get("risk")  # stored since the flip-risk map; None: an exact tie that drifted, or no margin
    if risk is None and p.get("margin") == 0 and p.get("drift"):
        risk = float("inf")
    if isinstance(risk, (int, float)):
        head.append(" · flip risk ")
        head.append(f"{risk:.2g}", "bold white on red" if risk > 1 else ("yellow" if risk > 0.5 else "green"))
    drifts = p.get("drifts")
    if isinstance(drifts, dict) and len(drifts) > 1:  # measured in several contexts: which one drifts most
        margin = p.get("margin")
        head.append(" · drift by context:", "dim")
        for name, d in drifts.items():
            over = isinstance(d, (int, float)) and isinstance(margin, (int, float)) and d > margin
            head.append(f" {name} {_exp(d) if isinstance(d, (int, float)) else '-'}", "bold red" if over else "")
    return head


def invariance_table(data: RequestData, selected: int | None, rows: int = 7) -> Text | None:
    """The positions around the selection: logprob batched, alone, |Δ| (and the first differing one)."""
    row = data.invariance
    if not row or not row.get("positions"):
        return None
    compared = [p for p in row["positions"] if isinstance(p, dict)]
    positions = [p.get("position") for p in compared]
    centre = positions.index(selected) if selected in positions else 0
    lo = max(0, min(centre - rows // 2, len(compared) - rows))
    out = Text(f"  {'pos':>3} {'batched':<12} {'lp batch':>8} {'lp alone':>8} {'|Δlp|':>8}", style="bold",
               no_wrap=True)
    for p in compared[lo:lo + rows]:
        mark = "▸" if p.get("position") == selected else " "
        out.append(f"\n{mark} {p.get('position'):>3} {quote(str(p.get('text_batched')), 12):<12} "
                   f"{num(p.get('logprob_batched'), 4):>8} {num(p.get('logprob_alone'), 4):>8} ")
        if p.get("token_batched") != p.get("token_alone"):
            tie = (row.get("verdict") or {}).get("near_tie")
            out.append(f"≠ {quote(str(p.get('text_alone')), 10)}", DIFFERS_STYLE.get(tie))
        else:
            out.append(f"{_exp(p.get('delta')):>8}")
    return out


def invariance_subtitle(data: RequestData) -> str:
    """` · alone: max Δlp 1.2e-07` (or ` · alone ≠ at 12 (tie)`: a near tie) for the pane's subtitle."""
    row = data.invariance
    if row is None:
        return ""
    if not row:
        return " · alone: not measured"
    if row.get("first_diff") is not None:
        tie = (row.get("verdict") or {}).get("near_tie")
        kind = {True: "tie", False: "real"}.get(tie, "no verdict")
        return f" · alone ≠ at {row['first_diff']} ({kind})"
    return f" · alone: max Δlp {_exp(row.get('max_delta'))}"
