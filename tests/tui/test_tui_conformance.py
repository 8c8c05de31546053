"""Live mode on a `workbench watch` proxy: the TUI's conformance view, and `watch --floor`.

The upstream is a real `workbench serve` (tiny-random, the conftest's `page_server`, with its live
events); the watch in front of it checks every request against SmolLM2 (the same tokenizer, other
weights: every greedy token it serves is one the reference would not take) and classifies against a
floor file (one band, bound 1 nat, largest flip margin 12 nats: a flip whose reference gap is within
12 nats is "inside the floor"). What a user relies on: `workbench tui --live WATCH_URL` opens on the
conformance view; its figures are the watch's (the floor beside them, positions inside the floor
and beyond it, conformance by minute, the latest real divergences); a divergence's tokens show beside
the reference's; `t` opens its trace in the main view with the reference beside each token; the
live view underneath follows the upstream's steps through the proxy. And a snapshot of the view.
"""

from __future__ import annotations

import math
import re

import httpx
import pytest
from textual.app import App
from textual.screen import Screen
from textual.widgets import DataTable

from tests.helpers.prompts import PLAIN
from tests.helpers.tui_pilot import SIZE, pane, wait_for
from tui.app import WorkbenchApp
from tui.conformance import status_url
from tui.live import events_url
from tui.screens.conformance import ConformanceScreen
from tui.screens.main import MainScreen

pytestmark = [pytest.mark.anyio]
FLIP_MARGIN = 12.0
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def watched(page_server, smollm2, tmp_path_factory):  # noqa: ANN001, ANN201
    """The watch proxy over `workbench serve`, four greedy completions sent through it and checked."""
    from workbench.engine.engine import Engine
    from workbench.external.floor import Floor, FloorBand
    from workbench.watch.service import Watch, WatchServer

    folder = tmp_path_factory.mktemp("watch-tui")
    floor = Floor([FloorBand(0.0, math.inf, 50, 50, 1.0)], 2, 50, 1, [FLIP_MARGIN], 0, {"url": "http://replica:8000"})
    reference = Engine(smollm2, trace=None, trace_level="off")
    watch = Watch(page_server.url, out=folder / "traces", sample=1.0, engine=reference,
                  floor=floor.save(folder / "floor.json"))
    with WatchServer(watch) as server:
        for p in PLAIN[:4]:
            r = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny-random", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.status_code == 200
        assert watch.settle(120)
        yield server


def _status(server) -> dict:  # noqa: ANN001
    return httpx.get(server.url + "/watch/status", timeout=10).json()


def test_watch_classifies_against_the_floor_file_and_shows_it(watched) -> None:  # noqa: ANN001
    """`watch --floor`: every position as `check --floor` classifies it; /watch/status and /metrics show the floor."""
    from workbench.external.check import check_trace
    from workbench.trace.checks import read_checks
    from workbench.trace.reader import open_trace

    status = _status(watched)
    totals = status["totals"]
    assert status["floor"]["source"]["url"] == "http://replica:8000" and status["floor"]["max_flip_margin"] == 12.0
    [path] = watched.watch.recorder.files
    live = read_checks(path)
    report = check_trace(path, "smollm2", engine=watched.watch.checker.scorer.engine, store=False, progress=False,
                         floor=watched.watch.floor)
    verdicts = [q.verdict for rc in report.requests for q in rc.positions]
    assert [q["verdict"] for rc in report.requests for q in live[rc.req_id]["positions"]] == verdicts
    # each greedy flip is inside the floor exactly when the reference's gap is within the flip margin
    assert verdicts == ["ok" if q.token_id == q.ref_argmax else "floor" if q.gap <= FLIP_MARGIN else "real"
                        for rc in report.requests for q in rc.positions]
    assert 0 < verdicts.count("floor") < len(verdicts), "the floor should split these flips; pick another margin"
    assert totals["positions"]["floor"] == verdicts.count("floor") and totals["positions"]["real"] == verdicts.count("real")
    assert totals["beyond_floor"] == sum(abs(q.delta) > 1.0 for rc in report.requests for q in rc.positions)
    metrics = httpx.get(watched.url + "/metrics").text
    assert f'workbench_watch_positions_checked_total{{verdict="floor"}} {float(verdicts.count("floor"))}' in metrics
    assert 'workbench_watch_floor_bound{band="≥0"} 1.0' in metrics
    assert "workbench_watch_floor_max_flip_margin 12.0" in metrics
    assert f"workbench_watch_positions_beyond_floor_total {float(totals['beyond_floor'])}" in metrics
    with open_trace(path) as trace:  # the stored summary has the floor beside the figures, as check's
        summary = trace.meta["check"]
    assert summary["floor"]["max_flip_margin"] == 12.0 and summary["inside_floor"] == verdicts.count("floor")


def test_the_command_refuses_a_floor_file_that_is_not_one(tmp_path, capsys) -> None:  # noqa: ANN001
    from workbench.cli import main

    (tmp_path / "f.json").write_text('{"format": "something else"}')
    assert main(["watch", "--upstream", "http://127.0.0.1:9", "--floor", str(tmp_path / "f.json")]) == 2
    assert "floor: f.json is not a floor file" in capsys.readouterr().err


async def test_live_mode_on_a_watch_proxy_opens_its_conformance_view(watched) -> None:  # noqa: ANN001
    status = _status(watched)
    latest = status["latest_real"]
    app = WorkbenchApp(live_url=events_url(watched.url))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ConformanceScreen) and app.screen.readings > 0, timeout=15)
        screen = app.screen
        summary = str(screen.query_one("#conf-summary").render())
        n = status["totals"]["positions"]
        assert "4 requests checked" in summary and "4 with a real divergence" in summary
        assert f"inside the floor {n['floor']}" in summary and f"real {n['real']}" in summary
        assert "measured at http://replica:8000" in summary and f"beyond the floor {status['totals']['beyond_floor']}" in summary
        minutes = str(screen.query_one("#conf-time").render())
        # one row per minute: the run may cross a minute's boundary, so the rows add up to the totals
        assert "by minute" in minutes
        assert sum(map(int, re.findall(r"inside the floor (\d+)", minutes))) == n["floor"], minutes
        table = screen.query_one(DataTable)
        assert [table.get_row_at(i)[1] for i in range(table.row_count)] == [d["req_id"] for d in latest]

        # the first divergence is shown; down + enter shows the next: its tokens beside the reference's
        await pilot.press("down", "enter")
        detail = str(screen.query_one("#conf-detail").render())
        second = latest[1]
        assert f"request {second['req_id']}" in detail and f"--request {second['req_id']}" in detail
        for t in second["tokens"][:6]:
            assert f'"{t["engine"]["text"]}"'[:15] in detail and f'"{t["reference"]["text"]}"'[:15] in detail

        # t: its trace in the main view, the reference beside each token; q comes back
        await pilot.press("t")
        await wait_for(pilot, lambda: isinstance(app.screen, MainScreen) and app.screen is not app.main
                       and app.screen.request is not None, timeout=15)
        opened = app.screen
        assert opened.request.req_id == second["req_id"]
        await wait_for(pilot, lambda: "reference" in pane(opened, "tokens"), timeout=10)
        tokens = pane(opened, "tokens")
        assert "real divergence" in tokens or "inside the engine's noise floor" in tokens
        from workbench.trace.checks import read_checks

        stored = [q["verdict"] for q in read_checks(second["trace"])[second["req_id"]]["positions"]]
        assert (f"check: {stored.count('real')} real, 0 near ties, {stored.count('floor')} inside the floor"
                in str(opened.query_one("#tokens").border_subtitle))
        await pilot.press("q")
        assert app.screen is screen

        # escape: the live view underneath, following the upstream's steps through the proxy
        await pilot.press("escape")
        assert app.screen is app.main
        await wait_for(pilot, lambda: "server step" in str(app.main.query_one("#status").render()), timeout=10)
        assert "watch proxy" in str(app.main.query_one("#status").render())
        await pilot.press("w")
        assert isinstance(app.screen, ConformanceScreen)


def test_status_url_names_a_watchs_status_from_any_of_its_urls() -> None:
    for url in ("http://h:8100", "http://h:8100/", "http://h:8100/debug/events", "http://h:8100/watch"):
        assert status_url(url) == "http://h:8100/watch/status"
    with pytest.raises(ValueError, match="must be http"):
        status_url("h:8100")


# --- a snapshot of the view, from a designed status ------------------------------------------------

STATUS = {
    "upstream": "http://127.0.0.1:8000", "sample": 0.1, "tolerance": 0.05, "reference": "smollm2",
    "reference_state": "ready", "started": 0.0,
    "floor": {"source": {"url": "http://127.0.0.1:8000"}, "positions": 2400, "requests": 24, "flips": 2,
              "max_abs": 0.012, "max_flip_margin": 0.031,
              "bands": [{"band": "[0, 0.01)", "samples": 1800, "bound": 0.0004},
                        {"band": "[0.01, 0.1)", "samples": 400, "bound": 0.003},
                        {"band": "[0.1, 1)", "samples": 200, "bound": 0.012}]},
    "totals": {"requests_checked": 41, "requests_real": 2, "beyond_floor": 5,
               "positions": {"ok": 612, "floor": 3, "near_tie": 1, "real": 2, "logprob": 0}},
    "conformance": 612 / 618,
    "over_time": [{"t": 60.0 * i, "requests": r, "requests_real": x,
                   "positions": {"ok": 16 * r - 2 * x - f, "floor": f, "near_tie": 0, "real": x, "logprob": 0}}
                  for i, (r, x, f) in enumerate([(6, 0, 0), (9, 0, 1), (7, 1, 1), (8, 0, 0), (11, 1, 1)])],
    "latest_real": [
        {"req_id": "chat-7f3a", "trace": "watch-traces/watch-0003.wbtrace", "time": 240.0, "greedy": True,
         "position": 5, "verdict": "real", "engine": {"id": 314, "text": " Lyon", "logprob": -0.41},
         "reference": {"id": 7042, "text": " Paris", "gap": 1.62, "margin": 1.62, "logprob_of_engine_token": -1.98},
         "floor": 0.012, "real_positions": 1, "inside_floor": 0,
         "tokens": [{"position": i, "engine": {"id": 1, "text": t, "logprob": lp},
                     "reference": {"id": 2, "text": r, "logprob_of_engine_token": rl}, "delta": lp - rl,
                     "floor": 0.003, "verdict": v}
                    for i, (t, r, lp, rl, v) in enumerate([
                        (" The", " The", -0.02, -0.021, "ok"), (" capital", " capital", -0.3, -0.301, "ok"),
                        (" of", " of", -0.001, -0.001, "ok"), (" France", " France", -0.05, -0.049, "ok"),
                        (" is", " is", -0.01, -0.01, "ok"), (" Lyon", " Paris", -0.41, -1.98, "real"),
                        (".", ".", -0.2, -0.22, "ok")])]},
        {"req_id": "cmpl-19c0", "trace": "watch-traces/watch-0002.wbtrace", "time": 130.0, "greedy": True,
         "position": 11, "verdict": "real", "engine": {"id": 11, "text": "\n", "logprob": -0.9},
         "reference": {"id": 12, "text": " and", "gap": 0.44, "margin": 0.44, "logprob_of_engine_token": -1.1},
         "floor": 0.012, "real_positions": 1, "inside_floor": 1, "tokens": []}],
    "checker": {"busy_s": 12.5, "positions_per_s": 49.4, "lag_s": 0.82},
    "queue": {"depth": 0, "capacity": 256, "max_depth": 3, "dropped": 0},
    "notes": [],
}


class _ConformanceApp(App[None]):
    CSS_PATH = WorkbenchApp.CSS_PATH

    def get_default_screen(self) -> Screen:
        return ConformanceScreen("http://127.0.0.1:8100/watch/status", status=STATUS, show_times=False)


def test_conformance_view_snapshot(snap_compare) -> None:  # noqa: ANN001
    assert snap_compare(_ConformanceApp(), terminal_size=SIZE)
