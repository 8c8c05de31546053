"""The native paged decode-attention kernel: same numbers as gathering the slots and calling
`scaled_dot_product_attention`, the same greedy tokens in the engine, and a clean fallback where it
cannot be built."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from workbench.engine.engine import Engine
from workbench.engine.run import cpu_kernels
from workbench.engine.sample.sampling_params import SamplingParams

NO_COMPILER = shutil.which("cc") is None and shutil.which("gcc") is None


def _reference(q, k_pool, v_pool, idx, lens, scale):
    b, length = idx.shape
    kvh, d = k_pool.shape[1:]
    k = k_pool.index_select(0, idx.reshape(-1)).view(b, length, kvh, d).transpose(1, 2)
    v = v_pool.index_select(0, idx.reshape(-1)).view(b, length, kvh, d).transpose(1, 2)
    mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
def test_kernel_matches_gather_plus_sdpa(heads, kv_heads, head_dim):
    assert cpu_kernels.available()
    gen = torch.Generator().manual_seed(heads)
    slots, batch, length = 500, 7, 40
    k_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, 40, 17, 2, 39, 25, 8])
    idx = torch.randint(1, slots, (batch, length), generator=gen) * (torch.arange(length)[None] < lens[:, None])
    q = torch.randn(batch, heads, head_dim, generator=gen) * 3  # peaked softmax rows too
    out = torch.full((batch, heads, head_dim), float("nan"))
    assert cpu_kernels.decode_attention(q, k_pool, v_pool, idx, lens, out, head_dim ** -0.5)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, idx, lens, head_dim ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_kernel_refuses_slots_outside_the_pool_instead_of_reading_them():
    pool = torch.randn(10, 2, 8)
    q, out = torch.randn(2, 4, 8), torch.zeros(2, 4, 8)
    for idx, lens in [(torch.tensor([[1, 2, 10], [1, 2, 3]]), torch.tensor([3, 2])),  # slot 10 of 10
                      (torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([4, 2])),  # longer than its row
                      (torch.tensor([[1, -1, 3], [1, 2, 3]]), torch.tensor([3, 2]))]:
        with pytest.raises(IndexError, match="outside the pool"):
            cpu_kernels.decode_attention(q, pool, pool, idx, lens, out, 0.3)
        assert not out.any()  # nothing written


def test_kernel_declines_what_it_does_not_read():
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    pool = torch.randn(10, 2, 8, dtype=torch.float64)
    idx, lens = torch.ones(2, 3, dtype=torch.int64), torch.tensor([3, 2])
    assert not cpu_kernels.decode_attention(q, pool, pool, idx, lens, torch.empty_like(q), 0.3)  # float64
    q32, pool32 = q.float(), pool.float()
    strided = torch.randn(2, 8, 4).transpose(1, 2)  # not contiguous
    assert not cpu_kernels.decode_attention(strided, pool32, pool32, idx, lens, torch.empty(2, 4, 8), 0.3)
    assert not cpu_kernels.decode_attention(q32[:, :3], pool32, pool32, idx, lens, torch.empty(2, 3, 8), 0.3)


def test_without_a_compiler_the_engine_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_attention", cpu_kernels._Once(cpu_kernels._load_attention))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="kernel unavailable, using torch"):
        assert cpu_kernels.load() is None
    q = torch.randn(1, 2, 4)
    assert not cpu_kernels.decode_attention(q, torch.randn(3, 2, 4), torch.randn(3, 2, 4),
                                            torch.ones(1, 2, dtype=torch.int64), torch.tensor([2]), q.clone(), 0.5)


def _greedy(tiny, prompts, kernels: bool):
    with Engine(tiny, trace_level="off", chunk_size=16) as engine:
        used = engine.config["cpu_kernels"]  # what the trace's meta will say ran
        assert used["decode_attention"] is kernels
        assert (used["packed_linear_bytes"] > 0) is (kernels and cpu_kernels.mkl() is not None)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True,
                                                       logprobs=True))
    return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs]


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_engine_tokens_and_logprobs_agree_with_and_without_the_kernels(tiny):
    prompts = ["The quick brown fox", "a" * 120, [{"role": "user", "content": "Name three rivers."}]]
    assert cpu_kernels.available()
    with_kernel = _greedy(tiny, prompts, kernels=True)
    with cpu_kernels.disabled(tiny.model):
        assert cpu_kernels.load() is None and not any(
            isinstance(m.forward, cpu_kernels.PackedLinear) for m in tiny.model.modules())
        without = _greedy(tiny, prompts, kernels=False)
    assert cpu_kernels.load() is not None
    assert with_kernel[0] == without[0]
    for a, b in zip(with_kernel[1], without[1], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def _linear_stack(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 200, bias=False), torch.nn.Linear(200, 64, bias=True)).eval()


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason="PACKED GEMM NOT CHECKED: this torch has no MKL packed sgemm")
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 200])
def test_packed_linears_give_exactly_what_f_linear_gives(rows):
    plain, packed = _linear_stack(0), _linear_stack(0)
    assert cpu_kernels.pack_linears(packed) > 0
    assert all(isinstance(m.forward, cpu_kernels.PackedLinear) for m in packed)
    x = torch.randn(2, rows, 96) * 4
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))  # bit for bit: greedy parity with transformers relies on it
        assert torch.equal(packed(x[:, ::2]), plain(x[:, ::2]))  # a strided input is made contiguous first


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason="PACKED GEMM NOT CHECKED: this torch has no MKL packed sgemm")
def test_a_packed_model_is_freed_as_soon_as_it_is_dropped():
    import weakref

    model = _linear_stack(3)
    assert cpu_kernels.pack_linears(model) > 0
    with torch.inference_mode():
        model(torch.randn(20, 96))
    gone = weakref.ref(model)
    del model  # no reference cycle through the packed forwards: freed now, not at the next GC pass
    assert gone() is None


@pytest.mark.skipif(cpu_kernels.mkl() is None, reason="PACKED GEMM NOT CHECKED: this torch has no MKL packed sgemm")
def test_packing_respects_its_memory_budget_and_runs_once():
    model = _linear_stack(1)
    assert cpu_kernels.pack_linears(model, budget_bytes=1000) == 0  # too big for the budget: untouched
    assert not any(isinstance(m.forward, cpu_kernels.PackedLinear) for m in model)
    first = cpu_kernels.pack_linears(model)
    forwards = [m.forward for m in model]
    assert first > 0 and cpu_kernels.pack_linears(model) == first  # a second Engine on the same model
    assert [m.forward for m in model] == forwards
    assert cpu_kernels.pack_linears(_linear_stack(2).double()) == 0  # float64: not packed
