"""Driving the TUI headless (Textual's Pilot): open it on a trace and wait until it settles, read a
pane's text as a user sees it, wait for a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from textual.pilot import Pilot
from textual.worker import WorkerState

from tui.app import WorkbenchApp
from tui.screens.main import MainScreen

SIZE = (160, 48)
BUSY_GROUPS = {"open", "load", "search", "filter", "vocab"}


async def settle(pilot: Pilot, timeout: float = 10.0) -> None:
    """Wait until no open/load/search/filter worker runs and the panes show the selection."""
    app = pilot.app
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        await pilot.pause(0.02)
        busy = [w for w in app.workers if w.group in BUSY_GROUPS and w.state in (WorkerState.PENDING, WorkerState.RUNNING)]
        screen = app.screen_stack[0]
        ready = isinstance(screen, MainScreen) and (
            screen.sel.step is None or (screen.view is not None and screen.view.step == screen.sel.step))
        if not busy and ready:
            # Panes lay out over a few refreshes after their data lands: wait for two identical frames.
            last = None
            while loop.time() < deadline:
                await pilot.wait_for_scheduled_animations()
                await pilot.pause(0.05)
                frame = app.export_screenshot()
                if frame == last:
                    return
                last = frame
            break
    raise AssertionError("the TUI did not settle")


@asynccontextmanager
async def tui(path: Path, **kwargs: object) -> AsyncIterator[tuple[Pilot, MainScreen]]:
    app = WorkbenchApp(str(path), **kwargs)  # type: ignore[arg-type]
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        yield pilot, app.main


def pane(screen: MainScreen, name: str) -> str:
    return screen.query_one(f"#{name}").text(120)  # type: ignore[attr-defined]


async def wait_for(pilot, predicate, timeout: float = 5.0) -> float:  # noqa: ANN001
    """Seconds until `predicate()` held (AssertionError after `timeout`)."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if predicate():
            return time.perf_counter() - start
        await pilot.pause(0.01)
    raise AssertionError("condition not met in time")
