"""The debug surface: live trace events over SSE (filtered by kind and request, bounded per subscriber
with a drop counter that never slows the engine), trace files listed and downloaded by id while
they are being written, and the server as `workbench serve` builds it."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx
import pytest

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.server.background import BackgroundServer
from workbench.server.cli_args import add_serve_args, build_server
from workbench.server.event_hub import EventHub
from workbench.trace.events import TokenChosen
from workbench.trace.reader import open_trace

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Built exactly as `workbench serve --model tiny-random --trace-dir DIR` builds it."""
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", MODEL, "--trace-dir", str(tmp_path_factory.mktemp("traces")),
                              "--device", "cpu"])
    assert args.host == "127.0.0.1"  # loopback unless asked otherwise
    engine, app = build_server(args)
    with BackgroundServer(app) as srv:
        srv.state = app.state.workbench
        yield srv
    engine.close()


def _events(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


def _complete(url: str, **body) -> dict:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120).json()


def test_event_stream_filters_by_kind_and_request(server):
    body = {"model": MODEL, "prompt": "Follow me", "max_tokens": 40, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json=body) as target:
        lines = target.iter_lines()  # kept alive: dropping it would close the connection (a disconnect)
        req_id = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
        other = threading.Thread(target=_complete, args=(server.url,), kwargs={"prompt": "noise", "max_tokens": 20,
                                                                                "ignore_eos": True})
        with http.stream("GET", "/debug/events", params={"kind": "token,request.finished",
                                                         "request": req_id}) as events:
            other.start()
            seen, deadline = [], time.monotonic() + 120
            for ev in _events(events):
                assert time.monotonic() < deadline, "request.finished never arrived"
                if ev["kind"].startswith("server."):
                    continue
                seen.append(ev)
                if ev["kind"] == "request.finished":
                    break
        assert [line for line in lines if line][-1] == "data: [DONE]"
        other.join()
    assert {e["req_id"] for e in seen} == {req_id}
    tokens = [e for e in seen if e["kind"] == "token"]
    assert tokens and seen[-1]["payload"]["finish_reason"] == "length"
    positions = [e["payload"]["position"] for e in tokens]
    assert positions == list(range(positions[0], 40))  # in order, none missing once subscribed
    assert all(set(e["payload"]) >= {"token_id", "text", "logprob", "top_logprobs"} for e in tokens)


def test_slow_subscriber_drops_with_a_counter_and_never_blocks_the_engine(server):
    hub, engine = server.state.hub, server.state.engine
    loop = asyncio.new_event_loop()  # never run: this subscriber never reads
    sub = hub.subscribe(loop, kinds=["token"], maxsize=3)
    try:
        out = _complete(server.url, prompt=["one", "two"], max_tokens=25, ignore_eos=True)
        assert out["usage"]["completion_tokens"] == 50  # the engine ran to the end regardless
        assert len(sub._buf) == 3 and sub.dropped == 47
    finally:
        hub.unsubscribe(sub)
        loop.close()
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size


def test_dropped_events_are_reported_on_the_stream(server):
    with httpx.Client(base_url=server.url, timeout=120) as http, \
            http.stream("GET", "/debug/events", params={"kind": "token", "buffer": 1}) as events:
        stream = _events(events)
        hello = next(stream)
        assert hello["kind"] == "server.hello" and hello["model"] == MODEL
        _complete(server.url, prompt=["a", "b", "c", "d"], max_tokens=30, ignore_eos=True)
        received, deadline = 0, time.monotonic() + 60
        for ev in stream:
            if ev["kind"] == "token":
                received += 1
            elif ev["kind"] == "server.stats" and ev["delivered"] + ev["dropped"] == 120:
                break
            assert time.monotonic() < deadline, f"stats never accounted for all 120 tokens: {ev}"
    assert ev["dropped"] > 0 and received == ev["delivered"]


def test_trace_of_the_running_server_downloads_by_id(server, tmp_path):
    done = _complete(server.url, prompt="Recorded", max_tokens=5)
    listing = httpx.get(server.url + "/debug/traces").json()["data"]
    (entry,) = listing
    assert entry["active"] and entry["id"].startswith("serve-")
    resp = httpx.get(f"{server.url}/debug/traces/{entry['id']}", timeout=60)
    assert resp.status_code == 200
    path = tmp_path / "download.wbtrace"
    path.write_bytes(resp.content)
    with open_trace(path) as trace:
        finished = [e for e in trace.events(kind="request.finished") if e.req_id == done["id"]]
        assert len(finished) == 1 and finished[0].text == done["choices"][0]["text"]


def test_live_page_and_its_assets_are_served(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'src="static/app.js"' in page.text
    for asset in ("static/app.js", "static/style.css"):
        assert httpx.get(f"{server.url}/{asset}").status_code == 200


def test_hub_subscriber_buffer_is_bounded_without_a_server():
    hub, loop = EventHub(), asyncio.new_event_loop()
    try:
        sub = hub.subscribe(loop, kinds=["token"], requests=["r1"], maxsize=4)
        for i in range(10_000):
            hub.write(TokenChosen(step=i, req_id="r1" if i % 2 else "r1-0", position=i))
            hub.write(TokenChosen(step=i, req_id="r10", position=i))  # another request: filtered out
        assert len(sub._buf) == 4 and sub.dropped == 10_000 - 4
        batch = loop.run_until_complete(sub.next_batch(0.1))
        assert [e.req_id for e in batch] == ["r1-0", "r1", "r1-0", "r1"]
    finally:
        loop.close()


def test_engine_direct_hub_wiring():
    """An engine built with the hub as its only sink keeps no events in memory."""
    hub = EventHub()
    engine = Engine(MODEL, trace_level="summary", trace_sinks=[hub], device="cpu")
    assert engine.memory_sink is None and engine.tracer.on
    engine.generate(["x"], SamplingParams(max_new_tokens=2, temperature=0))
    engine.close()


def test_stopping_the_server_finishes_its_trace_file(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", MODEL, "--trace-dir", str(tmp_path), "--device", "cpu"])
    _, app = build_server(args)
    with BackgroundServer(app) as srv:
        done = _complete(srv.url, prompt="Kept", max_tokens=3)
    (path,) = tmp_path.glob("*.wbtrace")
    assert not list(tmp_path.glob("*-wal")), "the trace was left open"
    with open_trace(path) as trace:
        assert trace.finished
        assert [e.req_id for e in trace.events(kind="request.finished")] == [done["id"]]


def test_stream_limit_flags_reach_the_engine_loop_and_bad_ones_name_the_flag():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--model", MODEL, "--device", "cpu", "--stream-buffer-bytes", "4096",
                              "--send-timeout", "0", "--prefix-sharing"])
    engine, app = build_server(args)
    assert engine.prefix_sharing and engine.config.prefix_sharing is True
    limits = app.state.workbench.loop.limits
    assert (limits.max_buffer_bytes, limits.send_timeout) == (4096, None)  # 0 means no limit
    engine.close()
    for flags, name in ((["--stream-buffer-bytes", "0"], "--stream-buffer-bytes: max_buffer_bytes must be an integer >= 1"),
                        (["--send-timeout", "-1"], "--send-timeout: send_timeout must be a number of seconds > 0")):
        with pytest.raises(ValueError, match=name):
            build_server(parser.parse_args(["--model", MODEL, "--device", "cpu", *flags]))
