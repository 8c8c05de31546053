"""The attention function registered with `transformers.AttentionInterface` as "workbench".

Owns: writing each layer's new K/V into the engine's pool at `out_cache_loc` and attending over
each request's KV slots read through `req_to_token`, honouring per call what the layer passes:
`scaling`, `sliding_window` (a query at position p sees positions p-window+1..p, as transformers'
`sliding_window_overlay`), `softcap` (scores -> tanh(scores / cap) * cap, Gemma 2) and `s_aux`
(one sink logit per head joining the softmax and then dropped, gpt-oss). Decode rows on CPU
float32 go through the native paged kernel (kernels/decode_attention.py: windows, soft-cap and sinks included)
when it could be built; extend rows and the fallback gather the slots and attend with
`scaled_dot_product_attention`, or with transformers' eager arithmetic where sdpa cannot express
the layer. variants.py refuses at load what this does not implement. The unmodified HF model calls
it with the ForwardBatch as the `forward_batch` keyword. Shapes from HF: query `[1, heads, N, head_dim]`,
key/value `[1, kv_heads, N, head_dim]`; it returns `[1, N, heads, head_dim]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.engine.kernels import decode_attention

ATTN_NAME = "workbench"


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """transformers' eager attention weights `[B, H, n, L]` (Gemma 2's soft-cap, gpt-oss's sinks) of
    `q [B, H, n, D]` over `k [B, KVH, L, D]`; `mask` bool broadcastable to `[B, H, n, L]` (True =
    attend) or None. The engine's eager path and capture (capture.py) both read them from here."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # repeat_kv
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(w, dim=-1, dtype=torch.float32)
    s = sinks.to(w.dtype).reshape(1, -1, 1, 1).expand(w.shape[0], -1, w.shape[2], 1)
    w = torch.cat([w, s], dim=-1)
    w = w - w.max(dim=-1, keepdim=True).values
    return torch.softmax(w, dim=-1, dtype=w.dtype)[..., :-1]


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """transformers' eager attention on `q [B, H, n, D]`, `k, v [B, KVH, L, D]`."""
    p = attention_probs(q, k, mask, scale, softcap, sinks)
    return torch.matmul(p.to(v.dtype), v.repeat_interleave(q.shape[1] // v.shape[1], dim=1))


def _attend(q, k, v, mask, scale, softcap, sinks, is_causal=False) -> torch.Tensor:
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    if mask is None:
        mask = torch.ones((q.shape[2], k.shape[2]), dtype=torch.bool, device=q.device).tril()
    return _eager(q, k, v, mask, scale, softcap, sinks)


def extend_mask(n: int, prefix: int, window: int | None, device) -> torch.Tensor | None:
    """`[n, prefix + n]` bool: query i (position prefix+i) sees key j when j <= prefix+i and, with a
    window, j > prefix+i-window. None for the plain causal case of a row without a prefix."""
    if prefix == 0 and (window is None or window >= n):
        return None
    mask = torch.ones((n, prefix + n), dtype=torch.bool, device=device).tril(diagonal=prefix)
    if window is not None and window < prefix + n:
        mask &= ~torch.ones_like(mask).tril(diagonal=prefix - window)
    return mask


def workbench_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None,
                        dropout: float = 0.0, forward_batch=None, sliding_window: int | None = None,
                        softcap: float | None = None, s_aux: torch.Tensor | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    if forward_batch is None:
        raise RuntimeError("workbench attention needs forward_batch=...; run the model through ModelRunner")
    fb = forward_batch
    layer = module.layer_idx
    kv = fb.memory.kv
    window = int(sliding_window) if sliding_window else None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # [N, kv_heads, head_dim]
    k_new = key[0].transpose(0, 1)
    v_new = value[0].transpose(0, 1)
    kv.write(layer, fb.out_cache_loc, k_new, v_new)
    num_tokens = query.shape[2]
    out = query.new_empty((1, num_tokens, query.shape[1], query.shape[3]))
    meta = fb.attn
    for start, n, prefix, kv_idx in meta.extend_rows:
        q = query[:, :, start:start + n]  # [1, H, n, D]
        mask = extend_mask(n, prefix, window, q.device)
        if prefix == 0:
            k = key[:, :, start:start + n]
            v = value[:, :, start:start + n]
        else:
            k = kv.k[layer].index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)  # [1, KVH, prefix+n, D]
            v = kv.v[layer].index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)
        o = _attend(q, k, v, mask, scale, softcap, s_aux, is_causal=mask is None)
        out[0, start:start + n] = o[0].transpose(0, 1)
    if meta.decode_kv_idx is not None:
        _decode(meta, kv, layer, query, out, scale, window, softcap, s_aux)
    if fb.capture is not None:  # the captured rows' weights over the keys written above (capture.py)
        fb.capture.attention(layer, query, kv, fb.memory.req_to_token_pool.req_to_token, scale, window, softcap,
                             s_aux)
    return out, None


def _decode(meta, kv, layer: int, query: torch.Tensor, out: torch.Tensor, scale: float, window: int | None,
            softcap: float | None, sinks: torch.Tensor | None) -> None:
    """The decode block: one query per row at position lens[b]-1 over that row's KV slots."""
    d0 = meta.decode_start
    q = query[0, :, d0:].transpose(0, 1)  # [Bd, H, D]
    if not decode_attention.refused(q.shape[0], q.shape[1], kv.k[layer].shape[1], q.shape[2]) and \
            decode_attention.decode_attention(q.contiguous(), kv.k[layer], kv.v[layer], meta.decode_kv_idx,
                                              meta.decode_lens, out[0, d0:], scale, window=window, softcap=softcap,
                                              sinks=sinks):
        return  # read the pool in place, no gather (kernels/decode_attention.py)
    idx = meta.decode_kv_idx  # [Bd, L]; index_select is ~3x faster than advanced indexing here
    if meta.decode_run is not None and window is None and softcap is None and sinks is None:
        # one row on consecutive slots: sdpa's own arithmetic in one C call over the pool's run, where
        # its check found it bit-identical (kernels/decode_attention.py flash_row)
        run = slice(meta.decode_run, meta.decode_run + idx.shape[1])
        if decode_attention.flash_row(q[0], kv.k[layer][run], kv.v[layer][run], out[0, d0], scale):
            return
    q = q.unsqueeze(2)  # [Bd, H, 1, D]
    shape = (*idx.shape, *kv.k[layer].shape[1:])
    if meta.decode_run is not None:  # one row on consecutive slots: the pool's slice is the gather's copy
        run = slice(meta.decode_run, meta.decode_run + idx.shape[1])
        k = kv.k[layer][run].view(shape).transpose(1, 2)  # [1, KVH, L, D], the gather's strides
        v = kv.v[layer][run].view(shape).transpose(1, 2)
    else:
        k = kv.k[layer].index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)  # [Bd, KVH, L, D]
        v = kv.v[layer].index_select(0, idx.reshape(-1)).view(shape).transpose(1, 2)
    mask = meta.decode_mask
    if idx.shape[0] == 1 and window is None and softcap is None and sinks is None:
        # one row has no padding: attend unmasked, as transformers' own decode step does (the same bits as
        # the all-True mask, and sdpa skips the mask work)
        mask = None
    if window is not None:
        first = (meta.decode_lens - window)[:, None, None, None]  # [Bd, 1, 1, 1]
        mask = mask & (torch.arange(idx.shape[1], device=idx.device) >= first)
    o = _attend(q, k, v, mask, scale, softcap, sinks)
    out[0, meta.decode_start:] = o[:, :, 0]


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, workbench_attention)
