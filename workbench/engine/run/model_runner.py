"""ModelRunner: runs the unmodified transformers model on a ForwardBatch and returns logits.

Owns: switching the HF model to the "workbench" attention function (after asking each layer's
attention variant, variants.py), the packed forward call (`input_ids [1, N]`, per-token
`position_ids`, `logits_to_keep` for the rows that need logits) and early-exit forwards for
self-drafting; which of the checked replacements (engine/kernels/) it puts in place at load: on
CPU float32 the model's `nn.Linear` layers through kernels/gemm.py (the modules and weights are
unchanged) and the decode-attention kernel's check, in exact mode the direct forward
(exact_forward.py) where its check passed, and `kernel_report()`, their one section of the engine
config. With `kernels="fast"` (opt-in, not transformers' numbers) it also wraps the linears, MLPs
and norms with fastmode.py's bf16 / fused forwards and switches them on around each of its forwards.
Does not own: KV allocation (forward_batch.py), sampling, or any verdict (kernels/book.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from workbench.engine.kernels import BOOK, decode_attention, gemm, native
from workbench.engine.run import attention, exact_forward, fastmode, variants
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
        self.variants, self.variants_source = variants.variants_for(self.model, loaded.content_hash)
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
        # CPU float32: nn.Linear through MKL-packed weights, same results as F.linear (kernels/gemm.py)
        self.packed_bytes = gemm.pack_linears(self.model) if self.device == "cpu" else 0
        self.cpu_fp32 = self.device == "cpu" and self.dtype == torch.float32
        if self.cpu_fp32:
            heads = int(self.config.num_attention_heads)
            decode_attention.check_attention(heads, self.kv_heads, self.head_dim)
        # fast mode's wrappers go on after the packed linears (they call those when the mode is off)
        self.fast = fastmode.install(self.model, self.kernels) if self.kernels != "exact" else None
        # exact mode: the direct forward where the model's family is one it inlines and the check passed
        self.direct = self._check_direct() if self.fast is None else {
            "used": False, "why": f"kernels={self.kernels!r} runs fast mode's wrappers"}
        self.use_direct = self.direct["used"]  # benchmarks switch it off to compare
        self._structure = exact_forward.assignments()
        self._modules = list(self.model.modules())
        self._inlined = exact_forward.containers(self.model) if self.use_direct else []
        # which forward ran, counted, and why the model's own last ran where the direct one could
        self.forwards: dict[str, Any] = {"direct": 0, "model": 0}

    def _check_direct(self) -> dict[str, Any]:
        """Whether the direct forward runs and why: its classes asked now, its check (kernels' book:
        once per model object, engines share models) where they are ones it inlines."""
        why = exact_forward.refusal(self.model)  # asked every time: modules may have been swapped since
        if why is not None:
            return {"used": False, "why": why}
        verdict = exact_forward.checked(self.model, self.loaded.content_hash, lambda: exact_forward.verify(
            self.model, self._model_forward, self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device))
        return {"used": verdict.ok, "why": verdict.detail}

    def kernel_report(self, counts: bool = True) -> dict[str, Any]:
        """Which replacements may run and why, for the engine config / trace meta. The first two keys
        are the ones older readers know; "checks" is the one section of every checked replacement
        (kernels/book.py: the switch, the store, and per replacement what it is and its verdicts so
        far, this model's for the per-model ones), with the direct forward's state now (with `counts`,
        how many forwards each path ran so far: the engine config, written at load, leaves them out)
        and, in fast mode, what fast mode changes."""
        direct = dict(self.direct)
        if counts:
            direct["forwards"] = dict(self.forwards)
        checks = BOOK.report(about=self.model, state={exact_forward.NAME: direct})
        if self.fast is not None:
            checks["fast"] = fastmode.report(self.kernels, self.fast)
        return {"decode_attention": self.cpu_fp32 and native.available(),
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
        if self.use_direct and exact_forward.assignments() != self._structure:
            self._restructured()
        if self.use_direct:
            why = "a captured request" if fb.capture is not None else \
                exact_forward.blocked(self.model, self._modules, self._inlined)
            if why is None:
                self.forwards["direct"] += 1
                return exact_forward.forward(self.model, fb, fb.layer_limit)
            self.forwards["last_model_forward_because"] = why
        self.forwards["model"] += 1
        if fb.layer_limit is not None:
            return self._forward_early_exit(fb)
        if fb.capture is not None:
            with fb.capture.hooks():
                return self._model_forward(fb)
        return self._model_forward(fb)

    def _restructured(self) -> None:
        """Submodules were assigned somewhere since the last look: if this model's classes are no
        longer ones the direct forward inlines, stop using it (and say why); else refresh the
        module lists its per-forward checks read."""
        self._structure = exact_forward.assignments()
        why = exact_forward.refusal(self.model)
        if why is not None:
            self.use_direct = False
            self.direct = {**self.direct, "used": False, "why": f"the model's modules changed after the check: {why}"}
            return
        self._modules = list(self.model.modules())
        self._inlined = exact_forward.containers(self.model)

    def _model_forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The unmodified HF model's own forward on the packed batch."""
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
        for layer in itertools.islice(inner.layers, fb.layer_limit):  # no new ModuleList (exact_forward.forward)
            hidden = layer(hidden, attention_mask=None, position_embeddings=rope, position_ids=pos,
                           forward_batch=fb)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        hidden = inner.norm(hidden[:, fb.logits_rows])
        return self.model.lm_head(hidden)[0].float()
