"""What-if widgets: `DiffView(a, b)` (two traces side by side, positions aligned, the first divergence
and a fork's branch point marked) and `InvarianceView(report)` (per position drift, alone vs batched).

Owns: the HTML tables of these two views (shown by a notebook through `_repr_html_`, or saved with
`.html()`). Reads traces through workbench.trace and takes an invariance report as given; never
imports the engine.
"""

from __future__ import annotations

import html
import os
from typing import TYPE_CHECKING, Any

from workbench.trace.diff import DiffReport, diff_traces
from workbench.trace.diff_format import format_report
from workbench.trace.reader import Trace, open_trace

if TYPE_CHECKING:
    from workbench.rerun.invariance import InvarianceReport

BRANCH_MARK = "⑂"
_STYLE = """<style>
.wb-diff table { border-collapse: collapse; font: 12px monospace; margin: 4px 0 12px 0; }
.wb-diff td, .wb-diff th { padding: 1px 8px; border-bottom: 1px solid #eee; text-align: left; }
.wb-diff tr.diverge td { background: #ffd7d7; font-weight: bold; }
.wb-diff tr.forced td { background: #f0d7ff; font-weight: bold; }
.wb-diff tr.after td { color: #888; }
.wb-diff .note { color: #555; margin: 2px 0; }
</style>"""


def _open(x: str | os.PathLike[str] | Trace) -> tuple[Trace, bool]:
    return (x, False) if isinstance(x, Trace) else (open_trace(x), True)


def _esc(text: Any) -> str:
    return html.escape(repr(text) if isinstance(text, str) else str(text))


def _lp(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


class DiffView:
    """Two traces side by side: per request, each output position's token in A and in B."""

    def __init__(self, a: str | os.PathLike[str] | Trace, b: str | os.PathLike[str] | Trace,
                 req_ids: list[str] | None = None, tolerance: float = 1e-3) -> None:
        ta, close_a = _open(a)
        tb, close_b = _open(b)
        try:
            self.report: DiffReport = diff_traces(ta, tb, tolerance=tolerance)
            self.tokens = {side: {r.req_id: r.tokens for r in (t.timeline(x.req_id) for x in t.requests())}
                           for side, t in (("a", ta), ("b", tb))}
            self.names = (str(getattr(ta, "path", a)), str(getattr(tb, "path", b)))
        finally:
            for t, close in ((ta, close_a), (tb, close_b)):
                if close:
                    t.close()
        self.req_ids = req_ids or [r.req_id for r in self.report.requests]

    def rows(self, req_id: str) -> list[dict[str, Any]]:
        """One dict per position: tokens, logprobs and `state` (same | diverge | forced | after)."""
        r = self.report.request(req_id)
        ta, tb = self.tokens["a"].get(req_id, []), self.tokens["b"].get(r.req_id_b, [])
        first = r.first_divergence.position if r.first_divergence else None
        out = []
        for i in range(max(len(ta), len(tb))):
            ea, eb = (ta[i] if i < len(ta) else None), (tb[i] if i < len(tb) else None)
            state = "same"
            if first is not None and i == first:
                state = "forced" if eb is not None and eb.source == "forced" else "diverge"
            elif first is not None and i > first:
                state = "after"
            out.append({"position": i, "state": state,
                        "text_a": ea.text if ea else None, "text_b": eb.text if eb else None,
                        "logprob_a": ea.logprob if ea else None, "logprob_b": eb.logprob if eb else None})
        return out

    def _table(self, req_id: str) -> str:
        r = self.report.request(req_id)
        cells = []
        for row in self.rows(req_id):
            mark = BRANCH_MARK + " " if row["state"] == "forced" else ""
            cells.append(f"<tr class='{row['state']}'><td>{row['position']}</td><td>{_esc(row['text_a'])}</td>"
                         f"<td>{mark}{_esc(row['text_b'])}</td><td>{_lp(row['logprob_a'])}</td>"
                         f"<td>{_lp(row['logprob_b'])}</td></tr>")
        note = f"shared prefix {r.shared_prefix} of {r.len_a} / {r.len_b} tokens"
        if r.first_divergence is not None and r.first_divergence.verdict is not None:
            note += f"; at position {r.first_divergence.position}: {r.first_divergence.verdict.describe()}"
        return (f"<h4>{html.escape(req_id)}</h4><div class='note'>{html.escape(note)}</div><table>"
                "<tr><th>pos</th><th>A</th><th>B</th><th>logprob A</th><th>logprob B</th></tr>"
                + "".join(cells) + "</table>")

    def html(self) -> str:
        head = (f"<div class='note'>A: {html.escape(self.names[0])}<br>B: {html.escape(self.names[1])}</div>"
                f"<pre>{html.escape(format_report(self.report))}</pre>")
        return f"<div class='wb-diff'>{_STYLE}{head}" + "".join(self._table(r) for r in self.req_ids) + "</div>"

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return format_report(self.report)


def _risk(risk: float | None) -> str:
    return "—" if risk is None else f"{risk:.3g}"


class InvarianceView:
    """A batch-invariance report (workbench.rerun.invariance): the flip-risk map (highest risk first),
    then a table per request: drift and flip risk per position."""

    def __init__(self, report: InvarianceReport, req_ids: list[str] | None = None) -> None:
        self.report = report
        self.req_ids = req_ids or [r.req_id for r in report.requests]

    def _table(self, req_id: str) -> str:
        r = self.report.request(req_id)
        cells = []
        for i, p in enumerate(r.positions):
            state = "diverge" if r.first_diff == i else "same"
            d = "differs" if p.delta is None and p.token_batched != p.token_alone else (
                "—" if p.delta is None else f"{p.delta:.2e}")
            size = r.batch_sizes[i] if i < len(r.batch_sizes) else ""
            cells.append(f"<tr class='{state}'><td>{p.position}</td><td>{size}</td><td>{_esc(p.text_batched)}</td>"
                         f"<td>{_esc(p.text_alone)}</td><td>{_lp(p.logprob_batched)}</td>"
                         f"<td>{_lp(p.logprob_alone)}</td><td>{d}</td><td>{_risk(p.risk)}</td></tr>")
        note = f"max |dlogprob| {r.max_delta:.2e}"
        if r.first_diff is not None:
            note += f"; first differing token at position {r.first_diff}: "
            note += r.verdict.describe() if r.verdict else "no verdict"
        return (f"<h4>{html.escape(req_id)}</h4><div class='note'>{html.escape(note)}</div><table>"
                "<tr><th>pos</th><th>batch</th><th>batched</th><th>alone</th><th>logprob batched</th>"
                "<th>logprob alone</th><th>|dlogprob|</th><th>flip risk</th></tr>" + "".join(cells) + "</table>")

    def html(self) -> str:
        # the flip-risk map first: the positions the batch context could flip, highest risk on top
        return (f"<div class='wb-diff'>{_STYLE}<pre>{html.escape(self.report.describe())}</pre>"
                f"<pre>{html.escape(self.report.risk_table())}</pre>"
                + "".join(self._table(r) for r in self.req_ids) + "</div>")

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return self.report.describe()
