"""The prefix cache (`Engine(prefix_cache=True)`, `workbench serve --prefix-cache`): a chat's next turn
copies the KV of the previous turn instead of recomputing it and answers exactly as without the cache;
cached KV gives way when memory is needed; the trace shows every slot kept, copied and evicted; a
trace recorded with it replays identically; the server reports cached prompt tokens the OpenAI way."""

from __future__ import annotations

import pytest

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.rerun.replay import replay

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=True)
FIRST = [{"role": "system", "content": "You are a careful assistant who answers in full sentences."},
         {"role": "user", "content": "Describe a lighthouse at night in two sentences."}]


def run_alone(engine: Engine, prompt, params: SamplingParams = GREEDY):  # noqa: ANN001 - a prompt or chat
    """Submit one request and step until it is done (so each turn arrives after the previous finished)."""
    (rid,) = engine.add_request(prompt, params)
    while engine.has_work():
        engine.step()
    return engine.finished[rid]


def follow_up(first_out) -> list[dict]:  # noqa: ANN001 - a RequestOutput
    return [*FIRST, {"role": "assistant", "content": first_out.text},
            {"role": "user", "content": "Now describe it at dawn."}]


def kv_events(engine: Engine) -> list:
    return [e for e in engine.memory_sink.events if e.kind == "kv"]


@pytest.fixture()
def cached(tiny):
    with Engine(tiny, prefix_cache=True, trace_level="summary") as engine:
        yield engine


def test_a_follow_up_turn_copies_the_previous_turn_and_answers_the_same(tiny, cached):
    with Engine(tiny, trace_level="off") as plain:
        expected = [run_alone(plain, FIRST)]
        expected.append(run_alone(plain, follow_up(expected[0])))
    first = run_alone(cached, FIRST)
    second = run_alone(cached, follow_up(first))

    assert first.usage["cached_prompt_tokens"] == 0
    # the whole first prompt (and the answer, as far as re-tokenizing it gives the same ids) came from the cache
    assert second.usage["cached_prompt_tokens"] >= len(first.prompt_token_ids)
    for got, want in zip((first, second), expected, strict=True):
        assert got.token_ids == want.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs)) < 1e-4

    events = cached.memory_sink.events
    fb = next(e for e in events if e.kind == "forward_batch" and second.req_id in e.req_ids)
    row = fb.req_ids.index(second.req_id)
    assert fb.extend_prefix_lens[row] == second.usage["cached_prompt_tokens"]  # prefill started after the copy
    assert fb.extend_seq_lens[row] == len(second.prompt_token_ids) - fb.extend_prefix_lens[row]
    kept = next(e for e in kv_events(cached) if e.op == "cache" and e.req_id == first.req_id)
    copy = next(e for e in kv_events(cached) if e.op == "alloc" and e.req_id == second.req_id)
    assert len(kept.slots) == len(first.prompt_token_ids) + len(first.token_ids) - 1  # all but the last token
    assert len(copy.slots) == second.usage["cached_prompt_tokens"] and first.req_id in copy.reason
    alloc = cached.memory.allocator
    assert kv_events(cached)[-1].kv_used == alloc.used() == cached.scheduler.prefix_cache.tokens > 0
    assert cached.flush_prefix_cache() > 0
    assert alloc.available_size() == alloc.size
    assert kv_events(cached)[-1].op == "evict" and kv_events(cached)[-1].kv_used == 0


def test_cached_prefixes_give_way_when_memory_is_needed(tiny):
    prompts = [f"Story number {i}: " + "once upon a time there was a tiny lighthouse keeper " * 3 for i in range(5)]
    big = SamplingParams(temperature=0, max_new_tokens=150, ignore_eos=True)
    with Engine(tiny, prefix_cache=True, kv_tokens=320, trace_level="summary") as engine:
        for p in prompts:
            run_alone(engine, p, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
        cache = engine.scheduler.prefix_cache
        held = cache.tokens
        assert len(cache) >= 3 and held > 200  # most of the pool is cached KV now
        out = run_alone(engine, "A completely different request that needs room. " * 4, big)
        assert out.finish_reason == "length" and len(out.token_ids) == 150
        evicted = [e for e in kv_events(engine) if e.op == "evict"]
        assert evicted and cache.evictions == len(evicted) and all("make room" in e.reason for e in evicted)
        assert out.timings["preemptions"] == 0  # the cache gave way; the running request was never preempted
        assert sum(len(e.slots) for e in evicted) <= held
    with Engine(tiny, trace_level="off", kv_tokens=320) as plain:
        assert run_alone(plain, "A completely different request that needs room. " * 4, big).token_ids == out.token_ids


def test_a_repeated_prompt_is_cached_once_and_a_longer_one_supersedes_it(tiny, cached):
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog, again and again, all day long."
    a = run_alone(cached, prompt, params)
    b = run_alone(cached, prompt, params)
    cache = cached.scheduler.prefix_cache
    assert b.token_ids == a.token_ids and b.usage["cached_prompt_tokens"] == len(b.prompt_token_ids) - 1
    assert len(cache) == 1  # the second run's KV equals the first's: freed, not cached twice
    assert [e.op for e in kv_events(cached) if e.req_id == b.req_id][-1] == "free"
    # a prompt (token ids) continuing the cached tokens: its own entry covers the old one, which goes
    longer = run_alone(cached, [*a.prompt_token_ids, *a.token_ids, *a.token_ids[:4]], params)
    assert longer.usage["cached_prompt_tokens"] == len(a.prompt_token_ids) + len(a.token_ids) - 1
    assert len(cache) == 1 and cache.entries[next(iter(cache.entries))].source == longer.req_id
    assert any(e.op == "evict" and "superseded" in e.reason for e in kv_events(cached))


def test_preemption_frees_are_traced_with_their_slots(tiny):
    prompts = [f"Request {i} asks for a long answer about ships and the sea" for i in range(6)]
    with Engine(tiny, kv_tokens=160, trace_level="summary") as engine:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
        preempted = [e for e in engine.memory_sink.events if e.kind == "schedule" and e.preempted]
        frees = [e for e in kv_events(engine) if e.op == "free" and e.reason == "preempt"]
    assert all(o.finish_reason == "length" for o in outs)
    assert preempted, "the pool was meant to run out"
    assert sorted(e.req_id for e in frees) == sorted(r for s in preempted for r in s.preempted)
    assert all(e.slots for e in frees)


def test_a_trace_recorded_with_the_prefix_cache_replays_identically(tiny, tmp_path):
    path = tmp_path / "cache.wbtrace"
    with Engine(tiny, prefix_cache=True, trace=str(path)) as engine:
        first = run_alone(engine, FIRST)
        second = run_alone(engine, follow_up(first))
    assert second.usage["cached_prompt_tokens"] > 0
    report = replay(str(path), progress=False)
    assert report.identical, report.divergence.describe()


def test_server_reports_cached_prompt_tokens(tiny):
    openai = pytest.importorskip("openai")
    from workbench.server.app import create_app
    from workbench.server.background import BackgroundServer

    engine = Engine(tiny, prefix_cache=True, trace_level="off")
    with BackgroundServer(create_app(engine, model_name="tiny-random")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        one = client.chat.completions.create(model="tiny-random", messages=FIRST, max_tokens=12, temperature=0)
        turn = [*FIRST, {"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": "And at dawn?"}]
        two = client.chat.completions.create(model="tiny-random", messages=turn, max_tokens=12, temperature=0)
    engine.close()
    assert one.usage.prompt_tokens_details is None
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens


def test_random_arrivals_under_memory_pressure_match_the_engine_without_cache(tiny):
    """Requests sharing prefixes (some continuing an earlier one, as a chat's next turn does) arrive at
    random steps into a small pool (preemption, eviction, n > 1, an abort): every greedy output equals
    the no-cache engine's, and after a flush the pool is whole. Three seeds; the cache must be hit."""
    import random

    def make_plan(rng: random.Random) -> list[tuple[int, str, SamplingParams]]:
        stems = ["Tell me about lighthouses and the keepers who lived in them long ago, ",
                 "Explain how a paged KV cache works in an inference engine, step by step, "]
        plan, prompts = [], []
        for _ in range(10):
            words = " ".join(rng.choices(["please", "briefly", "in detail", "now"], k=3))
            prompt = (rng.choice(prompts) + " and then " + words) if prompts and rng.random() < 0.5 else \
                rng.choice(stems) + words
            prompts.append(prompt)
            params = SamplingParams(temperature=0, max_new_tokens=rng.randint(5, 30), ignore_eos=True,
                                    n=rng.choice([1, 1, 2]))
            plan.append((rng.randint(0, 60), prompt, params))
        return sorted(plan, key=lambda x: x[0])

    def run(plan: list, abort_at: int, prefix_cache: bool) -> tuple[dict, int]:
        engine = Engine(tiny, prefix_cache=prefix_cache, kv_tokens=240, trace_level="off")
        ids, pending, aborted = [], list(plan), None
        while pending or engine.has_work():
            # an idle engine counts no steps: the next arrival comes now
            while pending and (pending[0][0] <= engine.step_no or not engine.has_work()):
                _, prompt, params = pending.pop(0)
                ids += engine.add_request(prompt, params, req_id=f"r{len(ids)}")
            if aborted is None and engine.step_no >= abort_at and ids:
                aborted = ids[0]
                engine.abort(aborted)
            engine.step()
        outs = {rid: engine.finished[rid].token_ids for rid in ids if rid != aborted}
        hits = engine.scheduler.prefix_cache.hits if prefix_cache else 0
        engine.flush_prefix_cache()
        alloc, pool = engine.memory.allocator, engine.memory.req_to_token_pool
        assert alloc.available_size() == alloc.size and pool.available_size() == pool.size
        engine.close()
        return outs, hits

    total_hits = 0
    for seed in range(3):
        rng = random.Random(seed)
        plan, abort_at = make_plan(rng), rng.randint(5, 30)
        with_cache, hits = run(plan, abort_at, True)
        assert with_cache == run(plan, abort_at, False)[0], f"seed {seed}"
        total_hits += hits
    assert total_hits > 0
