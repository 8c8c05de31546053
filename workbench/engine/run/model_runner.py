"""ModelRunner: runs the unmodified transformers model on a ForwardBatch and returns logits.

Owns: switching the HF model to the "workbench" attention function, the packed forward call
(`input_ids [1, N]`, per-token `position_ids`, `logits_to_keep` for the rows that need logits) and
early-exit forwards for self-drafting, and on CPU float32 routing the model's `nn.Linear` layers
through MKL-packed weights (`cpu_kernels.pack_linears`; the modules and weights are unchanged),
with the load-time checks that decide where those kernels may run (fastpath.py, `kernel_report`),
and asking each layer's attention variant (variants.py, cached by variants_store.py).
With `kernels="fast"` (opt-in, not transformers' numbers) it also wraps the linears, MLPs and norms
with fastmode.py's bf16 / fused forwards and switches them on around each of its forwards.
Does not own: KV allocation (forward_batch.py) or sampling.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from workbench.engine.run import attention, cpu_kernels, fastmode, fastpath, variants_store
from workbench.engine.run.forward_batch import ForwardBatch
from workbench.models.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kernels: str = fastmode.DEFAULT) -> None:
        self.kernels = fastmode.check(kernels)
        if kernels != "exact" and (loaded.device != "cpu" or loaded.model.dtype != torch.float32):
            raise ValueError(f"kernels={kernels!r} replaces the GEMMs of a CPU float32 model; this model is "
                             f"{loaded.device} {str(loaded.model.dtype).removeprefix('torch.')} (use kernels='exact')")
        attention.register()
        self.loaded = loaded
        self.model = loaded.model
        # what each layer asks of attention; refuses (ValueError) what attention.py does not compute.
        # A model probed before (same weights, config, code and versions) reuses that probe's result.
        self.variants, self.variants_source = variants_store.variants_for(self.model, loaded.content_hash)
        self.model.set_attn_implementation(attention.ATTN_NAME)
        self.config = self.model.config
        self.device = loaded.device
        self.dtype = self.model.dtype
        self.vocab_size = int(self.config.vocab_size)
        self.num_layers = int(self.config.num_hidden_layers)
        self.kv_heads = int(self.config.num_key_value_heads)
        self.head_dim = int(getattr(self.config, "head_dim", None)
                            or self.config.hidden_size // self.config.num_attention_heads)
        self.max_context_len = int(getattr(self.config, "max_position_embeddings", 4096))
        # CPU float32: nn.Linear through MKL-packed weights, same results as F.linear (cpu_kernels.py)
        self.packed_bytes = cpu_kernels.pack_linears(self.model) if self.device == "cpu" else 0
        self.cpu_fp32 = self.device == "cpu" and self.dtype == torch.float32
        if self.cpu_fp32:
            heads = int(self.config.num_attention_heads)
            cpu_kernels.check_attention(heads, self.kv_heads, self.head_dim)
        # fast mode's wrappers go on after the packed linears (they call those when the mode is off)
        self.fast = fastmode.install(self.model, self.kernels) if self.kernels != "exact" else None

    def kernel_report(self) -> dict[str, Any]:
        """Which native paths may run and why, for the engine config / trace meta. The first two keys
        are the ones older readers know; "checks" is fastpath.py's verdicts on this CPU so far."""
        checks = fastpath.CHECKS.report()
        if self.fast is not None:
            checks["fast"] = fastmode.report(self.kernels, self.fast)
        return {"decode_attention": self.cpu_fp32 and cpu_kernels.available(),
                "packed_linear_bytes": self.packed_bytes, "checks": checks}

    @property
    def attention_variants(self) -> list[dict]:
        """Per layer: `{layer, window (None = full), softcap, sinks, scaling}` (variants.py)."""
        return [v.as_dict() for v in self.variants]

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits `[len(fb.logits_rows), vocab]` in float32 for the kept rows."""
        if self.fast is None:
            return self._forward(fb)
        with fastmode.active(self.kernels):
            return self._forward(fb)

    @torch.inference_mode()
    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.layer_limit is not None:
            return self._forward_early_exit(fb)
        with fb.capture.hooks() if fb.capture is not None else contextlib.nullcontext():
            out = self.model(
                input_ids=fb.input_ids.unsqueeze(0), position_ids=fb.positions.unsqueeze(0), use_cache=False,
                logits_to_keep=fb.logits_rows, forward_batch=fb,
            )
        return out.logits[0].float()

    def _forward_early_exit(self, fb: ForwardBatch) -> torch.Tensor:
        """Run only the first `fb.layer_limit` decoder layers, then the final norm and head."""
        inner = self.model.model
        hidden = inner.embed_tokens(fb.input_ids.unsqueeze(0))
        pos = fb.positions.unsqueeze(0)
        rope = inner.rotary_emb(hidden, position_ids=pos)
        for layer in inner.layers[: fb.layer_limit]:
            hidden = layer(hidden, attention_mask=None, position_embeddings=rope, position_ids=pos,
                           forward_batch=fb)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        hidden = inner.norm(hidden[:, fb.logits_rows])
        return self.model.lm_head(hidden)[0].float()
