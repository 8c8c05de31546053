"""`workbench check`: teacher forcing a trace through the reference, and what it concludes.

On this engine's own traces (tiny-random) the reference agrees to float noise; a trace whose last
greedy token is swapped for the runner-up is a near tie or a real divergence depending on the
tolerance; a sampled logprob moved beyond the tolerance is caught; the results are stored in the
trace (old traces without them still open) and shown in the TUI (the reference beside each token)
and the notebook (Δlogprob by position, divergences marked).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from workbench.external.check import check_trace
from workbench.external.check_report import topk_divergence
from workbench.trace.checks import read_checks
from workbench.trace.events import TokenChosen
from workbench.trace.reader import open_trace
from workbench.trace.store import TraceWriter

pytestmark = pytest.mark.slow  # two tiny engines load once (about 30 s on a busy machine); each test is seconds

PROMPTS = ["The capital of France is", "Once upon a time", "List three fruits:"]


@pytest.fixture(scope="module")
def engine():
    from workbench.engine.engine import Engine

    return Engine("tiny-random", trace=None, trace_level="off")


@pytest.fixture(scope="module")
def own_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This engine's own trace: two greedy requests and one seeded sampled request."""
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("check") / "own.wbtrace"
    params = [SamplingParams(temperature=0, max_new_tokens=12), SamplingParams(temperature=0, max_new_tokens=12),
              SamplingParams(temperature=0.8, seed=5, max_new_tokens=12)]
    with Engine("tiny-random", trace=str(path)) as eng:
        eng.generate(PROMPTS, params)
    return path


def _rewrite(src: Path, dst: Path, change: Any) -> None:
    """Copy a trace's requests and tokens into a new trace, passing each token through `change`."""
    with open_trace(src) as trace, TraceWriter(dst, {"model": trace.meta.get("model")}) as out:
        for info in trace.requests():
            out.write(info.added)
            for tok in trace.timeline(info.req_id).tokens:
                out.write(change(tok))
            out.write(info.finished)


def test_this_engines_own_trace_agrees_with_the_reference(own_trace: Path, engine, capsys) -> None:
    report = check_trace(own_trace, "tiny-random", engine=engine, progress=False, store=False)
    assert report.exit_code == 0, report.render()
    assert [r.greedy for r in report.requests] == [True, True, False]
    assert report.positions == 36 and report.argmax_agreement == 1.0
    assert all(r.agree == 12 for r in report.requests if r.greedy)
    assert report.max_abs_delta < 1e-4  # the same runner, the same fp32 weights
    assert all(p.topk_overlap == 1.0 and p.topk_kl < 1e-4 for r in report.requests for p in r.positions)

    from workbench.cli import main

    assert main(["check", str(own_trace), "--reference", "tiny-random", "--no-store"]) == 0
    out = capsys.readouterr().out
    assert "positions         36" in out and "(2 greedy, 1 sampled)" in out
    assert "argmax agreement  100.00% (24/24 greedy positions)" in out
    assert "real divergences  0 positions" in out and "result: no real divergence" in out
    assert read_checks(own_trace) == {}  # --no-store leaves the trace as it was


def _swap_last(own_trace: Path, tmp_path: Path) -> tuple[Path, TokenChosen, list[Any]]:
    """The first greedy request's last token replaced by its runner-up (text and logprob too)."""
    with open_trace(own_trace) as trace:
        first = trace.requests()[0].req_id
        last = trace.timeline(first).tokens[-1]
    runner_up = last.top_logprobs[1]

    def change(tok: TokenChosen) -> TokenChosen:
        if tok.req_id == first and tok.position == last.position:
            return dataclasses.replace(tok, token_id=runner_up[0], logprob=runner_up[1], text=runner_up[2])
        return tok

    path = tmp_path / "swapped.wbtrace"
    _rewrite(own_trace, path, change)
    return path, last, runner_up


def test_a_greedy_runner_up_is_a_near_tie_under_the_tolerance_and_real_above(own_trace, engine, tmp_path) -> None:
    path, last, runner_up = _swap_last(own_trace, tmp_path)
    gap = last.logprob - runner_up[1]
    assert gap > 0.02
    tie = check_trace(path, "tiny-random", tolerance=gap + 0.01, engine=engine, progress=False, store=False)
    assert tie.exit_code == 0 and [r.req_id for r in tie.near_ties] == [last.req_id]
    r = tie.requests[0]
    assert (r.first_divergence, r.divergence_class) == (last.position, "near_tie")
    real = check_trace(path, "tiny-random", tolerance=gap / 2, engine=engine, progress=False)
    assert real.exit_code == 1 and [r.req_id for r in real.real_divergences] == [last.req_id]
    p = real.requests[0].positions[-1]
    assert (p.verdict, p.token_id, p.ref_argmax, p.rank) == ("real", runner_up[0], last.token_id, 2)
    assert math.isclose(p.gap, gap, abs_tol=1e-4) and math.isclose(p.ref_margin, gap, abs_tol=1e-4)
    assert f"position {last.position} real" in real.render()


def test_a_sampled_logprob_beyond_the_tolerance_is_a_divergence(own_trace, engine, tmp_path) -> None:
    with open_trace(own_trace) as trace:
        sampled = trace.requests()[2].req_id

    def change(tok: TokenChosen) -> TokenChosen:
        return dataclasses.replace(tok, logprob=tok.logprob + 0.3) if tok.req_id == sampled and tok.position == 4 else tok

    path = tmp_path / "shifted.wbtrace"
    _rewrite(own_trace, path, change)
    report = check_trace(path, "tiny-random", tolerance=0.1, engine=engine, progress=False, store=False)
    r = next(r for r in report.requests if r.req_id == sampled)
    assert (r.first_divergence, r.divergence_class) == (4, "logprob") and report.exit_code == 1
    assert math.isclose(report.max_abs_delta, 0.3, abs_tol=1e-3)
    assert check_trace(path, "tiny-random", tolerance=0.5, engine=engine, progress=False, store=False).exit_code == 0


def test_results_are_stored_replaced_and_old_traces_still_open(own_trace, engine, tmp_path) -> None:
    path, last, _ = _swap_last(own_trace, tmp_path)
    assert read_checks(path) == {}  # never checked
    check_trace(path, "tiny-random", tolerance=1e-3, engine=engine, progress=False)
    check_trace(path, "tiny-random", tolerance=1e-3, engine=engine, progress=False)  # replaces, never appends
    stored = read_checks(path)
    assert len(stored) == 3 and stored[last.req_id]["divergence_class"] == "real"
    with open_trace(path) as trace:
        trace.check()
        assert trace.meta["check"]["real_divergences"] == 1 and len(list(trace.events(kind="token"))) == 36


def test_the_notebook_shows_delta_by_position_with_the_divergence_marked(own_trace, engine, tmp_path) -> None:
    from workbench.notebook.viewer import TraceViewer

    path, last, _ = _swap_last(own_trace, tmp_path)
    check_trace(path, "tiny-random", tolerance=1e-3, engine=engine, progress=False)
    fig = TraceViewer(str(path), req_id=last.req_id, widgets=False).figures["reference"]
    bars = next(t for t in fig.data if t.name == "Δlogprob")
    assert list(bars.x) == list(range(12)) and max(abs(y) for y in bars.y) < 1e-4
    marked = next(t for t in fig.data if t.name == "real divergence")
    assert list(marked.x) == [last.position]
    unchecked = TraceViewer(str(own_trace), widgets=False).figures["reference"]
    assert "not checked" in " ".join(a.text for a in unchecked.layout.annotations)


@pytest.mark.anyio
async def test_the_tui_shows_the_reference_beside_each_token(own_trace, engine, tmp_path) -> None:
    from tests.helpers.tui_pilot import pane, tui

    path, last, runner_up = _swap_last(own_trace, tmp_path)
    check_trace(path, "tiny-random", tolerance=1e-3, engine=engine, progress=False)
    async with tui(path, step=last.step, request=last.req_id) as (pilot, screen):
        text = pane(screen, "tokens")
        lines = text.splitlines()
        swapped = next(ln for ln in lines if ln.lstrip("▸ ").startswith(f"{last.position} "))
        assert "✗ real divergence" in swapped and repr(last.text).strip("'") in swapped
        assert sum("✓ agrees" in ln for ln in lines) >= 5
        assert "check: 1 real, 0 near ties" in screen.query_one("#tokens").border_subtitle


def test_topk_divergence_aligns_the_two_sets_on_their_intersection() -> None:
    same = [(1, math.log(0.6)), (2, math.log(0.3))]
    assert topk_divergence(same, same) == (0.0, 1.0)
    # token 3 is only the engine's, token 2 only the reference's: both fall into the rest cell,
    # which holds 0.4 on each side, so the KL lower bound is 0 and the overlap shows the change
    kl, overlap = topk_divergence([(1, math.log(0.6)), (3, math.log(0.3))], same)
    assert overlap == 0.5 and kl == pytest.approx(0.0, abs=1e-12)
    # a shared token whose mass moved: cells {1} and rest; KL = sum p log(p/q) over them
    kl, overlap = topk_divergence([(1, math.log(0.8)), (2, math.log(0.1))], same)
    expected = 0.8 * math.log(0.8 / 0.6) + 0.1 * math.log(0.1 / 0.3) + 0.1 * math.log(0.1 / 0.1)
    assert overlap == 1.0 and kl == pytest.approx(expected, rel=1e-9)
    assert topk_divergence([], same) == (None, None)


def test_bad_input_is_a_value_error(own_trace, tmp_path) -> None:
    with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
        check_trace(own_trace, tolerance=-1)
    bad = tmp_path / "nope.wbtrace"
    bad.write_text("not a trace")
    with pytest.raises(ValueError, match="not a workbench trace"):
        check_trace(bad, progress=False)
