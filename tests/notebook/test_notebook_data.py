"""The notebook viewers' data layer, read over the hand-made scenario (tests/helpers/notebook_scenario.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.notebook_scenario import scenario_events, write_scenario
from workbench.notebook import EventSource, RequestView, TraceSource, as_source
from workbench.trace.recorder import MemorySink


@pytest.fixture
def scenario_trace(tmp_path: Path) -> Path:
    return write_scenario(tmp_path / "scenario.wbtrace")


# --- tests -------------------------------------------------------------------------------------


def test_request_view_answers_as_of_a_step() -> None:
    req = RequestView.from_events("req-b", [e for e in scenario_events() if e.req_id == "req-b"])
    assert [t.position for t in req.tokens] == list(range(9))
    assert req.token_at(2).token_id == 99 and req.token_at(2).source == "spec_recover"
    assert req.token_at(4).token_id == 24  # waiting at step 4: still the bonus token of step 3
    assert req.stages_for(req.token_at(2)) is None  # a verified token has no sampling stages
    assert req.stages_for(req.token_at(5)).step == 5
    assert req.verify_at(4).draft_tokens == [21, 22, 23]
    assert req.finish_at(4).step == 3 and req.finish_at(5).finish_reason == "stop"
    assert req.text_at(3) == "<1><2><3>" and req.detok_at(3).held_reason == "incomplete_char"
    assert req.vocab()[7] == " dog" and req.vocab()[13] == " b13"  # a rejected draft, named by its SpecDraft


def test_trace_and_memory_sources_agree(scenario_trace: Path) -> None:
    sink = MemorySink()
    for event in scenario_events():
        sink.write(event)
    file_src, mem_src = as_source(str(scenario_trace)), as_source(sink)
    assert isinstance(file_src, TraceSource) and isinstance(mem_src, EventSource)
    assert file_src.request_ids() == mem_src.request_ids() == ["req-a", "req-b"]
    for src in (file_src, mem_src):
        steps = src.steps()
        assert [s.step for s in steps] == [1, 2, 3, 4, 5]
        assert [s.batch_size for s in steps] == [2, 2, 2, 1, 1]
        assert [s.kv_used for s in steps] == [10, 20, 30, 40, 50]
        assert [t.token_id for t in src.request("req-a").tokens] == [101, 102, 103, 104]
    assert "length" in file_src.request_label("req-a") and "'Say b'" in mem_src.request_label("req-b")


def test_as_source_rejects_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="path_or_trace"):
        as_source(42)
    with pytest.raises(ValueError, match="no such trace file"):
        as_source(str(tmp_path / "missing.wbtrace"))

    class Engine:  # an engine that records to a file only
        class tracer:  # noqa: N801
            sinks: list = []

    with pytest.raises(ValueError, match="no in-memory trace"):
        as_source(Engine())
