"""The tokens pane: the selected request's output coloured by logprob, and the selected token's alternatives.

Owns: drawing the prompt line, the output as chips coloured by probability band (tokens produced
after the selected step dimmed, the selected token reversed, search matches underlined, checked
divergences marked), the selected token's id, logprob, rank and source, its top alternatives with
bars, when the trace was checked, the reference beside each token (widgets/reference.py), and when
its batch invariance was measured, the drift alone vs batched (widgets/invariance.py), and when it was
bisected, where (widgets/bisect.py; `b` opens the result). Does not own
loading the request (the screen's workers do).
"""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from tui.fmt import BRANCH_MARK, bar, legend, num, p_style, quote, visible
from tui.stepview import RequestData
from tui.widgets.base import Pane, PaneContext
from tui.widgets.bisect import bisect_hint
from tui.widgets.invariance import invariance_line, invariance_subtitle, invariance_table
from tui.widgets.reference import (
    check_subtitle,
    chip_style,
    client_timing_line,
    reference_line,
    reference_table,
)
from workbench.trace.events import TokenChosen

FUTURE_STYLE = "grey50"
CHIP_CHARS = 256  # a token longer than this (no vocabulary has one) is cut on its chip


def prompt_text(data: RequestData, limit: int = 160) -> Text:
    added = data.added
    if added is None:
        return Text("prompt: (not in this trace)", style="dim")
    prompt = added.prompt
    if isinstance(prompt, list):  # a chat: show the last message
        last = prompt[-1] if prompt and isinstance(prompt[-1], dict) else {}
        prompt = f"[{last.get('role', '?')}] {last.get('content', '')}"
    shown = visible(str(prompt), limit)  # cut first: a hostile prompt may be megabytes
    shown = shown if len(shown) <= limit else shown[: limit - 1] + "…"
    return Text.assemble(("prompt ", "bold"), (shown, "italic"), (f"  ({len(added.prompt_ids)} tokens)", "dim"))


def chips(data: RequestData, step: int | None, selected: int | None, hit_positions: tuple[int, ...]) -> Text:
    """The output tokens as coloured chips; a newline token also breaks the line."""
    out = Text()
    for i, tok in enumerate(data.tokens):
        future = step is not None and tok.step > step
        style = FUTURE_STYLE if future else p_style(tok.logprob, alt=i % 2 == 1)
        if tok.position == selected:
            style += " reverse bold underline"
        if tok.position in hit_positions:
            style += " underline"
        if tok.source == "forced":  # a fork's branch point: the token was forced, not sampled
            out.append(BRANCH_MARK, "bold magenta")
            style += " italic"
        marked = chip_style(data, tok.position) if not future else None
        if marked:
            style += " " + marked
        out.append(visible(tok.text, CHIP_CHARS) or "∅", style)
        if "\n" in tok.text:
            out.append("\n")
    return out


def token_detail(tok: TokenChosen) -> Text:
    p = f"{math.exp(tok.logprob):.3f}" if tok.logprob is not None else "—"
    return Text.assemble(("token ", "bold"), (f"{quote(tok.text)} #{tok.token_id}", "bold"),
                         f"  position {tok.position}  logprob {num(tok.logprob)} (p {p})  rank {tok.rank or '—'}"
                         f"  source {tok.source}  step {tok.step}")


def alternatives(tok: TokenChosen) -> Text:
    """The top alternatives at this position with logprob and probability bars (the chosen one marked)."""
    out = Text(f"  {'alternative':<14} {'id':>6} {'logprob':>7}  p", style="bold", no_wrap=True, overflow="ellipsis")
    for alt in tok.top_logprobs:
        tid, lp = alt[0], alt[1]
        text = alt[2] if len(alt) > 2 else "?"
        p = math.exp(lp) if isinstance(lp, (int, float)) and math.isfinite(lp) else 0.0
        mine = tid == tok.token_id
        out.append(f"\n{'▸' if mine else ' '} {quote(text, 14):<14} {tid:>6} {num(lp):>7}  ",
                   "bold" if mine else "")
        out.append(bar(p, 8) + f" {p:.3f}", "green" if mine else "blue")
    return out


def draw_tokens(ctx: PaneContext) -> RenderableType:
    data = ctx.request
    if data is None:
        return Text("no request selected" if ctx.selection.req_id is None else "loading…", style="dim")
    parts: list[RenderableType] = [prompt_text(data)]
    timing = client_timing_line(data, ctx.show_times)
    if timing is not None:
        parts.append(timing)
    hit = ctx.hit.positions if ctx.hit is not None and ctx.hit.req_id == data.req_id else ()
    if not data.tokens:
        parts.append(Text("no output tokens yet", style="dim"))
        return Group(*parts)
    parts.append(chips(data, ctx.selection.step, ctx.selection.position, hit))
    i = data.index_of(ctx.selection.position)
    if i is None:
        parts.append(Text("no token of this request in this step; h/l selects one", style="dim"))
    else:
        parts.append(token_detail(data.tokens[i]))
        for line in (reference_line(data, data.tokens[i].position), invariance_line(data, data.tokens[i].position),
                     bisect_hint(data.bisect_positions, data.tokens[i].position)):
            if line is not None:
                parts.append(line)
        if data.tokens[i].top_logprobs:
            parts.append(alternatives(data.tokens[i]))
    for table in (reference_table(data, ctx.selection.position), invariance_table(data, ctx.selection.position)):
        if table is not None:
            parts.append(table)
    return Group(*parts)


class TokensPane(Pane):
    TITLE = "Tokens"

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_tokens(ctx)

    def subtitle(self, ctx: PaneContext) -> str:
        data = ctx.request
        if data is None:
            return ""
        done = sum(1 for t in data.tokens if ctx.selection.step is None or t.step <= ctx.selection.step)
        state = f" · {data.finished.finish_reason}" if data.finished and data.finished.finish_reason else ""
        return f"{data.req_id} · {done}/{len(data.tokens)} tokens{state}{check_subtitle(data)}{invariance_subtitle(data)}"

    def show(self, ctx: PaneContext) -> None:
        super().show(ctx)
        self.border_title = Text.assemble(f"{self.TITLE} ", legend())  # type: ignore[assignment]
