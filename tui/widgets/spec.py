"""The speculative decoding pane: the selected request's draft tokens with accept/reject, p, q and u.

Owns: drawing the drafter and its proposals, and for each draft position the target probability
p, draft probability q, the uniform u (sampled verification) or the target's argmax (greedy), the
verdict with its reason, the recovered or bonus token and the KV slots rolled back. Does not own
verification itself (the engine's spec modules).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from tui.fmt import id_ranges, num, quote
from tui.vocab import Vocab
from tui.widgets.base import Pane, PaneContext
from workbench.trace.events import SpecDraft, SpecVerify


def _ratio(p: float | None, q: float | None) -> float | None:
    if p is None or q is None or q <= 0:
        return None
    return min(1.0, p / q)


def verdict(v: SpecVerify, i: int) -> Text:
    """Position i's mark: accepted, rejected, or not checked (after an earlier rejection)."""
    if i >= len(v.accepted) or i > v.num_accepted:
        return Text("· skip", style="dim")
    if v.accepted[i]:
        return Text("✓ accept", style="bold green")
    return Text("✗ reject", style="bold red")


def reject_reason(v: SpecVerify, vocab: Vocab) -> Text | None:
    """Why the first rejected position was rejected, in words."""
    i = v.num_accepted
    if i >= len(v.draft_tokens) or (i < len(v.accepted) and v.accepted[i]):
        return None
    if v.greedy:
        target = v.target_argmax[i] if i < len(v.target_argmax) else None
        why = f"the target's argmax is {quote(vocab.piece(target), 16)}, not the draft"
    else:
        u = v.u[i] if i < len(v.u) else None
        ratio = _ratio(v.p[i] if i < len(v.p) else None, v.q[i] if i < len(v.q) else None)
        why = f"u {num(u)} ≥ min(1, p/q) {num(ratio)}"
    return Text.assemble((f"#{i} rejected: ", "bold red"), why)


def verify_table(v: SpecVerify, draft: SpecDraft | None, vocab: Vocab) -> Table:
    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for name in ("#", "draft", "q", "p", "p/q", "target" if v.greedy else "u", ""):
        table.add_column(name, no_wrap=True)
    for i, tid in enumerate(v.draft_tokens):
        text = draft.texts[i] if draft is not None and i < len(draft.texts) else vocab.piece(tid)
        p = v.p[i] if i < len(v.p) else None
        q = v.q[i] if i < len(v.q) else None
        if v.greedy:
            target = v.target_argmax[i] if i < len(v.target_argmax) else None
            last = quote(vocab.piece(target), 12) if target is not None else "—"
        else:
            last = num(v.u[i] if i < len(v.u) else None)
        table.add_row(str(i), quote(text, 12), num(q), num(p), num(_ratio(p, q)), last, verdict(v, i))
    return table


def extra_text(v: SpecVerify, vocab: Vocab) -> Text:
    out = Text.assemble(("accepted ", "bold"), f"{v.num_accepted}/{len(v.draft_tokens)}")
    if v.extra_token is not None:
        out.append("  then ")
        out.append(f"{v.extra_kind or 'extra'} {quote(vocab.piece(v.extra_token))} #{v.extra_token}", "bold")
        draw = getattr(v, "extra_draw", None)  # a field newer than the first schema-1 files
        if draw is not None:
            out.append(f" (u {num(draw)})")
    if v.freed_slots:
        out.append(f"\nrolled back {len(v.freed_slots)} KV slots ({id_ranges(v.freed_slots, 3)})")
    return out


def draw_spec(ctx: PaneContext) -> RenderableType:
    rs = ctx.req_step
    if ctx.view is None:
        return Text("loading…", style="dim")
    if rs is None or not (rs.drafts or rs.verifies):
        return Text(f"no speculative decoding for {ctx.selection.req_id or 'this step'} in step {ctx.view.step}",
                    style="dim")
    parts: list[RenderableType] = []
    for i, v in enumerate(rs.verifies or [None]):
        draft = rs.drafts[i] if i < len(rs.drafts) else (rs.drafts[-1] if rs.drafts else None)
        if draft is not None:
            parts.append(Text.assemble(("drafter ", "bold"), draft.drafter or "?",
                                       f"  proposed {len(draft.tokens)}  ",
                                       ("greedy" if v is None or v.greedy else "sampled", "italic")))
        if v is None:
            parts.append(Text("draft only: no verification recorded", style="dim"))
            continue
        parts.append(verify_table(v, draft, ctx.vocab))
        reason = reject_reason(v, ctx.vocab)
        if reason is not None:
            parts.append(reason)
        parts.append(extra_text(v, ctx.vocab))
    return Group(*parts)


class SpecPane(Pane):
    TITLE = "Speculative"
    RECORDS = ("spec.draft", "spec.verify")
    WIDE = True

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_spec(ctx)

    def subtitle(self, ctx: PaneContext) -> str:
        rs = ctx.req_step
        if rs is None or not rs.verifies:
            return ""
        v = rs.verifies[-1]
        return f"{rs.req_id} · {v.num_accepted}/{len(v.draft_tokens)} accepted"
