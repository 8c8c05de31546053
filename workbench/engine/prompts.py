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


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry (byte-level
    and SentencePiece entries spell each character with at least one symbol; byte tokens such as
    `<0xE2>` only make the bound looser)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(k) for k in vocab), default=64)


def check_prompt_chars(prompt: Any, max_context_len: int, token_chars: int) -> None:
    """Refuse, before tokenizing it (or rendering its chat), a text prompt too long to fit in the context
    whatever its tokens: more than `max_context_len` x `2 * token_chars` characters (twice the bound,
    for tokenizers whose normalizer drops characters). Tokenizing a prompt is then bounded in time."""
    limit = max_context_len * 2 * token_chars
    if isinstance(prompt, str):
        size, name = len(prompt), "prompt"
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        if len(prompt) > max_context_len:  # a chat template renders each message to a token at least
            raise ValueError(f"messages: {len(prompt)} messages cannot fit in the model's context length of "
                             f"{max_context_len} tokens (at most {max_context_len} messages)")
        size, name = sum(len(m["content"]) for m in prompt if isinstance(m.get("content"), str)), "messages"
    else:
        return
    if size > limit:
        raise ValueError(f"{name} has {size} characters, more than can fit in the model's context length of "
                         f"{max_context_len} tokens (at most {limit} characters: no token is longer than "
                         f"{token_chars})")


def as_prompt_list(prompts: Any) -> list[Any]:
    """`generate()`'s argument as a list: one string or one chat is one prompt."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts]  # one chat
    if isinstance(prompts, (list, tuple)) and prompts:
        return list(prompts)
    raise ValueError("prompts must be a string, a chat, or a non-empty list of either")
