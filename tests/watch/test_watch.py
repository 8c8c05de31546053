"""`workbench watch` in front of a tiny fake upstream: what a client of the proxy notices.

Two proxies share one fake upstream (tests/helpers/watch_fake.py): one samples every request for checking
(so it rewrites each request and each response), one samples none (pure relay). Their checker's
reference never loads (it waits on an event), so the checker's queue fills: it must stay bounded
and say how many it dropped. Identity, errors, a killed or slow upstream, a client that goes away,
64 concurrent streams, metrics, credentials and rotation. The same against a real vLLM and
llama.cpp: tests/watch/test_watch_peers.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.watch_fake import FakeServer
from workbench.trace.reader import open_trace
from workbench.watch.rewrite import Rewrite, SseRelay, plan_rewrite, strip_json
from workbench.watch.service import Watch, WatchServer

CAPACITY = 8


@pytest.fixture(scope="module")
def fake():
    with FakeServer() as server:
        yield server


@pytest.fixture(scope="module")
def released():
    event = threading.Event()
    yield event
    event.set()


def _blocked(event: threading.Event) -> Any:
    def factory() -> Any:
        event.wait()
        raise RuntimeError("the test ended")
    return factory


@pytest.fixture(scope="module")
def sampled(fake, released, tmp_path_factory):
    watch = Watch(fake.url, out=tmp_path_factory.mktemp("sampled"), sample=1.0, seed=0,
                  engine_factory=_blocked(released), check_capacity=CAPACITY)
    with WatchServer(watch) as server:
        yield server
        released.set()


@pytest.fixture(scope="module")
def relay(fake, released, tmp_path_factory):
    watch = Watch(fake.url, out=tmp_path_factory.mktemp("relay"), sample=0.0, engine_factory=_blocked(released))
    with WatchServer(watch) as server:
        yield server
        released.set()


def _body(chat: bool, stream: bool, prompt: str = "The capital of France is", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake", "max_tokens": 8, "stream": stream, "temperature": 0, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _get(base: str, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         ) -> tuple[int, str | None, str | None, bytes]:
    if body is None:
        r = httpx.get(base + path, headers=headers, timeout=30)
    else:
        r = httpx.post(base + path, json=body, headers=headers, timeout=30)
    return r.status_code, r.headers.get("content-type"), r.headers.get("x-fake"), r.content


def _trace_requests(server: WatchServer) -> dict[str, Any]:
    assert server.watch.settle(30, checked=False)
    out = {}
    for path in server.watch.recorder.files:
        with open_trace(path) as trace:
            for info in trace.requests():
                out[info.req_id] = (info, [e for e in trace.events(kind="token") if e.req_id == info.req_id])
    return out


# --- the rewrite, on its own ------------------------------------------------------------------------


def test_stripping_keeps_every_byte_of_the_servers_own_dialect() -> None:
    _, rw = plan_rewrite({"prompt": "x"}, False, top=5, ids=True)
    assert rw == Rewrite(("logprobs", "token_ids", "prompt_token_ids"))
    # llama-cpp-python writes json.dumps defaults: ", " and ": ", \u escapes
    spaced = ('{"id": "c", "choices": [{"text": "caf\\u00e9 \\"logprobs\\": {}", "logprobs": {"tokens": ["a"], '
              '"top_logprobs": [{"a": -1e-05}]}, "token_ids": [1, 2]}], "usage": null}')
    assert strip_json(spaced, rw) == ('{"id": "c", "choices": [{"text": "caf\\u00e9 \\"logprobs\\": {}", '
                                      '"logprobs": null, "token_ids": null}], "usage": null}')
    # vLLM's chat: prompt_token_ids at the top level, token_ids in the choice
    compact = ('{"id":"x","choices":[{"index":0,"delta":{"content":"é"},"logprobs":{"content":[]},'
               '"token_ids":[5]}],"prompt_token_ids":[1,2]}')
    assert strip_json(compact, rw) == ('{"id":"x","choices":[{"index":0,"delta":{"content":"é"},"logprobs":null,'
                                       '"token_ids":null}],"prompt_token_ids":null}')
    relay = SseRelay(rw)  # events split anywhere across network reads
    stream = f"data: {compact}\n\n: keep-alive\n\ndata: [DONE]\n\n".encode()
    out = b"".join(relay.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + relay.tail()
    assert out == stream.replace(compact.encode(), strip_json(compact, rw).encode())


def test_a_client_that_asked_for_logprobs_keeps_them_untouched() -> None:
    sent, rw = plan_rewrite({"messages": [], "logprobs": True, "top_logprobs": 2}, True, top=5, ids=True)
    assert sent["top_logprobs"] == 2 and "return_tokens_as_token_ids" not in sent and sent["return_token_ids"]
    assert "logprobs" not in rw.null_keys


# --- through the proxy ------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("logprobs", [False, True])
def test_the_client_gets_the_upstreams_bytes_sampled_or_not(fake, sampled, relay, chat, stream, logprobs) -> None:
    extra = ({"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1}) if logprobs else {}
    body = _body(chat, stream, prompt=f"identity {chat} {stream} {logprobs}", **extra)
    direct = _get(fake.url, _path(chat), body)
    assert direct[0] == 200 and direct[2] == "1"
    n = len(fake.app.bodies)
    assert _get(sampled.url, _path(chat), body) == direct
    sent = fake.app.bodies[n]
    assert sent["return_token_ids"] is True and sent["logprobs"]  # the proxy did ask for more
    assert _get(relay.url, _path(chat), body) == direct
    assert fake.app.bodies[n + 1] == body  # unsampled: the request as the client sent it
    reqs = _trace_requests(sampled)
    info, tokens = next(v for v in reqs.values() if v[0].added.params.get("stream") == stream
                        and json.dumps(v[0].added.prompt).find(f"identity {chat} {stream} {logprobs}") >= 0)
    assert [t.token_id for t in tokens] == [504, 3575, 282, 4649, 314, 7042, 30, 198]  # the server's own ids
    assert info.finished.error is None and info.added.params["sampled"] is True


@pytest.mark.parametrize("status", [400, 500])
def test_errors_status_codes_and_other_paths_pass_through(fake, sampled, status) -> None:
    body = _body(False, True)
    headers = {"x-fake-status": str(status)}
    assert _get(sampled.url, "/v1/completions", body, headers) == _get(fake.url, "/v1/completions", body, headers)
    for path in ("/v1/models", "/nowhere"):
        assert _get(sampled.url, path) == _get(fake.url, path)


def test_an_upstream_that_refuses_the_added_fields_still_serves_the_client(fake, tmp_path) -> None:
    watch = Watch(fake.url, out=tmp_path, sample=1.0, engine_factory=lambda: None)
    with WatchServer(watch) as server:
        # the client's own bad request: answered as the upstream answers it, and nothing learnt from it
        bad = {"x-fake-strict": "1", "x-fake-status": "400"}
        assert _get(server.url, "/v1/completions", _body(False, True), bad) == \
            _get(fake.url, "/v1/completions", _body(False, True), bad)
        assert watch.proxy.ids_ok
        strict = {"x-fake-strict": "1"}
        body = _body(False, True, prompt="strict")
        assert _get(server.url, "/v1/completions", body, strict) == _get(fake.url, "/v1/completions", body, strict)
        assert not watch.proxy.ids_ok and watch.proxy.logprobs_ok  # ids dropped, logprobs still asked
        info, tokens = next(v for v in _trace_requests(server).values() if v[0].added.prompt == "strict")
        assert len(tokens) == 8 and {t.source for t in tokens} == {"external_recovered"}  # ids from the text


def test_an_unreachable_upstream_is_a_502_with_an_openai_shaped_message(tmp_path) -> None:
    from workbench.external.peers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    watch = Watch(dead, out=tmp_path, sample=1.0, engine_factory=lambda: None)
    with WatchServer(watch) as server:
        r = httpx.post(server.url + "/v1/completions", json=_body(False, True), timeout=30)
        assert r.status_code == 502
        err = r.json()["error"]
        assert dead in err["message"] and err["code"] == 502 and err["type"] == "upstream_unreachable"
        reqs = _trace_requests(server)
    assert len(reqs) == 1 and dead in next(iter(reqs.values()))[0].finished.error


def _stream_until_error(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[bytes, str | None]:
    got = b""
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
            for data in r.iter_raw():
                got += data
    except httpx.HTTPError as exc:
        return got, type(exc).__name__
    return got, None


@pytest.mark.parametrize("proxy", ["sampled", "relay"])
def test_an_upstream_killed_mid_stream_cuts_the_client_the_same_way(fake, proxy, request) -> None:
    server = request.getfixturevalue(proxy)
    body, headers = _body(False, True, prompt=f"killed {proxy}"), {"x-fake-die-after": "3"}
    direct = _stream_until_error(fake.url + "/v1/completions", body, headers)
    through = _stream_until_error(server.url + "/v1/completions", body, headers)
    assert direct[1] == "RemoteProtocolError" and direct[0].count(b"data: ") == 3
    assert through == direct  # the same three chunks, then the same broken end of body
    info, tokens = next(v for v in _trace_requests(server).values() if "killed" in str(v[0].added.prompt))
    assert "dropped the stream" in info.finished.error and info.finished.text == "The capital of"
    assert len(tokens) == (3 if proxy == "sampled" else 0)  # logprobs, and so tokens, only where sampled


def test_a_slow_upstreams_chunks_reach_the_client_as_they_are_made(sampled) -> None:
    arrivals = []
    t0 = time.perf_counter()
    with httpx.stream("POST", sampled.url + "/v1/completions", json=_body(False, True, prompt="slow"),
                      headers={"x-fake-delay": "0.25"}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter() - t0)
    assert len(arrivals) == 8
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert min(gaps) > 0.15, gaps  # one by one, not held back and sent together
    assert arrivals[0] < 1.0


def test_a_client_that_disconnects_cancels_the_upstream_request(fake, sampled) -> None:
    prompt = "disconnect me"
    with httpx.stream("POST", sampled.url + "/v1/completions", json=_body(False, True, prompt=prompt),
                      headers={"x-fake-delay": "0.3"}, timeout=30) as r:
        next(r.iter_raw())  # one chunk, then go away
    deadline = time.monotonic() + 3
    while json.dumps(prompt) not in fake.app.cancelled:
        assert time.monotonic() < deadline, "the upstream request went on after its client left"
        time.sleep(0.05)
    info, _ = next(v for v in _trace_requests(sampled).values() if v[0].added.prompt == prompt)
    assert "client disconnected" in info.finished.error


def test_64_concurrent_streams_pass_whole_and_the_checkers_queue_stays_bounded(fake, sampled) -> None:
    bodies = [_body(i % 2 == 1, True, prompt=f"concurrent {i}") for i in range(64)]
    headers = {"x-fake-delay": "0.02"}

    async def all_of(base: str) -> list[bytes]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            async def one(b: dict[str, Any]) -> bytes:
                r = await client.post(base + _path("messages" in b), json=b, headers=headers)
                assert r.status_code == 200
                return r.content
            return await asyncio.gather(*(one(b) for b in bodies))

    direct = asyncio.run(all_of(fake.url))
    through = asyncio.run(all_of(sampled.url))
    assert through == direct
    recorded = [v for v in _trace_requests(sampled).values() if "concurrent" in str(v[0].added.prompt)]
    assert len(recorded) == 64 and all(len(tokens) == 8 and info.finished.error is None for info, tokens in recorded)
    checker = sampled.watch.checker
    assert checker.max_depth <= CAPACITY and checker.queue.qsize() <= CAPACITY
    assert checker.dropped >= 64 - CAPACITY  # the reference never came: the rest were dropped, counted
    metrics = httpx.get(sampled.url + "/watch/metrics").text
    assert f"workbench_watch_check_dropped_total {float(checker.dropped)}" in metrics
    assert f"workbench_watch_check_queue_depth {float(checker.queue.qsize())}" in metrics
    status = httpx.get(sampled.url + "/watch/status").json()
    assert status["queue"]["dropped"] == checker.dropped and any("fell behind" in n for n in status["notes"])


def test_metrics_merge_the_upstreams_and_the_proxys(fake, sampled) -> None:
    merged = httpx.get(sampled.url + "/metrics").text
    assert merged.startswith(httpx.get(fake.url + "/metrics").text)  # the upstream's, unchanged, first
    assert "workbench_watch_requests_total" in merged and "workbench_watch_abs_delta_logprob_bucket" in merged
    own = httpx.get(sampled.url + "/watch/metrics").text
    assert "fake_up" not in own and "workbench_watch_positions_checked_total" in own


def test_the_live_page_is_served_and_reads_the_status(sampled) -> None:
    r = httpx.get(sampled.url + "/watch")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'fetch("/watch/status")' in r.text and "latest" in r.text


def test_credentials_never_reach_the_traces(sampled) -> None:
    body = _body(False, False, prompt="with credentials", api_key="sk-body-secret-4711")
    r = httpx.post(sampled.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-header-secret-4711"})
    assert r.status_code == 200
    assert sampled.watch.settle(30, checked=False)
    for path in sampled.watch.recorder.files:
        for suffix in ("", "-wal"):
            if Path(path + suffix).exists():
                assert b"secret-4711" not in Path(path + suffix).read_bytes()


def test_traces_rotate_at_their_size_cap_and_each_file_opens(fake, tmp_path) -> None:
    watch = Watch(fake.url, out=tmp_path, sample=0.0, max_bytes=1 << 16, keep=2, engine_factory=lambda: None)
    with WatchServer(watch) as server:
        for i in range(16):
            assert httpx.post(server.url + "/v1/completions", json=_body(False, False, prompt=f"rotate {i} " * 400),
                              timeout=30).status_code == 200
        assert server.watch.settle(30, checked=False)
        files = list(server.watch.recorder.files)
        assert server.watch.recorder._seq > 2  # it rotated more than once
    assert sorted(str(p) for p in tmp_path.glob("*.wbtrace")) == sorted(files) and len(files) == 2
    for path in files:
        with open_trace(path) as trace:
            assert trace.requests() and all(r.finished is not None for r in trace.requests())


def test_the_command_refuses_a_bad_value_in_one_line(capsys) -> None:
    from workbench.cli import main

    assert main(["watch", "--upstream", "http://127.0.0.1:9", "--sample", "1.5"]) == 2
    assert "--sample must be a fraction in [0, 1], got 1.5" in capsys.readouterr().err


def test_the_reference_process_classifies_against_the_floor_it_is_given(tiny) -> None:
    """`watch --floor` runs the reference in a process of its own: the floor crosses to it, and its verdicts
    are those of the same scoring in this process (and not those without the floor)."""
    import math

    from workbench.engine.engine import Engine
    from workbench.external.check import Scored
    from workbench.external.floor import Floor, FloorBand
    from workbench.trace.events import TokenChosen
    from workbench.watch.scorer import ProcessScorer, ThreadScorer

    floor = Floor([FloorBand(0.0, math.inf, 40, 40, 0.5)], 2, 40, 1, [1e6], 0, {"url": "http://replica"})
    tokens = [TokenChosen(step=0, req_id="r", t=0.0, position=i, token_id=100 + 7 * i, text="", logprob=-1.0, rank=None,
                          top_logprobs=[], source="external") for i in range(6)]

    def batch() -> list[Scored]:
        return [Scored("r", True, [1, 2, 3, 4], list(tokens))]

    engine = Engine(tiny, trace=None, trace_level="off")
    local, plain = ThreadScorer(lambda: engine, 0.05, floor), ThreadScorer(lambda: engine, 0.05)
    local.start()
    plain.start()
    remote = ProcessScorer("tiny-random", device="cpu", tolerance=0.05, threads=1, floor=floor)
    remote.start()
    try:
        [there] = remote.score(batch())
    finally:
        remote.close()
    [here], [without] = local.score(batch()), plain.score(batch())
    assert [(p.verdict, p.floor) for p in there.positions] == [(p.verdict, p.floor) for p in here.positions]
    assert {p.verdict for p in here.positions} == {"floor"} and {p.floor for p in here.positions} == {0.5}
    assert {p.verdict for p in without.positions} <= {"real", "near_tie"} and without.positions[0].floor is None
