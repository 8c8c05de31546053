"""Greedy output of the engine equals transformers generate(), token for token, with every prompt
submitted together: plain batching, chunked prefill forced to 16 tokens, and a KV pool so small
that requests are preempted and recomputed."""

from __future__ import annotations

import pytest

from tests.helpers.hf_reference import greedy_reference, token_logprobs
from tests.helpers.prompts import PROMPTS
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams

NEW = 64
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, logprobs=True)


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def model_and_refs(request):
    loaded = request.getfixturevalue(request.param)
    engine = Engine(loaded, trace_level="off")
    ids = [engine.tokenize(p) for p in PROMPTS]
    assert min(map(len, ids)) <= 5 and max(map(len, ids)) >= 300, "prompt lengths must span 5..400 tokens"
    refs = [greedy_reference(str(loaded.folder), p, NEW) for p in ids]
    return loaded, ids, refs


def _run(loaded, **engine_kwargs):
    engine = Engine(loaded, trace_level="off", **engine_kwargs)
    outs = engine.generate(PROMPTS, GREEDY)
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size
    return engine, outs


def test_batched_greedy_matches_transformers(model_and_refs):
    loaded, ids, refs = model_and_refs
    _, outs = _run(loaded)
    for prompt_ids, ref, out in zip(ids, refs, outs, strict=True):
        assert out.token_ids == ref, f"diverged for prompt of {len(prompt_ids)} tokens"
        want = token_logprobs(str(loaded.folder), prompt_ids, out.token_ids)
        got = [lp.logprob for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_chunked_prefill_16_matches_transformers(model_and_refs):
    loaded, _, refs = model_and_refs
    engine, outs = _run(loaded, chunk_size=16, max_batch_tokens=64)
    assert [o.token_ids for o in outs] == refs


def test_preemption_matches_transformers(model_and_refs):
    loaded, ids, refs = model_and_refs
    # Room for the longest request and a few more, not for all: requests are still preempted (the assert
    # below), but fewer times over (smollm2: 17.5 s against 23 with 336 slots fewer).
    kv = max(len(p) for p in ids) + NEW + 400
    engine, outs = _run(loaded, kv_tokens=kv, chunk_size=128)
    assert sum(o.timings["preemptions"] for o in outs) > 0, "the pool was meant to force preemption"
    assert [o.token_ids for o in outs] == refs


def test_prefix_sharing_matches_transformers(model_and_refs):
    # The chat prompts share the template's system prompt: with prefix sharing most of them copy its
    # KV from the first one's prefill instead of computing it, and the tokens must not change.
    loaded, _, refs = model_and_refs
    engine, outs = _run(loaded, prefix_sharing=True)
    assert sum(o.usage["cached_prompt_tokens"] > 0 for o in outs) >= 4
    assert [o.token_ids for o in outs] == refs
