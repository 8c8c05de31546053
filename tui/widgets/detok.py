"""The detokenizer pane: the incremental detokenizer's buffer for the selected request this step.

Owns: drawing the ids consumed, the prefix/read offsets, characters decoded, the held-back text
with the reason it is held (an incomplete UTF-8 character, or a tail that may start a stop
string), the delta emitted to the stream and a matched stop string. Does not own detokenizing
(workbench/engine/output/detokenizer.py).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tui.fmt import quote
from tui.vocab import Vocab
from tui.widgets.base import Pane, PaneContext
from workbench.trace.events import DetokState

REASONS = {
    "incomplete_char": "incomplete UTF-8 character: waiting for the next token's bytes",
    "possible_stop": "could be the start of a stop string: held until it matches or cannot",
}


def detok_table(d: DetokState, vocab: Vocab) -> Table:
    table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1))
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value")
    pieces = " ".join(quote(vocab.piece(i), 16) for i in d.new_ids)
    table.add_row("new ids", f"{list(d.new_ids)}  {pieces}")
    table.add_row("offsets", f"prefix {d.prefix_offset} · read {d.read_offset} · decoded {d.decoded_len} chars")
    if d.held_text or d.held_reason:
        reason = REASONS.get(d.held_reason or "", d.held_reason or "no reason recorded")
        table.add_row("held", Text.assemble((quote(d.held_text), "bold yellow"), f"  {reason}"))
    else:
        table.add_row("held", Text("nothing held back", style="dim"))
    table.add_row("delta", Text(quote(d.delta, 60), style="bold green") if d.delta else Text("(nothing emitted)", style="dim"))
    if d.stop_matched is not None:
        table.add_row("stop", Text(f"matched {quote(d.stop_matched)}: the text is cut there", style="bold red"))
    return table


def draw_detok(ctx: PaneContext) -> RenderableType:
    rs = ctx.req_step
    if ctx.view is None:
        return Text("loading…", style="dim")
    if rs is None or not rs.detok:
        return Text(f"no detokenizer state for {ctx.selection.req_id or 'this step'} in step {ctx.view.step}",
                    style="dim")
    return Group(*[detok_table(d, ctx.vocab) for d in rs.detok])


class DetokPane(Pane):
    TITLE = "Detokenizer"
    RECORDS = ("detok",)

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_detok(ctx)

    def subtitle(self, ctx: PaneContext) -> str:
        rs = ctx.req_step
        if rs is None or not rs.detok:
            return ""
        held = rs.detok[-1].held_reason
        return f"{rs.req_id} · held: {held}" if held else rs.req_id
