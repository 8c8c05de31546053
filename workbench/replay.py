"""Replay: re-execute a recorded trace and name the first step where anything differs.

Owns: rebuilding an engine from a trace's meta (refusing a model whose content hash differs),
re-submitting the recorded requests at their recorded arrival steps, and comparing every step's
events with the recording, stage by stage: batch composition (schedule, forward_batch), tokens and
logprobs (within a tolerance), detokenizer output and finish decisions. Stands above `trace/`
because it needs the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from workbench.trace import events as ev
from workbench.trace.reader import Trace, open_trace

# What is compared at each stage, per event kind: the payload fields that must be equal.
STAGES: list[tuple[str, str, tuple[str, ...]]] = [
    ("schedule", "schedule", ("mode", "prefill", "decode", "preempted")),
    ("forward_batch", "forward_batch", ("forward_mode", "req_ids", "input_ids", "positions", "seq_lens",
                                         "extend_prefix_lens", "extend_seq_lens", "out_cache_loc")),
    ("spec.draft", "spec.draft", ("tokens",)),
    ("spec.verify", "spec.verify", ("accepted", "extra_token")),
    ("token", "token", ("token_id",)),
    ("detok", "detok", ("delta", "held_text", "stop_matched")),
    ("finish", "finish", ("finish_reason",)),
]


@dataclass(slots=True)
class Divergence:
    step: int
    req_id: str | None
    stage: str
    field: str
    recorded: Any
    replayed: Any
    near_tie: bool | None = None
    recorded_top: list[Any] = field(default_factory=list)
    replayed_top: list[Any] = field(default_factory=list)
    margin: float | None = None

    def describe(self) -> str:
        who = f", request {self.req_id}" if self.req_id else ""
        lines = [f"first divergence at step {self.step}{who}, stage {self.stage!r} (field {self.field!r})",
                 f"  recorded: {_short(self.recorded)}", f"  replayed: {_short(self.replayed)}"]
        if self.recorded_top or self.replayed_top:
            lines.append(f"  recorded top-k: {_fmt_top(self.recorded_top)}")
            lines.append(f"  replayed top-k: {_fmt_top(self.replayed_top)}")
        if self.near_tie is not None:
            kind = "a near tie" if self.near_tie else "a real difference"
            lines.append(f"  verdict: {kind} (recorded top-2 margin {self.margin:.3g})")
        return "\n".join(lines)


@dataclass(slots=True)
class ReplayReport:
    steps_compared: int
    tokens_compared: int
    max_logprob_delta: float
    divergence: Divergence | None
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return self.divergence is None


def _short(x: Any, n: int = 160) -> str:
    s = json.dumps(x, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def _fmt_top(top: list[Any]) -> str:
    return ", ".join(f"{t[2]!r}:{t[1]:.3f}" if len(t) > 2 else f"{t[0]}:{t[1]:.3f}" for t in top[:5])


def _apply_overrides(requests: list[dict], engine_cfg: dict, overrides: list[str]) -> None:
    """`REQ:FIELD=VALUE` changes a request's sampling parameter; `engine.FIELD=VALUE` the engine."""
    for item in overrides:
        target, _, assignment = item.partition(":") if not item.startswith("engine.") else ("engine", "", item[7:])
        key, eq, raw = assignment.partition("=")
        if not eq or not key:
            raise ValueError(f"override {item!r}: expected REQ:FIELD=VALUE or engine.FIELD=VALUE")
        value = json.loads(raw) if raw not in ("",) else raw
        if target == "engine":
            if key not in engine_cfg:
                raise ValueError(f"override: unknown engine field {key!r}; one of {sorted(engine_cfg)}")
            engine_cfg[key] = value
            continue
        matched = [r for r in requests if r["req_id"] == target or r.get("parent_id") == target]
        if not matched:
            raise ValueError(f"override: no recorded request {target!r}")
        for r in matched:
            r["params"][key] = value


def _recorded_requests(trace: Trace) -> list[dict[str, Any]]:
    out = []
    for e in trace.events(kind="request.added"):
        out.append({"req_id": e.req_id, "step": e.step, "prompt_ids": e.prompt_ids, "params": dict(e.params),
                    "parent_id": e.parent_id})
    return out


def _build_engine(trace: Trace, engine_cfg: dict, device: str | None):
    from workbench.engine.engine import Engine
    from workbench.models.loader import load_model
    from workbench.trace.recorder import MemorySink

    model_meta = trace.meta.get("model") or {}
    spec = model_meta.get("spec") or engine_cfg.get("model")
    loaded = load_model(spec, device=device or model_meta.get("device", "cpu"), dtype=model_meta.get("dtype"))
    if model_meta.get("hash") and loaded.content_hash != model_meta["hash"]:
        raise ValueError(f"model {spec!r} has content hash {loaded.content_hash}, but the trace was recorded with "
                         f"{model_meta['hash']}: refusing to replay against a different model")
    sink = MemorySink()
    keys = ("max_batch_tokens", "chunk_size", "kv_tokens", "max_running", "enable_mixed", "trace_topk", "seed", "spec",
            "prefix_sharing", "prefix_cache")
    kwargs = {k: engine_cfg[k] for k in keys if k in engine_cfg}
    kwargs.setdefault("prefix_sharing", False)  # traces from before it existed ran without it
    engine = Engine(loaded, trace_level=trace.meta.get("trace_level", "summary"), trace_sinks=[sink], **kwargs)
    return engine, sink


def _submit(engine, reqs: list[dict]) -> None:
    from workbench.engine.sample.sampling_params import SamplingParams

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in reqs:
        groups[r["parent_id"] or r["req_id"]].append(r)
    for base, group in groups.items():
        params = SamplingParams.from_dict(group[0]["params"])
        engine.add_request(list(group[0]["prompt_ids"]), params, req_id=base)


def _index(events: list[ev.Event]) -> dict[tuple[str, str | None], list[ev.Event]]:
    idx: dict[tuple[str, str | None], list[ev.Event]] = defaultdict(list)
    for e in events:
        idx[(e.kind, e.req_id)].append(e)
    return idx


def compare_step(step: int, recorded: list[ev.Event], replayed: list[ev.Event], tolerance: float
                 ) -> tuple[Divergence | None, int, float]:
    """Compare one step's events stage by stage; return the first divergence, tokens compared, max |dlogprob|."""
    a, b = _index(recorded), _index(replayed)
    req_ids = sorted({k[1] for k in a} | {k[1] for k in b}, key=lambda x: (x is not None, x or ""))
    tokens, max_delta = 0, 0.0
    for stage, kind, fields in STAGES:
        for rid in req_ids:
            ra, rb = a.get((kind, rid), []), b.get((kind, rid), [])
            if len(ra) != len(rb):
                return Divergence(step, rid, stage, "count", len(ra), len(rb)), tokens, max_delta
            for ea, eb in zip(ra, rb):
                for f in fields:
                    va, vb = getattr(ea, f), getattr(eb, f)
                    if va != vb:
                        return _divergence(step, rid, stage, f, va, vb, a, b, tolerance), tokens, max_delta
                if kind == "token":
                    tokens += 1
                    if ea.logprob is not None and eb.logprob is not None:
                        delta = abs(ea.logprob - eb.logprob)
                        max_delta = max(max_delta, delta)
                        if delta > tolerance:
                            return (_divergence(step, rid, stage, "logprob", ea.logprob, eb.logprob, a, b, tolerance),
                                    tokens, max_delta)
    return None, tokens, max_delta


def _divergence(step, rid, stage, f, va, vb, a, b, tolerance) -> Divergence:
    d = Divergence(step, rid, stage, f, va, vb)
    ta, tb = a.get(("token", rid)), b.get(("token", rid))
    if ta or tb:
        d.recorded_top = list(ta[0].top_logprobs) if ta else []
        d.replayed_top = list(tb[0].top_logprobs) if tb else []
        top = d.recorded_top
        if len(top) >= 2 and top[0][1] is not None and top[1][1] is not None:
            d.margin = float(top[0][1] - top[1][1])
            d.near_tie = d.margin < tolerance
    return d


def replay(path: str, *, overrides: list[str] | None = None, tolerance: float = 1e-3, device: str | None = None,
           progress: bool = True) -> ReplayReport:
    import time

    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    with open_trace(path) as trace:
        if trace.meta.get("source") == "external":  # no engine config or steps of ours to re-run
            raise ValueError(f"trace {path!r} was recorded from an external server by workbench probe; "
                             "score it with: workbench check TRACE --reference MODEL")
        engine_cfg = dict(trace.meta.get("engine") or {})
        requests = _recorded_requests(trace)
        if not requests:
            raise ValueError(f"trace {path!r} records no requests: nothing to replay")
        _apply_overrides(requests, engine_cfg, overrides or [])
        engine, sink = _build_engine(trace, engine_cfg, device)
        pending = sorted(requests, key=lambda r: r["step"])
        num_steps = trace.num_steps
        bar = tqdm(total=num_steps, disable=not progress, desc="replaying", unit="step")
        compared = tokens = 0
        max_delta = 0.0
        divergence = None
        while pending or engine.has_work():
            due = [r for r in pending if r["step"] <= engine.step_no + 1]
            if not due and not engine.has_work():  # an idle engine does not count steps: next arrivals now
                due = [r for r in pending if r["step"] == pending[0]["step"]]
            if due:
                pending = [r for r in pending if r not in due]
                _submit(engine, due)
            sink.events.clear()
            engine.step()
            step = engine.step_no
            recorded = [e for e in trace.step(step) if e.kind != "request.added"]
            replayed = [e for e in sink.events if e.step == step and e.kind != "request.added"]
            divergence, n, delta = compare_step(step, recorded, replayed, tolerance)
            compared, tokens, max_delta = compared + 1, tokens + n, max(max_delta, delta)
            bar.update(1)
            if divergence is not None:
                break
        if divergence is None and engine.step_no != num_steps:
            divergence = Divergence(engine.step_no, None, "steps", "num_steps", num_steps, engine.step_no)
        bar.close()
        engine.close()
    return ReplayReport(compared, tokens, max_delta, divergence, time.perf_counter() - t0)


def main(args: argparse.Namespace) -> int:
    report = replay(args.trace, overrides=args.override, tolerance=args.tolerance, device=args.device,
                    progress=sys.stderr.isatty())
    if report.identical:
        print(f"identical: {report.steps_compared} steps, {report.tokens_compared} tokens, max |dlogprob| "
              f"{report.max_logprob_delta:.2e} ({report.seconds:.1f} s)")
        return 0
    print(report.divergence.describe())
    return 1
