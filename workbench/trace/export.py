"""Exports of a trace to other tools: Chrome/Perfetto trace JSON and per-token tables.

Owns: `export_perfetto` (Trace Event Format: an engine process with a "steps" lane of step slices,
one lane per request with queued/prefill/decode spans, counters for batch size, KV usage and
speculative acceptance) and `export_tokens` (one row per generated token, Parquet or CSV by suffix).
Reads through `reader.Trace` only; does not own the file layout or the event schema.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.trace.events import RequestAdded, RequestFinished, TokenChosen
from workbench.trace.format import shown_mode
from workbench.trace.reader import StepInfo, Trace, open_trace

ENGINE_PID = 1
STEPS_TID = 0


@dataclass(slots=True)
class _ReqTimes:
    """When one request arrived, was first scheduled, got its first token, and ended (seconds)."""

    added: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None


def export_perfetto(trace: Trace | str | os.PathLike[str], out_path: str | os.PathLike[str]) -> Path:
    """Write the trace as Chrome/Perfetto Trace Event Format JSON (open it in ui.perfetto.dev)."""
    if not isinstance(trace, Trace):
        with open_trace(trace) as opened:
            return export_perfetto(opened, out_path)
    steps = trace.steps()
    reqs = _request_times(trace, steps)
    starts = [s.t_start for s in steps if s.t_start is not None]
    starts += [r.added for r in reqs.values() if r.added is not None]
    t0 = min(starts, default=0.0)
    events = _metadata(trace, list(reqs))
    events += _step_slices(steps, t0)
    events += _counters(steps, t0)
    for tid, (req_id, times) in enumerate(reqs.items(), start=1):
        events += _request_spans(req_id, tid, times, t0)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"source": trace.name, "schema_version": str(trace.schema_version)}}
    out = Path(out_path)
    out.write_text(json.dumps(doc, separators=(",", ":"), allow_nan=False))
    return out


def export_tokens(trace: Trace | str | os.PathLike[str], out_path: str | os.PathLike[str]) -> int:
    """Write one row per generated token to `.parquet` or `.csv` (by suffix); return the row count."""
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in (".parquet", ".csv"):
        raise ValueError(f"token export path must end in .parquet or .csv, got {out.name!r}")
    if not isinstance(trace, Trace):
        with open_trace(trace) as opened:
            return export_tokens(opened, out_path)
    frame = trace.tokens_frame()
    if suffix == ".parquet":
        frame.to_parquet(out, index=False)
    else:
        frame.to_csv(out, index=False)
    return len(frame)


# --- building blocks --------------------------------------------------------------------------------


def _us(t: float, t0: float) -> int:
    """Seconds on the engine clock to integer microseconds since the trace start (exact nesting)."""
    return int(round((t - t0) * 1e6))


def _num(value: Any) -> float | int:
    """A finite number for counter args and JSON (Perfetto rejects NaN/Infinity)."""
    if isinstance(value, bool) or value is None:
        return int(bool(value))
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else 0.0


def _metadata(trace: Trace, req_ids: list[str]) -> list[dict[str, Any]]:
    model = trace.meta.get("model")
    name = model.get("name") if isinstance(model, dict) else model
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": ENGINE_PID, "tid": STEPS_TID,
         "args": {"name": f"workbench engine ({name})" if name else "workbench engine"}},
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": ENGINE_PID, "tid": STEPS_TID, "args": {"name": "steps"}},
        {"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": ENGINE_PID, "tid": STEPS_TID,
         "args": {"sort_index": 0}},
    ]
    for tid, req_id in enumerate(req_ids, start=1):
        events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": ENGINE_PID, "tid": tid,
                       "args": {"name": f"request {req_id}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": ENGINE_PID, "tid": tid,
                       "args": {"sort_index": tid}})
    return events


def _step_slices(steps: list[StepInfo], t0: float) -> list[dict[str, Any]]:
    """One X slice per step on the steps lane; each ends no later than the next one starts."""
    out = []
    for i, s in enumerate(steps):
        if s.t_start is None:
            continue
        start = _us(s.t_start, t0)
        end = _us(max(s.t_end or s.t_start, s.t_start + s.forward_ms / 1000.0), t0)
        following = next((n.t_start for n in steps[i + 1:] if n.t_start is not None), None)
        if following is not None:
            end = min(end, _us(following, t0))
        out.append({"name": shown_mode(s.mode, s.spec_proposed) or "step", "cat": "step", "ph": "X", "ts": start, "dur": max(end - start, 0),
                    "pid": ENGINE_PID, "tid": STEPS_TID,
                    "args": {"step": s.step, "batch_size": s.batch_size, "num_tokens": s.num_tokens,
                             "output_tokens": s.output_tokens, "forward_ms": _num(s.forward_ms),
                             "req_ids": list(s.req_ids)}})
    return out


def _counters(steps: list[StepInfo], t0: float) -> list[dict[str, Any]]:
    out = []
    for s in steps:
        if s.t_start is None:
            continue
        base = {"ph": "C", "ts": _us(s.t_start, t0), "pid": ENGINE_PID, "tid": STEPS_TID}
        out.append({**base, "name": "batch", "args": {"batch_size": s.batch_size, "num_tokens": s.num_tokens}})
        if s.kv_used is not None:
            used = _num(s.kv_used)
            free = max(_num(s.kv_total) - used, 0) if s.kv_total is not None else 0
            out.append({**base, "name": "kv_cache", "args": {"used": used, "free": free}})
        if s.spec_proposed > 0:
            out.append({**base, "name": "spec_acceptance",
                        "args": {"rate": round(s.spec_accepted / s.spec_proposed, 6)}})
    return out


def _request_times(trace: Trace, steps: list[StepInfo]) -> dict[str, _ReqTimes]:
    """Arrival, first scheduling, first token and end of every request, in arrival order."""
    reqs: dict[str, _ReqTimes] = {}
    for event in trace.events(kind=["request.added", "token", "request.finished"]):
        if event.req_id is None:
            continue
        r = reqs.setdefault(event.req_id, _ReqTimes())
        r.last = event.t if r.last is None else max(r.last, event.t)
        if isinstance(event, RequestAdded):
            r.added, r.prompt_tokens = event.t, len(event.prompt_ids)
        elif isinstance(event, TokenChosen):
            r.output_tokens += 1
            r.first_token = event.t if r.first_token is None else min(r.first_token, event.t)
        elif isinstance(event, RequestFinished):
            r.finished, r.finish_reason = event.t, event.finish_reason
    for s in steps:
        for req_id in s.req_ids:
            r = reqs.get(req_id)
            if r is not None and r.scheduled is None and s.t_start is not None:
                r.scheduled = s.t_start
    return reqs


def _request_spans(req_id: str, tid: int, r: _ReqTimes, t0: float) -> list[dict[str, Any]]:
    """A request slice enclosing its queued, prefill and decode slices (clamped to nest exactly)."""
    known = [t for t in (r.added, r.scheduled, r.first_token, r.last, r.finished) if t is not None]
    if not known:
        return []
    begin, end = min(known), max(known)
    sched = min(max(r.scheduled if r.scheduled is not None else begin, begin), end)
    first = min(max(r.first_token if r.first_token is not None else end, sched), end)
    marks = [_us(t, t0) for t in (begin, sched, first, end)]
    args = {"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "finish_reason": r.finish_reason or ("unfinished" if r.finished is None else None)}
    common = {"ph": "X", "pid": ENGINE_PID, "tid": tid, "cat": "request"}
    out = [{**common, "name": req_id, "ts": marks[0], "dur": marks[3] - marks[0], "args": args}]
    for name, a, b in (("queued", marks[0], marks[1]), ("prefill", marks[1], marks[2]),
                       ("decode", marks[2], marks[3])):
        if b > a:
            out.append({**common, "name": name, "ts": a, "dur": b - a, "args": {}})
    return out
