"""The layers pane: inside the forward pass that chose the selected token (issue 18).

Owns: drawing one captured token's layers: per residual entry (embeddings, then after each
decoder layer) the logit lens's top tokens, the finally chosen token's rank and probability by
layer, the residual norm, and the most attended positions shown as the prompt/output text they
point at. A trace without capture says "not recorded". Does not own reading the tensors
(tui/inside.py, in a worker) or the capture itself (the engine).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tui.fmt import num, quote
from tui.inside import InsideView
from tui.widgets.base import Pane, PaneContext

HOW = "serve with capture (Engine(capture=...) or add_request(..., capture=True)) to record it"


def inside_table(view: InsideView) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    for name in ("layer", "rank", "p(chosen)", "|h|"):
        table.add_column(name, justify="right", no_wrap=True, min_width=max(len(name), 6))
    for name in ("logit lens: top tokens", "most attended (mean over heads)"):
        table.add_column(name, no_wrap=True, overflow="ellipsis")
    for row in view.rows:
        first = row.chosen_rank == 1
        lens = Text()
        for text, p in row.top:
            lens.append(f"{quote(text, 9)} {p:.2f} ", "bold green" if text == view.token_text else "")
        att = Text(" ".join(f"{quote(t, 9)}@{p} {w:.2f}" for p, t, w in row.attended) or "—")
        table.add_row("emb" if row.layer < 0 else str(row.layer), str(row.chosen_rank or "—"),
                      Text(num(row.chosen_prob, 3), "bold green" if first else ""), num(row.norm, 1), lens, att)
    return table


def first_layer(view: InsideView) -> int | None:
    """The first residual entry from which on the chosen token stays the lens's top token."""
    found = None
    for row in view.rows:
        if row.chosen_rank == 1:
            found = row.layer if found is None else found
        else:
            found = None
    return found


def draw_layers(ctx: PaneContext) -> RenderableType:
    rs = ctx.req_step
    if ctx.view is None:
        return Text("loading…", style="dim")
    if not ctx.view.has_capture:
        return Text(f"Layers: not recorded. This trace has no capture inside the forward; {HOW}.",
                    style="dim italic")
    position = ctx.selection.position
    view = ctx.view.inside.get((ctx.selection.req_id or "", position if position is not None else -1))
    if rs is None or view is None:
        return Text(f"{ctx.selection.req_id or 'no request'} position {position}: not recorded (not captured; "
                    f"captured tokens are marked in the trace's capture events)", style="dim")
    head = Text.assemble(("chosen ", "bold"), (f"{quote(view.token_text)} #{view.token_id}", "bold green"),
                         f"  attending {view.kv_len} positions")
    layer = first_layer(view)
    if layer is not None:
        head.append(f"  · top of the lens from {'the embeddings' if layer < 0 else f'layer {layer}'} on", "dim")
    return Group(head, inside_table(view))


class LayersPane(Pane):
    TITLE = "Layers (inside the forward)"
    WIDE = True

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002 - Textual's name
        super().__init__(id=id)
        self.choice: bool | None = None  # `i`: shown / hidden by the user; None: shown for captured traces
        self._ctx: PaneContext | None = None

    def show(self, ctx: PaneContext) -> None:
        self._ctx = ctx
        if ctx.view is not None:
            self.display = ctx.view.has_capture if self.choice is None else self.choice
        super().show(ctx)

    def toggle(self) -> None:
        """Show or hide the pane (`i`); on a trace without capture it says "not recorded"."""
        self.choice = not self.display
        self.display = self.choice
        if self._ctx is not None:
            self.show(self._ctx)

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_layers(ctx)

    def subtitle(self, ctx: PaneContext) -> str:
        pos = ctx.selection.position
        return f"{ctx.selection.req_id} · position {pos}" if ctx.view is not None and ctx.view.has_capture else ""
