"""Replay: re-execute a recorded trace, save the replayed run, and name the first difference.

Owns: comparing a re-execution (workbench/rerun/rebuild.py rebuilds the engine and re-submits the
recorded requests) with the recording at one of three levels (`--compare`):
`steps` compares every step's events stage by stage (batch composition, tokens and logprobs within
a tolerance, detokenizer output, finish decisions); `tokens` only each request's tokens and
logprobs, wherever they were produced; `outputs` only each request's final output. A divergence
names the override it follows from. Stands above `trace/` because it needs the engine.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from workbench.rerun.rebuild import build_engine, parse_value, recorded_requests, run_recorded
from workbench.trace import events as ev
from workbench.trace.diff import verdict
from workbench.trace.diff_format import fmt_top, kernels_note
from workbench.trace.reader import open_trace

COMPARE = ("steps", "tokens", "outputs")
ENGINE_STAGES = ("schedule", "forward_batch", "spec.draft", "spec.verify", "steps")
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
    cause: str | None = None  # the override this divergence follows from
    position: int | None = None

    def describe(self) -> str:
        who = f", request {self.req_id}" if self.req_id else ""
        at = f", position {self.position}" if self.position is not None else ""
        lines = [f"first divergence at step {self.step}{who}{at}, stage {self.stage!r} (field {self.field!r})",
                 f"  recorded: {_short(self.recorded)}", f"  replayed: {_short(self.replayed)}"]
        if self.recorded_top or self.replayed_top:
            lines.append(f"  recorded top-k: {fmt_top(self.recorded_top)}")
            lines.append(f"  replayed top-k: {fmt_top(self.replayed_top)}")
        if self.near_tie is not None:
            kind = "a near tie" if self.near_tie else "a real difference"
            lines.append(f"  verdict: {kind} (recorded top-2 margin {self.margin:.3g})")
        lines.append(f"  follows from: {self.cause}" if self.cause else "  follows from: no override (the run itself)")
        return "\n".join(lines)


@dataclass(slots=True)
class ReplayReport:
    steps_compared: int
    tokens_compared: int
    max_logprob_delta: float
    divergence: Divergence | None  # the first difference at the `compare` level
    seconds: float = 0.0
    compare: str = "steps"
    step_divergence: Divergence | None = None  # the first step-level difference (any level)
    out: str | None = None
    kernels: tuple[str, str] = ("exact", "exact")  # the numerics mode (recorded, replayed)

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def describe(self) -> str:
        what = {"steps": "every step", "tokens": "tokens", "outputs": "outputs"}[self.compare]
        if self.divergence is not None:
            text = self.divergence.describe()
        else:
            text = (f"identical ({what}): {self.steps_compared} steps, {self.tokens_compared} tokens, "
                    f"max |dlogprob| {self.max_logprob_delta:.2e} ({self.seconds:.1f} s)")
            d = self.step_divergence
            if d is not None and self.compare != "steps":
                who = f" for {d.req_id}" if d.req_id else ""
                text += (f"\n  the steps differ from step {d.step}{who} (stage {d.stage!r}, field {d.field!r}), "
                         f"following from {d.cause or 'no override'}")
        note = kernels_note(*self.kernels, names=("recorded", "replayed"))
        return "\n".join([*note, text]) + (f"\nreplayed run saved to {self.out}" if self.out else "")


def _short(x: Any, n: int = 160) -> str:
    s = json.dumps(x, default=str)
    return s if len(s) <= n else s[: n - 3] + "..."


def _apply_overrides(requests: list[dict], engine_cfg: dict, overrides: list[str]) -> None:
    """`REQ:FIELD=VALUE` changes a request's sampling parameter; `engine.FIELD=VALUE` the engine."""
    for item in overrides:
        target, _, assignment = item.partition(":") if not item.startswith("engine.") else ("engine", "", item[7:])
        key, eq, raw = assignment.partition("=")
        if not eq or not key:
            raise ValueError(f"override {item!r}: expected REQ:FIELD=VALUE or engine.FIELD=VALUE")
        value = parse_value(raw)
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


def _cause(d: Divergence, overrides: list[str]) -> str | None:
    """The override a divergence follows from: for a difference in the batch's shape an engine
    override first, otherwise the diverging request's own override first; failing both, another
    request's override (its new tokens change the batch the others run in)."""
    engine = [(o, "the batch's shape") for o in overrides if o.startswith("engine.")]
    own, other = [], []
    for o in overrides:
        target = o.partition(":")[0]
        if o.startswith("engine."):
            continue
        if d.req_id is not None and (d.req_id == target or d.req_id.startswith(target + "-")):
            own.append((o, "that request's sampling"))
        else:
            other.append((o, "another request's changed tokens change the batch"))
    order = engine + own if d.stage in ENGINE_STAGES or d.req_id is None else own + engine
    order += other
    return f"--override {order[0][0]} ({order[0][1]})" if order else None


def _meta_object(trace: Any, key: str) -> dict:
    """`trace.meta[key]` as the object a recording writes there; a damaged one is a TraceError."""
    from workbench.trace.reader import TraceError

    value = trace.meta.get(key) or {}
    if not isinstance(value, dict):
        raise TraceError(f"{trace.name}: damaged trace (meta {key!r} is a {type(value).__name__}, expected an object)")
    return dict(value)


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
                        return _divergence(step, rid, stage, f, va, vb, ea, eb, tolerance), tokens, max_delta
                if kind == "token":
                    tokens += 1
                    if ea.logprob is not None and eb.logprob is not None:
                        delta = abs(ea.logprob - eb.logprob)
                        max_delta = max(max_delta, delta)
                        if delta > tolerance:
                            return (_divergence(step, rid, stage, "logprob", ea.logprob, eb.logprob, ea, eb,
                                                tolerance), tokens, max_delta)
    return None, tokens, max_delta


def _divergence(step, rid, stage, f, va, vb, ea, eb, tolerance) -> Divergence:
    d = Divergence(step, rid, stage, f, va, vb)
    if isinstance(ea, ev.TokenChosen) and isinstance(eb, ev.TokenChosen):
        d.position = ea.position
        d.recorded_top, d.replayed_top = list(ea.top_logprobs), list(eb.top_logprobs)
        v = verdict(d.recorded_top, ea.token_id, eb.token_id if eb.token_id != ea.token_id else -1, tolerance)
        d.margin, d.near_tie = v.margin, v.near_tie
    return d


def _tokens(events: list[ev.Event]) -> dict[str, list[ev.TokenChosen]]:
    out: dict[str, list[ev.TokenChosen]] = defaultdict(list)
    for e in events:
        if e.kind == "token":
            out[e.req_id].append(e)
    for toks in out.values():
        toks.sort(key=lambda e: e.position)
    return out


def compare_tokens(recorded: list[ev.Event], replayed: list[ev.Event], tolerance: float
                   ) -> tuple[Divergence | None, int, float]:
    """Each request's tokens (and logprobs within `tolerance`), wherever in the run they came."""
    a, b = _tokens(recorded), _tokens(replayed)
    found, tokens, max_delta = [], 0, 0.0
    for rid in sorted(set(a) | set(b)):
        ta, tb = a.get(rid, []), b.get(rid, [])
        for ea, eb in zip(ta, tb):
            tokens += 1
            delta = abs(ea.logprob - eb.logprob) if ea.logprob is not None and eb.logprob is not None else 0.0
            max_delta = max(max_delta, delta)
            if ea.token_id != eb.token_id or delta > tolerance:
                f = "token_id" if ea.token_id != eb.token_id else "logprob"
                found.append(_divergence(eb.step, rid, "token", f, getattr(ea, f), getattr(eb, f), ea, eb, tolerance))
                break
        else:
            if len(ta) != len(tb):
                step = (tb[len(ta)] if len(tb) > len(ta) else ta[len(tb)]).step
                found.append(Divergence(step, rid, "token", "count", len(ta), len(tb), position=min(len(ta), len(tb))))
    return min(found, key=lambda d: d.step, default=None), tokens, max_delta


def compare_outputs(recorded: list[ev.Event], replayed: list[ev.Event], tolerance: float) -> Divergence | None:
    """Each request's final output: token ids, text and finish reason."""
    fa = {e.req_id: e for e in recorded if e.kind == "request.finished"}
    fb = {e.req_id: e for e in replayed if e.kind == "request.finished"}
    for rid in sorted(set(fa) | set(fb)):
        ea, eb = fa.get(rid), fb.get(rid)
        if ea is None or eb is None:
            return Divergence((ea or eb).step, rid, "finish", "finished", ea is not None, eb is not None)
        for f in ("output_ids", "text", "finish_reason"):
            if getattr(ea, f) != getattr(eb, f):
                d = Divergence(eb.step, rid, "finish", f, getattr(ea, f), getattr(eb, f))
                if f == "output_ids":  # the verdict at the first differing token
                    tok, _, _ = compare_tokens([e for e in recorded if e.req_id == rid],
                                               [e for e in replayed if e.req_id == rid], float("inf"))
                    if tok is not None:
                        d.position, d.recorded_top, d.replayed_top = tok.position, tok.recorded_top, tok.replayed_top
                        d.margin, d.near_tie = tok.margin, tok.near_tie
                return d
    return None


def replay(path: str, *, overrides: list[str] | None = None, tolerance: float = 1e-3, device: str | None = None,
           progress: bool = True, compare: str = "steps", out: str | None = None) -> ReplayReport:
    """Re-execute `path`; compare at `compare` level (steps | tokens | outputs); save the run to `out`."""
    import time

    from tqdm.auto import tqdm

    if compare not in COMPARE:
        raise ValueError(f"compare must be one of {', '.join(COMPARE)}, got {compare!r}")
    overrides = list(overrides or [])
    t0 = time.perf_counter()
    with open_trace(path) as trace:
        if trace.meta.get("source") == "external":  # no engine config or steps of ours to re-run
            raise ValueError(f"trace {path!r} was recorded from an external server by workbench probe; "
                             "score it with: workbench check TRACE --reference MODEL")
        engine_cfg = _meta_object(trace, "engine")
        _meta_object(trace, "model")  # a damaged one stops here, naming the file
        engine_cfg.setdefault("kernels", "exact")  # traces from before the mode ran exact
        recorded_kernels = str(engine_cfg["kernels"])
        requests = recorded_requests(trace)
        if not requests:
            raise ValueError(f"trace {path!r} records no requests: nothing to replay")
        _apply_overrides(requests, engine_cfg, overrides)
        engine, sink = build_engine(trace, engine_cfg, device, out)
        if out is not None:
            engine.tracer.set_meta("replay", {"parent": str(path), "overrides": overrides})
        num_steps = trace.num_steps
        bar = tqdm(total=num_steps, disable=not progress, desc="replaying", unit="step")
        compared = tokens = 0
        max_delta, first = 0.0, None
        recorded_all: list[ev.Event] = []
        kept = trace.budget("the recorded events replay compares")  # bounded over the whole run, not per step
        for step, replayed in run_recorded(engine, sink, requests):
            recorded = [e for e in trace.step(step, budget=kept) if e.kind != "request.added"]
            recorded_all += recorded
            if first is None:
                first, n, delta = compare_step(step, recorded, replayed, tolerance)
                compared, tokens, max_delta = compared + 1, tokens + n, max(max_delta, delta)
            bar.update(1)
            if first is not None and compare == "steps" and out is None:
                break  # nothing more to learn, nothing to save
        if first is None and engine.step_no != num_steps:
            first = Divergence(engine.step_no, None, "steps", "num_steps", num_steps, engine.step_no)
        recorded_all += [e for s in range(engine.step_no + 1, num_steps + 1) for e in trace.step(s, budget=kept)]
        replayed_all = list(sink.events)
        bar.close()
        engine.close()
    if first is not None:
        first.cause = _cause(first, overrides)
    divergence = first
    if compare == "tokens":
        divergence, tokens, max_delta = compare_tokens(recorded_all, replayed_all, tolerance)
    elif compare == "outputs":
        divergence = compare_outputs(recorded_all, replayed_all, tolerance)
    if divergence is not None and divergence is not first:
        divergence.cause = _cause(divergence, overrides)
    steps = compared if compare == "steps" else engine.step_no  # tokens/outputs: every step ran and counted
    return ReplayReport(steps, tokens, max_delta, divergence, time.perf_counter() - t0, compare, first, out,
                        (recorded_kernels, engine.config.kernels))
