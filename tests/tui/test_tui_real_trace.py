"""The TUI on a trace recorded by the real engine: SmolLM2, greedy, n-gram speculative decoding, a stop string.

One session fixture records two chats (`Engine("smollm2", spec="ngram:k=4", trace=...)`): req-0 asks
for a line repeated (the drafter proposes from it), req-1 lists the week's days and stops at the
stop string "Friday". The tests check that the panes show what the engine returned, and take SVG
snapshots of a prefill step, a step with a rejected draft and the stop-string finish, with times
hidden (`show_times=False`) because a real run's timings change from run to run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tui_pilot import SIZE, pane, settle, tui
from tui.app import WorkbenchApp
from workbench.trace.reader import open_trace

CHATS = [[{"role": "user", "content": "Repeat this line three times: the cat sat on the mat."}],
         [{"role": "user", "content": "List the days of the week, one per line."}]]


@dataclass(frozen=True)
class Recorded:
    path: Path
    outputs: list[Any]
    prefill_step: int
    reject_step: int
    reject_req: str
    stop_step: int
    stop_req: str


@pytest.fixture(scope="session")
def real_trace(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("tui_real") / "smollm2.wbtrace"
    # without prefix sharing both chats prefill in the same first step, the scene the snapshots show
    with Engine("smollm2", trace=str(path), spec="ngram:k=4", prefix_sharing=False) as engine:
        outputs = engine.generate(CHATS, [SamplingParams(temperature=0, max_new_tokens=40),
                                          SamplingParams(temperature=0, max_new_tokens=40, stop=["Friday"])])
    with open_trace(path) as trace:
        prefill = next(s.step for s in trace.steps() if s.mode == "EXTEND")
        reject = next(e for e in trace.events(kind="spec.verify") if e.num_accepted < len(e.draft_tokens))
        stop = next(e for e in trace.events(kind="request.finished") if e.matched_stop == "Friday")
    return Recorded(path, outputs, prefill, reject.step, reject.req_id, stop.step, stop.req_id)


pytestmark = [pytest.mark.slow, pytest.mark.anyio]


async def test_the_tokens_pane_shows_what_the_engine_returned(real_trace: Recorded) -> None:
    out = real_trace.outputs[1]
    assert out.finish_reason == "stop" and out.matched_stop == "Friday"
    async with tui(real_trace.path, step=real_trace.stop_step, request=out.req_id) as (pilot, screen):
        text = pane(screen, "tokens")
        assert "prompt" in text and "days of the week" in text
        chips = "".join(t.text for t in screen.request.tokens)
        assert chips.startswith(out.text)  # the output text is the tokens' text cut before "Friday"
        assert "Friday" in chips[len(out.text):]


async def test_the_stop_string_finish_is_explained(real_trace: Recorded) -> None:
    async with tui(real_trace.path, step=real_trace.stop_step, request=real_trace.stop_req) as (pilot, screen):
        finish = pane(screen, "finish")
        fired = [line.split()[2] for line in finish.splitlines() if line.startswith("✓ fired")]
        assert fired == ["stop_string"] and 'matched="Friday"' in finish
        assert '→ finish_reason stop  evidence type="stop" matched="Friday"' in finish
        assert 'stop     matched "Friday"' in pane(screen, "detok")


async def test_a_rejected_draft_is_explained(real_trace: Recorded) -> None:
    async with tui(real_trace.path, step=real_trace.reject_step, request=real_trace.reject_req) as (pilot, screen):
        spec = pane(screen, "spec")
        assert "drafter ngram" in spec and "greedy" in spec
        assert "✗ reject" in spec and "rejected: the target's argmax is" in spec
        assert "TARGET_VERIFY" in pane(screen, "batch")


async def test_the_prefill_rows_carry_the_prompts(real_trace: Recorded) -> None:
    async with tui(real_trace.path, step=real_trace.prefill_step) as (pilot, screen):
        batch = pane(screen, "batch")
        with open_trace(real_trace.path) as trace:
            lengths = {r.req_id: len(r.added.prompt_ids) for r in trace.requests()}
        for rid, n in lengths.items():
            row = next(line for line in batch.splitlines() if line.startswith(rid + " "))
            assert row.split()[3] == str(n)  # extend: the whole prompt in one chunk
        assert batch.count('im_start|>assistant\\n"') == 2  # each prompt chunk ends with the assistant turn


@pytest.mark.parametrize("which", ["prefill", "spec-rejection", "stop-string-finish"])
def test_real_trace_snapshot(snap_compare, real_trace: Recorded, which: str) -> None:  # noqa: ANN001
    step, req = {"prefill": (real_trace.prefill_step, None),
                 "spec-rejection": (real_trace.reject_step, real_trace.reject_req),
                 "stop-string-finish": (real_trace.stop_step, real_trace.stop_req)}[which]
    app = WorkbenchApp(str(real_trace.path), step=step, request=req, show_times=False)
    assert snap_compare(app, terminal_size=SIZE, run_before=settle)
