"""What `workbench bisect` stored for a request, drawn for the terminal: the Tokens pane's hint line
and the bisect overlay's body (screens/bisect.py).

Owns: the hint under the selected token (`b`
opens the result, which positions have one), and the overlay's text (`bisect_view`): the header
(reference vs suspect, the picks, the first layer over its floor), per layer the error it added
(a context's: the growth of the difference) against its floor as a bar on a log scale, with the
total and the worst sub-block, and the behaves-like ranking of the candidates with their median
|Δ logprob|. Reads stored rows only, never the engine.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from tui.fmt import bar, num, quote
from workbench.trace.bisect_store import BLOCK_LABEL

BAR = 24
DECADES = 4  # the bars span 10^-2 .. 10^2 of the floor, log scale: 1x the floor sits in the middle


def bisect_hint(positions: list[int], selected: int | None) -> Text | None:
    """`bisect stored at 4, 6 · b opens it` (None when the request has none)."""
    if not positions:
        return None
    here = selected in positions
    text = Text("bisect ", style="bold")
    text.append(("stored here" if here else "stored at positions " + ", ".join(map(str, positions[:8])))
                + (" …" if len(positions) > 8 else ""), "magenta")
    return text.append(" · b opens it", "dim")


def _ratio_bar(ratio: float | None) -> tuple[str, str]:
    """A bar of added/floor on a log scale (1x the floor at the middle) and its style."""
    if ratio is None or ratio <= 0:
        return bar(0.0, BAR), "dim"
    frac = (math.log10(ratio) + DECADES / 2) / DECADES
    return bar(frac, BAR), "bold red" if ratio > 1 else ("yellow" if ratio > 0.5 else "green")


def _layers(row: dict[str, Any]) -> Text:
    context = row.get("kind") == "context"
    added = "growth" if context else "added"
    out = Text(f"  {'layer':>5}  {added:>9}  {'total':>9}  {'floor':>9}  {added + '/floor':>12}  "
               f"{'(log: 0.01x … 1x … 100x)':<{BAR}}  worst sub-block", style="bold", no_wrap=True)
    factor = row.get("factor") or 1.0
    for x in row["layers"]:
        ratio = x.get("ratio")
        cells, style = _ratio_bar(ratio / factor if isinstance(ratio, (int, float)) else None)
        blocks = [b for b in x.get("blocks") or [] if isinstance(b.get("ratio"), (int, float))]
        worst = max(blocks, key=lambda b: b["ratio"], default=None)
        where = f"{BLOCK_LABEL.get(worst['block'], worst['block'])} {worst['ratio']:.3g}x" if worst else ""
        first = x.get("layer") == row.get("first_layer")
        out.append(f"\n{'▸' if first else ' '} {x.get('layer'):>5}  {num(x.get('added')):>9}  {num(x.get('total')):>9}  "
                   f"{num(x.get('floor')):>9}  {num(ratio):>12}  ", "bold" if first else "")
        out.append(cells, style)
        out.append(f"  {where}")
    return out


def _header(row: dict[str, Any]) -> Text:
    rp, sp = row.get("reference_pick") or {}, row.get("suspect_pick") or {}
    text = Text.assemble(("bisect ", "bold"), (f"{row.get('req_id')}:{row.get('position')}", "bold cyan"),
                         f"  {row.get('reference')} vs ", (str(row.get("against")), "bold magenta"))
    text.append(f"\n  reference picks {quote(rp.get('text'))} (logprob {num(rp.get('logprob'), 4)}, margin "
                f"{num(rp.get('margin'), 4)}); suspect picks {quote(sp.get('text'))} (logprob "
                f"{num(sp.get('logprob'), 4)}, margin {num(sp.get('margin'), 4)})")
    if row.get("first_layer") is not None:
        text.append(f"\n  first layer over its floor: layer {row['first_layer']}, "
                    f"{BLOCK_LABEL.get(row.get('first_block'), row.get('first_block'))}", "bold red")
    else:
        text.append(f"\n  no layer adds more than {row.get('factor', 1.0):g}x its floor", "green")
    if row.get("note"):
        text.append(f"\n  {row['note']}", "italic")
    if row.get("kind") == "context":
        text.append("\n  both runs through the engine's scheduler: growth is how much each layer grew the difference "
                    "between the run alone and in the context", "dim")
    return text


def _ranking(fit: dict[str, Any]) -> Text:
    cands = [c for c in fit.get("candidates") or [] if isinstance(c.get("median_abs_delta"), (int, float))]
    out = Text("behaves like ", style="bold")
    out.append(str(fit.get("best")), "bold magenta")
    if fit.get("best_text"):
        out.append(f": {fit['best_text']}")
    positions = fit.get("positions") or []
    if positions:
        out.append(f"  (median |Δ logprob| of the engine's tokens at positions {positions[0]}..{positions[-1]})", "dim")
    worst = max((c["median_abs_delta"] for c in cands), default=0.0) or 1.0
    for i, c in enumerate(cands):
        delta = c["median_abs_delta"]
        out.append(f"\n{'▸' if i == 0 else ' '} {c['numerics']:<14} {delta:>9.2e}  ", "bold" if i == 0 else "")
        out.append(bar(delta / worst, BAR), "green" if i == 0 else "blue")
        if c.get("note"):
            out.append(f"  {c['note']}", "dim")
    return out


def bisect_view(position: int, row: dict | None, fit: dict | None, index: int, count: int) -> RenderableType:
    """The overlay's body for one stored position: the layer table, then the ranking."""
    parts: list[RenderableType] = [Text(f"stored result {index + 1} of {count} for this request · n/p: next / previous "
                                        "· escape closes", style="dim")]
    if row is not None:
        parts += [_header(row), _layers(row)]
    else:
        parts.append(Text(f"no layer bisect stored at position {position} (only the behaves-like fit)", style="dim"))
    if fit is not None:
        parts.append(Text(""))
        parts.append(_ranking(fit))
    return Group(*parts)
