"""Pilot tests of every key binding of the main screen, on the example trace (tests/tui/test_tui_fixtures.py).

`KEYS_TESTED` lists the keys these tests press; a binding added to the screen without a test here
fails `test_every_binding_is_tested`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.tui_pilot import pane, settle, tui
from tui.screens.help import HelpScreen, display_key
from tui.screens.main import MainScreen
from tui.widgets.cmdline import CommandLine

pytestmark = pytest.mark.anyio

KEYS_TESTED = {"n", "j", "down", "p", "k", "up", "pagedown", "ctrl+d", "pageup", "ctrl+u", "g", "home", "G", "end",
               "l", "right", "h", "left", "r", "R", "slash", "right_square_bracket", "left_square_bracket", "f", "F",
               "colon", "y", "Y", "escape", "question_mark", "q",
               "1", "2", "3", "4", "5", "6", "z",  # pane keys and maximize: tests/tui/test_tui_compact.py
               "i",  # the layers pane: tests/tui/test_tui_layers.py
               "b",  # a stored bisect: tests/tui/test_tui_bisect.py
               "w"}  # a watch proxy's conformance view: tests/tui/test_tui_conformance.py


def test_every_binding_is_tested() -> None:
    keys = {k.strip() for b in MainScreen.BINDINGS for k in b.key.split(",")}
    assert keys == KEYS_TESTED


async def press(pilot, *keys: str) -> None:  # noqa: ANN001 - textual Pilot
    for key in keys:
        await pilot.press(key)
        await settle(pilot)


async def test_step_keys_move_through_the_timeline(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        seen = []
        for key in ("n", "j", "down", "p", "k", "up"):
            await press(pilot, key)
            seen.append(screen.sel.step)
        assert seen == [2, 3, 4, 3, 2, 1]
        assert screen.timeline.cursor == 1 and pane(screen, "batch").startswith("schedule EXTEND")
        await press(pilot, "G")
        assert screen.sel.step == 6 and "step 6 (6/6)" in str(screen.query_one("#status").render())
        await press(pilot, "g")
        assert screen.sel.step == 1
        await press(pilot, "end", "home")
        assert screen.sel.step == 1
        await press(pilot, "pagedown")
        assert screen.sel.step == 6  # 10 steps on, clamped at the last
        await press(pilot, "pageup")
        assert screen.sel.step == 1
        await press(pilot, "ctrl+d", "ctrl+u")
        assert screen.sel.step == 1
        await press(pilot, "p")
        assert screen.sel.step == 1  # stays at the first step


async def test_arrow_keys_still_step_when_the_timeline_has_focus(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        assert screen.focused is screen.timeline
        await press(pilot, "down", "down")
        assert screen.sel.step == 3 and pane(screen, "batch").count("TARGET_VERIFY") == 1


async def test_token_keys_walk_a_requests_tokens_across_steps(example_trace: Path) -> None:
    async with tui(example_trace, step=2, request="req-1") as (pilot, screen):
        assert (screen.sel.step, screen.sel.position) == (2, 1)
        await press(pilot, "l")
        assert (screen.sel.step, screen.sel.req_id, screen.sel.position) == (3, "req-1", 2)
        await press(pilot, "right", "l")
        assert (screen.sel.step, screen.sel.position) == (3, 4)
        assert 'source spec_recover' in pane(screen, "tokens")
        await press(pilot, "l")
        assert (screen.sel.step, screen.sel.position) == (4, 5)
        await press(pilot, "h", "left")
        assert (screen.sel.step, screen.sel.position) == (3, 3)
        assert 'token " the" #260' in pane(screen, "tokens")


async def test_request_keys_cycle_the_batch(example_trace: Path) -> None:
    async with tui(example_trace, step=3) as (pilot, screen):
        order = [screen.sel.req_id]
        for _ in range(3):
            await press(pilot, "r")
            order.append(screen.sel.req_id)
        assert order == ["req-1", "req-2", "req-0", "req-1"]
        await press(pilot, "R")
        assert screen.sel.req_id == "req-0"
        assert "could be the start of a stop string" in pane(screen, "detok")


async def test_jump_to_step(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        await press(pilot, "colon")
        line = screen.query_one(CommandLine)
        assert line.has_class("open") and screen.focused is line
        await pilot.press(*"5", "enter")
        await settle(pilot)
        assert screen.sel.step == 5 and not line.has_class("open")
        await pilot.press("colon", *"x5", "enter")
        await settle(pilot)
        assert screen.sel.step == 5 and "not a step number: 'x5'" in str(screen.query_one("#status").render())
        await pilot.press("colon", *"99", "enter")
        await settle(pilot)
        assert screen.sel.step == 6  # past the end: the last step


async def test_search_finds_text_across_tokens_then_next_and_previous(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        await pilot.press("slash", *"the rocks", "enter")
        await settle(pilot)
        assert (screen.sel.step, screen.sel.req_id, screen.sel.position) == (3, "req-1", 4)
        assert screen.hit is not None and screen.hit.positions == (3, 4)  # " the" + " rocks"
        chips = pane(screen, "tokens")
        assert " Waves crash on the rocks" in chips
        await pilot.press("slash", *",", "enter")  # "," appears at steps 3 (req-2) and 5 (req-2)
        await settle(pilot)
        assert (screen.sel.step, screen.sel.req_id) == (5, "req-2")
        await press(pilot, "right_square_bracket")
        assert (screen.sel.step, screen.sel.req_id) == (3, "req-2")  # wrapped around
        await press(pilot, "left_square_bracket")
        assert (screen.sel.step, screen.sel.req_id) == (5, "req-2")
        await press(pilot, "escape")
        assert screen.hit is None


async def test_search_by_token_id_and_not_found(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        await pilot.press("slash", *"#7739", "enter")
        await settle(pilot)
        assert (screen.sel.step, screen.sel.req_id, screen.sel.position) == (3, "req-1", 4)
        await pilot.press("slash", *"zebra", "enter")
        await settle(pilot)
        assert screen.sel.step == 3 and "not found: zebra" in str(screen.query_one("#status").render())


async def test_filter_by_prompt_text_limits_the_timeline(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        await pilot.press("f", *"count", "enter")
        await settle(pilot)
        assert [r.split()[0] for r in screen.timeline.visible_rows()] == ["2", "3", "4", "5"]
        assert screen.sel == screen.sel.__class__(2, "req-2", 0)
        await press(pilot, "n", "n", "n", "n")
        assert screen.sel.step == 5 and screen.sel.req_id == "req-2"
        await pilot.press("f", *"nothing like this", "enter")
        await settle(pilot)
        assert "no request matches 'nothing like this'" in str(screen.query_one("#status").render())
        assert len(screen.timeline.visible_rows()) == 4  # the old filter stays
        await pilot.press("f", "enter")  # an empty filter shows every step
        await settle(pilot)
        assert len(screen.timeline.visible_rows()) == 6


async def test_follow_keeps_one_request_across_steps(example_trace: Path) -> None:
    async with tui(example_trace, request="req-0") as (pilot, screen):
        await press(pilot, "F")
        assert "following req-0" in str(screen.query_one("#status").render())
        steps = [screen.sel.step]
        for _ in range(4):
            await press(pilot, "n")
            steps.append(screen.sel.step)
        assert steps == [1, 2, 3, 4, 4] and screen.sel.req_id == "req-0"
        await press(pilot, "F")
        assert len(screen.timeline.visible_rows()) == 6


async def test_copy_the_requests_text_and_the_focused_pane(example_trace: Path) -> None:
    async with tui(example_trace, step=2, request="req-0") as (pilot, screen):
        await press(pilot, "y")
        assert pilot.app.clipboard == " Paris."
        await press(pilot, "n", "n", "y")
        assert pilot.app.clipboard == " Paris."  # finished at step 4: its final text, stop string cut
        screen.query_one("#finish").focus()
        await press(pilot, "Y")
        assert "stop_string" in pilot.app.clipboard and "finish_reason stop" in pilot.app.clipboard


async def test_help_lists_every_binding_and_closes(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        await press(pilot, "question_mark")
        help_screen = pilot.app.screen
        assert isinstance(help_screen, HelpScreen)
        from io import StringIO

        from rich.console import Console

        console = Console(file=StringIO(), width=120, color_system=None)
        console.print(help_screen.table)
        text = console.file.getvalue()
        for binding in MainScreen.BINDINGS:
            assert binding.description in text
            for key in binding.key.split(","):
                assert display_key(key.strip()) in text
        await press(pilot, "escape")
        assert pilot.app.screen is screen


async def test_q_quits(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        await pilot.press("q")
        await pilot.pause(0.1)
        assert not pilot.app.is_running


async def test_clicking_a_step_selects_it(example_trace: Path) -> None:
    async with tui(example_trace) as (pilot, screen):
        await pilot.click("#timeline", offset=(5, 4))  # border, header, then rows 1, 2, 3
        await settle(pilot)
        assert screen.sel.step == 3


async def test_text_typed_right_behind_slash_is_not_lost(example_trace: Path) -> None:
    """A fast typist (or a paste) sends `/the rocks⏎` in one burst, before the command line has focus."""
    from textual import events

    async with tui(example_trace) as (pilot, screen):
        burst = [("slash", "/")] + [(c if c != " " else "space", c) for c in "the rocks"] + [("enter", "\r")]
        for key, char in burst:
            pilot.app.post_message(events.Key(key, char))
        await settle(pilot)
        await settle(pilot)
        assert screen.query_text == "the rocks" and (screen.sel.step, screen.sel.req_id) == (3, "req-1")
        await pilot.press("slash", "up", "enter")  # ↑ recalls the last search: the next match wraps to it again
        await settle(pilot)
        assert screen.query_text == "the rocks"
