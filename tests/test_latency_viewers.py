"""The latency waterfall in the viewers, on a trace recorded through the server (tiny-random model): the
notebook figure, the TUI pane (Pilot), and what the live page is fed (the `stream_end` summary)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from textual.worker import WorkerState

from tests.test_tui_fixtures import _anyio_backend, _example_trace, _smollm2_folder  # noqa: F401 - fixtures
from tests.test_tui_panes import SIZE, settle
from tui.app import WorkbenchApp
from tui.widgets.latency import LatencyPane
from workbench.engine.engine import Engine
from workbench.notebook import TraceViewer
from workbench.notebook.figures import latency_waterfall
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer
from workbench.server.event_hub import EventHub
from workbench.trace.latency import CHUNK_COLUMNS, RequestLatency
from workbench.trace.reader import open_trace
from workbench.trace.store import TraceWriter

MODEL = "tiny-random"
TOKENS = 8


@pytest.fixture(scope="module")
def served_trace(tiny, tmp_path_factory) -> tuple[Path, str]:
    """A .wbtrace recorded by a server: one streamed chat request of 8 tokens; (path, its request id)."""
    path = tmp_path_factory.mktemp("served") / "served.wbtrace"
    hub, writer = EventHub(), TraceWriter(path)
    engine = Engine(tiny, trace_level="summary", trace_sinks=[hub, writer])
    app = create_app(engine, model_name=MODEL, hub=hub)
    with BackgroundServer(app) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": TOKENS,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", srv.url + "/v1/chat/completions",
                                                               json=body) as resp:
            rid = resp.headers["x-request-id"]
            resp.read()
    engine.close()
    return path, rid


def test_the_trace_rebuilds_the_servers_summary(served_trace):
    path, rid = served_trace
    with open_trace(path) as trace:
        lat = RequestLatency.from_events(rid, trace.events(req_id=rid))
    assert lat.has_server and len(lat.steps) == TOKENS and len(lat.written) >= TOKENS - 1
    rows = lat.summary["chunk_rows"]
    assert lat.summary["chunk_columns"] == list(CHUNK_COLUMNS) and len(rows) == len(lat.written)
    col = {name: i for i, name in enumerate(CHUNK_COLUMNS)}
    for row in rows:  # each frame's hand-offs in order: produced, handed over, taken, serialized, written
        times = [row[col[k]] for k in ("start", "forward_end", "output_done", "ready", "taken", "serialized", "written")]
        assert times == sorted(times) and times[0] > 0


def test_notebook_waterfall_draws_every_stage_from_arrival_to_the_socket(served_trace):
    path, rid = served_trace
    viewer = TraceViewer(str(path), req_id=rid, widgets=False)
    fig = viewer.figures["latency"]
    names = {t.name for t in fig.data}
    assert {"tokenize", "queue", "forward", "sample", "output", "serialize", "write"} <= names
    forward = next(t for t in fig.data if t.name == "forward")
    assert len(forward.y) == TOKENS and len(set(forward.y)) == TOKENS  # one row per step
    assert "at the socket" in fig.layout.title.text and rid in fig.layout.title.text
    assert all(x > 0 for t in fig.data for x in t.x)
    assert "no latency stamps" in latency_waterfall(None).layout.annotations[0].text


def test_notebook_title_escapes_the_request_id():
    lat = RequestLatency("<img src=x>", arrival=1.0, tokenized=1.001, timings={"ttft": 0.1})
    fig = latency_waterfall(lat)
    assert "<img" not in fig.layout.title.text and "&lt;img" in fig.layout.title.text


async def _wait_latency(pilot, pane: LatencyPane, rid: str) -> None:  # noqa: ANN001 - textual Pilot
    for _ in range(200):
        await pilot.pause(0.02)
        busy = [w for w in pilot.app.workers if w.group == "latency"
                and w.state in (WorkerState.PENDING, WorkerState.RUNNING)]
        if not busy and pane.latency is not None and pane.latency.req_id == rid:
            await pilot.pause(0.02)
            return
    raise AssertionError("the latency pane did not load")


@pytest.mark.anyio
async def test_tui_pane_shows_the_waterfall_of_a_served_request(served_trace):
    path, rid = served_trace
    app = WorkbenchApp(str(path), request=rid)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        pane = app.main.query_one(LatencyPane)
        await _wait_latency(pilot, pane, rid)
        assert pane.display
        text = pane.text(160)
        assert "TTFT" in text and "socket: first written" in text and "shares" in text
        step_rows = [line for line in text.splitlines() if line.lstrip().startswith("step ")]
        assert len(step_rows) == TOKENS
        assert all("fwd" in line and "write" in line for line in step_rows)
        assert rid in pane.border_subtitle and f"{TOKENS} steps" in pane.border_subtitle


@pytest.mark.anyio
async def test_tui_pane_stays_hidden_for_an_engine_only_trace(example_trace: Path):
    app = WorkbenchApp(str(example_trace))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        pane = app.main.query_one(LatencyPane)
        await _wait_latency(pilot, pane, app.main.sel.req_id)
        assert not pane.display and not pane.latency.has_server
