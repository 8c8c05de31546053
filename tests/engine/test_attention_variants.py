"""The attention variants against transformers' own definitions: the sliding-window mask of
`masking_utils` (off by one matters), Gemma 2's soft-capped and gpt-oss's sink eager attention, the
C decode kernel's windowed path (the full path over the window's slots, bit for bit, and the torch
path's numbers), and the runner's per-layer record in the trace and the TUI."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from workbench.engine.kernels import decode_attention, native
from workbench.engine.kernels.torch_paths import disabled
from workbench.engine.run import attention

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None


@pytest.mark.parametrize(("n", "prefix", "window"), [(1, 0, 4), (10, 0, 4), (10, 0, 10), (3, 20, 4), (1, 40, 32),
                                                      (16, 16, 32), (16, 48, 32), (5, 2, None), (7, 0, 1)])
def test_window_mask_is_transformers_sliding_window_mask(n, prefix, window):
    got = attention.extend_mask(n, prefix, window, "cpu")
    if got is None:  # plain causal attention over the row's own tokens
        got = torch.ones(n, n, dtype=torch.bool).tril()
    fn = sliding_window_causal_mask_function(window) if window else (lambda b, h, q, k: k <= q)
    q_idx = torch.arange(prefix, prefix + n)[:, None]
    kv_idx = torch.arange(prefix + n)[None, :]
    want = fn(torch.tensor(0), torch.tensor(0), q_idx, kv_idx).expand(n, prefix + n)
    assert torch.equal(got, want)
    if window:
        assert int(got[-1].sum()) == min(window, prefix + n)  # the query and the window-1 before it


def _qkv(n=6, length=9, heads=4, kv_heads=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, n, d, generator=g) * 3, torch.randn(1, kv_heads, length, d, generator=g),
            torch.randn(1, kv_heads, length, d, generator=g))


def _additive(mask: torch.Tensor) -> torch.Tensor:  # transformers' eager masks add the dtype's minimum
    return torch.where(mask, 0.0, torch.finfo(torch.float32).min)[None, None]


def test_soft_capped_attention_is_gemma2_eager():
    q, k, v = _qkv()
    mask = attention.extend_mask(6, 3, 4, "cpu")
    module = SimpleNamespace(num_key_value_groups=2, training=False)
    want, _ = gemma2_eager(module, q, k, v, _additive(mask), scaling=0.3, softcap=2.0)
    got = attention._attend(q, k, v, mask, 0.3, 2.0, None)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=1e-6)
    plain = attention._attend(q, k, v, mask, 0.3, None, None)
    assert (plain - got).abs().max() > 1e-2  # the cap changes the result: the test can fail


def test_attention_sinks_are_gpt_oss_eager():
    q, k, v = _qkv(seed=1)
    mask = attention.extend_mask(6, 3, None, "cpu")
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    module = SimpleNamespace(num_key_value_groups=2, training=False, sinks=sinks)
    want, _ = gpt_oss_eager(module, q, k, v, _additive(mask), scaling=0.25)
    got = attention._attend(q, k, v, mask, 0.25, None, sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-6, rtol=1e-6)
    assert (attention._attend(q, k, v, mask, 0.25, None, None) - got).abs().max() > 1e-2


def _pool(seed=3, slots=300, batch=6, length=50, kv_heads=2, d=16):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(slots, kv_heads, d, generator=g)
    v_pool = torch.randn(slots, kv_heads, d, generator=g)
    lens = torch.tensor([1, 50, 17, 33, 32, 8])
    idx = torch.randint(1, slots, (batch, length), generator=g) * (torch.arange(length)[None] < lens[:, None])
    q = torch.randn(batch, 2 * kv_heads, d, generator=g) * 3
    return q, k_pool, v_pool, idx, lens


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("window", [1, 4, 32, 64])
def test_windowed_decode_kernel_is_the_full_kernel_over_the_window(window):
    assert native.available()
    q, k_pool, v_pool, idx, lens = _pool()
    scale = 16 ** -0.5
    out = torch.full_like(q, float("nan"))
    assert decode_attention.decode_attention(q, k_pool, v_pool, idx, lens, out, scale, window=window)
    # the same kernel without a window, given only each row's last min(len, window) slots: bit for bit
    first = (lens - window).clamp(min=0)
    cut = torch.zeros_like(idx)
    for b in range(len(lens)):
        cut[b, :lens[b] - first[b]] = idx[b, first[b]:lens[b]]
    full = torch.full_like(q, float("nan"))
    assert decode_attention.decode_attention(q, k_pool, v_pool, cut, lens - first, full, scale)
    assert torch.equal(out, full)
    # and the numbers of the engine's torch path: gather + sdpa under the window mask
    b, length = idx.shape
    k = k_pool.index_select(0, idx.reshape(-1)).view(b, length, 2, 16).transpose(1, 2)
    v = v_pool.index_select(0, idx.reshape(-1)).view(b, length, 2, 16).transpose(1, 2)
    pos = torch.arange(length)[None, :]
    mask = ((pos < lens[:, None]) & (pos >= lens[:, None] - window))[:, None, None, :]
    want = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    torch.testing.assert_close(out, want[:, :, 0], atol=2e-6, rtol=1e-5)


def _family_greedy(loaded, prompts, **kw):
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    with Engine(loaded, trace_level="off", chunk_size=16, **kw) as engine:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, logprobs=True))
    return [o.token_ids for o in outs], [lp.logprob for o in outs for lp in o.logprobs]


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_a_windowed_model_gives_the_same_tokens_with_and_without_the_kernel():
    from workbench.models import load_model

    mistral = load_model("tiny-random:mistral", device="cpu")  # every layer windowed (32 tokens)
    prompts = ["The quick brown fox", "a" * 120, "one two three " * 12]
    with_kernel = _family_greedy(mistral, prompts)
    with disabled(mistral.model):
        without = _family_greedy(mistral, prompts)
    assert with_kernel[0] == without[0]
    assert with_kernel[1] == pytest.approx(without[1], abs=1e-4)


def test_the_trace_and_the_forward_batch_pane_show_each_layers_attention():
    from tui.widgets.batch import attention_text
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams
    from workbench.models import load_model
    from workbench.trace.recorder import MemorySink

    loaded = load_model("tiny-random:gemma2", device="cpu")  # sliding + soft-capped, then full + soft-capped
    sink = MemorySink()
    with Engine(loaded, trace_level="summary", trace_sinks=[sink]) as engine:
        engine.generate(["Hello there, how are"], SamplingParams(temperature=0, max_new_tokens=3))
        assert [(v["window"], v["softcap"], v["sinks"]) for v in engine.runner.attention_variants] == [
            (32, 10.0, False), (None, 10.0, False)]
    batches = sink.of_kind("forward_batch")
    assert batches and all(b.attention == [{"window": 32, "softcap": 10.0, "sinks": False, "scaling": 24 ** -0.5},
                                           {"window": None, "softcap": 10.0, "sinks": False, "scaling": 24 ** -0.5}]
                           for b in batches)
    assert attention_text(batches[0]).plain == (
        "attention layers 0 window 32 · softcap 10 · scale 0.204  |  layers 1 full · softcap 10 · scale 0.204")


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize(("window", "softcap", "with_sinks"), [(None, 2.0, False), (4, None, True), (32, 5.0, True)])
def test_decode_kernel_soft_cap_and_sinks_give_the_torch_paths_numbers(window, softcap, with_sinks):
    q, k_pool, v_pool, idx, lens = _pool(seed=5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 3.0]) if with_sinks else None
    out = torch.full_like(q, float("nan"))
    assert decode_attention.decode_attention(q, k_pool, v_pool, idx, lens, out, 0.25, window=window, softcap=softcap,
                                        sinks=sinks)
    b, length = idx.shape
    k = k_pool.index_select(0, idx.reshape(-1)).view(b, length, 2, 16).transpose(1, 2)
    v = v_pool.index_select(0, idx.reshape(-1)).view(b, length, 2, 16).transpose(1, 2)
    pos = torch.arange(length)[None, :]
    mask = (pos < lens[:, None]) & (pos >= lens[:, None] - (window or length))
    want = attention._attend(q.unsqueeze(2), k, v, mask[:, None, None, :], 0.25, softcap, sinks)[:, :, 0]
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    plain = torch.empty_like(q)
    assert decode_attention.decode_attention(q, k_pool, v_pool, idx, lens, plain, 0.25, window=window)
    assert (plain - out).abs().max() > 1e-3  # the cap and the sinks change the result: the test can fail
