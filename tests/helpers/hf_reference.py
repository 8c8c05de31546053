"""transformers references: greedy `generate()` and per-token log-softmax, on a separate stock model
(the engine switches its own model's attention implementation, so references never share it)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def stock_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def greedy_reference(folder: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = stock_model(folder)
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def token_logprobs(folder: str, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """log-softmax of transformers' logits at each output position, for the output token."""
    model = stock_model(folder)
    ids = torch.tensor([prompt_ids + output_ids])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = logp[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(output_ids)]
    return rows.gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()
