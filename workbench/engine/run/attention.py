"""The attention function registered with `transformers.AttentionInterface` as "workbench".

Owns: writing each layer's new K/V into the engine's pool at `out_cache_loc` and attending over
each request's KV slots read through `req_to_token`. Decode rows on CPU float32 go through the
native paged kernel (cpu_kernels.py) when it could be built; otherwise, and for extend rows, the
slots are gathered and attended with `scaled_dot_product_attention`. The unmodified HF model calls
it with the ForwardBatch as the `forward_batch` keyword. Shapes from HF: query `[1, heads, N, head_dim]`,
key/value `[1, kv_heads, N, head_dim]`; it returns `[1, N, heads, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine.run import cpu_kernels

ATTN_NAME = "workbench"


def workbench_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None,
                        dropout: float = 0.0, forward_batch=None, **kwargs) -> tuple[torch.Tensor, None]:
    if forward_batch is None:
        raise RuntimeError("workbench attention needs forward_batch=...; run the model through ModelRunner")
    fb = forward_batch
    layer = module.layer_idx
    kv = fb.memory.kv
    # [N, kv_heads, head_dim]
    k_new = key[0].transpose(0, 1)
    v_new = value[0].transpose(0, 1)
    kv.write(layer, fb.out_cache_loc, k_new, v_new)
    num_tokens = query.shape[2]
    out = query.new_empty((1, num_tokens, query.shape[1], query.shape[3]))
    meta = fb.attn
    for start, n, prefix, kv_idx in meta.extend_rows:
        q = query[:, :, start:start + n]  # [1, H, n, D]
        if prefix == 0:
            k = key[:, :, start:start + n]
            v = value[:, :, start:start + n]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            k = kv.k[layer].index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)  # [1, KVH, prefix+n, D]
            v = kv.v[layer].index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)
            mask = torch.ones((n, prefix + n), dtype=torch.bool, device=q.device).tril(diagonal=prefix)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[0, start:start + n] = o[0].transpose(0, 1)
    if meta.decode_kv_idx is not None:
        d0 = meta.decode_start
        q = query[0, :, d0:].transpose(0, 1)  # [Bd, H, D]
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        if cpu_kernels.decode_attention(q.contiguous(), kv.k[layer], kv.v[layer], meta.decode_kv_idx,
                                        meta.decode_lens, out[0, d0:], scale):
            return out, None  # read the pool in place, no gather (cpu_kernels.py)
        q = q.unsqueeze(2)  # [Bd, H, 1, D]
        idx = meta.decode_kv_idx  # [Bd, L]; index_select is ~3x faster than advanced indexing here
        shape = (*idx.shape, *kv.k[layer].shape[1:])
        k = kv.k[layer].index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)  # [Bd, KVH, L, D]
        v = kv.v[layer].index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True)
        out[0, d0:] = o[:, :, 0]
    return out, None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, workbench_attention)
