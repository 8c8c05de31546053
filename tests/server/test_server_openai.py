"""The OpenAI-compatible endpoint, driven by the official `openai` client against a real uvicorn server
on 127.0.0.1 (tiny-random model): completions and chat, streaming and not, logprobs, usage, stop,
seed, n; 64 concurrent streaming clients; a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from workbench.engine.engine import Engine
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer
from workbench.server.event_hub import EventHub
from workbench.trace.recorder import MemorySink

MODEL = "tiny-random"
CHAT = [{"role": "user", "content": "Tell me a story about a robot."}]


@pytest.fixture(scope="module")
def server(tiny):
    hub, recorder = EventHub(), MemorySink()  # the recorder lets tests see finish steps and reasons
    engine = Engine(tiny, trace_level="summary", trace_sinks=[hub, recorder], max_running=64)
    app = create_app(engine, model_name=MODEL, hub=hub)
    with BackgroundServer(app) as srv:
        srv.engine, srv.recorder = engine, recorder
        yield srv
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _kv_full(engine) -> bool:
    mem = engine.memory
    return (mem.allocator.available_size() == mem.allocator.size
            and mem.req_to_token_pool.available_size() == mem.req_to_token_pool.size)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("workbench_time_to_first_token_seconds_bucket", "workbench_inter_token_latency_seconds_count",
                 "workbench_num_requests_running", "workbench_num_requests_waiting",
                 "workbench_kv_cache_usage_ratio", "workbench_spec_decode_acceptance_rate"):
        assert name in text
    count = next(line for line in text.splitlines() if line.startswith("workbench_time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_completion_streaming_equals_non_streaming_greedy(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("length", "stop")
    parts, reasons = [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            parts.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(parts) == full.choices[0].text and full.choices[0].text
    assert reasons[-1] == full.choices[0].finish_reason
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0


def test_chat_streaming_equals_non_streaming_with_usage_and_logprobs(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    content_lp = choice.logprobs.content
    assert len(content_lp) == full.usage.completion_tokens
    for tok in content_lp:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob)  # greedy picks the top token
    text, stream_lp, usage = "", [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            stream_lp += c.logprobs.content if c.logprobs else []
    assert text == choice.message.content
    assert [t.token for t in stream_lp] == [t.token for t in content_lp]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_logprobs_shape(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(t) <= 2 and tok in t for t, tok in zip(lp.top_logprobs, lp.tokens))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == out.choices[0].text


def test_stop_string_cuts_the_text(client):
    base = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=16, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=16, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert base.startswith(choice.text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=16, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == choice.text


def test_seed_makes_sampling_repeatable_and_n_gives_choices(client):
    kw = dict(model=MODEL, prompt="Pick a word:", max_tokens=12, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=99, **kw).choices[0].text
    assert a == b and a != c
    one = client.completions.create(seed=7, **kw)
    many = client.completions.create(seed=7, n=3, logprobs=0, **kw)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    assert len({ch.text for ch in many.choices}) > 1  # each choice has its own generator
    assert many.usage.prompt_tokens == one.usage.prompt_tokens  # the shared prompt is counted once
    assert many.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in many.choices)


def test_batch_of_prompts_numbers_choices_prompt_major(client):
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
              for p in ("alpha", "beta")]
    both = client.completions.create(model=MODEL, prompt=["alpha", "beta"], max_tokens=5, temperature=0)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == single


def test_64_concurrent_streams_get_exact_token_counts_and_free_kv(server):
    want = 16
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> tuple[int, int, str | None]:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=want,
            temperature=0.7, seed=i, stream=True, logprobs=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        tokens, usage, reason = 0, None, None
        async for chunk in stream:
            for c in chunk.choices:
                tokens += len(c.logprobs.content) if c.logprobs else 0
                reason = c.finish_reason or reason
            usage = chunk.usage or usage
        return tokens, usage.completion_tokens, reason

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert results == [(want, want, "length")] * 64
    deadline = time.monotonic() + 10
    while not _kv_full(server.engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_full(server.engine), "KV slots were not all returned"
    assert not server.engine.reqs, "finished requests were kept by the engine"


def test_disconnect_mid_stream_aborts_and_frees_slots_within_one_step(server):
    body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            req_id = first["id"]
            seen = sum(1 for _, line in zip(range(4), lines))
            assert seen == 4
    # the connection is closed: the server must notice, abort, and free the request's KV
    deadline = time.monotonic() + 30
    finished = []
    while time.monotonic() < deadline and not finished:
        finished = [e for e in server.recorder.of_kind("request.finished") if e.req_id == req_id]
        time.sleep(0.02)
    assert finished, "the request was not ended after the client disconnected"
    event = finished[0]
    assert event.finish_reason == "abort"
    assert len(event.output_ids) < 1500
    asked = [step for rid, step in server.app.state.workbench.loop.recent_aborts if rid == req_id]
    assert asked and event.step - asked[0] <= 1, f"abort asked at step {asked}, done at step {event.step}"
    deadline = time.monotonic() + 5
    while not _kv_full(server.engine) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _kv_full(server.engine)


def test_token_id_prompts_echo_and_usage_chunk(server, client):
    ids = server.engine.tokenize("The quick brown fox")
    by_text = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The quick brown fox" + by_text.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == by_ids.usage.completion_tokens


def test_logit_bias_and_engine_parameters_reach_the_sampler(server, client):
    token_id = 1000
    text = server.engine.tokenizer.decode([token_id])
    forced = client.completions.create(model=MODEL, prompt="Anything", max_tokens=3, temperature=0,
                                       logit_bias={str(token_id): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [text] * 3
    greedy = client.completions.create(model=MODEL, prompt="Sample me", max_tokens=10, temperature=0).choices[0]
    top1 = client.completions.create(model=MODEL, prompt="Sample me", max_tokens=10, temperature=1.5, seed=3,
                                     extra_body={"top_k": 1}).choices[0]
    assert top1.text == greedy.text  # top_k=1 leaves only the argmax, whatever the temperature
