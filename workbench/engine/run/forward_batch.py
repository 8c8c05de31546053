"""`ForwardMode` and `ForwardBatch`: the packed tensors one model forward runs on.

Owns: the SGLang-shaped batch record and `build_forward_batch`, the one function that turns a
scheduled batch into it (allocating KV slots for the new tokens and writing `req_to_token`), plus
the attention metadata computed once per forward instead of once per layer. Does not own:
choosing what runs (scheduler.py) or running the model (model_runner.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.engine.sched.memory import Memory


class ForwardMode(enum.Enum):
    EXTEND = "EXTEND"
    DECODE = "DECODE"
    MIXED = "MIXED"
    IDLE = "IDLE"
    TARGET_VERIFY = "TARGET_VERIFY"
    DRAFT_EXTEND = "DRAFT_EXTEND"


@dataclass(slots=True)
class RowSpec:
    """One request's part of a forward: `length` new tokens after `prefix_len` cached ones."""

    req_id: str
    req_pool_idx: int
    prefix_len: int
    input_ids: list[int]
    sample_rows: int  # how many trailing positions need logits (0 for a mid-prompt chunk, k+1 to verify)
    prompt_logprob_rows: int = 0  # leading positions whose logits score the next prompt token


@dataclass(slots=True)
class AttentionMeta:
    """Per-forward attention plan. Extend rows attend one by one; decode rows (one new token each)
    attend together over a padded gather of their KV slots."""

    extend_rows: list[tuple[int, int, int, torch.Tensor | None]]  # (token start, length, prefix, kv idx)
    decode_start: int  # first token index of the decode rows (they are packed last)
    decode_kv_idx: torch.Tensor | None  # [num_decode, max_len] KV slots, 0-padded
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_len] bool, True = attend
    decode_lens: torch.Tensor | None  # [num_decode] int64 KV length of each decode row
    # one decode row whose KV slots are first, first + 1, ...: that first slot (attention reads the
    # pool's slice in place of a gathered copy: the same values in the same layout), else None
    decode_run: int | None = None


@dataclass(slots=True)
class ForwardBatch:
    """Everything one forward needs. Shapes: N = tokens in the batch, B = requests."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [N] int64
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] KV length after this forward
    out_cache_loc: torch.Tensor  # [N] KV slot of every new token
    positions: torch.Tensor  # [N]
    extend_prefix_lens: torch.Tensor  # [B]
    extend_seq_lens: torch.Tensor  # [B]
    req_ids: list[str]
    logits_rows: torch.Tensor  # token indices whose logits are kept (logits_to_keep)
    logits_owner: list[int]  # for each kept sampling row, the index of its request in the batch
    attn: AttentionMeta
    memory: Memory
    sampling_info: Any = None
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)
    layer_limit: int | None = None  # early-exit drafting runs only the first N layers
    # (batch index, position) of the kept rows after the sampling rows: logits for prompt logprobs
    prompt_logprob_rows: list[tuple[int, int]] = field(default_factory=list)
    capture: Any = None  # a capture.ForwardCapture when a captured request samples in this forward
    # the lists the int64 tensors above were made from, by field name (what a traced step records
    # without a tensor-to-list copy each); the tensors are not changed after the build
    host: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def build_forward_batch(mode: ForwardMode, rows: list[RowSpec], memory: Memory, device: str) -> ForwardBatch:
    """Allocate KV slots for every new token, record them in req_to_token, and pack the batch.

    One-token rows with a cached prefix at the end of `rows` form the decode block, attended in one
    batched call; the scheduler puts decodes last so that block is as large as possible.
    """
    table = memory.req_to_token_pool.req_to_token
    lengths = [len(r.input_ids) for r in rows]
    total = sum(lengths)
    out_cache_loc = memory.allocator.allocate(total)
    input_ids, positions, keep, owner, extend_rows = [], [], [], [], []
    prompt_keep, prompt_rows = [], []
    # The decode block is the longest run of one-token rows with a cached prefix at the end.
    first_decode = len(rows)
    while first_decode > 0 and lengths[first_decode - 1] == 1 and rows[first_decode - 1].prefix_len > 0:
        first_decode -= 1
    decode_start, start = total, 0
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        if b < first_decode:  # decode rows' slots are written below, in one indexed copy
            table[row.req_pool_idx, row.prefix_len:row.prefix_len + n] = out_cache_loc[start:start + n].to(table.device)
        input_ids.extend(row.input_ids)
        positions.extend(range(row.prefix_len, row.prefix_len + n))
        for j in range(n - row.sample_rows, n):
            keep.append(start + j)
            owner.append(b)
        for j in range(row.prompt_logprob_rows):
            prompt_keep.append(start + j)
            prompt_rows.append((b, row.prefix_len + j))
        if b == first_decode:
            decode_start = start
        if b < first_decode:
            kv_idx = table[row.req_pool_idx, :row.prefix_len + n] if row.prefix_len else None
            extend_rows.append((start, n, row.prefix_len, kv_idx))
        start += n
    seq_lens = [r.prefix_len + n for r, n in zip(rows, lengths, strict=True)]
    attn = _decode_plan(rows[first_decode:], seq_lens[first_decode:], table, decode_start, extend_rows,
                        out_cache_loc[decode_start:])
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
    host = {"input_ids": input_ids, "req_pool_indices": [r.req_pool_idx for r in rows], "seq_lens": seq_lens,
            "positions": positions, "extend_prefix_lens": [r.prefix_len for r in rows], "extend_seq_lens": lengths}
    return ForwardBatch(
        forward_mode=mode, batch_size=len(rows), input_ids=as_t(input_ids),
        req_pool_indices=as_t(host["req_pool_indices"]), seq_lens=as_t(seq_lens),
        out_cache_loc=out_cache_loc.to(device), positions=as_t(positions),
        extend_prefix_lens=as_t(host["extend_prefix_lens"]), extend_seq_lens=as_t(lengths),
        req_ids=[r.req_id for r in rows], logits_rows=as_t(keep + prompt_keep), logits_owner=owner, attn=attn,
        memory=memory, prompt_logprob_rows=prompt_rows, host=host,
    )


def _decode_plan(rows: list[RowSpec], seq_lens: list[int], table: torch.Tensor, decode_start: int,
                 extend_rows: list, new_slots: torch.Tensor) -> AttentionMeta:
    """The decode block's attention plan; also records each decode row's new KV slot in
    `req_to_token` (one indexed write for the block instead of one per row)."""
    if not rows:
        return AttentionMeta(extend_rows, decode_start, None, None, None)
    if len(rows) == 1:  # batch 1: the same plan in fewer tensor ops (0.24 -> 0.16 ms a step, cold)
        n = seq_lens[0]
        slots = table[rows[0].req_pool_idx]
        slots[n - 1:n] = new_slots.to(table.device)
        kv_idx = slots[None, :n].clone()  # [1, L]: no padding to zero
        first = int(kv_idx[0, 0])
        run = first if torch.equal(kv_idx[0], torch.arange(first, first + n, device=table.device)) else None
        return AttentionMeta(extend_rows, decode_start, kv_idx,
                             torch.ones((1, 1, 1, n), dtype=torch.bool, device=table.device),
                             torch.tensor([n], dtype=torch.int64, device=table.device), run)
    max_len = max(seq_lens)
    pool_idx = torch.tensor([r.req_pool_idx for r in rows], dtype=torch.int64, device=table.device)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=table.device)
    table[pool_idx, lens - 1] = new_slots.to(table.device)  # position prefix_len = seq_len - 1
    valid = torch.arange(max_len, device=table.device)[None, :] < lens[:, None]  # [B, L]
    kv_idx = table[pool_idx, :max_len] * valid  # padded positions read slot 0
    run = None
    if len(rows) == 1:
        first = int(kv_idx[0, 0])
        if int(kv_idx[0, -1]) == first + max_len - 1 and bool((kv_idx[0].diff() == 1).all()):
            run = first
    return AttentionMeta(extend_rows, decode_start, kv_idx, valid[:, None, None, :], lens, run)
