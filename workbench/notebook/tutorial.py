"""Helpers the tutorial notebooks call: tables and comparison figures over trace events.

Owns: the small analyses the notebooks show (one sampling stage's effect, the final distribution
under several settings, speculative acceptance by draft position and why drafts were rejected,
the detokenizer's state push by push, where two runs diverge). Inputs are trace events (or
anything with the same attributes, such as the detokenizer's `DetokUpdate`); outputs are pandas
frames and plotly figures. pandas is imported inside the functions that return frames.
Does not own: the viewer panels (figures.py) or running anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

from workbench.notebook.figures import HEIGHT, TEMPLATE, Vocab, shown_stages, stage_probs, token_label
from workbench.trace.events import SamplingStages, SpecVerify

if TYPE_CHECKING:
    import pandas as pd


def stage(stages: SamplingStages, name: str) -> dict[str, Any]:
    """One stage's record by name (ValueError naming the stages recorded)."""
    for record in stages.stages:
        if record.get("name") == name:
            return record
    raise ValueError(f"name must be one of {[s.get('name') for s in stages.stages]}, got {name!r}")


def final_distribution(stages: SamplingStages) -> dict[int, float]:
    """Token id -> probability in the distribution the token was drawn from (the last stage), top-k only."""
    last = stages.stages[-1]
    return {int(t): float(p) for t, p in zip(last.get("top_ids", []), last.get("top_probs", [])) if p > 0}


def stage_table(stages: SamplingStages, vocab: Vocab, top: int = 10) -> pd.DataFrame:
    """The top tokens' probability after each applied stage (one column per stage), with the kept
    count and mass of each stage as the last two rows."""
    import pandas as pd

    shown = shown_stages(stages)
    ids = [int(t) for t in shown[0].get("top_ids", [])[:top]]
    for record in shown[1:]:
        ids += [int(t) for t in record.get("top_ids", [])[:top] if int(t) not in ids]
    frame = pd.DataFrame({s["name"]: stage_probs(s, ids) for s in shown},
                         index=[token_label(t, vocab) for t in ids])
    frame.loc["(tokens kept)"] = [s.get("kept_count") for s in shown]
    frame.loc["(mass kept)"] = [s.get("kept_mass") for s in shown]
    return frame


def compare_figure(by_label: Mapping[str, SamplingStages], vocab: Vocab, top: int = 10) -> go.Figure:
    """The final distribution of one position under several settings, side by side (one bar group
    per token, one colour per setting); tokens are the first setting's top ones."""
    if not by_label:
        raise ValueError("by_label must name at least one setting")
    first = next(iter(by_label.values()))
    ids = [int(t) for t in shown_stages(first)[0].get("top_ids", [])[:top]]
    fig = go.Figure(layout={"template": TEMPLATE})
    for label, stages in by_label.items():
        dist = final_distribution(stages)
        kept = stages.stages[-1].get("kept_count")
        fig.add_trace(go.Bar(name=f"{label} (kept {kept:,})" if kept is not None else label,
                             x=[token_label(t, vocab) for t in ids], y=[dist.get(t, 0.0) for t in ids]))
    fig.update_layout(title="the distribution sampled from, under each setting", barmode="group",
                      height=HEIGHT + 60, yaxis_title="probability",
                      legend={"orientation": "h", "y": -0.2})
    return fig


# --- speculative decoding --------------------------------------------------------------------


def acceptance_by_position(verifies: Iterable[SpecVerify]) -> pd.DataFrame:
    """Per draft position: how many drafts reached it, how many were accepted, and the rate.

    A draft at position i counts as proposed whether or not an earlier one was rejected (it was
    computed and verified); it is accepted only if every draft before it was."""
    import pandas as pd

    proposed: dict[int, int] = {}
    accepted: dict[int, int] = {}
    for v in verifies:
        for i in range(len(v.draft_tokens)):
            proposed[i] = proposed.get(i, 0) + 1
            accepted[i] = accepted.get(i, 0) + int(i < v.num_accepted)
    rows = [(i, proposed[i], accepted[i], accepted[i] / proposed[i]) for i in sorted(proposed)]
    return pd.DataFrame(rows, columns=["position", "proposed", "accepted", "rate"])


def acceptance_figure(table: pd.DataFrame) -> go.Figure:
    """Acceptance rate by draft position (from `acceptance_by_position`)."""
    fig = go.Figure(layout={"template": TEMPLATE})
    fig.add_trace(go.Bar(name="acceptance", x=list(table["position"]), y=list(table["rate"]),
                           text=[f"{a}/{p}" for a, p in zip(table["accepted"], table["proposed"])],
                           textposition="outside", marker_color="#2ca02c"))
    fig.update_layout(title="acceptance rate by draft position", height=HEIGHT,
                      xaxis={"title": "draft position", "dtick": 1},
                      yaxis={"title": "accepted / proposed", "range": [0, 1.15]})
    return fig


def rejections(verifies: Iterable[SpecVerify], vocab: Vocab) -> pd.DataFrame:
    """Every rejected draft: where, what was drafted, what the target wanted instead, and p, q, u.

    Greedy verification rejects a draft the target's argmax disagrees with; sampled verification
    rejects when u >= p/q (the target gives the draft less probability than the drafter did)."""
    import pandas as pd

    rows = []
    for v in verifies:
        i = v.num_accepted
        if i >= len(v.draft_tokens):
            continue
        wanted = v.target_argmax[i] if v.greedy and i < len(v.target_argmax) else v.extra_token
        rows.append({"step": v.step, "draft position": i, "drafted": token_label(v.draft_tokens[i], vocab),
                     "target chose": token_label(wanted, vocab) if wanted is not None else None,
                     "p (target)": _at(v.p, i), "q (drafter)": _at(v.q, i), "u": _at(v.u, i),
                     "rule": "argmax differs" if v.greedy else "u >= p/q"})
    return pd.DataFrame(rows, columns=["step", "draft position", "drafted", "target chose", "p (target)",
                                       "q (drafter)", "u", "rule"])


def _at(values: Sequence[Any], i: int) -> Any:
    return values[i] if i < len(values) else None


# --- detokenizer -----------------------------------------------------------------------------


def detok_table(updates: Iterable[Any], tokenizer: Any = None) -> pd.DataFrame:
    """The detokenizer push by push: the ids it got, what it emitted, what it held back and why.

    `updates`: `DetokState` events or `DetokUpdate`s (anything with `new_ids, delta, held_text,
    held_reason, stop_matched`). With a tokenizer, two more columns: the tokens, and each push's ids
    decoded on their own (what a naive streamer would print)."""
    import pandas as pd

    rows = []
    for u in updates:
        row: dict[str, Any] = {"step": getattr(u, "step", None), "ids": list(u.new_ids)}
        if tokenizer is not None:
            row["tokens"] = tokenizer.convert_ids_to_tokens(list(u.new_ids))
            row["decoded alone"] = tokenizer.decode(list(u.new_ids))
        row.update({"emitted": u.delta, "held back": u.held_text, "why held": u.held_reason,
                    "stop matched": u.stop_matched})
        rows.append(row)
    frame = pd.DataFrame(rows)
    return frame.drop(columns=["step"]) if frame.empty or frame["step"].isna().all() else frame


# --- diff --------------------------------------------------------------------------------------


def divergence_figure(positions: Sequence[Any], title: str = "") -> go.Figure:
    """Logprob delta and KL per output position of one request in two runs, the first divergence marked.

    `positions`: the diff's per-position records (`position, token_a, token_b, text_a, text_b,
    logprob_delta, kl`)."""
    xs = [p.position for p in positions]
    fig = go.Figure(layout={"template": TEMPLATE})
    fig.add_trace(go.Scatter(name="|logprob delta|", x=xs, mode="lines+markers",
                             y=[abs(p.logprob_delta) if p.logprob_delta is not None else None for p in positions]))
    fig.add_trace(go.Scatter(name="KL(a || b) over top-k", x=xs, mode="lines+markers",
                             y=[p.kl for p in positions]))
    first = next((p for p in positions if p.token_a != p.token_b), None)
    if first is not None:
        fig.add_vline(x=first.position, line_dash="dot", line_color="#d62728")
        fig.add_annotation(x=first.position, y=1, yref="paper", showarrow=False, yanchor="bottom",
                           text=f"first divergence: {first.text_a!r} vs {first.text_b!r}")
    fig.update_layout(title=title or "where the two runs differ", height=HEIGHT,
                      xaxis_title="output position", yaxis={"type": "log", "title": "size"},
                      legend={"orientation": "h", "y": -0.25})
    return fig
