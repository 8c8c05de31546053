"""Tiny random Llama-family models with real tokenizers, for tests that must run in seconds.

Owns: building `tiny-random` (SmolLM2's byte-level BPE tokenizer) and `tiny-random-sp` (a small
SentencePiece tokenizer with byte fallback, trained here) folders: config, seeded random weights
saved as safetensors, tokenizer files and a chat template. Does not own loading (loader.py).
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SP_CORPUS = """The quick brown fox jumps over the lazy dog. A stitch in time saves nine.
Inference engines batch requests, schedule prefill and decode, and sample tokens from logits.
Speculative decoding drafts tokens cheaply and verifies them with the target model in one pass.
Once upon a time there was a small model that learned to count: one, two, three, four, five.
The detokenizer holds back text while a character is incomplete, and stop strings end a request.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
"""


def tiny_config(vocab_size: int, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                bos: int = 1, eos: int = 2, pad: int = 2):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, initializer_range=0.2,
    )


def _save_random_model(config, folder: Path, seed: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Peaked logits make greedy comparisons meaningful: with the default init every token is a near tie.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)


def build_tiny_bpe(folder: Path, smollm2_tokenizer_folder: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama with SmolLM2's byte-level BPE tokenizer and chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    config = tiny_config(len(tok), bos=tok.bos_token_id or 1, eos=tok.eos_token_id, pad=tok.eos_token_id)
    _save_random_model(config, folder, seed)
    return folder


def train_sentencepiece(folder: Path, vocab_size: int = 400, *, corpus: list[str] | None = None,
                        model_type: str = "bpe", chat: bool = True, character_coverage: float = 0.9995) -> Path:
    """Train a small byte-fallback SentencePiece model and lay it out so AutoTokenizer loads it fast.

    Per DESIGN.md: `tokenizer.model` beside a `tokenizer_config.json` naming `LlamaTokenizer`;
    characters outside the vocabulary come out as `<0xE2>`-style byte tokens. With `chat`, the
    `<|im_start|>`/`<|im_end|>` markers are pieces and the config carries a chat template.
    """
    import io

    import sentencepiece as spm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus or _SP_CORPUS.splitlines() * 20), model_writer=buf, vocab_size=vocab_size,
        model_type=model_type, byte_fallback=True, character_coverage=character_coverage, bos_id=1, eos_id=2,
        unk_id=0, pad_id=-1, user_defined_symbols=["<|im_start|>", "<|im_end|>"] if chat else [], minloglevel=2,
        num_threads=1,
    )
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": chat, "add_eos_token": False, "legacy": False}
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def build_tiny_sp(folder: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama with a trained SentencePiece byte-fallback tokenizer."""
    from transformers import AutoTokenizer

    train_sentencepiece(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    config = tiny_config(len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.eos_token_id)
    _save_random_model(config, folder, seed)
    tok.save_pretrained(folder)
    return folder


# --- tiny random models of other transformers families ------------------------------------------
# Each is its family's own config class at tiny sizes, with the traits that change attention set on
# purpose: sliding windows (32 tokens, shorter than the test prompts; all layers, alternating, or from
# Qwen2's use_sliding_window/max_window_layers), soft-capping, sinks, a non-default scaling, MoE.
FAMILY_WINDOW = 32
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": FAMILY_WINDOW,
                              "max_window_layers": 1}),  # layer 0 full, layer 1 sliding
    "qwen3": ("Qwen3Config", {}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"attention_multiplier": 0.2, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5, "logits_scaling": 0.5}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "mistral": ("MistralConfig", {"sliding_window": FAMILY_WINDOW}),
    "gemma2": ("Gemma2Config", {"sliding_window": FAMILY_WINDOW, "attn_logit_softcapping": 10.0,
                                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 24}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": FAMILY_WINDOW, "query_pre_attn_scalar": 24,
                                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
    "gpt_oss": ("GptOssConfig", {"sliding_window": FAMILY_WINDOW, "num_local_experts": 4,
                                 "num_experts_per_tok": 2, "max_position_embeddings": 131072}),  # alternating sliding/full, attention sinks
}


def family_config(family: str, vocab_size: int, *, bos: int = 1, eos: int = 2, pad: int = 2):
    """The transformers config of tiny family `family` (a key of FAMILIES)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"model: unknown tiny-random family {family!r}; expected one of {sorted(FAMILIES)}")
    cls_name, extra = FAMILIES[family]
    layers = len(extra.get("layer_types", ())) or 2
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
                  pad_token_id=pad, initializer_range=0.2)
    return getattr(transformers, cls_name)(**{**kwargs, **extra})  # gpt_oss: its YaRN rope wants 128k


def build_family(folder: Path, family: str, smollm2_tokenizer_folder: Path, seed: int = 0) -> Path:
    """`tiny-random:<family>`: SmolLM2's tokenizer and a seeded random model of that family, built
    once into `folder` under a file lock and renamed into place, so concurrent processes (test workers,
    a server beside a notebook) never see or build a half-written folder."""
    import fcntl
    import os
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "model.safetensors").exists():  # another process built it while we waited
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_folder)
            tok.save_pretrained(tmp)
            config = family_config(family, len(tok), bos=tok.bos_token_id or 1, eos=tok.eos_token_id,
                                   pad=tok.eos_token_id)
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                model.lm_head.weight.mul_(8.0)  # peaked logits, as in tiny-random
            model.save_pretrained(tmp)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
