"""TraceViewer through its widgets: the slider and the picker move every figure to that step's or
request's data (asserted on figure data), clicks on tokens, the no-anywidget and no-widget paths,
and the static HTML export. Reads the hand-made trace of test_notebook_data (no model)."""

from __future__ import annotations

import re
from pathlib import Path

import plotly.graph_objects as go
import pytest
from plotly.callbacks import InputDeviceState, Points

from tests.helpers.notebook_scenario import _stages, write_scenario
from workbench.notebook import PANELS, TraceViewer
from workbench.notebook.figures import ACCEPT, DISCARD, REJECT


@pytest.fixture
def trace_path(tmp_path: Path) -> str:
    return str(write_scenario(tmp_path / "scenario.wbtrace"))


def _trace(fig: go.Figure, name: str) -> go.BaseTraceType:
    return next(t for t in fig.data if t.name == name)


def _stage_bars(fig: go.Figure) -> dict[str, list[float]]:
    return {t.name.split(" ·")[0]: list(t.y) for t in fig.data if t.type == "bar" and t.name != "kept"}


def _assert_shows_req_a_step(viewer: TraceViewer, step: int) -> None:
    figs = viewer.figures
    tokens = _trace(figs["tokens"], "tokens")
    assert list(tokens.x) == [0, 1, 2, 3]
    assert list(tokens.marker.opacity) == [1.0 if s <= step else 0.25 for s in (1, 2, 3, 4)]
    assert list(_trace(figs["tokens"], "selected").x) == [step - 1]
    expected = {s["name"]: s["top_probs"] + [0.0] * (3 - len(s["top_probs"])) for s in _stages(step)}
    assert _stage_bars(figs["stages"]) == pytest.approx(expected)
    assert f"(step {step})" in figs["stages"].layout.title.text
    assert [s.x0 for s in figs["batch"].layout.shapes] == [step]
    table = _trace(figs["finish"], "checks")
    assert list(table.cells.values[2]) == (["fired", "–"] if step == 4 else ["–", "–"])
    assert f"step {step}:" in figs["finish"].layout.title.text


def test_slider_moves_every_figure_to_that_step(trace_path: str) -> None:
    viewer = TraceViewer(trace_path)
    assert (viewer.req_id, viewer.step) == ("req-a", 4)  # the selected request's last step
    assert all(isinstance(viewer.figures[name], go.FigureWidget) for name in PANELS)
    _assert_shows_req_a_step(viewer, 4)
    widget_before = viewer.figures["tokens"]
    for step in (2, 1, 3):
        viewer.slider.value = step
        assert viewer.step == step
        _assert_shows_req_a_step(viewer, step)
    assert viewer.figures["tokens"] is widget_before  # updated in place, not replaced
    assert "The cat sat" in viewer.info.value and "step 3" in viewer.info.value


def test_picker_moves_every_figure_to_that_request(trace_path: str) -> None:
    viewer = TraceViewer(trace_path, step=3)
    assert [value for _, value in viewer.picker.options] == ["req-a", "req-b"]
    viewer.picker.value = "req-b"
    figs = viewer.figures
    tokens = _trace(figs["tokens"], "tokens")
    assert list(tokens.x) == list(range(9))
    assert list(tokens.text) == ["␣b51", "␣b11", "␣b12", "␣b99", "␣b21", "␣b22", "␣b23", "␣b24", "␣b55"]
    assert list(_trace(figs["tokens"], "selected").x) == [7]  # the bonus token of step 3
    spec = _trace(figs["spec"], "spec")
    assert [list(row) for row in spec.z] == [[ACCEPT, ACCEPT, REJECT], [ACCEPT, ACCEPT, ACCEPT]]
    assert list(spec.y) == ["step 2", "step 3"]
    assert [(s.y0, s.y1) for s in figs["spec"].layout.shapes] == [(0.5, 1.5)]  # row of step 3
    assert "accepted from a draft" in figs["stages"].layout.annotations[0].text
    assert [b for b in _trace(figs["batch"], "batch size").marker.color].count("#1f77b4") == 4
    assert "incomplete_char" in viewer.info.value
    viewer.slider.value = 5
    assert list(_trace(viewer.figures["finish"], "checks").cells.values[2]) == ["–", "fired"]
    # the chosen token 55 was outside the recorded top 3: shown last, at 0
    assert _stage_bars(viewer.figures["stages"])["top_k"] == pytest.approx(_stages(5)[1]["top_probs"] + [0.0])


def test_picking_a_request_that_had_not_started_moves_to_its_first_step(tmp_path: Path) -> None:
    from tests.helpers.notebook_scenario import scenario_events
    from workbench.trace import events as ev

    late = [ev.RequestAdded(step=4, req_id="req-late", t=4.0, prompt="late"),
            ev.TokenChosen(step=4, req_id="req-late", t=4.0, position=0, token_id=9, text="!", logprob=-1.0)]
    viewer = TraceViewer(scenario_events() + late, step=2, widgets=False)
    viewer.select(req_id="req-late")
    assert viewer.step == 4 and list(_trace(viewer.figures["tokens"], "selected").x) == [0]


def test_clicking_a_token_selects_its_step(trace_path: str) -> None:
    viewer = TraceViewer(trace_path)
    tokens = _trace(viewer.figures["tokens"], "tokens")
    tokens._dispatch_on_click(Points(point_inds=[1], xs=[1], ys=[-1.0], trace_name="tokens", trace_index=0),
                              InputDeviceState())
    assert viewer.step == 2 and viewer.slider.value == 2
    _assert_shows_req_a_step(viewer, 2)


def test_without_anywidget_figures_live_in_output_widgets(trace_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import ipywidgets
    from plotly.missing_anywidget import FigureWidget as MissingFigureWidget

    monkeypatch.setattr(go, "FigureWidget", MissingFigureWidget)  # what plotly offers without anywidget
    viewer = TraceViewer(trace_path)
    assert all(isinstance(p.widget, ipywidgets.Output) for p in viewer._panes.values())
    viewer.slider.value = 2
    _assert_shows_req_a_step(viewer, 2)


def test_without_widgets_select_and_export_still_work(trace_path: str) -> None:
    viewer = TraceViewer(trace_path, widgets=False)
    assert viewer.widget is None and viewer.slider is None
    viewer.select(step=3)
    _assert_shows_req_a_step(viewer, 3)
    page = viewer.to_html()
    assert page.count("<script type='text/javascript'>") == 1 and "Plotly" in page
    assert not re.search(r"<script[^>]+src=", page)  # nothing fetched from a network
    assert all(f"data-panel='{name}'" in page for name in PANELS)
    bundle = viewer._repr_mimebundle_()
    assert "wb-tokens" in bundle["text/html"]


def test_bad_selection_is_a_value_error(trace_path: str) -> None:
    with pytest.raises(ValueError, match="req_id 'nope' is not in this trace"):
        TraceViewer(trace_path, req_id="nope")
    viewer = TraceViewer(trace_path, widgets=False)
    with pytest.raises(ValueError, match=r"step must be an integer in \[1, 5\]"):
        viewer.select(step="2")  # type: ignore[arg-type]
    viewer.select(step=99)
    assert viewer.step == 5  # clamped to the last step


def test_spec_strip_greys_out_drafts_after_the_first_rejection() -> None:
    from workbench.notebook.figures import spec_cells, spec_figure
    from workbench.trace.events import SpecVerify

    verify = SpecVerify(step=7, req_id="r", draft_tokens=[1, 2, 3, 4], accepted=[True, False, True, False],
                        num_accepted=1, extra_token=9, extra_kind="recovered")
    assert spec_cells(verify) == [ACCEPT, REJECT, DISCARD, DISCARD]
    fig = spec_figure([verify], 7, {1: "a", 2: "b"})
    assert list(fig.data[0].text[0]) == ["a", "b", "#3", "#4"] and "1/4 accepted" in fig.layout.title.text


def test_refresh_picks_up_a_trace_still_being_written(tmp_path: Path) -> None:
    from tests.helpers.notebook_scenario import scenario_events
    from workbench.trace.store import TraceWriter

    events = scenario_events()
    with TraceWriter(tmp_path / "live.wbtrace") as writer:
        for event in (e for e in events if e.step <= 2):
            writer.write(event)
        writer.flush()
        viewer = TraceViewer(str(tmp_path / "live.wbtrace"), step=2)
        assert viewer.slider.max == 2 and list(_trace(viewer.figures["tokens"], "tokens").x) == [0, 1]
        for event in (e for e in events if e.step > 2):
            writer.write(event)
        writer.flush()
        viewer.refresh()
        assert viewer.slider.max == 5 and viewer.step == 2
        assert list(_trace(viewer.figures["tokens"], "tokens").x) == [0, 1, 2, 3]
        viewer.source.trace.close()


def test_text_from_an_untrusted_trace_cannot_inject_markup_into_the_page() -> None:
    from workbench.trace import events as ev

    evil = "</script><script>alert(1)</script><img src=x onerror=alert(2)>"
    rid = "r<b>1"
    events = [ev.RequestAdded(step=1, req_id=rid, prompt=evil), ev.ScheduleDecision(step=1, kv_used=1, kv_total=2),
              ev.TokenChosen(step=1, req_id=rid, position=0, token_id=5, text=evil, logprob=-1.0,
                             top_logprobs=[[6, -2.0, evil]]),
              ev.DetokState(step=1, req_id=rid, delta=evil, held_text=evil, held_reason=evil),
              ev.FinishDecision(step=1, req_id=rid, checks=[{"name": evil, "inputs": {"x": evil}, "result": True}],
                                finish_reason="stop", evidence={"matched": evil})]
    viewer = TraceViewer(events, widgets=False)
    page = viewer.to_html(include_plotlyjs=False)
    assert "<script>alert" not in page and "<img src=x" not in page and "<b>1" not in page
    assert "&lt;img src=x" in page  # shown as text, not dropped
