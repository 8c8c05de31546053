"""The reference column of the Tokens pane: what `workbench check` found for each output token.

Owns: the style of a checked token's chip (a real divergence in red, a near tie in yellow, a
sampled logprob beyond the tolerance in magenta, a flip inside a measured noise floor in cyan), the selected token's reference line (reference
logprob, Δ to the engine's, the reference's argmax, its top-2 margin, the token's rank under the
reference, the top-k divergence) and a table of the tokens around the selection with the reference
beside each. Reads the stored check only (workbench/trace/checks.py); does not compute it.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text

from tui.fmt import num, quote
from tui.stepview import RequestData
from workbench.trace.checks import position_map

VERDICT_STYLE = {"real": "bold white on red", "near_tie": "black on yellow", "logprob": "bold white on magenta",
                 "floor": "black on cyan"}
VERDICT_TEXT = {"ok": "✓ agrees", "real": "✗ real divergence", "near_tie": "≈ near tie",
                "logprob": "✗ logprob beyond tolerance", "floor": "≈ inside the engine's noise floor"}


def verdict_text(p: dict[str, Any]) -> str:
    """What a checked position's verdict means; a sampled token off the argmax can still agree."""
    verdict = str(p.get("verdict", "ok"))
    if verdict == "ok" and p.get("token_id") != p.get("ref_argmax"):
        return "✓ logprob agrees (sampled)"
    return VERDICT_TEXT.get(verdict, verdict)


def chip_style(data: RequestData, position: int) -> str | None:
    """The extra style of a token's chip when the check marked it (None: agrees, or not checked)."""
    p = position_map(data.check).get(position)
    return VERDICT_STYLE.get(p.get("verdict")) if p else None


def _signed(value: Any) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value:+.2e}"


def reference_line(data: RequestData, position: int) -> Text | None:
    """`reference  logprob … Δ … argmax … margin … rank … verdict` for one position, if checked."""
    if data.check is None:
        return None
    p = position_map(data.check).get(position)
    if p is None:
        note = data.check.get("note") or "not scored (past the last position the reference could read)"
        return Text(f"reference  {note}", style="dim")
    verdict = str(p.get("verdict", "ok"))
    kl = p.get("topk_kl")
    out = Text.assemble(("reference ", "bold"),
                        f" logprob {num(p.get('ref_logprob'))}  Δ {_signed(p.get('delta'))}"
                        f"  argmax {quote(str(p.get('ref_argmax_text', '')))} #{p.get('ref_argmax')}"
                        f"  margin {num(p.get('ref_margin'))}  rank {p.get('rank')}"
                        f"  top-k KL {num(kl, 4) if isinstance(kl, (int, float)) else '—'}  ")
    out.append(verdict_text(p), VERDICT_STYLE.get(verdict, "green"))
    return out


def reference_table(data: RequestData, selected: int | None, rows: int = 9) -> Text | None:
    """The tokens around the selection, the engine's logprob and the reference's beside each."""
    checked = position_map(data.check)
    if not checked:
        return None
    positions = [t.position for t in data.tokens]
    centre = positions.index(selected) if selected in positions else 0
    lo = max(0, min(centre - rows // 2, len(positions) - rows))
    out = Text(f"  {'pos':>4} {'token':<14} {'engine':>8} {'reference':>9} {'Δ':>9}  {'ref argmax':<14} verdict",
               style="bold", no_wrap=True)
    for tok in data.tokens[lo:lo + rows]:
        p = checked.get(tok.position)
        mark = "▸" if tok.position == selected else " "
        if p is None:
            out.append(f"\n{mark} {tok.position:>4} {quote(tok.text, 14):<14} {num(tok.logprob):>8} {'—':>9}")
            continue
        verdict = str(p.get("verdict", "ok"))
        out.append(f"\n{mark} {tok.position:>4} {quote(tok.text, 14):<14} {num(tok.logprob):>8} "
                   f"{num(p.get('ref_logprob')):>9} {_signed(p.get('delta')):>9}  "
                   f"{quote(str(p.get('ref_argmax_text', '')), 14):<14} ")
        out.append(verdict_text(p), VERDICT_STYLE.get(verdict, "green"))
    return out


def check_subtitle(data: RequestData) -> str:
    """` · check: 1 real, 2 near ties` (or ` · check: agrees`) for the pane's subtitle."""
    if data.check is None:
        return ""
    verdicts = [p.get("verdict") for p in data.check.get("positions", []) if isinstance(p, dict)]
    real = sum(v in ("real", "logprob") for v in verdicts)
    ties = sum(v == "near_tie" for v in verdicts)
    inside = sum(v == "floor" for v in verdicts)
    floor = f", {inside} inside the floor" if inside else ""
    return f" · check: {real} real, {ties} near ties{floor}" if real or ties or inside else " · check: agrees"


def client_timing_line(data: RequestData, show_times: bool = True) -> Text | None:
    """For a probed request: the client's TTFT, median gap and end-to-end, and the server's own
    timings when OTLP spans were joined (`server queue … prefill … decode …`)."""
    timings = data.finished.timings if data.finished is not None else None
    if not isinstance(timings, dict) or timings.get("clock") != "client":
        return None
    if not show_times:
        return Text("client   (times hidden)", style="dim")

    def ms(v: Any) -> str:
        return f"{1000 * v:.1f} ms" if isinstance(v, (int, float)) else "—"

    gaps = sorted(g for g in timings.get("itl") or [] if isinstance(g, (int, float)))
    out = Text.assemble(("client   ", "bold"), f"TTFT {ms(timings.get('ttft'))}  inter-token p50 "
                        f"{ms(gaps[len(gaps) // 2] if gaps else None)}  e2e {ms(timings.get('e2e'))}  "
                        f"chunks {timings.get('chunks', '—')}")
    server = timings.get("server")
    if isinstance(server, dict) and server:
        out.append("  server " + "  ".join(f"{k[:-2]} {ms(v)}" for k, v in server.items()), "cyan")
    else:
        out.append("  server timings not recorded (probe --otlp-port joins a server's spans)", "dim")
    return out
