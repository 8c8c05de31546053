"""Re-running a recorded trace: an engine rebuilt from its meta, its requests re-submitted as recorded.

Owns: reading the recorded requests (`recorded_requests`), rebuilding an engine like the recorded
one (`build_engine`: config from the meta, the model refused when its content hash differs,
tracing into memory and optionally a new .wbtrace), and stepping it with every request submitted
at its recorded arrival step (`run_recorded`, with a hook before each step). replay, fork and
invariance all run a trace through here. Imports the engine only inside `build_engine`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from workbench.trace import events as ev
from workbench.trace.reader import Trace


def parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # a bare word: a string value


def recorded_requests(trace: Trace) -> list[dict[str, Any]]:
    out = []
    for e in trace.events(kind="request.added", budget=trace.budget("the recorded requests")):
        out.append({"req_id": e.req_id, "step": e.step, "prompt_ids": e.prompt_ids, "params": dict(e.params),
                    "parent_id": e.parent_id})
    return out


def model_meta(trace: Trace) -> dict[str, Any]:
    meta = trace.meta.get("model") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"trace meta 'model' is {type(meta).__name__} {meta!r}, expected an object with 'spec' "
                         "and 'hash': the file was not written by the engine, so it cannot be replayed")
    return meta


def build_engine(trace: Trace, engine_cfg: dict, device: str | None, out: str | None = None,
                 overrides: dict[str, Any] | None = None):
    """An engine like the recorded one (config, model checked by hash), tracing into a MemorySink and,
    with `out`, a new .wbtrace file too. `overrides` replaces Engine keyword arguments (e.g. spec)."""
    from workbench.engine.config import EngineArgs
    from workbench.engine.engine import Engine
    from workbench.models.loader import load_model
    from workbench.trace.recorder import MemorySink

    meta = model_meta(trace)
    spec = meta.get("spec") or engine_cfg.get("model")
    loaded = load_model(spec, device=device or meta.get("device", "cpu"), dtype=meta.get("dtype"))
    if meta.get("hash") and loaded.content_hash != meta["hash"]:
        raise ValueError(f"model {spec!r} has content hash {loaded.content_hash}, but the trace was recorded with "
                         f"{meta['hash']}: refusing to replay against a different model")
    sink = MemorySink()
    args = EngineArgs.from_recorded(engine_cfg, **(overrides or {}))  # kernels: a fast trace re-runs fast
    level = trace.meta.get("trace_level", "summary")
    if out is not None:
        from pathlib import Path

        Path(out).unlink(missing_ok=True)
    engine = Engine(loaded, args, trace=out, trace_level=level if level != "off" else "summary", trace_sinks=[sink])
    return engine, sink


def _submit(engine, reqs: list[dict]) -> None:
    from workbench.engine.sample.sampling_params import SamplingParams

    groups: dict[str, list[dict]] = defaultdict(list)
    for r in reqs:
        groups[r["parent_id"] or r["req_id"]].append(r)
    for base, group in groups.items():
        params = SamplingParams.from_dict(group[0]["params"])
        engine.add_request(list(group[0]["prompt_ids"]), params, req_id=base)


def run_recorded(engine, sink, requests: list[dict], before_step: Callable[[Any], None] | None = None
                 ) -> Iterator[tuple[int, list[ev.Event]]]:
    """Submit `requests` at their recorded arrival steps and step until every one has finished;
    yield (step, that step's events except request.added). Every event stays in `sink.events`."""
    pending = sorted(requests, key=lambda r: r["step"])
    while pending or engine.has_work():
        due = [r for r in pending if r["step"] <= engine.step_no + 1]
        if not due and not engine.has_work():  # an idle engine does not count steps: next arrivals now
            due = [r for r in pending if r["step"] == pending[0]["step"]]
        if due:
            pending = [r for r in pending if r not in due]
            _submit(engine, due)
        if before_step is not None:
            before_step(engine)
        start = len(sink.events)
        engine.step()
        step = engine.step_no
        yield step, [e for e in sink.events[start:] if e.step == step and e.kind != "request.added"]
