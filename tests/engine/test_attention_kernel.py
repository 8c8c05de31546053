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
from workbench.engine.kernels import BOOK, Book, decode_attention, native
from workbench.engine.kernels.gemm import PackedLinear
from workbench.engine.kernels.torch_paths import disabled
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
    assert native.available()
    gen = torch.Generator().manual_seed(heads)
    slots, batch, length = 500, 7, 40
    k_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(slots, kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, 40, 17, 2, 39, 25, 8])
    idx = torch.randint(1, slots, (batch, length), generator=gen) * (torch.arange(length)[None] < lens[:, None])
    q = torch.randn(batch, heads, head_dim, generator=gen) * 3  # peaked softmax rows too
    out = torch.full((batch, heads, head_dim), float("nan"))
    assert decode_attention.decode_attention(q, k_pool, v_pool, idx, lens, out, head_dim ** -0.5)
    torch.testing.assert_close(out, _reference(q, k_pool, v_pool, idx, lens, head_dim ** -0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_a_nan_in_one_request_stays_in_that_request_as_in_sdpa():
    """The kernel's vector exp must not turn a NaN score into a number (a clamp would), and a
    request's NaN must not reach the other rows of the batch."""
    gen = torch.Generator().manual_seed(5)
    k_pool, v_pool = torch.randn(300, 3, 64, generator=gen), torch.randn(300, 3, 64, generator=gen)
    lens = torch.tensor([45, 45, 13])
    idx = torch.randint(0, 300, (3, 45), generator=gen) * (torch.arange(45)[None] < lens[:, None])
    q = torch.randn(3, 9, 64, generator=gen)
    q[1, 4, 7] = float("nan")
    out = torch.zeros(3, 9, 64)
    assert decode_attention.decode_attention(q, k_pool, v_pool, idx, lens, out, 0.125)
    want = _reference(q, k_pool, v_pool, idx, lens, 0.125)
    assert torch.equal(out.isnan(), want.isnan()) and out[1, 4].isnan().all() and not out[1, 3].isnan().any()
    torch.testing.assert_close(out[[0, 2]], want[[0, 2]], atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_kernel_refuses_slots_outside_the_pool_instead_of_reading_them():
    pool = torch.randn(10, 2, 8)
    q, out = torch.randn(2, 4, 8), torch.zeros(2, 4, 8)
    for idx, lens in [(torch.tensor([[1, 2, 10], [1, 2, 3]]), torch.tensor([3, 2])),  # slot 10 of 10
                      (torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([4, 2])),  # longer than its row
                      (torch.tensor([[1, -1, 3], [1, 2, 3]]), torch.tensor([3, 2]))]:
        with pytest.raises(IndexError, match="outside the pool"):
            decode_attention.decode_attention(q, pool, pool, idx, lens, out, 0.3)
        assert not out.any()  # nothing written


def test_kernel_declines_what_it_does_not_read():
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    pool = torch.randn(10, 2, 8, dtype=torch.float64)
    idx, lens = torch.ones(2, 3, dtype=torch.int64), torch.tensor([3, 2])
    assert not decode_attention.decode_attention(q, pool, pool, idx, lens, torch.empty_like(q), 0.3)  # float64
    q32, pool32 = q.float(), pool.float()
    strided = torch.randn(2, 8, 4).transpose(1, 2)  # not contiguous
    assert not decode_attention.decode_attention(strided, pool32, pool32, idx, lens, torch.empty(2, 4, 8), 0.3)
    assert not decode_attention.decode_attention(q32[:, :3], pool32, pool32, idx, lens, torch.empty(2, 3, 8), 0.3)


def test_without_a_compiler_the_engine_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "c_library", native.Once(native._load_c))
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))  # the one cache root: nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(UserWarning, match="kernel unavailable, using torch"):
        assert native.load() is None
    q = torch.randn(1, 2, 4)
    assert not decode_attention.decode_attention(q, torch.randn(3, 2, 4), torch.randn(3, 2, 4),
                                                 torch.ones(1, 2, dtype=torch.int64), torch.tensor([2]), q.clone(), 0.5)


def _greedy(tiny, prompts, kernels: bool):
    with Engine(tiny, trace_level="off", chunk_size=16) as engine:
        used = engine.config.cpu_kernels  # what the trace's meta will say ran
        assert used.decode_attention is kernels
        assert (used.packed_linear_bytes > 0) is (kernels and native.mkl() is not None)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True,
                                                       logprobs=True))
    return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs]


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_engine_tokens_and_logprobs_agree_with_and_without_the_kernels(tiny):
    prompts = ["The quick brown fox", "a" * 120, [{"role": "user", "content": "Name three rivers."}]]
    assert native.available()
    with_kernel = _greedy(tiny, prompts, kernels=True)
    with disabled(tiny.model):
        assert native.load() is None and not any(
            isinstance(m.forward, PackedLinear) for m in tiny.model.modules())
        without = _greedy(tiny, prompts, kernels=False)
    assert native.load() is not None
    assert with_kernel[0] == without[0]
    for a, b in zip(with_kernel[1], without[1], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def _off_attention(shift: float, real=decode_attention._unchecked):
    def kernel(q, k_pool, v_pool, idx, lens, out, scale):
        real(q, k_pool, v_pool, idx, lens, out, scale)
        out.add_(shift)
    return kernel


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_an_attention_kernel_outside_sdpas_error_is_refused_and_the_torch_path_runs(monkeypatch, tiny):
    # Force the failing verification: a kernel off by 1e-3 everywhere (far outside sdpa's own
    # rounding error). The check refuses it for every row count and the engine attends with torch.
    monkeypatch.setattr(decode_attention, "BOOK", book := Book())
    monkeypatch.setattr(decode_attention, "_unchecked", _off_attention(1e-3))
    q, pool = torch.randn(3, 4, 8), torch.randn(10, 2, 8)
    idx, lens = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), torch.tensor([3, 2, 1])
    assert not decode_attention.decode_attention(q, pool, pool, idx, lens, torch.empty_like(q), 0.3)
    assert not decode_attention.decode_attention(q[:1], pool, pool, idx[:1], lens[:1], torch.empty_like(q[:1]), 0.3)
    one, several = (book.tables[n][(4, 2, 8)] for n in (decode_attention.ONE_ROW, decode_attention.BATCH))
    assert not one.ok and not several.ok
    (reported,) = book.report()["replacements"][decode_attention.BATCH]["verdicts"]
    assert reported["key"] == {"heads": 4, "kv_heads": 2, "head_dim": 8} and "exceeds" in reported["detail"]
    # The engine still computes what the torch path computes: the same tokens as with no kernels at all
    prompts = ["The quick brown fox", [{"role": "user", "content": "Name three rivers."}]]
    refused = _greedy(tiny, prompts, kernels=True)
    with disabled(tiny.model):
        without = _greedy(tiny, prompts, kernels=False)
    assert refused == without


@pytest.mark.skipif(NO_COMPILER, reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_the_attention_kernel_runs_for_several_rows_only_within_sdpas_error_and_one_row_only_if_identical(
        monkeypatch):
    monkeypatch.delenv("WORKBENCH_REPLACEMENTS", raising=False)
    monkeypatch.setattr(decode_attention, "BOOK", book := Book())
    decode_attention.check_attention(9, 3, 64)  # SmolLM2's layout, as ModelRunner checks it at load
    one, several = (book.tables[n][(9, 3, 64)] for n in (decode_attention.ONE_ROW, decode_attention.BATCH))
    v = several.facts
    assert several.ok == (v["kernel_error"] <= 4 * v["torch_error"]) and v["torch_error"] > 0
    assert one.ok == (one.facts["single_row_max_diff"] == 0.0)
    # The kernel's own rounding stays within sdpa's here (it is a correct float32 attention):
    assert several.ok
    monkeypatch.setenv("WORKBENCH_REPLACEMENTS", "exact")  # identity demanded everywhere
    monkeypatch.setattr(decode_attention, "BOOK", book := Book())
    decode_attention.check_attention(9, 3, 64)
    exact = book.tables[decode_attention.BATCH][(9, 3, 64)]
    # "inf": some probe was not bit-identical
    assert exact.ok == (exact.facts["kernel_error"] != "inf" and math.isfinite(exact.facts["kernel_error"]))
    assert book.report()["switch"] == "WORKBENCH_REPLACEMENTS=exact"


def test_one_request_on_consecutive_slots_reads_the_pool_in_place_with_the_gathers_bits(smollm2, monkeypatch):
    """Batch 1 attends through sdpa where the C kernel is not bit-identical to it; its KV slots are
    then usually consecutive, and the pool's slice stands in for the gathered copy (the same values
    in the same strides): tokens and logprobs must not change."""
    from workbench.engine.run import exact_forward, forward_batch

    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=3)
    runs = []
    plan = forward_batch._decode_plan

    def recorded(*a, **kw):
        meta = plan(*a, **kw)
        runs.append(meta.decode_run is not None)
        return meta

    monkeypatch.setattr(forward_batch, "_decode_plan", recorded)
    flash = decode_attention.flash_row
    ran = []
    monkeypatch.setattr(decode_attention, "flash_row", lambda *a: ran.append(flash(*a)) or ran[-1])
    fused = exact_forward._decode_layers(smollm2.model)
    fused_before = fused.calls
    with Engine(smollm2, trace_level="off") as engine:
        in_place = engine.generate(["The tide came in slowly over the"], params)[0]
    assert sum(runs) >= 10  # the decode steps read the slice
    # ... through the C replay of sdpa's flash kernel where its check passed on this CPU (else sdpa):
    # layer by layer, or inside the one C call of all the layers (kernels/decode_layers.py), which
    # calls the same replay
    verdict = BOOK.tables[decode_attention.FLASH_ROW].get((9, 3, 64, torch.get_num_threads()))
    assert verdict is not None and sum(ran) == (len(ran) if verdict.ok else 0)
    assert len(ran) + 30 * (fused.calls - fused_before) >= 10 * 30
    assert verdict.ok or fused.calls == fused_before
    monkeypatch.setattr(forward_batch, "_decode_plan",
                        lambda *a, **kw: setattr(meta := plan(*a, **kw), "decode_run", None) or meta)
    with Engine(smollm2, trace_level="off") as engine:
        gathered = engine.generate(["The tide came in slowly over the"], params)[0]
    assert in_place.token_ids == gathered.token_ids
    assert [(t.logprob, t.top_logprobs) for t in in_place.logprobs] == \
        [(t.logprob, t.top_logprobs) for t in gathered.logprobs]


def test_the_flash_row_replay_gives_sdpas_bits_or_is_refused(monkeypatch):
    """The one-row replay of torch's flash kernel against sdpa at lengths around its vector width and
    its 512-key blocks: bit-identical where its check passed; a replay at a width torch's kernel was
    not built for is refused, and the caller's sdpa runs."""
    book = Book()
    monkeypatch.setattr(decode_attention, "BOOK", book)
    heads, kv_heads, d = 9, 3, 64
    gen = torch.Generator().manual_seed(5)
    for keys in (1, 9, 16, 40, 513, 777):
        pool_k, pool_v = torch.randn(keys + 2, kv_heads, d, generator=gen), torch.randn(keys + 2, kv_heads, d, generator=gen)
        q = torch.randn(1, 1, heads * d, generator=gen).view(1, 1, heads, d).transpose(1, 2)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, pool_k[1:keys + 1].view(1, keys, kv_heads, d).transpose(1, 2),
            pool_v[1:keys + 1].view(1, keys, kv_heads, d).transpose(1, 2), scale=0.125, enable_gqa=True)[0, :, 0]
        out = torch.empty(heads, d)
        if decode_attention.flash_row(q[0, :, 0], pool_k[1:keys + 1], pool_v[1:keys + 1], out, 0.125):
            assert torch.equal(out, want), keys
    verdict = book.tables[decode_attention.FLASH_ROW][(heads, kv_heads, d, torch.get_num_threads())]
    if native.mkl() is not None:  # MKL's sgemm is what the replay calls
        assert verdict.ok and verdict.facts["lanes"] in decode_attention.FLASH_LANES
    monkeypatch.setattr(decode_attention, "FLASH_LANES", (4,))  # no such build of torch's kernel
    other = Book()
    monkeypatch.setattr(decode_attention, "BOOK", other)
    assert not decode_attention.flash_row(q[0, :, 0], pool_k[1:keys + 1], pool_v[1:keys + 1], out, 0.125)
    assert "no listed vector width" in other.tables[decode_attention.FLASH_ROW][
        (heads, kv_heads, d, torch.get_num_threads())].detail
