"""GPT-2's byte-level BPE alphabet: the reversible byte -> printable character table that byte-level
vocabularies (SmolLM2's, Llama 3's, Qwen's) store their tokens in, and its inverse.

Owns `UNICODE_TO_BYTE`, used wherever a token's vocabulary string is turned back into its bytes (the
server's logprob `bytes`, the probe's token-id recovery). Standard library only.
"""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """Byte value -> the printable character a byte-level vocabulary writes for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, (chr(c) for c in chars)))


UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}
