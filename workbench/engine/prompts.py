"""What a prompt is and how it becomes token ids.

Owns: the accepted prompt forms (a string, a chat `[{"role", "content"}, ...]` rendered with the
tokenizer's chat template, or a list of token ids), their validation with ValueErrors that name
what is wrong, and splitting `generate()`'s argument into a list of prompts. Does not own: sampling
parameters (sampling_params.py) or admission (engine.py).
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, str]]


def tokenize_prompt(tokenizer: Any, vocab_size: int, prompt: Prompt | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(tokenizer(prompt).input_ids)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        for m in prompt:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("messages: each message needs string 'role' and 'content'")
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:3]}")
        return list(prompt)
    raise ValueError("prompt must be a non-empty string, a list of chat messages or a list of token ids")


def as_prompt_list(prompts: Any) -> list[Any]:
    """`generate()`'s argument as a list: one string or one chat is one prompt."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts]  # one chat
    if isinstance(prompts, (list, tuple)) and prompts:
        return list(prompts)
    raise ValueError("prompts must be a string, a chat, or a non-empty list of either")
