"""The TUI shows a request's batch-invariance drift (issue 17): what `workbench invariance T` stored.

One test runs the real thing on a tiny model: record a batched run, `workbench invariance T`
stores its result in the trace, and the Tokens pane shows, per position, the |Δlogprob| the run
measured; a request it did not measure says so. A snapshot shows the pane on the example trace
with a stored result where req-1's tokens drift and then differ at a near tie (a designed result,
as the example trace itself is designed, so the picture is the same on every machine).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.tui_pilot import SIZE, pane, settle, tui
from tui.app import WorkbenchApp
from workbench.trace.invariance_store import read_invariance, store_invariance
from workbench.trace.reader import open_trace

pytestmark = pytest.mark.anyio


def _designed_result(path: Path) -> None:
    """req-1 measured: its first tokens drift by growing amounts, position 4 differs at a near tie."""
    with open_trace(path) as trace:
        tokens = sorted((e for e in trace.events(kind="token", req_id="req-1")), key=lambda e: e.position)
    positions = []
    for i, tok in enumerate(tokens[:5]):
        differs = i == 4
        delta = None if differs else [0.0, 3e-7, 1.2e-6, 4.5e-6][i]
        positions.append({"position": tok.position, "token_batched": tok.token_id,
                          "token_alone": tok.token_id + 1 if differs else tok.token_id,
                          "text_batched": tok.text, "text_alone": " cliffs" if differs else tok.text,
                          "logprob_batched": tok.logprob,
                          "logprob_alone": None if tok.logprob is None else tok.logprob - (0.25 if differs else delta),
                          "delta": delta, "batch_size": 3})
    row = {"req_id": "req-1", "len_batched": len(tokens), "len_alone": len(tokens), "first_diff": positions[-1]["position"],
           "seeded": True, "max_delta": 4.5e-6,
           "verdict": {"near_tie": True, "margin": 4e-4, "text": "a near tie (top-2 margin 0.0004 nats)"},
           "positions": positions}
    store_invariance(path, {"device": "cpu", "dtype": "float32", "requests": 1, "identical": 0, "max_delta": 4.5e-6},
                     [row])


@pytest.fixture
def measured_example(example_trace: Path, tmp_path: Path) -> Path:
    path = tmp_path / "measured.wbtrace"
    shutil.copy(example_trace, path)
    _designed_result(path)
    return path


@pytest.mark.parametrize("position", [2, 4], ids=["drift", "first-difference"])
def test_tokens_pane_shows_the_drift(snap_compare, measured_example: Path, position: int) -> None:  # noqa: ANN001
    app = WorkbenchApp(str(measured_example), step=1, request="req-1")

    async def walk(pilot) -> None:  # noqa: ANN001 - from req-1's first token to `position`
        await settle(pilot)
        await pilot.press(*["l"] * position)
        await settle(pilot)
        assert app.main.sel.position == position

    assert snap_compare(app, terminal_size=SIZE, run_before=walk)


async def test_an_unmeasured_request_and_an_unmeasured_trace_say_so(example_trace: Path,
                                                                    measured_example: Path) -> None:
    async with tui(measured_example, step=1, request="req-0") as (pilot, screen):
        assert "invariance not measured for this request" in pane(screen, "tokens")
        assert "alone: not measured" in str(screen.query_one("#tokens").border_subtitle)
    async with tui(example_trace, step=1, request="req-0") as (pilot, screen):  # never measured: no line
        assert "invariance" not in pane(screen, "tokens")


@pytest.mark.slow
async def test_workbench_invariance_stores_what_the_tui_shows(tiny, tmp_path: Path) -> None:  # noqa: ANN001
    from workbench.cli import main as cli_main
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    path = tmp_path / "batched.wbtrace"
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):", "Roses are red,"]
    with Engine(tiny, trace=str(path)) as engine:
        engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=True,
                                                top_logprobs=2))
    assert cli_main(["invariance", str(path), "--request", "req-1", "--request", "req-2"]) == 0
    summary, rows = read_invariance(path)
    assert summary is not None and summary["requests"] == 2 and set(rows) == {"req-1", "req-2"}
    row = rows["req-1"]
    assert len(row["positions"]) == 6 and row["first_diff"] is None  # CPU fp32: the same tokens alone
    p = row["positions"][3]
    async with tui(path, step=1, request="req-1") as (pilot, screen):
        await pilot.press(*["l"] * 3)
        await settle(pilot)
        text = pane(screen, "tokens")
        assert f"invariance alone vs batched (batch {p['batch_size']}): |Δlogprob| {p['delta']:.2e}" in text
        assert f"flip risk {p['risk']:.2g}" in text  # drift / top-2 margin, stored by workbench invariance
        assert p["batch_size"] > 1
        assert f"alone: max Δlp {row['max_delta']:.2e}" in str(screen.query_one("#tokens").border_subtitle)
    async with tui(path, request="req-0") as (pilot, screen):
        assert "not measured for this request" in pane(screen, "tokens")
    assert cli_main(["invariance", str(path), "--request", "req-0", "--no-store"]) == 0
    assert set(read_invariance(path)[1]) == {"req-1", "req-2"}  # --no-store left the stored result alone


async def test_a_run_in_several_contexts_shows_the_drift_of_each(example_trace: Path, tmp_path: Path) -> None:
    """`workbench invariance --context ...` stores each context's drift per position; the Tokens pane
    names them, the one beyond the top-2 margin marked."""
    path = tmp_path / "contexts.wbtrace"
    shutil.copy(example_trace, path)
    with open_trace(path) as trace:
        tokens = sorted((e for e in trace.events(kind="token", req_id="req-1")), key=lambda e: e.position)
    drifts = {"alone": 1e-5, "chunked:4": 3e-5, "speculative": None}
    positions = [{"position": t.position, "token_batched": t.token_id, "token_alone": t.token_id, "text_batched": t.text,
                  "text_alone": t.text, "logprob_batched": t.logprob, "logprob_alone": t.logprob, "delta": 1e-5,
                  "batch_size": 3, "margin": 2e-5, "drift": 3e-5, "risk": 1.5, "drifts": drifts} for t in tokens]
    store_invariance(path, {"device": "cpu", "dtype": "float32", "requests": 1, "identical": 1, "max_delta": 1e-5,
                            "contexts": list(drifts)},
                     [{"req_id": "req-1", "len_batched": len(tokens), "len_alone": len(tokens), "first_diff": None,
                       "seeded": True, "max_delta": 1e-5, "verdict": None, "positions": positions}])
    async with tui(path, step=1, request="req-1") as (pilot, screen):
        await pilot.press("l")
        await settle(pilot)
        text = " ".join(pane(screen, "tokens").split())  # the line wraps at the pane's width
        assert "flip risk 1.5" in text
        assert "drift by context: alone 1.00e-05 chunked:4 3.00e-05 speculative -" in text
