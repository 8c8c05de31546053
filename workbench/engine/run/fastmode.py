"""`kernels="fast"`: an explicit, opt-in mode that trades transformers' exact numbers for speed on CPU.

The default (`kernels="exact"`) runs the unmodified model; its replacements run only where their
checks passed (engine/kernels/: bit-identical, or for multi-row decode attention within a stated
tolerance). This module is the other mode, which changes the numbers on purpose, is not a checked
replacement, and says so in every trace (the engine config's `kernels` and `cpu_kernels.checks["fast"]`):

- **bf16 GEMMs**: every `nn.Linear` computes in bfloat16 (weights rounded to bf16 once, at load;
  activations rounded at each GEMM's input; the result widened back to float32). The residual
  stream, norms, softmax, attention and the KV cache stay float32. It pays only on a CPU with a
  native bf16 GEMM (AVX512-BF16 / AMX in oneDNN); elsewhere torch emulates bf16 (`report()` says
  which this CPU has; nothing switches back by itself; BENCHMARKS.md has the numbers).
- **Fused MLP**: gate and up projections as one GEMM over their concatenated weight, then SiLU and
  the multiply in place (2 GEMM calls instead of 3, 2 temporaries instead of 4).
- **RMSNorm** through torch's one fused `rms_norm` op instead of transformers' six ops.
- `kernels="fast-int8"`: the same, with the weights rounded to int8 (symmetric, per output
  channel): torch's weight-only int8 GEMM (`_weight_int8pack_mm`, bf16 inputs) at up to
  `INT8_MAX_ROWS` rows, where decode is bound by the bytes read; above, those int8 weights
  dequantized to bf16 and the bf16 GEMM (the same weights at every row count; the kernel differs).

Everything is switched per forward call (`active()`), not per model: an exact engine sharing the
same loaded model computes exactly what it did (the wrappers call the original forward when the
flag is off). The mode applies to CPU float32 models of the Llama layout (the MLP/norm classes it
recognises); other layers keep their own forward and `report()` lists what was fused.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from workbench.engine.config import KERNELS

DEFAULT = KERNELS[0]

_state = threading.local()


def check(kernels: Any) -> str:
    """The validated mode name; ValueError naming the parameter and the allowed values otherwise."""
    if not isinstance(kernels, str) or kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(repr(k) for k in KERNELS)} ('exact': transformers' "
                         "numbers, the default; 'fast': bf16 GEMMs and fused ops; 'fast-int8': int8 weights; "
                         f"the fast ones' output may differ), got {kernels!r}")
    return kernels


def current() -> str | None:
    """The fast mode switched on for this thread ("fast" / "fast-int8"), None when off."""
    return getattr(_state, "mode", None)


@contextlib.contextmanager
def active(mode: str | None) -> Iterator[None]:
    """`mode`'s fast forwards for this thread while the block runs (ModelRunner wraps each forward)."""
    prev = current()
    _state.mode = mode
    try:
        yield
    finally:
        _state.mode = prev


def cpu_has_bf16() -> bool:
    """Whether oneDNN has a native bf16 GEMM here (AVX512-BF16 / AMX); without it bf16 is emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


INT8_MAX_ROWS = 8  # at most this many rows: torch's weight-only int8 GEMM; above: the same weights as bf16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: `weight ~= q * scale[:, None]`, q in [-127, 127]."""
    w = weight.detach().float()  # may be the weight itself: nothing below writes into it
    scale = torch.linalg.vector_norm(w, ord=float("inf"), dim=1).clamp_(min=1e-12).div_(127.0)
    q = torch.empty(w.shape, dtype=torch.int8)
    for start in range(0, w.shape[0], 1024):  # a block at a time: one small float buffer, not a weight-sized one
        block = slice(start, start + 1024)
        q[block] = torch.div(w[block], scale[block, None]).round_().clamp_(-127, 127)
    return q, scale.to(torch.bfloat16)


class _Weights:
    """One GEMM's fast weights: bf16 (`kernels="fast"`), or int8 with per-channel scales plus their
    bf16 dequantization (`"fast-int8"`: the same weights for every row count; the kernel differs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, int8: bool) -> None:
        self.int8 = None
        if int8:
            q, scale = quantize_int8(weight)
            self.int8 = (q, scale)
            # q * scale is exact in float32 (8-bit by 8-bit mantissas), so one bf16 rounding either way
            self.weight = q.to(torch.bfloat16).mul_(scale[:, None])
        else:
            self.weight = weight.detach().to(torch.bfloat16)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def nbytes(self) -> int:
        return self.weight.numel() * 2 + (self.int8[0].numel() if self.int8 is not None else 0)

    def __call__(self, x16: torch.Tensor) -> torch.Tensor:
        """bf16 `[..., in]` -> bf16 `[..., out]`."""
        rows = x16.numel() // x16.shape[-1]
        if self.int8 is None or rows > INT8_MAX_ROWS:
            return F.linear(x16, self.weight, self.bias)
        y = torch._weight_int8pack_mm(x16.reshape(rows, x16.shape[-1]), *self.int8)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x16.shape[:-1], y.shape[-1])


class _Wrapped:
    """A module's forward replaced by a fast one: `exact(x)` is the forward it replaced (an instance
    forward such as kernels/gemm.PackedLinear, or the class's own), which runs whenever fast mode is off."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = weakref.ref(module)
        self.inner = module.__dict__.get("forward")  # None: the class's forward
        self.by_mode: dict[str, _Weights] = {}

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            return self.inner(x)
        m = self._module()
        return type(m).forward(m, x)


class FastLinear(_Wrapped):
    """One `nn.Linear`'s forward: in fast mode `bf16(x) @ W_fast.T (+ b)` widened to float32;
    otherwise the forward it replaced (a kernels/gemm.PackedLinear or `F.linear`), unchanged."""

    def add(self, mode: str) -> None:
        if mode not in self.by_mode:
            m = self._module()
            self.by_mode[mode] = _Weights(m.weight, m.bias, mode == "fast-int8")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mode = current()
        if mode is None or x.dtype != torch.float32:
            return self.exact(x)
        return self.by_mode[mode](x.to(torch.bfloat16)).float()


class FastMLP(_Wrapped):
    """A Llama-style MLP (`down(act(gate(x)) * up(x))`, SiLU) in fast mode: gate and up as one
    GEMM, SiLU and the multiply in place in bf16, then the down projection; otherwise unchanged."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.split = module.gate_proj.out_features

    def add(self, mode: str) -> None:
        if mode not in self.by_mode:
            m = self._module()
            gate, up = m.gate_proj, m.up_proj
            bias = None if gate.bias is None else torch.cat([gate.bias.detach(), up.bias.detach()])
            self.by_mode[mode] = _Weights(torch.cat([gate.weight.detach(), up.weight.detach()]), bias,
                                          mode == "fast-int8")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mode = current()
        if mode is None or x.dtype != torch.float32:
            return self.exact(x)
        m = self._module()
        gu = self.by_mode[mode](x.to(torch.bfloat16))
        h = F.silu(gu[..., : self.split])  # a new tensor; then h *= up in place
        h.mul_(gu[..., self.split:])
        down = m.down_proj.forward
        if isinstance(down, FastLinear):
            return down.by_mode[mode](h).float()
        return down(h.float())


class FastRMSNorm(_Wrapped):
    """`torch.rms_norm` (one fused op) for a Llama-style RMSNorm in fast mode; otherwise unchanged."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.shape = (int(module.weight.shape[0]),)
        self.eps = float(module.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if current() is None or x.dtype != torch.float32:
            return self.exact(x)
        return torch.rms_norm(x, self.shape, self._module().weight, self.eps)


def _is_silu_mlp(m: torch.nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    return (all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")))


def _is_llama_rmsnorm(m: torch.nn.Module) -> bool:
    # transformers' plain RMSNorm: weight * norm(x) (Gemma's (1 + weight) form is a different class name)
    return (type(m).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
            and hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.Tensor))


def install(model: torch.nn.Module, mode: str) -> dict[str, Any]:
    """Wrap the model's linears, MLPs and norms with their fast forwards (once per model) and give
    them `mode`'s weights (once per mode). Returns what was wrapped, for `report()`."""
    installed = model.__dict__.setdefault("_workbench_fast", {})
    if mode in installed:
        return installed[mode]
    start = time.perf_counter()
    wrappers: list[FastLinear | FastMLP] = []
    norms = 0
    fused: set[int] = set()  # gate/up projections the fused MLP computes (no fast copy of their own)
    for m in model.modules():
        f = m.__dict__.get("forward")
        if _is_silu_mlp(m):
            if not isinstance(f, FastMLP):
                m.forward = f = FastMLP(m)
            wrappers.append(f)
            fused.update((id(m.gate_proj), id(m.up_proj)))
        elif _is_llama_rmsnorm(m):
            if not isinstance(f, FastRMSNorm):
                m.forward = FastRMSNorm(m)
            norms += 1
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m) not in fused:
            f = m.__dict__.get("forward")
            if not isinstance(f, FastLinear):
                m.forward = f = FastLinear(m)
            wrappers.append(f)
    for w in wrappers:
        w.add(mode)
    done = {"linears": sum(isinstance(w, FastLinear) for w in wrappers),
            "mlps": sum(isinstance(w, FastMLP) for w in wrappers), "norms": norms,
            "weight_bytes": sum(w.by_mode[mode].nbytes() for w in wrappers),
            "install_seconds": round(time.perf_counter() - start, 3)}
    installed[mode] = done
    return done


def report(mode: str, installed: dict[str, Any]) -> dict[str, Any]:
    """What fast mode changes, for the engine config and the trace (cpu_kernels.checks["fast"])."""
    native = cpu_has_bf16()
    where = "native AVX512-BF16/AMX in oneDNN" if native else "no native bf16 on this CPU: emulated, slow"
    gemm = (f"int8 weights (symmetric, per output channel) with bf16 inputs: torch._weight_int8pack_mm at "
            f"<= {INT8_MAX_ROWS} rows, the same weights dequantized to bf16 above ({where})"
            if mode == "fast-int8" else f"bf16 weights and inputs ({where})")
    return {
        "mode": f"{mode}: not transformers' numbers; greedy output can differ from the exact mode",
        "gemm": f"{gemm}, float32 output, on {installed['linears']} linears and {installed['mlps']} MLPs",
        "mlp": f"gate+up as one GEMM, SiLU*up in place in bf16 ({installed['mlps']} MLPs)",
        "rmsnorm": f"torch.rms_norm, one fused op ({installed['norms']} norms)",
        "unchanged": "attention, rotary, residual adds, embeddings and the KV cache (float32, as in exact mode)",
        "not_used": "exact mode's packed fp32 GEMMs (packed_linear_bytes is what they take where an exact "
                    "engine runs them; this engine does not call them)",
        "fast_weight_bytes": installed["weight_bytes"],  # beside the float32 weights, which stay
        "install_seconds": installed["install_seconds"],
        "native_bf16": native,
    }
