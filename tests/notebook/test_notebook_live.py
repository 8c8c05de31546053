"""LiveView: the viewer's figures follow an engine while it generates (a tracer fed by hand, then a
real engine on the tiny random model)."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from tests.helpers.notebook_scenario import scenario_events
from workbench.notebook import LiveView
from workbench.trace.recorder import MemorySink, Tracer


class FakeEngine:
    """What LiveView reads from an engine: its tracer (and a tokenizer when there is one)."""

    def __init__(self, level: str = "summary") -> None:
        self.tracer = Tracer(level, [MemorySink()])


def _x(fig: go.Figure, name: str) -> list:
    return list(next(t for t in fig.data if t.name == name).x)


def test_live_view_follows_each_step_as_it_arrives() -> None:
    engine = FakeEngine()
    live = LiveView(engine, min_interval=0)
    assert live.req_id is None and "no tokens yet" in live.figures["tokens"].layout.annotations[0].text
    seen = []
    for event in scenario_events():
        if seen and event.step != seen[-1][0]:  # a new step began: the previous one was drawn
            assert live.step == seen[-1][0]
            assert _x(live.figures["batch"], "batch size") == list(range(1, live.step + 1))
        engine.tracer.emit(event)
        seen.append((event.step, event.kind))
    engine.tracer.flush()
    assert live.step == 5 and [v for _, v in live.picker.options] == ["req-a", "req-b"]
    assert _x(live.figures["tokens"], "tokens") == [0, 1, 2, 3]
    assert live.slider.max == 5 and live.slider.value == 5


def test_moving_the_slider_stops_following_until_the_newest_step() -> None:
    engine = FakeEngine()
    live = LiveView(engine, min_interval=0)
    events = scenario_events()
    for event in (e for e in events if e.step <= 3):
        engine.tracer.emit(event)
    engine.tracer.flush()
    live.slider.value = 1
    assert not live.following
    for event in (e for e in events if e.step > 3):
        engine.tracer.emit(event)
    engine.tracer.flush()
    assert live.step == 1 and live.slider.max == 5  # the range grew, the selection stayed
    assert _x(live.figures["tokens"], "selected") == [0]
    live.slider.value = 5
    assert live.following
    live.detach()
    assert live._sink not in engine.tracer.sinks


def test_live_view_refuses_an_engine_that_does_not_trace() -> None:
    with pytest.raises(ValueError, match="trace_level 'summary' or 'full'"):
        LiveView(FakeEngine("off"))
    with pytest.raises(ValueError, match="engine"):
        LiveView(object())
    with pytest.raises(ValueError, match="min_interval"):
        LiveView(FakeEngine(), min_interval=-1)


def test_live_view_redraws_while_a_real_engine_generates() -> None:
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    drawn: list[int] = []

    class Recording(LiveView):
        def refresh(self) -> None:
            super().refresh()
            tokens = next((t for t in self.figures["tokens"].data if t.name == "tokens"), None)
            drawn.append(0 if tokens is None else len(tokens.x))

    engine = Engine("tiny-random", trace_level="summary")
    live = Recording(engine, min_interval=0)
    outs = engine.generate(["hello there", "one two three"], SamplingParams(temperature=0, max_new_tokens=6,
                                                                           ignore_eos=True))
    assert live.req_id == outs[0].req_id and live.step == engine.step_no
    assert [t.token_id for t in live.request.tokens] == outs[0].token_ids
    assert _x(live.figures["tokens"], "tokens") == list(range(6))
    assert len(set(drawn)) >= 4 and drawn == sorted(drawn)  # drawn step by step while generating
    assert {v for _, v in live.picker.options} == {o.req_id for o in outs}
