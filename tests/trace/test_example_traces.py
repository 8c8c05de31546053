"""The example traces in traces/ (made by `workbench make-traces`) open, hold what their names
promise, and replay identically on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.rerun.replay import replay
from workbench.trace.reader import open_trace

TRACES = Path(__file__).resolve().parents[2] / "traces"
NAMES = ["concurrent_chats", "speculative", "stop_string", "structured"]


def test_every_example_is_there():
    assert sorted(p.stem for p in TRACES.glob("*.wbtrace")) == sorted(NAMES)


def test_examples_hold_what_they_promise():
    with open_trace(TRACES / "concurrent_chats.wbtrace") as t:
        assert len(t.requests()) == 4 and any(s.batch_size >= 4 for s in t.steps())
    with open_trace(TRACES / "speculative.wbtrace") as t:
        verifies = list(t.events(kind="spec.verify"))
        assert verifies and any(v.num_accepted > 0 for v in verifies)
    with open_trace(TRACES / "stop_string.wbtrace") as t:
        reasons = {r.req_id: r.finished for r in t.requests()}
        assert all(f is not None and f.finish_reason == "stop" for f in reasons.values())
        assert {f.matched_stop for f in reasons.values()} == {"Wednesday", " 9,"}
        assert "Wednesday" not in reasons["req-0"].text and reasons["req-1"].text.endswith(" 9,")
    with open_trace(TRACES / "structured.wbtrace") as t:
        (req,) = t.requests()
        obj = json.loads(req.finished.text)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_a_trace_from_before_the_slot_order_replays_with_the_order_it_was_recorded_in():
    from workbench.rerun.rebuild import build_engine

    with open_trace(TRACES / "stop_string.wbtrace") as t:
        recorded = dict(t.meta["engine"])
        assert "kv_slot_order" not in recorded  # recorded before session 13
        engine, _ = build_engine(t, recorded, None)
    try:
        assert engine.config.kv_slot_order == "fifo" and engine.memory.allocator.order == "fifo"
    finally:
        engine.close()


@pytest.mark.parametrize("name", NAMES)
def test_example_replays_identically(name):
    report = replay(str(TRACES / f"{name}.wbtrace"), progress=False)
    assert report.identical, report.divergence.describe()
