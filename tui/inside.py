"""What the layers pane shows of one captured token, read from the trace in a worker thread.

Owns: `InsideView` (per residual entry: the logit lens's top tokens, the finally chosen token's
rank and probability, the residual norm, and the most attended positions with the text they point
at) and `load_inside`, which builds it from a `capture` event through the reader's methods
(workbench/trace/inside.py). A source without stored tensors (a live event stream) gives None.
Never imports torch or the engine; never touches a widget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from workbench.trace.events import Captured

TOP = 3  # lens tokens per layer
ATTENDED = 3  # positions per layer


@dataclass(frozen=True, slots=True)
class LayerRow:
    """One residual entry: `layer` -1 is the embeddings, i the residual after decoder layer i."""

    layer: int
    top: list[tuple[str, float]]  # the lens's top tokens and probabilities
    chosen_rank: int | None
    chosen_prob: float | None
    norm: float | None
    attended: list[tuple[int, str, float]] = field(default_factory=list)  # (position, text, weight)


@dataclass(frozen=True, slots=True)
class InsideView:
    req_id: str
    position: int
    token_id: int
    token_text: str
    kv_len: int
    what: list[str]
    rows: list[LayerRow]


def load_inside(source: Any, event: Captured, context: list[str]) -> InsideView | None:
    """The layers view of one capture (`context`: the text of each position the request attends)."""
    if not hasattr(source, "logit_lens"):
        return None
    req, pos = event.req_id or "", event.position
    lens = source.logit_lens(req, pos) if "lens_ids" in event.tensors else None
    norms = source.residual_norms(req, pos) if "norms" in event.tensors else None
    att = source.attention(req, pos) if "attention_entropy" in event.tensors else None
    entries = len(lens) if lens is not None else len(norms) if norms is not None else (
        att.num_layers + 1 if att is not None else 0)
    rows = []
    for i in range(entries):
        top, rank, prob = [], None, None
        if lens is not None:
            r = lens.iloc[i]
            top = [(t, math.exp(lp)) for t, lp in zip(r["top_texts"][:TOP], r["top_logprobs"][:TOP])]
            rank, prob = int(r["chosen_rank"]), float(r["chosen_prob"])
        attended = []
        if att is not None and i >= 1:
            attended = [(p, context[p] if p < len(context) else f"@{p}", w)
                        for p, w in att.top(layer=i - 1, k=ATTENDED)]
        rows.append(LayerRow(i - 1, top, rank, prob, float(norms[i]) if norms is not None else None, attended))
    text = lens.iloc[0]["chosen_text"] if lens is not None else (
        context[event.kv_len] if event.kv_len < len(context) else f"#{event.token_id}")
    return InsideView(req, pos, event.token_id, text, event.kv_len, list(event.what), rows)
