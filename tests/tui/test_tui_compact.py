"""The TUI on an 80x24 terminal (panes as tabs: every pane reachable and drawn full height), `z` to
maximize, the command palette's jump / request / search commands, a verify step labelled as one with
the same batch size in both panes, and a filter's success clearing an earlier "no request matches"."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.tui_pilot import settle
from tui.app import WorkbenchApp
from tui.screens.compact import PANES
from workbench.trace.export import export_perfetto
from workbench.trace.reader import open_trace

pytestmark = pytest.mark.anyio
SMALL = (80, 24)
ROOT = Path(__file__).resolve().parents[2]


async def test_every_pane_gets_the_room_at_80x24(example_trace: Path) -> None:
    app = WorkbenchApp(str(example_trace), step=3, request="req-1")
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        screen = app.main
        assert screen.has_class("-compact")
        bar = str(screen.query_one("#panebar").render())
        assert all(f"{key}:{name}" in bar for key, _, name in PANES)
        for key, pane_id, _ in PANES:
            await pilot.press(key)
            await settle(pilot)
            pane = screen.query_one(f"#{pane_id}")
            assert pane.region.height >= 15, (pane_id, pane.region)  # the right column's full height
            assert pane.text(120).strip(), pane_id
            others = [p for _, p, _ in PANES if p != pane_id]
            assert all(screen.query_one(f"#{o}").region.height == 0 for o in others)
            assert screen.focused is pane  # its keys (scrolling, Y to copy) act on it


async def test_z_maximizes_the_focused_pane(example_trace: Path) -> None:
    app = WorkbenchApp(str(example_trace), step=3, request="req-1")
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        await pilot.press("3")  # focus the Tokens pane
        await pilot.press("z")
        await settle(pilot)
        assert app.main.maximized is not None and app.main.maximized.id == "tokens"
        assert app.main.query_one("#tokens").region.width > 150
        await pilot.press("z")
        await settle(pilot)
        assert app.main.maximized is None


async def _palette(pilot, text: str) -> None:
    await pilot.press("ctrl+p")
    await pilot.pause(0.2)
    await pilot.press(*text)
    await pilot.pause(0.6)  # the providers' search runs in the background
    await pilot.press("enter")
    await settle(pilot)


async def test_command_palette_jumps_selects_and_searches(example_trace: Path) -> None:
    app = WorkbenchApp(str(example_trace))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        screen = app.main
        await _palette(pilot, "5")
        assert screen.sel.step == 5
        await _palette(pilot, "req-2")
        assert screen.sel.req_id == "req-2"
        with open_trace(example_trace) as trace:
            arrival = next(r.arrival_step for r in trace.requests() if r.req_id == "req-2")
        assert screen.sel.step == arrival


async def test_verify_step_is_labelled_and_counted_alike(example_trace: Path) -> None:
    app = WorkbenchApp(str(example_trace), step=3, request="req-1")
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        screen = app.main
        row = next(r.split() for r in screen.timeline.visible_rows() if r.split()[0] == "3")
        assert row[1] == "VERIFY"
        assert re.search(r"batch_size (\d+)", screen.query_one("#batch").text(160)).group(1) == row[2]
    out = example_trace.parent / "perfetto.json"
    with open_trace(example_trace) as trace:
        export_perfetto(trace, str(out))
    names = {e["name"] for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "step"}
    assert "TARGET_VERIFY" in names


async def test_engine_verify_rows_are_not_counted_as_requests() -> None:
    """The engine packs a verify as k+1 rows per request: the pane counts requests, as the Steps table."""
    app = WorkbenchApp(str(ROOT / "traces" / "speculative.wbtrace"), step=9, request="req-1")
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        row = next(r.split() for r in app.main.timeline.visible_rows() if r.split()[0] == "9")
        batch = app.main.query_one("#batch").text(200)
        assert f"TARGET_VERIFY  batch_size {row[2]} ({row[3]} rows)" in batch


async def test_a_recorded_verify_step_is_not_labelled_decode_anywhere(tmp_path: Path) -> None:
    """traces/speculative.wbtrace was written when the step summary still said DECODE for a verify
    step: the Steps pane, the ForwardBatch pane's subtitle and the Perfetto export all say verify."""
    path = ROOT / "traces" / "speculative.wbtrace"
    with open_trace(path) as trace:
        steps = trace.steps()
        verify = [s.step for s in steps if s.spec_proposed]
        export_perfetto(trace, str(tmp_path / "perfetto.json"))
    assert verify and any(s.mode == "DECODE" for s in steps if s.spec_proposed)  # the stored summary
    slices = {e["args"]["step"]: e["name"] for e in json.loads((tmp_path / "perfetto.json").read_text())["traceEvents"]
              if e.get("cat") == "step"}
    assert all(slices[n] == "TARGET_VERIFY" for n in verify)
    assert {slices[s.step] for s in steps if not s.spec_proposed} <= {"EXTEND", "DECODE", "MIXED", "IDLE"}
    app = WorkbenchApp(str(path), step=verify[0], request="req-1")
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        rows = {r.split()[0]: r.split()[1] for r in app.main.timeline.visible_rows() if r.split()[0].isdigit()}
        assert all(rows[str(n)] == "VERIFY" for n in verify if str(n) in rows) and str(verify[0]) in rows
        assert "DECODE" in rows.values()  # the plain decode steps keep their label
        assert str(app.main.query_one("#batch").border_subtitle) == f"step {verify[0]} · TARGET_VERIFY"


async def test_a_successful_filter_clears_no_match(example_trace: Path) -> None:
    app = WorkbenchApp(str(example_trace))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        screen = app.main
        await pilot.press("f", *"zzzz-nothing", "enter")
        await settle(pilot)
        assert "no request matches" in screen.note
        await pilot.press("f", *"req-1", "enter")
        await settle(pilot)
        status = str(screen.query_one("#status").render())
        assert "no request matches" not in status and "filter 'req-1'" in status
