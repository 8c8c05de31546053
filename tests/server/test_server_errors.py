"""Bad requests get the right status and an OpenAI-shaped error body naming the parameter, and the
server keeps serving: a valid request right after each one succeeds. Also: API keys, 503 while
shutting down, and an engine failure in the middle of a stream (error event, then [DONE])."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from workbench.engine.engine import Engine
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer
from workbench.server.event_hub import EventHub
from workbench.trace.store import TraceWriter

MODEL = "tiny-random"
MAX_BODY = 256 << 10
LONG = "word " * 2600  # more tokens than tiny-random's 2048-token context
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
SECRET = "top-secret-contents"


def _engine(tiny) -> Engine:
    hub = EventHub()
    return Engine(tiny, trace_level="summary", trace_sinks=[hub])


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    (root / "secret.txt").write_text(SECRET)
    traces = root / "traces"
    traces.mkdir()
    with TraceWriter(traces / "kept.wbtrace", meta={"note": "a finished trace"}):
        pass
    engine = _engine(tiny)
    app = create_app(engine, model_name=MODEL, trace_dir=traces, max_body_bytes=MAX_BODY)
    with BackgroundServer(app) as srv:
        yield srv
    engine.close()


def c(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def ch(**kw):
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


def raw(text: str) -> bytes:
    return text.encode("utf-8")


# (name, method, path, body, status, param, code); body: dict -> JSON, bytes -> sent as is
CASES = [
    ("temperature too high", "POST", C, c(temperature=3), 400, "temperature", None),
    ("temperature negative", "POST", CH, ch(temperature=-1), 400, "temperature", None),
    ("temperature NaN", "POST", C, raw('{"model":"tiny-random","prompt":"hi","temperature":NaN}'), 400,
     "temperature", None),
    ("top_p Infinity", "POST", CH, raw('{"model":"tiny-random","messages":[{"role":"user","content":"x"}],'
                                       '"top_p":Infinity}'), 400, "top_p", None),
    ("temperature is a boolean", "POST", C, c(temperature=True), 400, "temperature", None),
    ("top_p zero", "POST", C, c(top_p=0), 400, "top_p", None),
    ("top_p above one", "POST", CH, ch(top_p=1.5), 400, "top_p", None),
    ("max_tokens zero", "POST", C, c(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens a string", "POST", C, c(max_tokens="10"), 400, "max_tokens", None),
    ("max_tokens a float", "POST", CH, ch(max_tokens=1.5), 400, "max_tokens", None),
    ("max_tokens beyond the context", "POST", C, c(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
    ("min_tokens above max_tokens", "POST", C, c(min_tokens=50, max_tokens=10), 400, "min_tokens", None),
    ("n zero", "POST", C, c(n=0), 400, "n", None),
    ("n too large", "POST", CH, ch(n=17), 400, "n", None),
    ("presence_penalty out of range", "POST", C, c(presence_penalty=3), 400, "presence_penalty", None),
    ("frequency_penalty out of range", "POST", CH, ch(frequency_penalty=-2.5), 400, "frequency_penalty", None),
    ("repetition_penalty zero", "POST", C, c(repetition_penalty=0), 400, "repetition_penalty", None),
    ("top_k below -1", "POST", C, c(top_k=-5), 400, "top_k", None),
    ("min_p above one", "POST", CH, ch(min_p=2), 400, "min_p", None),
    ("seed a string", "POST", C, c(seed="abc"), 400, "seed", None),
    ("stream a string", "POST", C, c(stream="yes"), 400, "stream", None),
    ("completions logprobs above 20", "POST", C, c(logprobs=21), 400, "logprobs", None),
    ("chat top_logprobs above 20", "POST", CH, ch(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("top_logprobs without logprobs", "POST", CH, ch(top_logprobs=2), 400, "top_logprobs", None),
    ("empty prompt", "POST", C, c(prompt=""), 400, "prompt", None),
    ("empty prompt list", "POST", C, c(prompt=[]), 400, "prompt", None),
    ("prompt a number", "POST", C, c(prompt=123), 400, "prompt", None),
    ("no messages", "POST", CH, ch(messages=[]), 400, "messages", None),
    ("unknown role", "POST", CH, ch(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
    ("content a number", "POST", CH, ch(messages=[{"role": "user", "content": 42}]), 400,
     "messages[0].content", None),
    ("image content part", "POST", CH, ch(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages[0].content", None),
    ("too-long prompt", "POST", C, c(prompt=LONG), 400, "prompt", "context_length_exceeded"),
    ("too-long prompt, streaming", "POST", C, c(prompt=LONG, stream=True), 400, "prompt", "context_length_exceeded"),
    ("too-long chat, streaming", "POST", CH, ch(messages=[{"role": "user", "content": LONG}], stream=True), 400,
     "messages", "context_length_exceeded"),
    ("unknown model", "POST", C, c(model="gpt-9"), 404, "model", "model_not_found"),
    ("unknown model, streaming chat", "POST", CH, ch(model="gpt-9", stream=True), 404, "model", "model_not_found"),
    ("missing model", "POST", C, {"prompt": "hi"}, 400, "model", None),
    ("malformed JSON", "POST", C, raw('{"model": "tiny-random", "prompt": '), 400, None, None),
    ("body is an array", "POST", CH, raw("[1, 2]"), 400, None, None),
    ("non-UTF-8 body", "POST", C, b'{"model": "tiny-random", "prompt": "\xff\xfe"}', 400, None, None),
    ("oversized body", "POST", C, c(prompt="a" * (MAX_BODY + 1000)), 413, None, "request_too_large"),
    ("logit_bias key not a token id", "POST", C, c(logit_bias={"abc": 1}), 400, "logit_bias", None),
    ("logit_bias token id out of range", "POST", CH, ch(logit_bias={"99999999": 1}), 400, "logit_bias", None),
    ("logit_bias value out of range", "POST", C, c(logit_bias={"5": 200}), 400, "logit_bias", None),
    ("invalid json_schema", "POST", CH, ch(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}), 400, "response_format", None),
    ("json_schema missing", "POST", CH, ch(response_format={"type": "json_schema"}), 400, "response_format", None),
    ("unknown response_format type", "POST", CH, ch(response_format={"type": "xml"}), 400,
     "response_format.type", None),
    ("invalid regex", "POST", C, c(regex="(("), 400, "regex", None),
    ("empty stop string", "POST", C, c(stop=[""]), 400, "stop", None),
    ("too many stop strings", "POST", CH, ch(stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("misspelt parameter", "POST", C, c(temprature=0.5), 400, "temprature", None),
    ("stream_options without stream", "POST", CH, ch(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("tool_choice names a missing function", "POST", CH, ch(tools=[{"type": "function", "function": {"name": "f"}}],
                                                            tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice", None),
    ("tool_choice without tools", "POST", CH, ch(tool_choice="required"), 400, "tool_choice", None),
    ("tool name with spaces", "POST", CH, ch(tools=[{"type": "function", "function": {"name": "get weather"}}]), 400,
     "tools[0].function.name", None),
    ("echo with logprobs", "POST", C, c(echo=True, logprobs=1), 400, "echo", None),
    ("best_of different from n", "POST", C, c(best_of=3), 400, "best_of", None),
    ("trace path traversal, encoded", "GET", "/debug/traces/..%2F..%2Fsecret.txt", None, 404, None, None),
    ("trace path traversal, dots", "GET", "/debug/traces/..", None, 404, None, None),
    ("trace path traversal, absolute", "GET", "/debug/traces/%2Fetc%2Fpasswd", None, 404, None, None),
    ("trace path traversal, sibling name", "GET", "/debug/traces/..%2Fsecret", None, 404, None, None),
    ("unknown trace id", "GET", "/debug/traces/nope", None, 404, "trace_id", "trace_not_found"),
    ("unknown route", "GET", "/v2/nothing", None, 404, None, None),
    ("unknown event kind", "GET", "/debug/events?kind=bogus", None, 400, "kind", None),
    ("event buffer of zero (FastAPI's 422, remapped)", "GET", "/debug/events?buffer=0", None, 400, "buffer", None),
]


def _send(http: httpx.Client, method: str, path: str, body) -> httpx.Response:
    if body is None:
        return http.request(method, path)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.request(method, path, content=content, headers={"content-type": "application/json"})


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name,method,path,body,status,param,code", CASES, ids=[case[0] for case in CASES])
def test_bad_request_then_a_good_one(server, name, method, path, body, status, param, code):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        resp = _send(http, method, path, body)
        assert resp.status_code == status, resp.text
        assert resp.headers["content-type"].startswith("application/json")  # never a stream, even with stream=true
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param, err
        assert err["code"] == code, err
        assert err["message"] and "Traceback" not in err["message"] and ".py" not in err["message"]
        assert SECRET not in resp.text and "/tmp" not in err["message"]
        ok = http.post(C, json=c(max_tokens=2))
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_error_messages_name_the_allowed_range(server):
    with httpx.Client(base_url=server.url) as http:
        msg = http.post(C, json=c(temperature=3)).json()["error"]["message"]
        assert "temperature" in msg and "2" in msg and "0" in msg
        msg = http.post(CH, json=ch(logprobs=True, top_logprobs=21)).json()["error"]["message"]
        assert "top_logprobs" in msg and "20" in msg


def test_trace_listing_and_download_by_id(server, tmp_path):
    with httpx.Client(base_url=server.url) as http:
        listing = http.get("/debug/traces").json()["data"]
        assert [t["id"] for t in listing] == ["kept"]
        resp = http.get("/debug/traces/kept")
        assert resp.status_code == 200
        path = tmp_path / "kept.wbtrace"
        path.write_bytes(resp.content)
    from workbench.trace.reader import open_trace

    with open_trace(path) as trace:
        assert trace.meta["note"] == "a finished trace"


@pytest.fixture()
def solo(tiny):
    """A server of its own, for tests that break or stop it."""
    engine = _engine(tiny)
    app = create_app(engine, model_name=MODEL, api_key="s3cret-key")
    with BackgroundServer(app) as srv:
        srv.engine = engine
        yield srv
    engine.close()


def test_api_key_is_required_everywhere_but_health_and_the_page(solo):
    with httpx.Client(base_url=solo.url) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/").status_code == 200  # the page holds nothing; it asks for a session with the key
        for path in ("/v1/models", "/metrics", "/debug/traces"):
            resp = http.get(path)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert http.post(C, json=c(), headers={"Authorization": "Bearer wrong"}).status_code == 401
        # a key in the URL would land in access logs and browser history: refused on every route
        assert http.get("/v1/models", params={"api_key": "s3cret-key"}).status_code == 401
        assert http.post(C, json=c(), params={"api_key": "s3cret-key"}).status_code == 401
    good = openai.OpenAI(base_url=solo.url + "/v1", api_key="s3cret-key", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    bad = openai.OpenAI(base_url=solo.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_503_while_shutting_down(solo):
    auth = {"Authorization": "Bearer s3cret-key"}
    solo.app.state.workbench.loop.begin_drain()
    with httpx.Client(base_url=solo.url, headers=auth) as http:
        for path in (C, CH):
            body = c(stream=True) if path == C else ch()
            resp = http.post(path, json=body)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down"
        assert http.get("/health").status_code == 503


def test_engine_failure_mid_stream_sends_error_then_done_and_engine_survives(solo):
    engine = solo.engine
    forward = engine.runner.forward
    state = {"calls": 0}

    def flaky(fb):
        state["calls"] += 1
        if state["calls"] == 4:  # the prefill and a few decodes succeed, then one step fails
            raise RuntimeError("injected failure at /secret/path.py")
        return forward(fb)

    engine.runner.forward = flaky
    body = ch(max_tokens=50, stream=True, ignore_eos=True)
    with httpx.Client(base_url=solo.url, headers={"Authorization": "Bearer s3cret-key"}, timeout=60) as http:
        with http.stream("POST", CH, json=body) as resp:
            assert resp.status_code == 200
            data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_error"
        assert "secret" not in error["message"] and "RuntimeError" in error["message"]
        assert any(json.loads(d)["choices"] and json.loads(d)["choices"][0]["delta"].get("content")
                   for d in data[:-2]), "tokens before the failure were streamed"
        again = http.post(CH, json=ch(max_tokens=3, ignore_eos=True))
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        metrics = http.get("/metrics").text
        assert "workbench_engine_step_failures_total 1.0" in metrics
