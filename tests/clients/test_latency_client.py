"""`workbench client` against a real server (tiny-random model): the report's columns, the server's numbers
for the same request ids, and the three modes (normal, slow reader, disconnect midway)."""

from __future__ import annotations

import json
import time

import pytest

from workbench.cli import main
from workbench.clients import load as client_mod
from workbench.clients import stream as client_stream
from workbench.engine.engine import Engine
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer
from workbench.server.event_hub import EventHub
from workbench.trace.recorder import MemorySink

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def server(tiny):
    hub, recorder = EventHub(), MemorySink()
    engine = Engine(tiny, trace_level="summary", trace_sinks=[hub, recorder])
    app = create_app(engine, model_name=MODEL, hub=hub)
    with BackgroundServer(app) as srv:
        srv.engine, srv.recorder = engine, recorder
        yield srv
    engine.close()


def _finished(server, rid: str):  # noqa: ANN001, ANN202
    return next(e for e in server.recorder.of_kind("request.finished") if e.req_id == rid)


def test_normal_mode_reports_client_and_server_side_by_side(server, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["client", "--url", server.url, "-n", "4", "--max-tokens", "8", "--per-request", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "4 requests (4 ok) · mode normal · concurrency 4" in text
    for heading in ("client", "server (engine)", "server (socket write)", "network gap"):
        assert heading in text
    ttft_row = next(line for line in text.splitlines() if line.startswith("TTFT"))
    assert "n/a" not in ttft_row and len(ttft_row.split()) == 1 + 12  # 4 columns of p50/p90/p99
    report = json.loads(out.read_text())
    assert report["ok"] == 4 and report["same_clock"] is True
    for row in report["per_request"]:
        rid = row["request_id"]
        assert rid in text  # the per-request lines name the ids the server traced
        assert row["server_ttft"] == pytest.approx(_finished(server, rid).timings["ttft"])
        assert row["client_ttft"] > row["socket_ttft"] > row["server_ttft"] > 0  # each later hand-off is later
        assert abs(row["first_gap"]) < row["client_ttft"]
    s = report["seconds"]
    assert s["gap"]["p50"] is not None and s["client_itl"]["p99"] >= s["client_itl"]["p50"] > 0


def test_disconnect_mode_hangs_up_and_the_server_aborts(server, capsys):
    code = main(["client", "--url", server.url, "-n", "2", "--max-tokens", "400", "--mode", "disconnect",
                 "--disconnect-after", "2", "--per-request"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "2 aborted by the server (client disconnected)" in text
    ids = [line.split()[0] for line in text.splitlines() if line.startswith("cmpl-") or line.startswith("chatcmpl-")]
    assert len(ids) == 2
    for rid in ids:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.req_id == rid for e in server.recorder.of_kind("request.finished")):
            time.sleep(0.05)
        finished = _finished(server, rid)
        assert finished.finish_reason == "abort" and len(finished.output_ids) < 400


def test_slow_mode_reads_late_but_gets_everything(server, capsys):
    code = main(["client", "--url", server.url, "-n", "2", "--slow", "1", "--mode", "slow", "--read-delay", "0.3",
                 "--max-tokens", "12", "--per-request"])
    text = capsys.readouterr().out
    assert code == 0, text
    lines = [line for line in text.splitlines() if line.startswith("chatcmpl-")]
    assert sorted(line.split()[1] for line in lines) == ["normal", "slow"]
    assert all(line.rstrip().endswith("length") for line in lines)


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["client", "--requests", "0"]) == 2
    assert "--requests must be >= 1" in capsys.readouterr().err
    assert main(["client", "--url", "ftp://x"]) == 2
    assert "--url must be an http(s) URL" in capsys.readouterr().err


def test_modes_are_listed_once():
    assert client_mod.MODES == client_stream.MODES
