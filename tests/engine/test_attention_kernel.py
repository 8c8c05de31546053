"""The native paged decode-attention kernel: same numbers as gathering the slots and calling
`scaled_dot_product_attention`, the same greedy tokens and logprobs in the engine with and without
the native kernels, a clean fallback where it cannot be built, and a kernel outside sdpa's own
rounding error refused at the check."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from workbench.engine.engine import Engine
from workbench.engine.run import cpu_kernels
from workbench.engine.run.fastpath import FastPathChecks
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
        used = engine.config.cpu_kernels  # what the trace's meta will say ran
        assert used.decode_attention is kernels
        assert (used.packed_linear_bytes > 0) is (kernels and cpu_kernels.mkl() is not None)
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


def _off_attention(shift: float, real=cpu_kernels._unchecked_attention):
    def kernel(q, k_pool, v_pool, idx, lens, out, scale):
        real(q, k_pool, v_pool, idx, lens, out, scale)
        out.add_(shift)
    return kernel


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_an_attention_kernel_outside_sdpas_error_is_refused_and_the_torch_path_runs(monkeypatch, tiny):
    # Force the failing verification: a kernel off by 1e-3 everywhere (far outside sdpa's own
    # rounding error). The check refuses it for every row count and the engine attends with torch.
    monkeypatch.setattr(cpu_kernels, "CHECKS", FastPathChecks())
    monkeypatch.setattr(cpu_kernels, "_unchecked_attention", _off_attention(1e-3))
    q, pool = torch.randn(3, 4, 8), torch.randn(10, 2, 8)
    idx, lens = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), torch.tensor([3, 2, 1])
    assert not cpu_kernels.decode_attention(q, pool, pool, idx, lens, torch.empty_like(q), 0.3)
    assert not cpu_kernels.decode_attention(q[:1], pool, pool, idx[:1], lens[:1], torch.empty_like(q[:1]), 0.3)
    verdict = cpu_kernels.CHECKS.attention[(4, 2, 8)]
    assert not verdict.single_row and not verdict.multi_row
    assert "exceeds" in cpu_kernels.CHECKS.report()["attention"]["4x2x8"]["multi_row"]
    # The engine still computes what the torch path computes: the same tokens as with no kernels at all
    prompts = ["The quick brown fox", [{"role": "user", "content": "Name three rivers."}]]
    refused = _greedy(tiny, prompts, kernels=True)
    with cpu_kernels.disabled(tiny.model):
        without = _greedy(tiny, prompts, kernels=False)
    assert refused == without


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_the_attention_kernel_runs_for_several_rows_only_within_sdpas_error_and_one_row_only_if_identical(
        monkeypatch):
    monkeypatch.setattr(cpu_kernels, "CHECKS", FastPathChecks())
    cpu_kernels.check_attention(9, 3, 64)  # SmolLM2's layout, as ModelRunner checks it at load
    v = cpu_kernels.CHECKS.attention[(9, 3, 64)]
    assert v.multi_row == (v.kernel_error <= 4 * v.torch_error) and v.torch_error > 0
    assert v.single_row == (v.single_row_max_diff == 0.0)
    # The kernel's own rounding stays within sdpa's here (it is a correct float32 attention):
    assert v.multi_row
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "exact")  # identity demanded everywhere
    monkeypatch.setattr(cpu_kernels, "CHECKS", FastPathChecks())
    cpu_kernels.check_attention(9, 3, 64)
    exact = cpu_kernels.CHECKS.attention[(9, 3, 64)]
    assert exact.multi_row == math.isfinite(exact.kernel_error)  # inf: some probe was not bit-identical
    assert cpu_kernels.CHECKS.report()["policy"] == "exact"
