"""The terminal table of a bisect row (trace/bisect_store.py's payload): per layer the error it adds,
the error it carries on, the total, its floor, and the sub-block that adds most; the first layer
over its floor named above the table. Reads the stored row, so the same text renders a stored result.
"""

from __future__ import annotations

from typing import Any

from workbench.trace.bisect_store import BLOCK_LABEL


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


def format_result(row: dict[str, Any], seconds: float | None = None) -> str:
    rp, sp = row["reference_pick"], row["suspect_pick"]
    context = row.get("kind") == "context"
    lines = [f"bisect {row['req_id']}:{row['position']}: {row['reference']} vs {row['against']}"]
    lines.append(f"  reference picks {rp['text']!r} (logprob {rp['logprob']:.4f}, top-2 margin {rp['margin']:.4f}); "
                 f"suspect picks {sp['text']!r} (logprob {sp['logprob']:.4f}, margin {sp['margin']:.4f})")
    if row.get("first_layer") is not None:
        lines.append(f"  first layer over its floor (ratio > {row['factor']:g}): layer {row['first_layer']}, "
                     f"{BLOCK_LABEL.get(row['first_block'], row['first_block'])}")
    else:
        worst = max(row["layers"], key=lambda x: x["ratio"] or 0.0, default=None)
        lines.append(f"  no layer adds more than {row['factor']:g}x its floor"
                     + (f" (largest: layer {worst['layer']}, {_num(worst['ratio'])}x)" if worst else ""))
    if row.get("note"):
        lines.append(f"  {row['note']}")
    lines.append(f"  embeddings differ by {_num(row['embed_error'])}")
    added = "growth" if context else "added"
    head = f"  {'layer':>5}  {added:>9}  {'carried':>9}  {'total':>9}  {'floor':>9}  {added + '/floor':>11}  worst sub-block"
    lines += [head, "  " + "-" * (len(head) - 2)]
    for x in row["layers"]:
        blocks = [b for b in x["blocks"] if b["ratio"] is not None]
        worst = max(blocks, key=lambda b: b["ratio"], default=None)
        mark = " <" if x["layer"] == row.get("first_layer") else ""
        where = f"{BLOCK_LABEL.get(worst['block'], worst['block'])} {_num(worst['ratio'])}x" if worst else ""
        lines.append(f"  {x['layer']:>5}  {_num(x['added']):>9}  {_num(x['propagated']):>9}  {_num(x['total']):>9}  "
                     f"{_num(x['floor']):>9}  {_num(x['ratio']):>11}  {where}{mark}")
    if context:
        lines.append("  both runs through the engine's scheduler, tokens forced: the reference alone and in the context; "
                     "total: the difference of their residuals after the layer; growth: how much the layer grew it; "
                     "floor: one float32 rounding of the layer's output (L2 over the hidden vector of the deciding "
                     "row; a layer cannot be re-run inside a batch, so added and carried are not separated)")
    else:
        lines.append("  added: this layer in the suspect numerics on the reference's input; carried: the reference "
                     "layer on the suspect's input; floor: one rounding of the suspect's dtype at the input and output "
                     "(L2 over the hidden vector of the deciding row)")
    if seconds is not None:
        lines.append(f"  ({seconds:.1f} s)")
    return "\n".join(lines)
