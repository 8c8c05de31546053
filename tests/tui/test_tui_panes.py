"""Pilot tests of every pane: what each shows for the example trace (tests/helpers/example_trace.py).

Each test opens the TUI headless at a step and request, waits for the workers, and reads the
pane's text as a user would see it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tui_pilot import pane, settle, tui
from tui.app import WorkbenchApp
from tui.screens.main import MainScreen

pytestmark = pytest.mark.anyio


async def test_timeline_lists_every_step_with_mode_batch_tokens_and_time(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        rows = [r.split() for r in screen.timeline.visible_rows()]
        assert rows == [["1", "EXTEND", "2", "13", "2", "6.5"], ["2", "MIXED", "3", "9", "3", "5.2"],
                        ["3", "VERIFY", "3", "11", "9", "9.8", "6/8"], ["4", "DECODE", "3", "3", "3", "4.5"],
                        ["5", "DECODE", "2", "2", "2", "4.2"], ["6", "DECODE", "1", "1", "1", "4.0"]]
        assert screen.sel.step == 1 and screen.sel.req_id == "req-0"


async def test_batch_pane_shows_each_requests_slice_of_the_packed_batch(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        text = pane(screen, "batch")
        assert "schedule EXTEND  budget 2048  scheduled 12" in text
        assert "prefill req-0[0:5] req-1[0:8]" in text
        assert "forward  EXTEND  batch_size 2  tokens 13  return_logprob true" in text
        row0 = next(line for line in text.splitlines() if line.startswith("req-0"))
        assert row0.split()[:7] == ["req-0", "0", "0", "5", "5", "0–4", "1–5"]
        assert '[504, 3575, 282, … +2]' in row0 and '"The capital of France is"' in row0
        assert '"Write a haiku about the sea:"' in text
        assert "req-1: temperature=0.7 top_p=0.9 top_k=50" in text
        assert "alloc 13 slots (1–13)" in text


async def test_batch_pane_on_the_verify_step_shows_drafts_in_the_rows_and_the_rollback(example_trace: Path) -> None:
    async with tui(example_trace, step=3) as (pilot, screen):
        text = pane(screen, "batch")
        assert "forward  TARGET_VERIFY  batch_size 3  tokens 11" in text
        row1 = next(line for line in text.splitlines() if line.startswith("req-1"))
        assert row1.split()[:7] == ["req-1", "1", "9", "5", "14", "9–13", "22–26"]
        assert '" crash on the shore and"' in row1
        assert "rollback 2 slots (25–26) req-1 [spec: rejected drafts]" in text


async def test_sampling_pane_shows_each_stage_kept_mass_and_the_draw(example_trace: Path) -> None:
    async with tui(example_trace, request="req-1") as (pilot, screen):
        text = pane(screen, "sampling")
        header = text.splitlines()[:2]
        assert ["temperature", "top_k", "top_p"] == [w for w in header[0].split() if w != "logits"]
        assert "kept 50 · mass 0.97" in header[1] and "kept 3 · mass 0.86" in header[1]
        assert '" Waves"' in text and "0.301" in text  # exp(-1.2)
        assert 'chosen " Waves" #40853  by draw u=0.5300 (seeded)' in text


async def test_sampling_pane_for_a_greedy_request_says_argmax(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        text = pane(screen, "sampling")
        assert "entropy" in text and '✓" Paris"' in text
        assert 'chosen " Paris" #7042  by greedy (argmax)' in text


async def test_tokens_pane_colours_by_logprob_and_lists_alternatives(example_trace: Path) -> None:
    async with tui(example_trace, step=3, request="req-1") as (pilot, screen):
        text = pane(screen, "tokens")
        assert "prompt Write a haiku about the sea:  (8 tokens)" in text
        assert " Waves crash on the rocks" in text
        assert 'token " on" #335  position 2  logprob -0.480 (p 0.619)  rank 1  source spec_accept  step 3' in text
        assert '" against"' in text and "0.247" in text
        chips = screen.query_one("#tokens").draw(screen_context(screen)).renderables[1]  # type: ignore[attr-defined]
        styles = {chips.plain[s.start:s.end]: str(s.style) for s in chips.spans}
        assert "#afd75f" in styles[" on"] and "reverse" in styles[" on"]  # p 0.62: the ≥.5 band, selected
        assert "#ffd75f" in styles[" Waves"] or "#e0b840" in styles[" Waves"]  # p 0.30: the ≥.2 band
        assert styles["<|im_end|>"] == "grey50"  # produced after step 3: dimmed


def screen_context(screen: MainScreen):  # noqa: ANN201 - the PaneContext the panes last drew
    from tui.widgets.base import PaneContext

    return PaneContext(screen.view, screen.request, screen.sel, screen.model.vocab, True, screen.hit)


async def test_spec_pane_marks_accepts_the_rejection_and_the_recovered_token(example_trace: Path) -> None:
    async with tui(example_trace, step=3, request="req-1") as (pilot, screen):
        lines = pane(screen, "spec").splitlines()
        assert lines[0].split() == ["drafter", "ngram", "proposed", "4", "sampled"]
        rows = [line for line in lines if line[:1].isdigit()]
        assert [r.split('"')[1] for r in rows] == [" on", " the", " shore", " and"]
        assert [r.split('"')[2].split()[-2:] for r in rows] == [["✓", "accept"], ["✓", "accept"], ["✗", "reject"],
                                                                ["·", "skip"]]
        assert rows[2].split('"')[2].split()[:4] == ["1.000", "0.120", "0.120", "0.570"]  # q, p, p/q, u
        text = "\n".join(lines)
        assert "#2 rejected: u 0.570 ≥ min(1, p/q) 0.120" in text
        assert 'accepted 2/4  then recovered " rocks" #7739 (u 0.330)' in text
        assert "rolled back 2 KV slots (25–26)" in text


async def test_spec_pane_for_greedy_drafts_shows_targets_and_the_bonus(example_trace: Path) -> None:
    async with tui(example_trace, step=3, request="req-2") as (pilot, screen):
        text = pane(screen, "spec")
        assert "greedy" in text and 'accepted 4/4  then bonus "," #28' in text
        assert text.count("✓ accept") == 4 and "rejected" not in text


async def test_detok_pane_explains_held_back_text(example_trace: Path) -> None:
    async with tui(example_trace, step=3, request="req-0") as (pilot, screen):
        text = pane(screen, "detok")
        assert 'held     "\\n"  could be the start of a stop string' in text
        assert "(nothing emitted)" in text
    async with tui(example_trace, step=4, request="req-1") as (pilot, screen):
        text = pane(screen, "detok")
        assert "incomplete UTF-8 character" in text and '"\ufffd"' in text
    async with tui(example_trace, step=5, request="req-1") as (pilot, screen):
        assert 'delta    "🙂"' in pane(screen, "detok")


async def test_finish_pane_shows_every_check_and_the_stop_string_decision(example_trace: Path) -> None:
    async with tui(example_trace, step=4) as (pilot, screen):
        text = pane(screen, "finish")
        names = [line.split()[2] for line in text.splitlines() if line.startswith(("· no", "✓ fired"))]
        assert names == ["abort", "max_new_tokens", "context_full", "before_min_new_tokens", "eos_token",
                         "stop_token_ids", "stop_string", "tool_calls"]
        fired = [line.split()[2] for line in text.splitlines() if line.startswith("✓ fired")]
        assert fired == ["stop_string"]
        assert '→ finish_reason stop  evidence type="stop" matched="\\n\\n"' in text
        assert 'finished stop  matched "\\n\\n"' in text and 'text " Paris."' in text
    async with tui(example_trace, step=1) as (pilot, screen):
        assert "→ continues" in pane(screen, "finish")


async def test_panes_say_so_when_the_request_did_nothing_there(example_trace: Path) -> None:
    async with tui(example_trace, step=1) as (pilot, screen):
        assert pane(screen, "spec").strip() == "no speculative decoding for req-0 in step 1"


@pytest.mark.parametrize("name", ["batch", "sampling", "tokens", "spec", "detok", "finish"])
async def test_without_a_tokenizer_ids_still_show(example_trace: Path, tmp_path: Path, name: str) -> None:
    """A trace whose tokenizer folder is gone: prompt slices show as ids, output texts from the trace."""
    import shutil
    import sqlite3

    copy = tmp_path / "moved.wbtrace"
    shutil.copy(example_trace, copy)
    with sqlite3.connect(copy) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'tokenizer'", ('{"name": "/nonexistent"}',))
    async with tui(copy, step=3, request="req-1") as (pilot, screen):
        text = pane(screen, name)
        assert text.strip() and "Traceback" not in text
        if name == "batch":
            assert '" crash on the shore and"' in text  # these ids all appear as tokens somewhere in the trace
        if name == "tokens":
            assert " Waves crash on the rocks" in text


async def test_a_small_terminal_narrows_the_timeline_and_keeps_every_pane(example_trace: Path) -> None:
    app = WorkbenchApp(str(example_trace), step=4)
    async with app.run_test(size=(110, 34)) as pilot:
        await settle(pilot)
        screen = app.main
        assert screen.has_class("-narrow") and screen.has_class("-short")
        assert screen.timeline.outer_size.width == 30
        for name in ("batch", "sampling", "tokens", "spec", "detok", "finish"):
            widget = screen.query_one(f"#{name}")
            assert widget.outer_size.height >= 3 and widget.outer_size.width >= 20, name
        assert "stop_string" in pane(screen, "finish")
