"""Live mode: the TUI follows an SSE stream of trace events (a stand-in `/debug/events` server here),
and a trace file that is still being written.

The stand-in speaks what workbench/server's `/debug/events` sends: a `server.hello` record, events
in their `to_json()` form, `server.stats` records, one `data: <json>` frame each.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.tui_pilot import SIZE, pane, settle, wait_for
from tui.app import WorkbenchApp
from tui.live import LiveTrace, events_url, parse_sse
from workbench.trace.reader import open_trace
from workbench.trace.store import TraceWriter

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("frozen_heap")]


class StandInServer:
    """`GET /debug/events`: streams whatever `send` queues; `status` other than 200 answers an error."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.frames: queue.Queue[bytes | None] = queue.Queue()
        self.connections = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/debug/events":
                    self.send_error(404)
                    return
                owner.connections += 1
                if owner.status != 200:
                    body = json.dumps({"error": {"message": "invalid API key", "type": "x", "param": None,
                                                 "code": "invalid_api_key"}}).encode()
                    self.send_response(owner.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                while (frame := owner.frames.get()) is not None:
                    self.wfile.write(frame)
                    self.wfile.flush()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def send(self, obj: dict[str, Any] | str) -> None:
        self.frames.put(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

    def close(self) -> None:
        for _ in range(4):
            self.frames.put(None)
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[StandInServer]:
    srv = StandInServer()
    yield srv
    srv.close()


def step_events(trace_path: Path) -> dict[int, list[dict[str, Any]]]:
    with open_trace(trace_path) as trace:
        return {s.step: [e.to_json() for e in trace.step(s.step)] for s in trace.steps()}



async def test_live_mode_shows_each_new_step_within_a_second(server: StandInServer, example_trace: Path) -> None:
    steps = step_events(example_trace)
    app = WorkbenchApp(live_url=events_url(server.url))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main
        server.send({"kind": "server.hello", "model": "SmolLM2-135M-Instruct", "engine": {}, "step": 0, "running": 0,
                     "waiting": 0, "kv_used": 0, "kv_total": 4096, "dropped": 0, "delivered": 0})
        await wait_for(pilot, lambda: "connected" in str(screen.query_one("#status").render()))
        latencies = []
        for n in (1, 2, 3):
            for event in steps[n]:
                server.send(event)
            latencies.append(await wait_for(pilot, lambda n=n: screen.view is not None and screen.view.step == n))
        assert max(latencies) < 1.0, latencies
        await settle(pilot)
        assert [r.split()[:2] for r in screen.timeline.visible_rows()] == [["1", "EXTEND"], ["2", "MIXED"],
                                                                           ["3", "VERIFY"]]  # the verify step, labelled as one
        assert screen.sel.step == 3  # live mode follows the newest step
        assert "forward  TARGET_VERIFY  batch_size 3  tokens 11" in pane(screen, "batch")
        status = str(screen.query_one("#status").render())
        assert "SmolLM2-135M-Instruct" in status and "following new steps" in status and "KV 0/4096" in status


async def test_moving_back_stops_following_and_g_resumes(server: StandInServer, example_trace: Path) -> None:
    steps = step_events(example_trace)
    app = WorkbenchApp(live_url=events_url(server.url))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main
        for n in (1, 2):
            for event in steps[n]:
                server.send(event)
        await wait_for(pilot, lambda: screen.sel.step == 2)
        await pilot.press("p")
        await settle(pilot)
        for event in steps[3]:
            server.send(event)
        await wait_for(pilot, lambda: len(screen.nav) == 3)
        await settle(pilot)
        assert screen.sel.step == 1  # the user is reading step 1: new steps do not pull them away
        await pilot.press("G")
        await wait_for(pilot, lambda: screen.view is not None and screen.view.step == 3)
        for event in steps[4]:
            server.send(event)
        await wait_for(pilot, lambda: screen.view is not None and screen.view.step == 4)


async def test_a_step_arriving_in_pieces_updates_the_panes(server: StandInServer, example_trace: Path) -> None:
    events = step_events(example_trace)[4]
    cut = next(i for i, e in enumerate(events) if e["kind"] == "finish" and e["req_id"] == "req-0")
    app = WorkbenchApp(live_url=events_url(server.url))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main
        for event in events[:cut]:
            server.send(event)
        await wait_for(pilot, lambda: screen.view is not None and screen.view.step == 4)
        await settle(pilot)
        assert pane(screen, "finish").startswith("no finish check for req-0")
        for event in events[cut:]:
            server.send(event)
        await wait_for(pilot, lambda: "stop_string" in pane(screen, "finish"))


async def test_unknown_records_are_skipped_and_an_error_status_is_shown(example_trace: Path) -> None:
    srv = StandInServer(status=401)
    try:
        app = WorkbenchApp(live_url=events_url(srv.url))
        async with app.run_test(size=SIZE) as pilot:
            screen = app.main
            await wait_for(pilot, lambda: "HTTP 401: invalid API key" in str(screen.query_one("#status").render()))
            srv.status = 200
            srv.send({"kind": "no.such.kind", "step": 1, "payload": {}})
            srv.send("not json")
            for event in step_events(example_trace)[1]:
                srv.send(event)
            await wait_for(pilot, lambda: screen.view is not None and screen.view.step == 1, timeout=10)
            assert srv.connections >= 2  # it reconnected after the error
    finally:
        srv.close()


def test_parse_sse_joins_data_lines_and_skips_comments() -> None:
    lines = [": keep-alive", "", "event: x", 'data: {"a":', "data: 1}", "", "id: 3", "data: [DONE]", "", "data: 2", ""]
    assert list(parse_sse(lines)) == [{"a": 1}, None]


@pytest.mark.parametrize(("url", "expected"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/debug/events"),
    ("http://h:1/", "http://h:1/debug/events"),
    ("https://h/debug/events?kind=token", "https://h/debug/events?kind=token"),
])
def test_events_url(url: str, expected: str) -> None:
    assert events_url(url) == expected


@pytest.mark.parametrize("url", ["ftp://h", "127.0.0.1:8000", "http://"])
def test_events_url_rejects_what_is_not_http(url: str) -> None:
    with pytest.raises(ValueError, match="--live must be an http"):
        events_url(url)


def test_live_trace_keeps_the_newest_steps(example_trace: Path) -> None:
    from workbench.trace.events import event_from_json

    live = LiveTrace("http://x", max_steps=2)
    for events in step_events(example_trace).values():
        live.add(event_from_json(e) for e in events)
    assert [s.step for s in live.steps()] == [5, 6]
    assert {r.req_id for r in live.requests()} == {"req-0", "req-1", "req-2"}
    assert [e.kind for e in live.events(kind="token", req_id="req-1")] == ["token", "token"]


async def test_a_file_being_written_grows_on_screen(tmp_path: Path, example_trace: Path) -> None:
    """`workbench tui FILE` on a trace a running engine is still writing: new steps appear."""
    from workbench.trace.events import event_from_json

    steps = step_events(example_trace)
    path = tmp_path / "live.wbtrace"
    writer = TraceWriter(path, {"model": {"name": "growing"}})
    try:
        for event in steps[1]:
            writer.write(event_from_json(event))
        writer.flush()
        app = WorkbenchApp(str(path))
        async with app.run_test(size=SIZE) as pilot:
            screen = app.main
            await settle(pilot)
            assert len(screen.nav) == 1 and "following a file being written" in str(screen.query_one("#status").render())
            await pilot.press("G")
            for n in (2, 3):
                for event in steps[n]:
                    writer.write(event_from_json(event))
                writer.flush()
                await wait_for(pilot, lambda n=n: screen.view is not None and screen.view.step == n)
            writer.close()
            await wait_for(pilot, lambda: "file complete" in str(screen.query_one("#status").render()))
    finally:
        writer.close()
    await asyncio.sleep(0)
