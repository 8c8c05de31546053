"""Every model family the engine serves runs exactly like transformers, or is refused at load.

For each tiny family model (`tiny-random:<family>`, models/tiny.py: sliding windows of 32 tokens,
shorter than most prompts, alternating sliding/full layers, Qwen2's use_sliding_window, Gemma 2's
soft-capping, gpt-oss's sinks, Granite's scaling, two MoE families), eight prompts of 1 to 300
tokens submitted together give transformers' greedy `generate()` output token for token: batched,
with chunked prefill of 16 tokens, with a pool small enough to preempt, with n-gram speculation, with
the model drafting for itself (every draft accepted: the verify path keeps accepted runs) and with
the prefix cache; chosen-token logprobs are within 1e-4 of transformers' log-softmax. The family
tests are `slow` (a few seconds each alone; eleven families).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.helpers.hf_reference import greedy_reference, token_logprobs
from tests.helpers.prompts import LONG_TEXT
from workbench.engine.engine import Engine
from workbench.engine.run import variants
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.models import load_model, tiny

NEW = 16  # the 19-token prompt decodes past its 32-token window
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, logprobs=True)
LENGTHS = (1, 6, 19, 33, 64, 128, 200, 300)  # five longer than the 32-token windows
FAMILIES = sorted(tiny.FAMILIES)
# what the layers of each family must report (the probe reads it from the model, not from this list)
EXPECTED = {"qwen2": [None, 32], "mistral": [32, 32], "gemma2": [32, None], "gemma3": [32, 32, None],
            "gpt_oss": [32, None]}


@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def family(request):
    loaded = load_model(f"tiny-random:{request.param}", device="cpu")
    text = loaded.tokenizer(LONG_TEXT * 6, add_special_tokens=False)["input_ids"]
    prompts = [text[:n] for n in LENGTHS]
    refs = [greedy_reference(str(loaded.folder), p, NEW) for p in prompts]
    return request.param, loaded, prompts, refs


def _run(loaded, prompts, **engine_kwargs):
    engine = Engine(loaded, trace_level="off", **engine_kwargs)
    outs = engine.generate(prompts, GREEDY)
    return engine, outs


def _assert_same(outs, prompts, refs, name):
    for p, ref, out in zip(prompts, refs, outs, strict=True):
        assert out.token_ids == ref, f"{name}: diverged from transformers for the prompt of {len(p)} tokens"


def test_batched_greedy_and_logprobs_match_transformers(family):
    name, loaded, prompts, refs = family
    engine, outs = _run(loaded, prompts)
    windows = [v["window"] for v in engine.runner.attention_variants]
    assert windows == EXPECTED.get(name, [None] * len(windows))
    _assert_same(outs, prompts, refs, name)
    for p, out in zip(prompts, outs, strict=True):
        want = token_logprobs(str(loaded.folder), p, out.token_ids)
        got = [lp.logprob for lp in out.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, f"{name}: {len(p)}-token prompt"


def test_chunked_prefill_16_matches_transformers(family):
    name, loaded, prompts, refs = family
    _, outs = _run(loaded, prompts, chunk_size=16, max_batch_tokens=64)
    _assert_same(outs, prompts, refs, name)


def test_preemption_matches_transformers(family):
    name, loaded, prompts, refs = family
    _, outs = _run(loaded, prompts, kv_tokens=max(LENGTHS) + NEW + 64, chunk_size=128)
    assert sum(o.timings["preemptions"] for o in outs) > 0, "the pool was meant to force preemption"
    _assert_same(outs, prompts, refs, name)


def test_ngram_speculation_matches_transformers(family):
    name, loaded, prompts, refs = family
    # random weights seldom repeat an n-gram, so drafts are few (and mostly rejected); the next test
    # drafts every step
    _, outs = _run(loaded, prompts, spec="ngram:k=3:min=1")
    _assert_same(outs, prompts, refs, name)


def test_self_drafting_speculation_matches_transformers(family):
    # random weights rarely repeat an n-gram; the model drafting for itself has every draft accepted
    name, loaded, prompts, refs = family
    engine, outs = _run(loaded, prompts, spec=f"draft:tiny-random:{name}:k=3")
    metrics = engine.spec.metrics()
    assert metrics["accepted_tokens"] > 0.9 * metrics["draft_tokens"] > 0
    _assert_same(outs, prompts, refs, name)


def test_prefix_cache_matches_transformers(family):
    # the prompts are prefixes of one text: prefix sharing and the cache copy KV across windows
    name, loaded, prompts, refs = family
    engine = Engine(loaded, trace_level="off", prefix_cache=True)
    engine.generate(prompts[-1:], GREEDY)
    outs = engine.generate(prompts, GREEDY)
    assert sum(o.usage["cached_prompt_tokens"] for o in outs) >= sum(LENGTHS[3:]) - 5 * 16
    _assert_same(outs, prompts, refs, name)


def _tiny(config_cls, **kw):
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_cls(**{**base, **kw})).eval()


def test_an_attention_feature_the_engine_lacks_is_refused_at_load():
    bidirectional = _tiny(transformers.Gemma3TextConfig, sliding_window=8, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"^gemma3_text: bidirectional \(non-causal\) attention is not supported"):
        variants.probe(bidirectional)
    mpt = transformers.AutoModelForCausalLM.from_config(
        transformers.MptConfig(vocab_size=128, d_model=32, n_heads=2, n_layers=2, max_seq_len=64)).eval()
    with pytest.raises(ValueError, match=r"^mpt: attention outside transformers' AttentionInterface"):
        variants.probe(mpt)


def test_a_layer_passing_an_unknown_attention_keyword_is_refused(monkeypatch):
    model = _tiny(transformers.LlamaConfig)
    attn = model.model.layers[1].self_attn
    original = attn.forward

    def with_position_bias(*args, **kwargs):  # what an ALiBi-style layer would pass its attention function
        return original(*args, position_bias=torch.zeros(1), **kwargs)

    monkeypatch.setattr(attn, "forward", with_position_bias)
    with pytest.raises(ValueError, match=r"^llama: the attention keyword 'position_bias' is not supported"):
        variants.probe(model)


def test_an_unknown_family_spec_names_the_families():
    with pytest.raises(ValueError, match="unknown tiny-random family 'bert'.*gemma2"):
        load_model("tiny-random:bert", device="cpu")


def test_attention_the_model_would_shape_through_its_mask_is_refused():
    chunked = _tiny(transformers.LlamaConfig)
    chunked.config.attention_chunk_size = 8  # Llama 4's chunked attention lives in the mask only
    with pytest.raises(ValueError, match=r"^llama: chunked attention \(attention_chunk_size\) is not supported"):
        variants.probe(chunked)
    qwen2 = _tiny(transformers.Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert [v.window for v in variants.probe(qwen2)] == [None, 8]
    qwen2.model.layers[1].self_attn.sliding_window = None  # a window the layer does not pass on
    with pytest.raises(ValueError, match=r"^qwen2: a sliding window applied only through the mask \(layer 1\)"):
        variants.probe(qwen2)
