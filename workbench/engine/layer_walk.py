"""One request's sequence through the decoder layers in a chosen numerics, every call of every layer
and sub-block kept, so that one layer can be run again on another numerics' input.

Owns: `Numerics` (what a run computes in: a loaded model, the dtype its activations have, the unit
of that dtype's rounding, and a context switched on around each call: fast mode's
`fastmode.active`, or modules a user swapped in from Python), building the candidates by name
(`numerics_for`: float32, bfloat16, float16, fast, fast-int8, each through this engine's
`ModelRunner`, so the attention function, the packed linears and fast mode's wrappers are the
runner's own), and `walk`: the prefill of one sequence (one request, no prefix, as the engine's
extend path attends it) layer by layer with hooks keeping each layer's and sub-block's inputs and
output (`Call`), then the final norm and lm_head on the rows asked for. `rerun` calls a kept call
again in another numerics (its floating tensors cast to that numerics' dtype). A public engine
module (api.PUBLIC_MODULES): `workbench bisect` (rerun/bisect.py) asks it, never the runner's
parts. Does not own the attribution (rerun/bisect.py) or what is reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.trace.bisect_store import CANDIDATES, SUB_BLOCKS

__all__ = ["CANDIDATES", "SUB_BLOCKS", "Numerics", "Call", "Walk", "numerics_for", "runner_for", "swapped", "walk",
           "rerun"]

# machine epsilon (one ulp at 1.0) of the dtype each numerics rounds its activations to
EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@dataclass(slots=True)
class Numerics:
    """What a run computes in. `model` is the transformers model (shared with the reference for
    fast mode and swapped modules: `context` switches the difference on around each call)."""

    name: str
    model: torch.nn.Module
    dtype: torch.dtype  # the activations' dtype fed to its layers
    eps: float  # one ulp at 1.0 of the dtype it rounds to (the floor's unit)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def layers(self) -> Any:
        return self.model.model.layers


@dataclass(slots=True)
class Call:
    """One call of a module as the walk made it: its arguments and its output `[1, N, hidden]`."""

    args: tuple
    kwargs: dict[str, Any]
    out: torch.Tensor


@dataclass(slots=True)
class Walk:
    """A sequence's prefill in one numerics: the residual entering each layer and leaving the last
    (`residual[i]`, `[N, hidden]` float32, entry 0 the embeddings), each layer's calls (`calls[i]`:
    "layer" and each sub-block), and float32 log-probabilities `[rows, vocab]` of the rows asked for."""

    residual: list[torch.Tensor]
    calls: list[dict[str, Call]]
    logprobs: torch.Tensor
    rows: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _ExtendAttn:
    extend_rows: list[tuple[int, int, int, Any]]
    decode_kv_idx: Any = None


class _DroppedKV:
    """The pool the attention function writes new K/V into: a one-request prefill with no prefix
    attends the keys of the call itself, so nothing needs keeping."""

    def write(self, *args: Any) -> None:
        return None


@dataclass(slots=True)
class _Memory:
    kv: _DroppedKV


@dataclass(slots=True)
class Prefill:
    """The part of a ForwardBatch that attention.workbench_attention reads, for one request's prefill
    of `n` tokens with no prefix (the engine's extend path: causal sdpa over the call's own keys)."""

    n: int
    attn: _ExtendAttn = None  # type: ignore[assignment]
    memory: _Memory = None  # type: ignore[assignment]
    capture: Any = None
    out_cache_loc: Any = None  # where the pool would keep the new K/V: dropped (_DroppedKV)

    def __post_init__(self) -> None:
        self.attn = _ExtendAttn([(0, self.n, 0, None)])
        self.memory = _Memory(_DroppedKV())


def runner_for(loaded: Any) -> Any:
    """The reference: a `ModelRunner` on `loaded` (float32 on the CPU) in exact mode."""
    from workbench.engine.run.model_runner import ModelRunner

    return ModelRunner(loaded)


def numerics_for(name: str, reference: Any, load: Callable[[str], Any]) -> Numerics:
    """The numerics `name` (one of CANDIDATES) beside the reference `ModelRunner` (float32, exact):
    float32 is the reference itself, fast/fast-int8 its model under fast mode's wrappers, bfloat16
    and float16 the same weights loaded in that dtype (`load(dtype)` gives a LoadedModel) behind
    their own runner. ValueError for another name."""
    from workbench.engine.run import fastmode
    from workbench.engine.run.model_runner import ModelRunner

    if name == "float32":
        return Numerics("float32", reference.model, torch.float32, EPS[torch.float32])
    if name in ("fast", "fast-int8"):
        ModelRunner(reference.loaded, kernels=name)  # installs the wrappers and checks the model can run them
        return Numerics(name, reference.model, torch.float32, EPS[torch.bfloat16], lambda: fastmode.active(name))
    if name in ("bfloat16", "float16"):
        runner = ModelRunner(load(name))
        dtype = getattr(torch, name)
        return Numerics(name, runner.model, dtype, EPS[dtype])
    raise ValueError(f"--against must be one of {', '.join(CANDIDATES)} (or modules swapped in from Python), "
                     f"got {name!r}")


def swapped(reference: Numerics, modules: dict[str, torch.nn.Module]) -> Numerics:
    """The reference model with `modules` (dotted path -> replacement, e.g. `{"model.layers.3.mlp": m}`)
    swapped in around each call and put back after: a module the user wrote, checked against the one
    it replaces."""
    if not modules:
        raise ValueError("against: give at least one module path to swap in")
    for path in modules:
        _parent(reference.model, path)  # ValueError for a path that does not exist

    @contextlib.contextmanager
    def swap() -> Iterator[None]:
        saved = []
        try:
            for path, module in modules.items():
                parent, attr = _parent(reference.model, path)
                saved.append((parent, attr, getattr(parent, attr)))
                setattr(parent, attr, module)
            yield
        finally:
            for parent, attr, module in reversed(saved):
                setattr(parent, attr, module)

    return Numerics("swapped " + ", ".join(modules), reference.model, reference.dtype, reference.eps, swap)


def _parent(model: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    head, _, attr = path.rpartition(".")
    try:
        parent = model.get_submodule(head) if head else model
        getattr(parent, attr)
    except AttributeError as exc:
        raise ValueError(f"against: the model has no module {path!r} (e.g. 'model.layers.3.mlp')") from exc
    return parent, attr


def cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(cast(v, dtype) for v in value)
    return value


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def hidden_input(call: Call) -> torch.Tensor:
    return call.args[0] if call.args else call.kwargs["hidden_states"]


def with_input(call: Call, x: torch.Tensor) -> Call:
    """The same call with its hidden-states input replaced by `x`."""
    if call.args:
        return Call((x, *call.args[1:]), call.kwargs, call.out)
    return Call(call.args, {**call.kwargs, "hidden_states": x}, call.out)


@torch.inference_mode()
def rerun(num: Numerics, layer: int, block: str, call: Call) -> torch.Tensor:
    """`block` ("layer" or a sub-block) of decoder layer `layer` in numerics `num` on `call`'s inputs
    (cast to its dtype): the output `[1, N, hidden]` in float32."""
    with num.context():
        module = num.layers()[layer]
        if block != "layer":
            module = getattr(module, block)
        out = module(*cast(call.args, num.dtype), **{k: cast(v, num.dtype) for k, v in call.kwargs.items()})
    return _first(out).float()


@torch.inference_mode()
def walk(num: Numerics, ids: list[int], rows: list[int]) -> Walk:
    """Prefill `ids` through `num`'s model layer by layer, keeping every layer's and sub-block's call,
    then log-probabilities of `rows` (indices into `ids`)."""
    inner = num.model.model
    device = next(num.model.parameters()).device
    n = len(ids)
    fb = Prefill(n)
    calls: list[dict[str, Call]] = []
    with num.context():
        x = inner.embed_tokens(torch.tensor([ids], device=device))
        pos = torch.arange(n, device=device)[None]
        rope = inner.rotary_emb(x, position_ids=pos)
        residual = [x[0].float()]
        for layer in inner.layers:
            kept: dict[str, Call] = {}
            handles = []
            for name in SUB_BLOCKS:
                sub = getattr(layer, name, None)
                if sub is not None:
                    handles.append(sub.register_forward_hook(_keeper(kept, name), with_kwargs=True))
            try:
                out = _first(layer(x, attention_mask=None, position_embeddings=rope, position_ids=pos,
                                   forward_batch=fb))
            finally:
                for h in handles:
                    h.remove()
            kept["layer"] = Call((x,), {"attention_mask": None, "position_embeddings": rope, "position_ids": pos,
                                        "forward_batch": fb}, out.float())
            calls.append(kept)
            x = out
            residual.append(x[0].float())
        # one row at a time: a fast-mode GEMM's rounding depends on how many rows it multiplies, and a
        # row's pick must not depend on which other rows were asked for
        logits = torch.cat([num.model.lm_head(inner.norm(x[:, r:r + 1]))[0].float() for r in rows])  # [rows, vocab]
    cap = getattr(num.model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return Walk(residual, calls, torch.log_softmax(logits, dim=-1), rows)


def _keeper(kept: dict[str, Call], name: str) -> Callable:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        kept[name] = Call(args, dict(kwargs), _first(out).float())
    return hook
