"""Which attention each layer of a model asks for, found at load by asking the model itself.

Owns: the load-time probe (one 3-token forward of the unmodified HF model through a recording
attention function, no KV pool) that collects, per layer, the keywords the layer passes to its
attention function: `sliding_window`, `softcap`, `s_aux` (sinks), `scaling`; the `AttentionVariant`
record of each layer (what the trace and the TUI show); and refusing, with a ValueError naming the
model type and the feature, whatever the engine's attention function (attention.py) does not
compute exactly as transformers does. Deciding from what the layers pass, not from model names,
means a new family with a known trait works, and one with an unknown trait is refused.

The probe's verdict is the checked replacement `attention.variants` (engine/kernels/registry.py):
`variants_for` asks the kernels' book, which reads an accepted probe of this same model, code and
library versions from the verdict store instead of probing again (a refused model is probed, and
refused, on every load). What the key cannot see is a model changed in memory after loading (a
monkeypatched layer): code that does that calls `probe` itself, or sets the switch's `fresh`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from workbench.engine.kernels import BOOK, Verdict
from workbench.engine.kernels.book import model_environment

PROBE_NAME = "workbench_probe"
# keywords the engine's attention function computes (attention.py)
HANDLED = {"scaling", "sliding_window", "softcap", "s_aux"}
# keywords that do not change attention's result here: eval-mode dropout (refused when not 0), the
# engine's own batch, and flags the model threads through its layers
IGNORED = {"dropout", "forward_batch", "position_ids", "use_cache", "output_router_logits", "output_attentions",
           "cache_position", "is_causal"}


@dataclass(slots=True)
class AttentionVariant:
    """One layer's attention: full (window None) or a sliding window of `window` tokens (the query and
    the window-1 before it, as transformers' sliding_window_overlay), soft-capped scores, sinks."""

    layer: int
    window: int | None
    softcap: float | None
    sinks: bool
    scaling: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        parts = [f"window {self.window}" if self.window else "full"]
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return " · ".join(parts)


def _refuse(model_type: str, feature: str) -> ValueError:
    return ValueError(f"{model_type}: {feature} is not supported")


def _check_call(model_type: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                mask: Any, kwargs: dict[str, Any]) -> AttentionVariant:
    """The variant one layer's call asks for, or the ValueError for what the engine cannot honour."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise _refuse(model_type, f"an attention module without a layer index ({type(module).__name__})")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise _refuse(model_type, "bidirectional (non-causal) attention")
    if mask is not None:
        raise _refuse(model_type, "an attention mask built by the model (the engine builds its own)")
    if key.shape[2] != query.shape[2]:
        raise _refuse(model_type, "keys and values taken from another layer or a cache")
    if float(kwargs.get("dropout") or 0.0) != 0.0:
        raise _refuse(model_type, "attention dropout at inference")
    for name, value in kwargs.items():
        if name not in HANDLED and name not in IGNORED and value is not None and value is not False:
            raise _refuse(model_type, f"the attention keyword {name!r}")
    window = kwargs.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise _refuse(model_type, f"sliding_window={window!r} (expected a positive int or None)")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != query.shape[1]):
        raise _refuse(model_type, "attention sinks not given as one logit per query head")
    scaling = kwargs.get("scaling")
    return AttentionVariant(layer=int(layer), window=int(window) if window else None,
                            softcap=float(softcap) if softcap is not None else None, sinks=sinks is not None,
                            scaling=float(scaling) if scaling is not None else query.shape[-1] ** -0.5)


def _check_config(model_type: str, config: Any, calls: dict[int, AttentionVariant]) -> None:
    """What the model would do through its attention mask, which the engine does not build: chunked
    attention, layer types other than full and sliding, a sliding layer that passes no window."""
    if getattr(config, "attention_chunk_size", None):
        raise _refuse(model_type, "chunked attention (attention_chunk_size)")
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in ("full_attention", "sliding_attention"):
            raise _refuse(model_type, f"attention layer type {kind!r} (layer {i})")
        if kind == "sliding_attention" and i in calls and calls[i].window is None:
            raise _refuse(model_type, f"a sliding window applied only through the mask (layer {i})")


def probe(model: torch.nn.Module) -> list[AttentionVariant]:
    """Run `model` once on 3 tokens through a recording attention function and return each layer's
    variant; raises ValueError for what attention.py does not implement. Leaves the model's attention
    implementation on the probe: the caller sets its own next."""
    from transformers import AttentionInterface

    config = model.config
    model_type = str(getattr(config, "model_type", type(model).__name__))
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(model_type, "an encoder-decoder model")
    calls: dict[int, AttentionVariant] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        variant = _check_call(model_type, module, query, key, attention_mask, kwargs)
        if variant.layer in calls:
            raise _refuse(model_type, f"a layer calling attention twice (layer {variant.layer})")
        calls[variant.layer] = variant
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3]), None

    AttentionInterface.register(PROBE_NAME, record)
    try:
        model.set_attn_implementation(PROBE_NAME)
    except (ValueError, ImportError) as exc:
        raise _refuse(model_type, f"a custom attention function ({exc})") from exc
    device = next(model.parameters()).device
    ids = torch.zeros((1, 3), dtype=torch.int64, device=device)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(3, device=device)[None], use_cache=False,
              logits_to_keep=1, forward_batch=None)
    layers = int(getattr(config, "num_hidden_layers", len(calls)))
    _check_config(model_type, config, calls)
    if not calls:
        raise _refuse(model_type, "attention outside transformers' AttentionInterface (no layer called the "
                      "engine's attention function)")
    if sorted(calls) != list(range(layers)):
        raise _refuse(model_type, f"attention in layers {sorted(calls)} instead of one per layer 0..{layers - 1}")
    return [calls[i] for i in range(layers)]


def trace_record(runner: Any, layer_limit: int | None) -> list[dict[str, Any]]:
    """Per layer of the forward (index = layer; an early-exit draft runs the first `layer_limit`):
    `{window, softcap, sinks, scaling}` of the runner that runs it, the target's or the drafter's.
    A layer that runs what the layer before it runs shares that layer's dict (the same values to the
    bit), which a trace stores once with a count (trace/events.py, ForwardBatchBuilt)."""
    out: list[dict[str, Any]] = []
    before = None
    for v in runner.variants[:layer_limit]:
        key = (v.window, v.softcap.hex() if isinstance(v.softcap, float) else v.softcap, v.sinks,
               v.scaling.hex() if isinstance(v.scaling, float) else v.scaling)
        if key != before:
            record = {"window": v.window, "softcap": v.softcap, "sinks": v.sinks, "scaling": v.scaling}
            before = key
        out.append(record)
    return out


NAME = "attention.variants"  # its entry in engine/kernels/registry.py


def _valid(entry: Any, index: int) -> bool:
    """One layer's record as `variants_for` keeps it (anything else means the file is not ours: re-probe)."""
    if not isinstance(entry, dict) or set(entry) != {"layer", "window", "softcap", "sinks", "scaling"}:
        return False
    window, softcap, scaling = entry["window"], entry["softcap"], entry["scaling"]
    return (entry["layer"] == index and type(entry["layer"]) is int
            and (window is None or (type(window) is int and window >= 1))
            and (softcap is None or type(softcap) is float)
            and type(entry["sinks"]) is bool and type(scaling) is float)


def variants_for(model: Any, content_hash: str) -> tuple[list[AttentionVariant], str]:
    """Each layer's variant and where it came from ("checked in this process" or "cached from
    <date>"): kept from an earlier load of this exact model, code and library versions, else by
    `probe` (whose ValueError refuses the model). A cached result leaves the model's attention
    implementation as it was; a probe leaves it on the probe: the caller sets its own next."""
    layers = int(getattr(model.config, "num_hidden_layers", -1))

    def check() -> Verdict:
        found = probe(model)
        return Verdict(True, f"{len(found)} layers: every attention keyword is one the engine computes",
                       {"layers": [v.as_dict() for v in found]})

    def valid(v: Verdict) -> bool:
        found = v.facts.get("layers")
        return (v.ok and isinstance(found, list) and len(found) == layers
                and all(_valid(e, i) for i, e in enumerate(found)))

    verdict = BOOK.decide(NAME, (content_hash,), check, about=model,
                          env=lambda: model_environment(NAME, model, content_hash), valid=valid)
    return [AttentionVariant(**e) for e in verdict.facts["layers"]], verdict.source
