"""The latency waterfall in the viewers, on a trace recorded through the server (tiny-random model): the
notebook figure, the TUI pane (Pilot), and the live page in headless Chromium (skipped, saying so,
without chromium)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest
from textual.worker import WorkerState

from tests.helpers.tui_pilot import SIZE, settle
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
    assert lat.has_server and len(lat.steps) == TOKENS and lat.written
    # a busy machine coalesces deltas into fewer frames; frames plus merged deltas still cover every token
    assert len(lat.written) + int(lat.summary.get("coalesced") or 0) >= TOKENS - 1
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


# --- the live page, in headless Chromium ------------------------------------------------------------

BLUE_PIXELS = """async (src) => {
  const img = new Image(); img.src = src; await img.decode();
  const c = document.createElement("canvas"); c.width = img.width; c.height = img.height;
  const ctx = c.getContext("2d"); ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i + 2] - Math.min(d[i], d[i + 1]) > 60) n++;
  return n;
}"""


def test_live_page_draws_the_waterfall_when_a_stream_ends(chromium, page_server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(page_server.url + "/")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=60_000)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", page_server.url + "/v1/chat/completions",
                                                           json=body) as resp:
        rid = resp.headers["x-request-id"]
        body = resp.read().decode()
    # the server coalesces tokens into one frame when the socket is behind: count what it sent
    sent = sum(1 for line in body.splitlines()
               if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"))
    page.wait_for_function("document.querySelectorAll('.req .lat rect').length > 0", timeout=60_000)
    card = page.locator(".req", has_text=rid)
    header = card.locator(".lat .dim").inner_text()
    assert "socket: first token written" in header and "forward" in header
    frames = page.evaluate("new Set([...document.querySelectorAll('.req .lat rect title')]"
                           ".map(t => t.textContent.split(' (')[0])).size")
    # one row per frame that carried tokens; on a busy machine all 8 tokens can arrive as one frame
    assert sent >= 1 and frames == sent
    png = card.locator(".lat svg").screenshot()
    blue = page.evaluate(BLUE_PIXELS, "data:image/png;base64," + base64.b64encode(png).decode())
    assert blue > 100, blue  # the bars are drawn, not just present in the DOM
    page.close()
