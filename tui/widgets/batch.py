"""The ForwardBatch pane: the schedule decision and every field of each forward batch of the step.

Owns: drawing the schedule line (queues, budget, KV use, chunks, preemptions), each ForwardBatch's
scalar fields, and per request its slice of the packed batch: pool index, prefix and extend
lengths, seq_len, positions, cache locations, input ids and their text, sampling info; KV
operations. Does not own loading the step (the screen's workers do).
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


def batch_header(fb: ForwardBatchBuilt, done: ForwardDone | None, show_times: bool) -> Text:
    model = getattr(fb, "model", "target")
    out = Text.assemble(("forward  ", "bold"), (fb.forward_mode, "bold magenta"), f" ({model})" if model != "target" else "",
                        f"  batch_size {fb.batch_size}  tokens {len(fb.input_ids)}"
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
