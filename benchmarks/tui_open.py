"""TUI speed on a million-event trace: time to first paint, and time to move one step.

Writes a synthetic trace (workbench.trace.synth, ~1M events) unless `--trace` names one, then:
- first paint, in process: from constructing `WorkbenchApp` until the timeline and every pane show
  the first step (headless, 160x48);
- first paint, real command (`--cold`, needs tmux): from starting `python -m tui FILE` until the
  ForwardBatch pane shows on a 160x48 terminal (Python and Textual start-up included);
- one step: the `n` key event posted until every pane holds the next step and the next frame is
  drawn (median and p95 over `--moves`);
- far jumps: `G` (last step) and `:` to the middle, each until the panes show it.

Usage: python benchmarks/tui_open.py [--events 1000000] [--trace PATH] [--moves 50] [--cold] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textual import events  # noqa: E402
from textual.screen import Screen  # noqa: E402

from tui.app import WorkbenchApp  # noqa: E402
from tui.screens.main import MainScreen  # noqa: E402
from workbench.trace.synth import write_synthetic_trace  # noqa: E402

SIZE = (160, 48)
PAINTS: list[float] = []  # when the screen last wrote a frame (Textual's compositor refresh)

_refresh = Screen._compositor_refresh


def _timed_refresh(self: Screen) -> None:
    _refresh(self)
    PAINTS.append(time.perf_counter())


Screen._compositor_refresh = _timed_refresh  # a benchmark-only probe: when a frame is drawn


def shown(screen: MainScreen, step: int) -> bool:
    """True once the panes were redrawn from the loaded view of `step`."""
    return screen.view is not None and screen.view.step == step and screen.sel.step == step and \
        screen.query_one("#batch").border_subtitle.startswith(f"step {step} ")


async def painted(predicate: Any, start: float, timeout: float = 30.0) -> float:
    """Seconds from `start` until `predicate()` holds and the next frame after that is drawn."""
    while not predicate():
        if time.perf_counter() - start > timeout:
            raise TimeoutError("the TUI did not show it in time")
        await asyncio.sleep(0.001)
    ready = time.perf_counter()
    while not PAINTS or PAINTS[-1] < ready:
        await asyncio.sleep(0.001)
    return PAINTS[-1] - start


async def keys(app: WorkbenchApp, *names: str) -> float:
    """Post key events as a terminal would; return when they were sent."""
    start = time.perf_counter()
    for name in names:
        app.post_message(events.Key(name, name if len(name) == 1 else None))
    return start


async def measure(path: str, moves: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    app = WorkbenchApp(path)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main
        first_paint = await painted(lambda: screen.nav.steps and shown(screen, screen.nav.first()), t0)
        await pilot.pause(0.5)
        num_steps = len(screen.nav.steps)
        step_times = []
        for _ in range(moves):
            target = screen.nav.move(screen.sel.step, 1)
            start = await keys(app, "n")
            step_times.append(await painted(lambda target=target: shown(screen, target), start))
            await pilot.pause(0.05)
        start = await keys(app, "G")
        last = await painted(lambda: shown(screen, screen.nav.last()), start)
        await pilot.pause(0.05)
        middle = screen.nav.steps[num_steps // 2].step
        start = await keys(app, "colon", *str(middle), "enter")
        jump = await painted(lambda: shown(screen, middle), start)
    step_times.sort()
    return {"steps": num_steps, "first_paint_s": first_paint, "step_median_s": statistics.median(step_times),
            "step_p95_s": step_times[int(0.95 * (len(step_times) - 1))], "last_step_s": last, "jump_middle_s": jump}


def cold_start(path: str) -> float | None:
    """Seconds from launching `python -m tui FILE` in tmux until the ForwardBatch pane shows a step."""
    if shutil.which("tmux") is None:
        return None
    name = f"wbbench-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", name, "-f", "/dev/null"]
    start = time.perf_counter()
    subprocess.run([*tmux, "new-session", "-d", "-s", name, "-x", "160", "-y", "48",
                    f"env -u COLUMNS -u LINES TERM=xterm-256color {sys.executable} -m tui {path}"], check=True)
    try:
        while time.perf_counter() - start < 60:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", name], capture_output=True, text=True).stdout
            if "step 0 · " in screen or "step 1 · " in screen:  # the batch pane's subtitle: its content is drawn
                return time.perf_counter() - start
            time.sleep(0.01)
        return None
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--trace", help="use this trace instead of writing a synthetic one")
    parser.add_argument("--moves", type=int, default=50)
    parser.add_argument("--cold", action="store_true", help="also time the real command's start in tmux")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    tmp = None
    if args.trace:
        path = args.trace
        info = {"trace": path}
    else:
        tmp = tempfile.mkdtemp(prefix="tui_open_")
        path = os.path.join(tmp, "synthetic.wbtrace")
        t = time.perf_counter()
        info = write_synthetic_trace(path, args.events)
        print(f"wrote {info['events']:,} events, {info['steps']:,} steps, {info['bytes'] / 2**20:.0f} MiB "
              f"in {time.perf_counter() - t:.1f} s")
    try:
        result = {**info, **asyncio.run(measure(path, args.moves))}
        if args.cold:
            result["cold_first_paint_s"] = cold_start(path)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"first paint (in process): {result['first_paint_s'] * 1e3:.0f} ms over {result['steps']:,} steps")
    if result.get("cold_first_paint_s") is not None:
        print(f"first paint (python -m tui in tmux, start-up included): {result['cold_first_paint_s'] * 1e3:.0f} ms")
    print(f"one step (n): median {result['step_median_s'] * 1e3:.1f} ms, p95 {result['step_p95_s'] * 1e3:.1f} ms")
    print(f"G to the last step: {result['last_step_s'] * 1e3:.1f} ms; jump to the middle: "
          f"{result['jump_middle_s'] * 1e3:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
