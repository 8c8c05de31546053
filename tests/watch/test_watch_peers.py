"""`workbench watch` in front of the real vLLM (fp32) and llama.cpp (Q4_1) the suite already starts.

What a user relies on: through the proxy, greedy and seeded streams are the bytes vLLM sends
straight; an honest fp32 vLLM shows no real divergence; a fault injected between the proxy and vLLM
(one request's temperature changed on its way) is flagged within seconds on `/metrics` and in
`/watch/status`; llama.cpp's Q4_1 divergences are the ones `workbench check` finds. Every proxy
here samples every request, so every response is rewritten and checked.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from typing import Any

import httpx
import pytest

from tests.helpers.prompts import CHAT, PLAIN
from workbench.watch.service import Watch, WatchServer

pytestmark = pytest.mark.slow
MAX_TOKENS = 16


class _Locked:
    """One reference engine shared by the module's checkers, one batch at a time."""

    def __init__(self, engine: Any) -> None:
        self._engine, self._lock = engine, threading.Lock()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._engine.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def reference() -> _Locked:
    from workbench.engine.engine import Engine

    return _Locked(Engine("smollm2", trace=None, trace_level="off"))


@pytest.fixture(scope="module")
def vllm_watch(vllm_server, reference, tmp_path_factory):
    watch = Watch(vllm_server.check_alive().url, out=tmp_path_factory.mktemp("watch-vllm"), sample=1.0,
                  engine=reference)
    with WatchServer(watch) as server:
        yield server


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _normal(raw: bytes) -> bytes:
    return re.sub(rb'"created":\d+', b'"created":0', raw)  # the second it was made: differs between any two requests


def _content(raw: bytes) -> str:
    """Everything a stream said, with its chunk boundaries taken away."""
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                out.append(f"[{choice.get('finish_reason')}]" if choice.get("finish_reason") else "")
    return "".join(out)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 1234}])
def test_streams_through_watch_are_the_bytes_vllm_sends_straight(vllm_server, vllm_watch, chat, sampling) -> None:
    url = vllm_server.check_alive().url
    body: dict[str, Any] = {"model": _model(url), "max_tokens": MAX_TOKENS, "stream": True, **sampling}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": CHAT[1]}]
    else:
        path, body["prompt"] = "/v1/completions", PLAIN[4]
    tries = []
    for attempt in range(3):
        # vLLM names the response after X-Request-Id: the same id makes the two comparable byte for byte
        headers = {"X-Request-Id": f"watch-identity-{chat}-{sampling['temperature']}-{attempt}"}
        direct = httpx.post(url + path, json=body, headers=headers, timeout=120)
        through = httpx.post(vllm_watch.url + path, json=body, headers=headers, timeout=120)
        assert through.status_code == direct.status_code == 200
        assert through.headers["content-type"] == direct.headers["content-type"]
        tries.append((_normal(direct.content), _normal(through.content)))
        # what was said is always the same; vLLM's chunking follows its own timing (two direct
        # requests can group tokens differently under load), so the bytes are compared again then
        assert _content(tries[-1][1]) == _content(tries[-1][0])
        if tries[-1][0] == tries[-1][1]:
            break
    assert tries[-1][0] == tries[-1][1], f"never byte-identical in {len(tries)} tries: {tries[-1]}"
    assert b'"logprobs":null' in tries[-1][1] and b"token_id:" not in tries[-1][1]  # what the proxy asked, taken off


def test_an_honest_fp32_vllm_shows_no_real_divergence(vllm_server, vllm_watch) -> None:
    url, model = vllm_watch.url, _model(vllm_server.check_alive().url)

    async def send() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            reqs = [client.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": MAX_TOKENS,
                                                                "temperature": 0, "stream": True}) for p in PLAIN]
            reqs += [client.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": c}], "max_tokens": MAX_TOKENS,
                "temperature": 0.8, "seed": 7, "stream": False}) for c in CHAT[:4]]
            assert all(r.status_code == 200 for r in await asyncio.gather(*reqs))

    asyncio.run(send())
    assert vllm_watch.watch.settle(300)
    status = httpx.get(url + "/watch/status").json()
    totals = status["totals"]
    assert totals["requests_checked"] >= 12 and status["queue"]["dropped"] == 0
    assert totals["requests_real"] == 0 and totals["positions"]["real"] == totals["positions"]["logprob"] == 0, \
        status["latest_real"][:1]
    assert totals["positions"]["ok"] >= 12 * MAX_TOKENS * 0.9
    metrics = httpx.get(url + "/metrics").text
    assert "vllm:" in metrics and "workbench_watch_requests_real_divergence_total 0.0" in metrics
    print(f"\nwatch checker on fp32 vLLM: {status['checker']}")


class _FaultLayer:
    """A relay between the proxy and vLLM that changes the sampling of requests marked `x-inject-fault`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.client = httpx.AsyncClient(timeout=None)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k not in (b"host", b"content-length")}
        if headers.pop("x-inject-fault", None):
            obj = json.loads(body)
            obj.update(temperature=1.5, seed=11)
            body = json.dumps(obj).encode()
        resp = await self.client.post(self.upstream + scope["path"], content=body, headers=headers)
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": [(b"content-type", resp.headers["content-type"].encode())]})
        await send({"type": "http.response.body", "body": resp.content})


def test_a_fault_injected_between_proxy_and_vllm_is_flagged_within_seconds(vllm_server, browser, tmp_path) -> None:
    """As `workbench watch` runs it: the reference loads in the checker's own process."""
    import uvicorn

    from workbench.external.peers import free_port

    port = free_port()
    layer = uvicorn.Server(uvicorn.Config(_FaultLayer(vllm_server.check_alive().url), host="127.0.0.1", port=port,
                                          log_level="warning"))
    thread = threading.Thread(target=layer.run, daemon=True)
    thread.start()
    while not layer.started:
        time.sleep(0.02)
    model = _model(vllm_server.url)
    try:
        watch = Watch(f"http://127.0.0.1:{port}", out=tmp_path, sample=1.0)
        with WatchServer(watch) as server:
            deadline = time.monotonic() + 300
            while watch.status.reference_state == "loading":
                assert time.monotonic() < deadline, "the reference process did not load in 300 s"
                time.sleep(0.2)
            assert watch.status.reference_state == "ready", watch.status.notes
            def one(prompt: str, fault: bool) -> None:
                r = httpx.post(server.url + "/v1/completions", timeout=120,
                               headers={"x-inject-fault": "1"} if fault else {},
                               json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
                assert r.status_code == 200

            for p in PLAIN[:3]:
                one(p, False)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(server.url + "/watch")
            page.wait_for_function("document.getElementById('checked').textContent !== ''", timeout=30_000)
            sent = time.monotonic()
            one(PLAIN[5], True)
            while True:
                metrics = httpx.get(server.url + "/metrics").text
                if "workbench_watch_requests_real_divergence_total 1.0" in metrics:
                    break
                assert time.monotonic() - sent < 60, "the injected fault was not flagged within 60 s"
                time.sleep(0.2)
            flagged_after = time.monotonic() - sent
            status = httpx.get(server.url + "/watch/status").json()
            # the live page shows it within its next refresh; a click opens its tokens beside the reference's
            page.wait_for_function("document.querySelectorAll('#latest tbody tr').length === 1", timeout=5_000)
            assert page.locator("#real").text_content() == "1"
            page.locator("#latest tbody tr").first.click()
            detail = page.locator("#detail").text_content()
            page_real_rows = page.locator("#detail tr.v-real").count()
            page.close()
    finally:
        layer.should_exit = True
        thread.join(timeout=10)
    assert status["totals"]["requests_real"] == 1  # only the faulted one
    latest = status["latest_real"][0]
    assert latest["greedy"] and latest["verdict"] == "real"
    assert latest["engine"]["id"] != latest["reference"]["id"]  # its token beside the reference's
    assert any(t["verdict"] == "real" for t in latest["tokens"])
    assert latest["req_id"] in detail and json.dumps(latest["engine"]["text"]) in detail
    assert json.dumps(latest["reference"]["text"]) in detail and page_real_rows >= 1
    from workbench.trace.reader import open_trace

    with open_trace(latest["trace"]) as trace:
        assert next(r for r in trace.requests() if r.req_id == latest["req_id"]).added.prompt == PLAIN[5]
    print(f"\ninjected fault flagged {flagged_after:.1f} s after its request was sent")
    assert flagged_after < 30


def test_llamacpp_divergences_are_found_as_check_finds_them(llamacpp_server, vllm_server, reference,
                                                            tmp_path) -> None:
    """The watch's live verdicts on llama.cpp's traffic are those `workbench check` gives its recorded
    trace, with the local reference and with the fp32 vLLM as the reference (`--reference URL`)."""
    from workbench.external.check import check_trace
    from workbench.trace.checks import read_checks
    from workbench.trace.reader import open_trace

    url = llamacpp_server.check_alive().url
    greedy = {"temperature": 0.0, "repeat_penalty": 1.0}  # llama.cpp's default penalty aside: what is left is the weights
    watch = Watch(url, out=tmp_path, sample=1.0, engine=reference)
    model = _model(url)
    with WatchServer(watch) as server:
        for p in PLAIN[:4]:
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": p, "max_tokens": 32, "stream": True, **greedy})
            assert r.status_code == 200 and re.search(rb'"logprobs": ?null', r.content)
        assert watch.settle(300)
        status = httpx.get(server.url + "/watch/status").json()
    [path] = watch.recorder.files
    live = read_checks(path)
    with open_trace(path) as trace:
        assert [r.added.prompt for r in trace.requests()] == PLAIN[:4]
        assert sum(1 for _ in trace.events(kind="token")) > 4 * 16  # ids recovered from llama.cpp's text
    report = check_trace(path, "smollm2", engine=reference, store=False, progress=False)
    assert {r.req_id for r in report.requests} == set(live)
    for rc in report.requests:
        row = live[rc.req_id]
        assert (row["first_divergence"], row["divergence_class"]) == (rc.first_divergence, rc.divergence_class)
        assert [q["verdict"] for q in row["positions"]] == [q.verdict for q in rc.positions]
    assert report.real_divergences, "Q4_1 against fp32 showed no real divergence: nothing to find"
    from workbench.external.server_reference import ServerReference

    served = check_trace(path, vllm_server.check_alive().url, engine=ServerReference(vllm_server.url), store=False,
                         progress=False)
    for local, remote in zip(report.requests, served.requests, strict=True):
        assert [q.verdict for q in remote.positions] == [q.verdict for q in local.positions]
        assert [q.ref_argmax for q in remote.positions] == [q.ref_argmax for q in local.positions]
        assert max(abs(a.ref_logprob - b.ref_logprob) for a, b in zip(local.positions, remote.positions)) < 1e-3
    assert status["totals"]["requests_real"] == len(report.real_divergences)
    assert status["latest_real"] and status["latest_real"][0]["req_id"] in {r.req_id for r in report.real_divergences}
    print(f"\nllama.cpp through watch: {status['totals']}")


def test_a_measured_floor_classifies_llamacpps_traffic_as_check_floor_does(llamacpp_server, vllm_server, reference,
                                                                          browser, tmp_path) -> None:
    """`watch --floor FILE`: the floor `workbench floor` measures between two deployments of SmolLM2 (the
    fp32 vLLM and llama.cpp's Q4_1 as the two replicas), then llama.cpp's traffic through a watch that
    classifies against it: position by position the verdicts of `workbench check --floor` on the same
    trace, flips within the measured spread inside the floor, and the floor beside the figures in
    /watch/status, /metrics and on the live page."""
    from workbench.external.check import check_trace
    from workbench.external.floor import measure_floor
    from workbench.external.records import ProbeRequest
    from workbench.trace.checks import read_checks

    url = llamacpp_server.check_alive().url
    floor = measure_floor(vllm_server.check_alive().url, [ProbeRequest(prompt=p) for p in PLAIN[4:7]],
                          tmp_path / "floor.json", url2=url, top_logprobs=20, max_tokens=12, concurrency=1,
                          progress=False)
    print(f"\n{floor.describe()}")
    watch = Watch(url, out=tmp_path / "traces", sample=1.0, engine=reference, floor=tmp_path / "floor.json")
    model = _model(url)
    with WatchServer(watch) as server:
        for p in PLAIN[:3]:
            r = httpx.post(server.url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": p, "max_tokens": 24, "temperature": 0.0, "repeat_penalty": 1.0})
            assert r.status_code == 200
        assert watch.settle(300)
        status = httpx.get(server.url + "/watch/status").json()
        metrics = httpx.get(server.url + "/watch/metrics").text  # llama.cpp's server has no /metrics of its own
        page = browser.new_page()
        page.goto(server.url + "/watch")
        page.wait_for_function("document.getElementById('inside').textContent !== ''", timeout=30_000)
        shown = {k: page.locator(f"#{k}").text_content() for k in ("floor", "inside", "beyond", "positions")}
        page.close()
    [path] = watch.recorder.files
    live = read_checks(path)
    report = check_trace(path, "smollm2", engine=reference, store=False, progress=False, floor=tmp_path / "floor.json")
    plain = check_trace(path, "smollm2", engine=reference, store=False, progress=False)
    for rc, without in zip(report.requests, plain.requests, strict=True):
        assert [q["verdict"] for q in live[rc.req_id]["positions"]] == [q.verdict for q in rc.positions]
        # the floor moves a greedy flip from near tie / real to inside it only where its spread covers the gap
        for q, w in zip(rc.positions, without.positions, strict=True):
            moved = w.verdict in ("near_tie", "real") and q.gap <= floor.flip_bound(q.ref_logprob + q.gap)
            assert q.verdict == ("floor" if moved else w.verdict)
    inside = sum(rc.inside_floor for rc in report.requests)
    assert inside, "no flip of llama.cpp's fell inside the floor measured against it: nothing was classified by it"
    counts = status["totals"]["positions"]
    assert counts["floor"] == inside and counts["real"] == report.real_positions
    assert status["floor"]["max_abs"] == floor.max_abs and status["floor"]["source"]["url2"] == floor.source["url2"]
    assert f'workbench_watch_positions_checked_total{{verdict="floor"}} {float(inside)}' in metrics
    assert "workbench_watch_floor_bound{" in metrics and "workbench_watch_positions_beyond_floor_total" in metrics
    assert shown["floor"].startswith(f"measured at {floor.source['url']} ({floor.positions} positions")
    assert shown["inside"] == str(inside) and shown["beyond"] == str(status["totals"]["beyond_floor"])
    assert f"floor {inside}" in shown["positions"]
    print(f"\nllama.cpp through watch --floor: {counts}, beyond the floor {status['totals']['beyond_floor']}")
