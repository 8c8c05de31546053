"""The ForwardBatch pane: the schedule decision and every field of each forward batch of the step.

Owns: drawing the schedule line (queues, budget, KV use, chunks, preemptions), each ForwardBatch's
scalar fields, and per request its slice of the packed batch: pool index, prefix and extend
lengths, seq_len, positions, cache locations, input ids and their text, sampling info; KV
operations; which attention each layer ran (full or sliding window, soft-cap, sinks, scaling).
Does not own loading the step (the screen's workers do).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from tui.fmt import grid, id_ranges, ids_list, ms, quote, short_json
from tui.stepview import StepView
from tui.vocab import Vocab
from tui.widgets.base import Pane, PaneContext
from workbench.trace.events import ForwardBatchBuilt, ForwardDone, ScheduleDecision


def slices(fb: ForwardBatchBuilt) -> list[tuple[int, int]]:
    """(start, length) of each request's tokens in the packed `input_ids`."""
    n, bs = len(fb.input_ids), max(fb.batch_size, len(fb.req_ids), 1)
    lengths = list(fb.extend_seq_lens) if len(fb.extend_seq_lens) == bs else [n // bs] * bs
    out, start = [], 0
    for length in lengths:
        out.append((start, int(length)))
        start += int(length)
    return out


def schedule_text(s: ScheduleDecision) -> Text:
    pct = f" ({100 * s.kv_used / s.kv_total:.1f}%)" if s.kv_total else ""
    out = Text.assemble(("schedule ", "bold"), (s.mode, "bold cyan"),
                        f"  budget {s.token_budget}  scheduled {s.tokens_scheduled}  waiting {len(s.waiting)}"
                        f"  running {len(s.running)}  KV {s.kv_used}/{s.kv_total}{pct}\n")
    chunks = " ".join(f"{c.get('req_id')}[{c.get('start')}:{c.get('start', 0) + c.get('length', 0)}]"
                      + ("" if c.get("last_chunk", True) else "…") for c in s.prefill)
    out.append(f"         prefill {chunks or '—'}  decode {' '.join(s.decode) or '—'}")
    if s.preempted:
        out.append(f"  preempted {' '.join(s.preempted)}", "bold red")
    if s.rejected:
        out.append("  rejected " + " ".join(f"{r.get('req_id')} ({r.get('reason')})" for r in s.rejected), "red")
    return out


def _forward_of(fb: ForwardBatchBuilt, forwards: list[ForwardDone]) -> ForwardDone | None:
    model = getattr(fb, "model", "target")  # schema 1 files written before the field existed lack it
    return next((f for f in forwards if f.forward_mode == fb.forward_mode and f.model == model), None)


def _requests(fb: ForwardBatchBuilt) -> int:
    """Requests in the batch, as the Steps table counts them (a verify packs k+1 rows per request)."""
    return len(set(fb.req_ids)) if fb.req_ids else fb.batch_size


def _rows(fb: ForwardBatchBuilt) -> str:
    return f" ({fb.batch_size} rows)" if fb.batch_size != _requests(fb) else ""


def batch_header(fb: ForwardBatchBuilt, done: ForwardDone | None, show_times: bool) -> Text:
    model = getattr(fb, "model", "target")
    out = Text.assemble(("forward  ", "bold"), (fb.forward_mode, "bold magenta"), f" ({model})" if model != "target" else "",
                        f"  batch_size {_requests(fb)}{_rows(fb)}  tokens {len(fb.input_ids)}"
                        f"  return_logprob {str(fb.return_logprob).lower()}  top_logprobs_nums {ids_list(fb.top_logprobs_nums, 4)}")
    if done is not None:
        out.append(f"  {ms(done.forward_ms, show_times)} ms + sample {ms(done.sample_ms, show_times)} ms")
    return out


_COLUMNS = ("req", "pool", "prefix", "extend", "seq_len", "positions", "cache_loc", "input_ids", "text")
_CAPS = {7: 26, 8: 34}  # input_ids, text


def batch_table(fb: ForwardBatchBuilt, vocab: Vocab, selected: str | None) -> Text:
    """One row per request: its slice of every per-token and per-request field."""
    rows, styles = [], []
    for i, (start, length) in enumerate(slices(fb)):
        rid = fb.req_ids[i] if i < len(fb.req_ids) else f"#{i}"
        ids = fb.input_ids[start:start + length]
        text = vocab.decode(ids)
        rows.append([
            rid, _get(fb.req_pool_indices, i), _get(fb.extend_prefix_lens, i), str(length), _get(fb.seq_lens, i),
            id_ranges(fb.positions[start:start + length], 2), id_ranges(fb.out_cache_loc[start:start + length], 2),
            ids_list(ids, 3), quote(text, 34, middle=True) if text is not None else "?"])
        styles.append("reverse" if rid == selected else None)
    return grid(_COLUMNS, rows, _CAPS, styles)


def sampling_text(fb: ForwardBatchBuilt) -> Text | None:
    """The per-request sampling_info summary, one `req: k=v ...` group per request."""
    if not fb.sampling_info:
        return None
    parts = [f"{fb.req_ids[i] if i < len(fb.req_ids) else i}: {short_json(info, 48)}"
             for i, info in enumerate(fb.sampling_info)]
    return Text.assemble(("sampling ", "bold"), " · ".join(parts))


def attention_label(layer: dict) -> str:
    """One layer's attention, e.g. `window 32 · softcap 10 · sinks · scale 0.204`."""
    parts = [f"window {layer['window']}" if layer.get("window") else "full"]
    if layer.get("softcap") is not None:
        parts.append(f"softcap {layer['softcap']:g}")
    if layer.get("sinks"):
        parts.append("sinks")
    if layer.get("scaling") is not None:
        parts.append(f"scale {layer['scaling']:.3g}")
    return " · ".join(parts)


def _layer_set(layers: list[int]) -> str:
    """`0–3`, `0, 2, 4` or, for a long alternating pattern, `0–46 step 2`."""
    steps = {b - a for a, b in zip(layers, layers[1:])}
    if len(layers) > 3 and len(steps) == 1 and steps != {1}:
        return f"{layers[0]}–{layers[-1]} step {steps.pop()}"
    return id_ranges(layers, 4)


def attention_text(fb: ForwardBatchBuilt) -> Text | None:
    """The layers of each attention variant: `attention  layers 0 window 32 · … | layers 1 full · …`."""
    layers = getattr(fb, "attention", None) or []  # files written before the field existed lack it
    groups: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        groups.setdefault(attention_label(layer), []).append(i)
    if not groups:
        return None
    parts = [f"layers {_layer_set(idx)} {label}" for label, idx in groups.items()]
    return Text.assemble(("attention ", "bold"), "  |  ".join(parts))


def _get(values: list, i: int) -> str:
    return str(values[i]) if i < len(values) else "—"


def kv_text(view: StepView) -> Text | None:
    ops = list(view.kv) + [e for r in view.reqs.values() for e in r.kv]
    if not ops:
        return None
    parts = [f"{e.op} {len(e.slots)} slots ({id_ranges(e.slots, 2)})" + (f" {e.req_id}" if e.req_id else "")
             + (f" [{e.reason}]" if e.reason else "") for e in ops]
    return Text.assemble(("kv       ", "bold"), "; ".join(parts))


def draw_batch(ctx: PaneContext) -> RenderableType:
    view = ctx.view
    if view is None:
        return Text("loading…", style="dim")
    parts: list[RenderableType] = []
    if view.schedule is not None:
        parts.append(schedule_text(view.schedule))
    if not view.batches:
        parts.append(Text("no forward batch in this step", style="dim"))
    for fb in view.batches:
        parts.append(batch_header(fb, _forward_of(fb, view.forwards), ctx.show_times))
        parts.append(batch_table(fb, ctx.vocab, ctx.selection.req_id))
        attn = attention_text(fb)
        if attn is not None:
            parts.append(attn)
        info = sampling_text(fb)
        if info is not None:
            parts.append(info)
    kv = kv_text(view)
    if kv is not None:
        parts.append(kv)
    for err in view.errors:
        parts.append(Text(f"error: {err.message} (ended {', '.join(err.affected) or 'no request'})", style="bold red"))
    return Group(*parts)


class BatchPane(Pane):
    TITLE = "ForwardBatch"
    RECORDS = ("schedule", "forward_batch", "forward", "kv")
    WIDE = True

    def draw(self, ctx: PaneContext) -> RenderableType:
        return draw_batch(ctx)

    def subtitle(self, ctx: PaneContext) -> str:
        if ctx.view is None:
            return ""
        external = "forward" in ctx.not_recorded and not ctx.view.batches  # a received chunk, not a batch
        return f"step {ctx.view.step} · {'chunk' if external else ctx.view.mode}"
