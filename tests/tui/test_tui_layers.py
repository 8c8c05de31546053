"""The TUI's layers pane (issue 18): inside the forward of a captured token, and "not recorded"."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tui_pilot import pane, settle, tui
from tui.fmt import quote
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.trace.reader import open_trace

pytestmark = pytest.mark.anyio
PROMPT = "Hello there, how are you doing today? I was thinking"


@pytest.fixture(scope="module")
def captured_trace(tiny, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("layers") / "cap.wbtrace"
    with Engine(tiny, trace=str(path)) as engine:
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_new_tokens=3), req_id="seen",
                           capture={"attention_topk": 4})
        engine.add_request("Once upon a time", SamplingParams(temperature=0, max_new_tokens=3), req_id="other")
        while engine.has_work():
            engine.step()
    return path


async def test_layers_pane_shows_the_lens_rank_norm_and_attended_text(captured_trace: Path) -> None:
    with open_trace(captured_trace) as trace:
        cap = trace.capture("seen", 1)
        lens = trace.logit_lens("seen", 1)
        att = trace.attention("seen", 1)
        context = trace.context_texts("seen")
        norms = trace.residual_norms("seen", 1)
    async with tui(captured_trace, step=cap.step, request="seen") as (pilot, screen):
        text = pane(screen, "layers")
        assert "logit lens: top tokens" in text and "most attended" in text
        lines = [ln.split() for ln in text.splitlines()]
        rows = {ln[0]: ln for ln in lines if ln and (ln[0] == "emb" or ln[0].isdigit())}
        assert list(rows) == ["emb", "0", "1"]
        for layer, row in rows.items():
            i = -1 if layer == "emb" else int(layer)
            want = lens.iloc[i + 1]
            assert row[1] == str(want["chosen_rank"]) and row[2] == f"{want['chosen_prob']:.3f}"
            assert row[3] == f"{norms[i + 1]:.1f}"
        pos, weight = att.top(layer=1, k=1)[0]  # the most attended position of the last layer, as its text
        last = next(ln for ln in text.splitlines() if ln.split()[:1] == ["1"])
        assert f"{quote(context[pos], 9)}@{pos} {weight:.2f}" in last
        assert text.startswith(f'chosen "{lens.iloc[-1]["chosen_text"]}" #{cap.token_id}')


async def test_uncaptured_token_and_trace_say_not_recorded(captured_trace: Path, example_trace: Path) -> None:
    with open_trace(captured_trace) as trace:
        step = trace.capture("seen", 0).step
    async with tui(captured_trace, step=step, request="other") as (pilot, screen):
        assert "not recorded (not captured" in pane(screen, "layers")
    async with tui(example_trace) as (pilot, screen):
        layers = screen.query_one("#layers")
        assert not layers.display  # a trace without capture does not give the pane room
        await pilot.press("i")
        await settle(pilot)
        assert layers.display and "Layers: not recorded. This trace has no capture" in pane(screen, "layers")
        await pilot.press("i")
        assert not layers.display
