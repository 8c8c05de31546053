"""`python -m tui FILE --screenshot OUT.svg`: draw the TUI headless at a step and save an SVG.

Owns taking the picture once every pane shows the selected step (for docs/tui.svg and bug
reports). Does not own what is drawn (the app).
"""

from __future__ import annotations

import asyncio
import os

from tui.app import WorkbenchApp
from workbench.trace.live import TraceView

SIZE = (160, 48)
TIMEOUT = 30.0


async def _shoot(app: WorkbenchApp, out: str, size: tuple[int, int]) -> None:
    async with app.run_test(size=size) as pilot:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT
        screen = app.main
        while not (screen.sel.step is not None and screen.view is not None and screen.view.step == screen.sel.step):
            if loop.time() > deadline:
                raise TimeoutError("the TUI did not draw the step in time")
            await pilot.pause(0.05)
        await pilot.pause(0.3)  # the tokenizer may still arrive and redraw the panes
        app.save_screenshot(os.path.basename(out), os.path.dirname(os.path.abspath(out)))


def screenshot(source: TraceView, out: str, *, step: int | None = None, request: str | None = None,
               tokenizer: str | None = None, show_times: bool = True, size: tuple[int, int] = SIZE) -> str:
    """Save the main screen of `source` at `step` as an SVG file `out`; returns `out`."""
    if not out.endswith(".svg"):
        raise ValueError(f"--screenshot must name an .svg file, got {out!r}")
    app = WorkbenchApp(source=source, step=step, request=request, tokenizer=tokenizer, show_times=show_times)
    asyncio.run(_shoot(app, out, size))
    return out
