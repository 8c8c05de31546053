"""Small text helpers shared by the panes: quoting token text, id ranges, bars, logprob colours.

Owns: how a token's text, a list of ids, a probability and a time are written on screen. Does not
own any widget or any access to the trace.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from rich.text import Text

# Probability bands for colouring tokens by logprob: (lowest p of the band, style, legend label).
# Each band has a second, darker shade so that neighbouring tokens of one band stay apart.
P_BANDS: tuple[tuple[float, str, str, str], ...] = (
    (0.9, "black on #5fd787", "black on #48b870", "p≥.9"),
    (0.5, "black on #afd75f", "black on #94bb48", "≥.5"),
    (0.2, "black on #ffd75f", "black on #e0b840", "≥.2"),
    (0.05, "black on #ffaf5f", "black on #e09040", "≥.05"),
    (0.0, "white on #d75f5f", "white on #b84848", "<.05"),
)
UNKNOWN_P_STYLE = ("black on #bcbcbc", "black on #a0a0a0")
BAR_CHARS = " ▏▎▍▌▋▊▉█"


def quote(text: str | None, limit: int = 40, middle: bool = False) -> str:
    """A token's text as a JSON string literal (spaces visible, newlines escaped), cut to `limit` chars.

    `middle=True` keeps both ends and cuts the middle (a prompt chunk's end says most about it).
    """
    if text is None:
        return "?"
    out = json.dumps(text, ensure_ascii=False)
    if len(out) <= limit:
        return out
    if middle:
        head = (limit - 1) // 3
        return out[:head] + "…" + out[len(out) - (limit - 1 - head):]
    return out[: limit - 2] + "…\""


def visible(text: str, limit: int | None = None) -> str:
    """Text for inline display: control characters shown as escapes, a newline as ↵; with `limit`,
    only the first `limit` characters, then "…" (a trace's strings are untrusted: one may be huge)."""
    cut = limit is not None and len(text) > limit
    out = []
    for ch in text[:limit] if cut else text:
        if ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("⇥")
        elif ord(ch) < 32 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out) + ("…" if cut else "")


def id_ranges(values: Sequence[int], limit: int = 6) -> str:
    """Compress ints into runs: [1, 2, 3, 7, 8] -> "1–3, 7–8" (at most `limit` runs, then "…")."""
    if not values:
        return "—"
    runs: list[tuple[int, int]] = []
    start = prev = int(values[0])
    for v in values[1:]:
        v = int(v)
        if v == prev + 1:
            prev = v
            continue
        runs.append((start, prev))
        start = prev = v
    runs.append((start, prev))
    parts = [f"{a}" if a == b else f"{a}–{b}" for a, b in runs[:limit]]
    return ", ".join(parts) + (", …" if len(runs) > limit else "")


def ids_list(values: Sequence[int], limit: int = 8) -> str:
    """[1, 2, 3] with at most `limit` items, then the count of the rest."""
    shown = ", ".join(str(v) for v in values[:limit])
    rest = len(values) - limit
    return f"[{shown}{f', … +{rest}' if rest > 0 else ''}]"


def bar(fraction: float, width: int) -> str:
    """A horizontal bar `width` cells wide at full scale, with eighth-cell resolution."""
    fraction = 0.0 if not math.isfinite(fraction) else min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (BAR_CHARS[part] if part else "")).ljust(width)


def p_style(logprob: float | None, alt: bool = False) -> str:
    """The chip style of a token with this logprob (one band per probability range; `alt`: darker shade)."""
    if logprob is None or not math.isfinite(logprob):
        return UNKNOWN_P_STYLE[alt]
    p = math.exp(logprob)
    return next((dark if alt else light) for low, light, dark, _ in P_BANDS if p >= low)


def legend() -> Text:
    out = Text()
    for _, style, _, label in P_BANDS:
        out.append(f" {label} ", style)
    return out


def num(value: float | None, digits: int = 3) -> str:
    """A float with `digits` decimals, or — for None / NaN."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}f}"


def ms(value: float | None, show: bool = True) -> str:
    """Milliseconds from the trace; `show=False` hides them (deterministic snapshots of live runs)."""
    if not show:
        return "·"
    if value is None:
        return "—"
    return f"{value:.1f}"


def short_json(value: object, limit: int = 60) -> str:
    """A compact one-line JSON rendering of check inputs and evidence, cut to `limit` chars."""
    if isinstance(value, dict):
        text = " ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in value.items())
    else:
        text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def grid(headers: Sequence[str], rows: Sequence[Sequence[str]], caps: dict[int, int] | None = None,
         row_styles: Sequence[str | None] | None = None, gap: int = 1) -> Text:
    """A plain column layout as one Text: a bold header line, then one line per row.

    Much cheaper than a rich Table for large batches (no measuring pass). `caps[i]` limits column
    i's width; longer cells end in "…".
    """
    caps = caps or {}
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], min(len(cell), caps.get(i, 1 << 30)))
    sep = " " * gap
    out = Text(sep.join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), style="bold")
    for n, row in enumerate(rows):
        cells = [c if len(c) <= w else c[: w - 1] + "…" for c, w in zip(row, widths)]
        out.append("\n")
        out.append(sep.join(c.ljust(w) for c, w in zip(cells, widths)).rstrip(),
                   style=(row_styles[n] if row_styles else None) or "")
    return out


BRANCH_MARK = "⑂"  # marks a fork's branch point (a forced token, the fork in the status line)


def kernels_label(meta: dict) -> str | None:
    """`⚠ kernels=fast (not exact)` when the engine ran a non-exact numerics mode, else None."""
    from workbench.trace.diff import kernels_of

    kernels = kernels_of(meta)
    return None if kernels in (None, "exact") else f"⚠ kernels={kernels} (not exact)"


def fork_label(meta: dict) -> str | None:
    """`⑂ fork of parent.wbtrace at req-3:5 (forced 'x', set temperature=0)` for a fork trace, else None."""
    fork = meta.get("fork")
    if not isinstance(fork, dict):
        return None
    what = [f"forced {quote(fork.get('token_text'), 16)}"] if fork.get("token") is not None else []
    what += [f"set {k}={v}" for k, v in (fork.get("set") or {}).items()]
    parent = str(fork.get("parent", "?")).rsplit("/", 1)[-1]
    return f"{BRANCH_MARK} fork of {parent} at {fork.get('req_id')}:{fork.get('position')} ({', '.join(what)})"
