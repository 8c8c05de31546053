"""Live mode against the real server: `workbench serve` on tiny-random in its own process (as a user
runs it beside the TUI), the TUI following `/debug/events` while a completion runs, each new step on
screen within a second of the server sending it, and the request's tokens and finish decision in the
panes once it is done.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.helpers.tui_pilot import SIZE, pane, settle, wait_for
from tui.app import WorkbenchApp
from tui.live import events_url

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("frozen_heap")]
MODEL = "tiny-random"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a ServerProcess
    from workbench.server.background import ServerProcess
    from workbench.trace.reader import open_trace

    trace_dir = tmp_path_factory.mktemp("tui_server")
    with ServerProcess(["--model", MODEL, "--device", "cpu", "--log-level", "warning", "--trace-dir", str(trace_dir)]) as srv:
        yield srv
    # SIGTERM was a graceful shutdown: the server closed its trace, every step the TUI saw is in it
    (path,) = trace_dir.glob("*.wbtrace")
    with open_trace(path) as trace:
        assert trace.finished and trace.num_steps >= 16


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()


async def test_the_tui_follows_a_running_server(server) -> None:  # noqa: ANN001
    app = WorkbenchApp(live_url=events_url(server.url))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main
        await wait_for(pilot, lambda: "server step" in str(screen.query_one("#status").render()), timeout=10)
        result = await asyncio.to_thread(complete, server.url, "The workbench TUI follows", 24)
        text = result["choices"][0]["text"]
        await wait_for(pilot, lambda: screen.request is not None and screen.request.finished is not None, timeout=10)
        await settle(pilot)
        mine = [s for s in screen.nav.steps if screen.request.req_id in s.req_ids]
        assert len(mine) == 24  # the prefill step (first token), then one decode step per token
        status = str(screen.query_one("#status").render())
        assert "following new steps" in status and "connected" in status
        tokens = pane(screen, "tokens")
        assert "The workbench TUI follows" in tokens
        assert "".join(t.text for t in screen.request.tokens) == text
        finish = pane(screen, "finish")
        assert "finish_reason length" in finish and "✓ fired  max_new_tokens" in finish


async def test_new_steps_show_within_a_second_of_the_server_sending_them(server) -> None:  # noqa: ANN001
    """Each step's `schedule` event is stamped on the server's clock; the TUI must show it < 1 s later."""
    seen: dict[int, float] = {}
    sent: dict[int, float] = {}
    app = WorkbenchApp(live_url=events_url(server.url))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main
        await wait_for(pilot, lambda: "server step" in str(screen.query_one("#status").render()), timeout=10)
        stream = asyncio.create_task(asyncio.to_thread(_record_sends, server.url, sent, 8.0))
        await asyncio.sleep(0.3)
        task = asyncio.create_task(asyncio.to_thread(complete, server.url, "Timing", 16))
        while not (task.done() and stream.done()):
            for info in screen.nav.steps:
                seen.setdefault(info.step, time.perf_counter())
            await pilot.pause(0.005)
    lags = [seen[s] - sent[s] for s in sent if s in seen]
    assert len(lags) >= 16 and max(lags) < 1.0, lags


def _record_sends(url: str, sent: dict[int, float], seconds: float) -> None:
    """A second subscriber: when each step's schedule event reached a client (a stand-in for 'sent')."""
    deadline = time.perf_counter() + seconds
    with httpx.stream("GET", url + "/debug/events?kind=schedule", timeout=seconds + 5) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"kind":"schedule"' in line:
                step = int(line.split('"step":')[1].split(",")[0])
                sent.setdefault(step, time.perf_counter())
            if time.perf_counter() > deadline:
                return
