"""The server as a hostile or careless client finds it (issue 19): one request cannot stall the others
or outlive its client, a web page cannot reach it (Host, Content-Type), secrets stay out of URLs and
logs, oversized asks are refused naming the limit and its flag, slow debug subscribers cost bounded
memory, and SIGTERM ends every stream with an error event and [DONE]."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from workbench.engine.engine import Engine
from workbench.server.admission import AdmissionLimits
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer, ServerProcess
from workbench.server.event_hub import EventHub, TooManySubscribers
from workbench.server.output_buffer import StreamLimits
from workbench.trace.events import Event
from workbench.trace.reader import open_trace
from workbench.trace.store import TraceWriter

MODEL = "tiny-random"
C, CH = "/v1/completions", "/v1/chat/completions"
KEY = "k3y-that-must-never-be-logged"


def _engine(tiny) -> Engine:
    return Engine(tiny, trace_level="summary", trace_sinks=[EventHub()])


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    traces = tmp_path_factory.mktemp("hardening")
    with TraceWriter(traces / "kept.wbtrace"):
        pass
    engine = _engine(tiny)
    app = create_app(engine, model_name=MODEL, trace_dir=traces,
                     admission=AdmissionLimits(max_prompts=4000, max_tokens=50_000))
    with BackgroundServer(app) as srv:
        srv.engine, srv.state = engine, app.state.workbench
        yield srv
    engine.close()


def c(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# --- bounded admission ----------------------------------------------------------------------------


def test_too_many_prompts_or_tokens_are_refused_naming_the_flag(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        err = _error(http.post(C, json=c(prompt=["hi"] * 4001)), 400)
        assert err["param"] == "prompt" and "4000" in err["message"] and "--max-prompts-per-request" in err["message"]
        err = _error(http.post(C, json=c(prompt=["hi"] * 3000, n=2, max_tokens=10)), 400)
        assert err["param"] == "max_tokens" and "50000" in err["message"] and "--max-request-tokens" in err["message"]
        assert http.post(C, json=c()).status_code == 200  # and the server goes on serving


def test_a_small_request_is_not_held_behind_a_big_one(server):
    """200 prompts x 8 tokens streaming; a 2-token request sent after the big one started finishes
    while most of the big one's choices are still unfinished (FCFS admission made it wait for ~136)."""

    async def run() -> tuple[int, int]:
        finished = 0
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async def big() -> None:
                nonlocal finished
                body = c(prompt=[f"story {i}" for i in range(200)], max_tokens=8, ignore_eos=True, stream=True)
                async with http.stream("POST", C, json=body) as resp:
                    async for line in resp.aiter_lines():
                        started.set()
                        if line.startswith("data: {"):
                            finished += sum(ch["finish_reason"] is not None for ch in json.loads(line[6:])["choices"])

            task = asyncio.create_task(big())
            await asyncio.wait_for(started.wait(), 60)
            resp = await http.post(C, json=c(max_tokens=2))
            assert resp.status_code == 200
            at_small = finished
            await task
            return at_small, finished

    at_small, total = asyncio.run(run())
    assert total == 200
    assert at_small < 80, f"the small request finished only after {at_small} of the big request's 200 choices"


def test_admission_stops_when_the_client_leaves(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = c(prompt=[f"p{i}" for i in range(3000)], max_tokens=8, ignore_eos=True, stream=True)
        with http.stream("POST", C, json=body) as resp:
            next(resp.iter_lines())  # the stream has begun; the client goes away
    loop, deadline = server.state.loop, time.monotonic() + 10
    while time.monotonic() < deadline and (loop.open_requests or server.engine.has_work()):
        time.sleep(0.05)
    assert loop.open_requests == 0 and loop.pending_prompts == 0
    assert not server.engine.has_work(), "the engine kept working on a request whose client left"


# --- what a web page could do -----------------------------------------------------------------------


def test_foreign_host_header_is_refused(server):
    with httpx.Client(base_url=server.url) as http:
        err = _error(http.get("/debug/traces", headers={"Host": "evil.example"}), 400)
        assert "--allowed-hosts" in err["message"]
        assert http.get("/debug/traces", headers={"Host": f"localhost:{server.port}"}).status_code == 200


def test_only_json_bodies_start_generations(server):
    with httpx.Client(base_url=server.url) as http:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": ctype} if ctype else {}
            err = _error(http.post(C, content=json.dumps(c()).encode(), headers=headers), 415)
            assert err["code"] == "unsupported_media_type"
        ok = http.post(C, content=json.dumps(c()).encode(), headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200


def test_trace_downloads_are_nosniff_and_header_count_is_limited(server):
    with httpx.Client(base_url=server.url) as http:
        resp = http.get("/debug/traces/kept")
        assert resp.status_code == 200 and resp.headers["x-content-type-options"] == "nosniff"
        err = _error(http.get("/health", headers=[(f"x-h{i}", "v") for i in range(150)]), 431)
        assert "--max-request-headers" in err["message"]


# --- limits named like vLLM names them ---------------------------------------------------------------


def test_max_tokens_beyond_the_context_is_refused(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        err = _error(http.post(C, json=c(max_tokens=4096)), 400)
        assert err["param"] == "max_tokens" and "2048" in err["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4096}
        err = _error(http.post(CH, json=chat), 400)
        assert err["param"] == "max_tokens" and "2048" in err["message"]


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_broken_tool_schema_is_refused_for_every_tool_choice(server, choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    with httpx.Client(base_url=server.url, timeout=60) as http:
        err = _error(http.post(CH, json=body), 400)
        assert err["param"] == "tools" and "tools[0]" in err["message"]


# --- buffers ---------------------------------------------------------------------------------------


def test_output_buffer_limit_applies_to_streams_only(tiny):
    engine = _engine(tiny)
    app = create_app(engine, model_name=MODEL, stream_limits=StreamLimits(max_buffer_bytes=600))
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        resp = http.post(C, json=c(n=16, max_tokens=8, logprobs=5, ignore_eos=True))
        assert resp.status_code == 200, resp.text
        assert all(len(ch["logprobs"]["tokens"]) == 8 for ch in resp.json()["choices"])
    engine.close()


def test_subscribers_that_never_read_share_one_bounded_budget():
    hub = EventHub(budget=8192, max_subscribers=100)
    loop = asyncio.new_event_loop()
    try:
        subs = [hub.subscribe(loop) for _ in range(100)]
        with pytest.raises(TooManySubscribers, match="--max-debug-subscribers"):
            hub.subscribe(loop)
        for i in range(20_000):
            hub.write(Event(step=i, req_id="r"))
        assert hub.buffered <= 8192  # not 100 full 4096-event buffers (335 MB in the issue)
        assert all(s.dropped > 0 for s in subs) and hub.dropped_total == 100 * 20_000 - hub.buffered
        for s in subs[:99]:
            hub.unsubscribe(s)
        assert subs[99].limit == 4096  # a lone subscriber gets its whole buffer back
    finally:
        loop.close()


# --- keys and sessions -------------------------------------------------------------------------------


def test_api_key_only_in_the_header_and_a_session_cookie_for_the_page(tiny):
    engine = _engine(tiny)
    app = create_app(engine, model_name=MODEL, api_key=KEY)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/debug/traces", params={"api_key": KEY}).status_code == 401
        assert http.get("/").status_code == 200  # the page, which reads the key from its #fragment
        assert http.post("/debug/session", headers={"Authorization": "Bearer wrong"}).status_code == 401
        resp = http.post("/debug/session", headers={"Authorization": f"Bearer {KEY}"})
        assert resp.status_code == 204 and "HttpOnly" in resp.headers["set-cookie"]
        assert KEY not in resp.headers["set-cookie"]
        with http.stream("GET", "/debug/events") as events:  # the cookie, as the page's EventSource sends it
            assert events.status_code == 200 and "server.hello" in next(events.iter_lines())
        assert http.post(C, json=c()).status_code == 401  # a cookie never authorises generations
        http.cookies.clear()
        assert http.get("/debug/traces").status_code == 401
    engine.close()


# --- a real `workbench serve`: its log, and SIGTERM ------------------------------------------------


def _stream_lines(url: str, out: list[str]) -> None:
    body = c(prompt="tell me", max_tokens=2000, ignore_eos=True, stream=True)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url + C, json=body, headers=headers, timeout=120) as resp:
        for line in resp.iter_lines():
            if line:
                out.append(line)


@pytest.mark.slow  # starts `workbench serve` in its own process (~25 s on a shared CPU)
def test_serve_keeps_the_key_out_of_its_log_and_sigterm_ends_every_stream(tmp_path):
    log = tmp_path / "serve.log"
    args = ["--model", MODEL, "--api-key", KEY, "--trace-dir", str(tmp_path), "--graceful-timeout", "0.5",
            "--log-level", "info"]
    with ServerProcess(args, log_path=str(log), start_timeout=120) as srv:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(srv.url + "/v1/models", params={"api_key": KEY}).status_code == 401
        assert httpx.get(srv.url + "/v1/models", params={"token": KEY}, headers=auth).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers=auth).status_code == 200
        lines: list[str] = []
        reader = threading.Thread(target=_stream_lines, args=(srv.url, lines))
        reader.start()
        viewer = httpx.Client(base_url=srv.url, headers=auth, timeout=60)  # subscribes, then never reads
        viewer_stream = viewer.stream("GET", "/debug/events")
        assert viewer_stream.__enter__().status_code == 200
        deadline = time.monotonic() + 60
        while len(lines) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        during = httpx.post(srv.url + C, json=c(), headers=auth, timeout=10)  # the socket is still open
        reader.join(60)
        srv.proc.wait(60)
        viewer.close()
    assert during.status_code == 503 and during.json()["error"]["code"] == "shutting_down"
    assert lines[-1] == "data: [DONE]"
    assert "error" in json.loads(lines[-2][6:]), lines[-2]
    text = log.read_text()
    assert "GET /v1/models" in text  # the access log was on
    assert KEY not in text and "Traceback" not in text and "CancelledError" not in text, text[-2000:]
    (trace_file,) = [p for p in tmp_path.glob("serve-*.wbtrace")]
    assert open_trace(trace_file).finished
