"""The fused per-layer ops of the direct forward (kernels/layer_ops.py): the RMSNorm with its
residual add and the rotary embedding give transformers' bits on this CPU or are refused, and a
model's greedy tokens and logprobs are the same with them as without them."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from workbench.engine.engine import Engine
from workbench.engine.kernels import Book, decode_layers, layer_ops, native
from workbench.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.load() is None, reason="no C compiler: the fused ops cannot be built")


def _norm(n: int, seed: int) -> LlamaRMSNorm:
    torch.manual_seed(seed)
    norm = LlamaRMSNorm(n, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n))
    return norm


@pytest.mark.parametrize("n", [17, 576, 960, 2048, 4100])
def test_the_fused_norm_gives_the_residual_add_and_rmsnorm_bits_at_any_size(n):
    ops = layer_ops.LayerOps(apply_rotary_pos_emb, Book())
    norm = _norm(n, n)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 40):
        x = torch.randn(1, rows, n, generator=gen) * 50
        delta = torch.randn(1, rows, n, generator=gen)
        h, out = ops.norm(norm, x, delta)
        assert torch.equal(h, x + delta)
        assert torch.equal(out, norm(x + delta))
        h, out = ops.norm(norm, x)  # the first layer's norm: no add
        assert h is x and torch.equal(out, norm(x))
    assert ops.lanes[layer_ops._norm_key(norm)] in layer_ops.NORM_LANES  # the C pass ran, not the fallback


def test_a_sum_order_that_is_not_torchs_is_refused_and_the_torch_ops_run(monkeypatch):
    monkeypatch.setattr(layer_ops, "NORM_LANES", (1,))  # one lane: a plain cascade, not torch's vectors
    book = Book()
    ops = layer_ops.LayerOps(apply_rotary_pos_emb, book)
    norm = _norm(576, 0)
    x = torch.randn(1, 4, 576)
    _, out = ops.norm(norm, x)
    assert torch.equal(out, norm(x))
    verdict = book.verdicts(layer_ops.NORM)[0][1]
    assert not verdict.ok and "no listed sum order" in verdict.detail


@pytest.mark.parametrize("heads, kv_heads, head_dim, rows", [(9, 3, 64, 1), (9, 3, 64, 33), (32, 8, 128, 4)])
def test_the_fused_rotation_gives_apply_rotary_pos_embs_bits(heads, kv_heads, head_dim, rows):
    ops = layer_ops.LayerOps(apply_rotary_pos_emb, Book())
    assert ops.rope_fits(heads, kv_heads, head_dim)
    q = torch.randn(1, rows, heads * head_dim) * 10
    k = torch.randn(1, rows, kv_heads * head_dim) * 10
    angle = torch.arange(rows, dtype=torch.float32)[None, :, None] * torch.rand(head_dim)
    cos, sin = angle.cos(), angle.sin()
    view = lambda t: t.view(1, rows, -1, head_dim).transpose(1, 2)  # noqa: E731
    want = apply_rotary_pos_emb(view(q), view(k), cos, sin)
    got = ops.rope(q, k, cos, sin, head_dim)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_rotation_off_by_one_ulp_is_refused(monkeypatch):
    rope_c = layer_ops.LayerOps._rope_c

    def off(self, *args):
        qo, ko = rope_c(self, *args)
        qo.view(-1)[5] = torch.nextafter(qo.view(-1)[5], torch.tensor(float("inf")))
        return qo, ko

    monkeypatch.setattr(layer_ops.LayerOps, "_rope_c", off)
    book = Book()
    assert not layer_ops.LayerOps(apply_rotary_pos_emb, book).rope_fits(9, 3, 64)
    assert "differs from apply_rotary_pos_emb" in book.verdicts(layer_ops.ROPE)[0][1].detail


@pytest.mark.parametrize("n", [1536, 32 * 1536, 5])
def test_the_fused_activation_gives_silu_times_up_bits(n):
    # LlamaMLP's act_fn(gate) * up at batch 1, batch 32 (threaded) and a short tail, over the range
    # where exp under- and overflows: the same bits as torch's SiLU module and multiply.
    ops = layer_ops.LayerOps(apply_rotary_pos_emb, Book())
    act = torch.nn.SiLU()
    gate = torch.randn(1, 1, n) * torch.logspace(-3, 2.1, n)
    up = torch.randn(1, 1, n)
    got = ops.silu_mul(act, gate, up)
    assert ops.act_ok[("SiLU",)] and torch.equal(got, act(gate) * up)


def test_another_activation_or_a_replaced_forward_runs_through_torch():
    book = Book()
    ops = layer_ops.LayerOps(apply_rotary_pos_emb, book)
    gate, up = torch.randn(1, 1, 64) * 4, torch.randn(1, 1, 64)
    gelu = torch.nn.GELU(approximate="tanh")
    assert torch.equal(ops.silu_mul(gelu, gate, up), gelu(gate) * up)
    assert not ops.act_ok[("GELU",)] and "differs from GELU" in book.verdicts(layer_ops.SILU_MUL)[0][1].detail
    silu = torch.nn.SiLU()
    silu.forward = lambda x: torch.zeros_like(x)  # a notebook's edit of this one module
    assert torch.equal(ops.silu_mul(silu, gate, up), torch.zeros_like(up))


def _greedy(tiny) -> tuple[list, list]:
    with Engine(tiny, trace_level="off") as engine:
        outs = engine.generate(["a b c d", "the sea"], SamplingParams(temperature=0, max_new_tokens=6,
                                                                       ignore_eos=True, logprobs=True))
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def test_greedy_tokens_and_logprobs_are_the_same_with_the_fused_ops_as_with_the_models_forward(monkeypatch):
    from workbench.models import load_model

    tiny = load_model("tiny-random", device="cpu")  # its own object: other tests' wrappers block the direct forward
    # the direct forward's Python path, where these ops are called one by one: its decode rows (two
    # here) may otherwise run in the layers' one C call (kernels/decode_layers.py, tested on its own)
    monkeypatch.setattr(decode_layers.DecodeLayers, "run", lambda self, *a, **kw: None)
    calls = []
    norm_c, rope_c, act_c = layer_ops.LayerOps._norm_c, layer_ops.LayerOps._rope_c, layer_ops.LayerOps._silu_mul_c
    monkeypatch.setattr(layer_ops.LayerOps, "_norm_c", lambda self, *a: calls.append("norm") or norm_c(self, *a))
    monkeypatch.setattr(layer_ops.LayerOps, "_rope_c", lambda self, *a: calls.append("rope") or rope_c(self, *a))
    monkeypatch.setattr(layer_ops.LayerOps, "_silu_mul_c", staticmethod(lambda *a: calls.append("act") or act_c(*a)))
    fused = _greedy(tiny)
    layers = tiny.model.config.num_hidden_layers
    assert calls.count("norm") > 2 * layers and "rope" in calls and calls.count("act") > 2 + layers  # 2: its check
    calls.clear()
    hook = tiny.model.register_forward_hook(lambda *a: None)  # a hook: the model's own forward runs
    try:
        own = _greedy(tiny)
    finally:
        hook.remove()
    assert not calls
    assert fused == own
