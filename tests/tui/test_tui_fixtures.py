"""The example trace the TUI tests look at (tests/helpers/example_trace.py) reads back as designed."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.example_trace import EOS, REQS  # noqa: F401
from workbench.trace.reader import open_trace


def test_example_trace_reads_back_as_designed(example_trace: Path) -> None:
    with open_trace(example_trace) as trace:
        steps = {s.step: s for s in trace.steps()}
        assert sorted(steps) == [1, 2, 3, 4, 5, 6]
        assert steps[3].spec_proposed == 8 and steps[3].spec_accepted == 6
        finished = {r.req_id: (r.finish_step, r.finish_reason, r.finished.text) for r in trace.requests()}
    assert finished == {"req-0": (4, "stop", " Paris."), "req-1": (6, "stop", " Waves crash on the rocks🙂"),
                        "req-2": (5, "length", " three, four, five, six,")}
