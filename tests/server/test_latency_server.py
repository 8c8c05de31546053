"""Latency anatomy through the server (tiny-random model, real uvicorn on 127.0.0.1): the stage shares of a
seeded streamed request add up to its end-to-end time at the socket, every frame is stamped, every
response carries `X-Request-Id`, /metrics has the latency histograms, and the output buffer's
coalescing keeps the text while its byte limit holds."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from workbench.engine.engine import Engine
from workbench.engine.output.output import StepOutput, TokenLogprob
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer
from workbench.server.engine_loop import StreamItem
from workbench.server.event_hub import EventHub
from workbench.server.output_buffer import OVERFLOW, OutputBuffer, StreamLimits
from workbench.trace.latency import ENGINE_STAGES, SERVER_STAGES, Handoff, RequestLatency
from workbench.trace.recorder import MemorySink

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def server(tiny):
    hub, recorder = EventHub(), MemorySink()
    engine = Engine(tiny, trace_level="summary", trace_sinks=[hub, recorder], chunk_size=4)
    app = create_app(engine, model_name=MODEL, hub=hub)
    with BackgroundServer(app) as srv:
        srv.engine, srv.recorder = engine, recorder
        yield srv
    engine.close()


def _stream(url: str, body: dict) -> tuple[httpx.Headers, list[tuple[float, dict]], float]:
    """(response headers, [(received, chunk)], when the request was sent)."""
    frames = []
    with httpx.Client(timeout=60) as client:
        sent = time.perf_counter()
        with client.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    frames.append((time.perf_counter(), json.loads(line[6:])))
            return resp.headers, frames, sent


def _latency(server, rid: str) -> RequestLatency:  # noqa: ANN001 - the fixture
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lat = RequestLatency.from_events(rid, server.recorder.events)
        if lat.summary is not None and lat.timings:
            return lat
        time.sleep(0.02)
    raise AssertionError(f"no stream_end summary for {rid}")


def test_seeded_stream_stage_shares_add_up_to_the_socket_end_to_end(server):
    prompt = "a seeded request with a prompt longer than one prefill chunk of four tokens"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.8, "seed": 3, "stream": True,
            "ignore_eos": True}
    headers, frames, sent = _stream(server.url + "/v1/completions", body)
    rid = headers["x-request-id"]
    assert all(chunk["id"] == rid for _, chunk in frames)  # the header names what the body and the trace name
    lat = _latency(server, rid)
    summary = lat.summary
    stages = summary["stages"]
    assert set(stages) == set(ENGINE_STAGES) | set(SERVER_STAGES)
    assert all(v >= 0 for v in stages.values()), stages
    assert stages["serialize"] > 0 and stages["write"] > 0 and stages["forward"] > 0
    # end to end, measured from the trace's own stamps: arrival .. the last frame's write returned
    e2e = max(e.t for e in lat.written) - lat.arrival
    assert abs(sum(stages.values()) - e2e) <= 0.05 * e2e
    assert sum(summary["shares"].values()) == pytest.approx(1.0, abs=0.05)
    # the client saw the same request: it sent before the server's arrival and received after its write
    received_last = max(t for t, chunk in frames if chunk["choices"] and chunk["choices"][0]["text"])
    assert summary["e2e_socket"] < received_last - sent
    # every token's frame was stamped serialized, then written
    assert sum(e.detail["tokens"] for e in lat.serialized) == 16
    assert [e.detail["seq"] for e in lat.serialized] == [e.detail["seq"] for e in lat.written]
    assert all(w.t >= s.t for s, w in zip(lat.serialized, lat.written))
    assert len(summary["ready_to_written"]) == len(lat.written) and min(summary["ready_to_written"]) > 0


def test_the_waterfall_has_one_row_per_step_from_schedule_to_write(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6,
            "temperature": 0, "stream": True, "ignore_eos": True}
    headers, _, _ = _stream(server.url + "/v1/chat/completions", body)
    lat = _latency(server, headers["x-request-id"])
    segs = lat.segments()
    rows = {s.row for s in segs}
    assert rows == set(range(len(lat.steps) + 1)) and len(lat.steps) == 6
    for row in range(1, 7):
        stages = [s.stage for s in segs if s.row == row]
        assert stages[:4] == ["schedule", "forward", "sample", "output"] and stages[-1] == "write"
        ordered = sorted((s for s in segs if s.row == row), key=lambda s: s.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(ordered, ordered[1:]))  # hand-offs in order


def test_every_response_carries_x_request_id(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        plain = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert plain.headers["x-request-id"] == plain.json()["id"]
        bad = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": -1})
        assert bad.status_code == 400 and bad.headers["x-request-id"].startswith("req-")
        mine = client.post("/v1/completions", json={"model": "nope", "prompt": "Hi"}, headers={"X-Request-Id": "abc-1"})
        assert mine.status_code == 404 and mine.headers["x-request-id"] == "abc-1"
        weird = client.get("/health", headers={"X-Request-Id": "no spaces <allowed>"})
        assert weird.headers["x-request-id"].startswith("req-")  # not echoed: it is not a safe id
        for path in ("/health", "/metrics", "/v1/models", "/no/such/route"):
            assert client.get(path).headers.get("x-request-id"), path


def test_metrics_expose_ttft_tpot_itl_queue_and_socket_histograms(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        time.sleep(0.1)
        text = client.get("/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.endswith(tuple("0123456789"))
              and "_count" in line}
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                 "request_queue_time_seconds", "time_to_first_token_written_seconds",
                 "stream_ready_to_written_seconds"):
        assert counts[f"workbench_{name}_count"] >= 1, name
    assert "# TYPE workbench_stream_aborts_total counter" in text


# --- the output buffer on its own ---------------------------------------------------------------------


def _item(rid: str, text: str, ids: list[int], finished: bool = False, step: int = 1) -> StreamItem:
    handoff = Handoff(step, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 0.5)
    logprobs = [TokenLogprob(i, text, -0.5, 1, [(i, text, -0.5)]) for i in ids]
    return StreamItem(rid, StepOutput(rid, ids, text, finished, None), logprobs, handoff=handoff)


def test_buffer_coalesces_what_a_slow_reader_missed_without_changing_the_text():
    async def run() -> None:
        buf = OutputBuffer(StreamLimits(max_buffer_bytes=1 << 20))
        deltas = ["Hel", "lo", " wor", "ld", "!"]
        for k, d in enumerate(deltas):
            buf.put_nowait(_item("a", d, [k], finished=k == len(deltas) - 1, step=k + 1))
        buf.put_nowait(_item("b", "other", [9]))
        first = await buf.get()
        assert first.req_id == "a" and first.step.delta == "Hello world!" and first.step.new_token_ids == [0, 1, 2, 3, 4]
        assert first.step.finished and [lp.token_id for lp in first.logprobs] == [0, 1, 2, 3, 4]
        assert (await buf.get()).step.delta == "other"
        assert buf.coalesced == 4 and buf.pending_bytes == 0
        taken = buf.take_chunks()
        assert taken["a"].deltas == 5 and taken["a"].tokens == 5 and taken["a"].last.step == 5
        buf.put_nowait(_item("a", "x", [7]))  # a reader that keeps up gets every delta as it was
        assert (await buf.get()).step.delta == "x" and buf.coalesced == 4

    asyncio.run(run())


def test_buffer_past_its_byte_limit_aborts_once_and_keeps_nothing_more():
    async def run() -> None:
        calls: list[str] = []
        buf = OutputBuffer(StreamLimits(max_buffer_bytes=600), on_overflow=calls.append)
        for k in range(20):
            buf.put_nowait(_item("a", "x" * 50, [k]))
        assert calls == [OVERFLOW]
        assert buf.pending_bytes == 0 and 600 < buf.max_pending_bytes <= 600 + 200
        item = await buf.get()
        assert item.step is None and OVERFLOW in item.error and "600" in item.error

    asyncio.run(run())


@pytest.mark.parametrize(("kwargs", "word"), [({"max_buffer_bytes": 0}, "max_buffer_bytes"),
                                              ({"send_timeout": -1.0}, "send_timeout"),
                                              ({"send_timeout": float("nan")}, "send_timeout")])
def test_stream_limits_name_the_bad_value(kwargs, word):
    with pytest.raises(ValueError, match=word):
        StreamLimits(**kwargs)
