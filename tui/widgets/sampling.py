"""The logits and sampling pane: top-k after each sampling stage, kept mass, the chosen token.

Owns: drawing, for the selected request and output position, the raw logits' top-k and entropy,
then one column per stage (temperature, top_k, top_p, ...) with probability bars, how many tokens
and how much mass each stage kept, and the chosen token with the uniform draw. Does not own the
sampler's rules (the engine) or picking the position (the screen).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from tui.fmt import bar, num, quote
from tui.vocab import Vocab
from tui.widgets.base import Pane, PaneContext
from workbench.trace.events import Logits, SamplingStages, TokenChosen

ROWS = 5
BAR = 6
CELL = 1 + 11 + 1 + BAR + 1 + 5  # mark, quoted text, bar, value
GAP = 2


def _cell(vocab: Vocab, tid: int, value: str, fraction: float | None, chosen: int) -> Text:
    mark = "✓" if tid == chosen else " "
    out = Text(f"{mark}{quote(vocab.piece(tid), 11):<11} ", style="bold" if tid == chosen else "")
    if fraction is not None:
        out.append(bar(fraction, BAR), "green" if tid == chosen else "blue")
        out.append(" ")
    out.append(value)
    return out


def _columns_text(headers: list[tuple[str, str]], columns: list[list[Text]], widths: list[int]) -> Text:
    """Side-by-side columns as one Text (two header lines, then rows): no table measuring pass."""
    out = Text()
    for line in range(2):
        for title, width in zip(headers, widths):
            out.append(title[line].ljust(width + GAP), "bold")
        out.append("\n")
    for row in range(max((len(c) for c in columns), default=0)):
        for column, width in zip(columns, widths):
            cell = column[row] if row < len(column) else Text("")
            cell.truncate(width, pad=True)
            out.append_text(cell)
            out.append(" " * GAP)
        out.append("\n")
    out.rstrip()
    return out


def stage_table(logits: Logits | None, sampling: SamplingStages | None, vocab: Vocab) -> Text:
    """Columns: the logits' top-k, then the distribution after each stage."""
    chosen = sampling.chosen if sampling is not None else -1
    headers: list[tuple[str, str]] = []
    columns: list[list[Text]] = []
    widths: list[int] = []
    if logits is not None:
        headers.append(("logits", f"entropy {num(logits.entropy, 2)}"))
        columns.append([_cell(vocab, tid, num(v, 2), None, chosen)
                        for tid, v in zip(logits.top_ids[:ROWS], logits.top_logits[:ROWS])])
        widths.append(CELL - BAR - 1)
    for stage in sampling.stages if sampling is not None else []:
        kept = stage.get("kept_count")
        applied = "" if stage.get("applied", True) else " (off)"
        headers.append((f"{stage.get('name', '?')}{applied}",
                        f"kept {kept if kept is not None else '—'} · mass {num(stage.get('kept_mass'), 2)}"))
        probs = [float(p) for p in stage.get("top_probs", [])[:ROWS]]
        columns.append([_cell(vocab, int(tid), num(p, 3), p, chosen)
                        for tid, p in zip(stage.get("top_ids", [])[:ROWS], probs)])
        widths.append(CELL)
    widths = [max(w, len(h[0]), len(h[1])) for w, h in zip(widths, headers)]
    return _columns_text(headers, columns, widths)


def chosen_text(sampling: SamplingStages | None, token: TokenChosen | None, vocab: Vocab) -> Text:
    if sampling is None and token is not None and token.source.startswith("spec"):
        return Text.assemble(("chosen ", "bold"), (f"{quote(token.text)} #{token.token_id}", "bold green"),
                             f"  by {token.source.replace('_', ' ')} (speculative: see the Speculative pane)")
    if sampling is None:
        return Text("no sampling stages recorded for this token", style="dim")
    how = "greedy (argmax)" if sampling.greedy else f"draw u={num(sampling.draw, 4)}" + (
        " (seeded)" if sampling.seeded else "")
    return Text.assemble(("chosen ", "bold"), (f"{quote(vocab.piece(sampling.chosen))} #{sampling.chosen}", "bold green"),
                         f"  by {how}")


def draw_sampling(ctx: PaneContext) -> RenderableType:
    rs = ctx.req_step
    if ctx.view is None:
        return Text("loading…", style="dim")
    if rs is None or not (rs.logits or rs.sampling):
        who = ctx.selection.req_id or "no request"
        return Text(f"{who}: nothing sampled in step {ctx.view.step}", style="dim")
    position = ctx.selection.position if ctx.selection.position in rs.positions else None
    logits, sampling = rs.logits_at(position), rs.sampling_at(position)
    token = next((t for t in rs.tokens if t.position == (position if position is not None else rs.positions[0])), None) \
        if rs.tokens else None
    parts: list[RenderableType] = [stage_table(logits, sampling, ctx.vocab), chosen_text(sampling, token, ctx.vocab)]
    if len(rs.positions) > 1:
        parts.append(Text(f"this step produced positions {rs.positions}; h/l moves between them", style="dim"))
    return Group(*parts)


class SamplingPane(Pane):
    TITLE = "Logits & sampling"
    RECORDS = ("logits", "sampling")
    WIDE = True

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_sampling(ctx)

    def subtitle(self, ctx: PaneContext) -> str:
        rs = ctx.req_step
        if rs is None or not rs.logits:
            return ""
        pos = ctx.selection.position if ctx.selection.position in rs.positions else rs.logits[0].position
        return f"{rs.req_id} · position {pos}"
