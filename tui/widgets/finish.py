"""The finish pane: every finish check made for the selected request this step, in order.

Owns: drawing each check's name, inputs and result (fired or not), the decision (finish reason
and evidence), and, on the step a request ends, its `request.finished` record (text, usage).
Does not own the checks themselves (workbench/engine/output/finish.py).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tui.fmt import quote, short_json
from tui.widgets.base import Pane, PaneContext
from workbench.trace.events import FinishDecision, RequestFinished


def checks_table(d: FinishDecision) -> Table:
    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    table.add_column("result", no_wrap=True, min_width=7)
    table.add_column("check", no_wrap=True)
    table.add_column("inputs", overflow="fold")
    for check in d.checks:
        fired = check.get("result")
        result = Text("✓ fired", style="bold red") if fired is True else Text("· no", style="dim") \
            if fired is False else Text(short_json(fired, 20))
        table.add_row(result, str(check.get("name", "?")), short_json(check.get("inputs", {}), 90),
                      style=None if fired else "dim")
    return table


def decision_text(d: FinishDecision) -> Text:
    if d.finish_reason is None:
        return Text("→ continues", style="green")
    out = Text.assemble(("→ finish_reason ", "bold"), (d.finish_reason, "bold red"))
    if d.evidence:
        out.append(f"  evidence {short_json(d.evidence, 80)}")
    return out


def finished_text(f: RequestFinished) -> Text:
    usage = " ".join(f"{k}={v}" for k, v in f.usage.items())
    out = Text.assemble(("finished ", "bold"), (str(f.finish_reason), "bold red"),
                        f"  matched {quote(f.matched_stop) if isinstance(f.matched_stop, str) else f.matched_stop}"
                        f"  {usage}\n", ("text ", "bold"), quote(f.text, 120))
    if f.error:
        out.append(f"\nerror {f.error}", "bold red")
    return out


def draw_finish(ctx: PaneContext) -> RenderableType:
    rs = ctx.req_step
    if ctx.view is None:
        return Text("loading…", style="dim")
    if rs is None or not (rs.finish or rs.finished):
        return Text(f"no finish check for {ctx.selection.req_id or 'this step'} in step {ctx.view.step}", style="dim")
    parts: list[RenderableType] = []
    if rs.finished is not None:
        parts.append(finished_text(rs.finished))
    for d in rs.finish:
        parts += [decision_text(d), checks_table(d)]
    return Group(*parts)


class FinishPane(Pane):
    TITLE = "Finish"
    RECORDS = ("finish",)
    MIN_WIDTH = 50

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_finish(ctx)

    def subtitle(self, ctx: PaneContext) -> str:
        rs = ctx.req_step
        if rs is None or not rs.finish:
            return ""
        reason = rs.finish[-1].finish_reason
        return f"{rs.req_id} · {reason or 'continues'}"
