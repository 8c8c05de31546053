"""`kernels="fast"`: an explicit, opt-in mode that trades transformers' exact numbers for speed on CPU.

The default (`kernels="exact"`) runs the unmodified model; its native paths are used only where
fastpath.py found them bit-identical (or, for multi-row decode attention, where the torch path has
no single result to be identical to). This module is the other mode, which changes the numbers on
purpose and says so in every trace (the engine config's `kernels` and `cpu_kernels.checks["fast"]`):

- **bf16 GEMMs**: every `nn.Linear` computes in bfloat16 (weights rounded to bf16 once, at load;
  activations rounded at each GEMM's input; the result widened back to float32). The residual
  stream, norms, softmax, attention and the KV cache stay float32. On a CPU with AVX512-BF16
  (oneDNN's bf16 GEMM) this is 2-3x faster than the fp32 GEMM at 8-32 rows and moves half the
  bytes at one row; on a CPU without it torch emulates bf16 and it is slower (`report()` says
  which this CPU has, and the load-time timing decides).
- **Fused MLP**: gate and up projections as one GEMM over their concatenated weight, then SiLU and
  the multiply in place (2 GEMM calls and 1 temporary instead of 3 and 3).
- **RMSNorm** through torch's one fused `rms_norm` op instead of transformers' six ops.

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

KERNELS = ("exact", "fast")
DEFAULT = "exact"

_state = threading.local()


def check(kernels: Any) -> str:
    """The validated mode name; ValueError naming the parameter and the allowed values otherwise."""
    if not isinstance(kernels, str) or kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(repr(k) for k in KERNELS)} ('exact': transformers' "
                         f"numbers, the default; 'fast': bf16 GEMMs and fused ops, output may differ), got {kernels!r}")
    return kernels


def is_active() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def active(on: bool = True) -> Iterator[None]:
    """The fast forwards for this thread while the block runs (ModelRunner wraps each forward)."""
    prev = is_active()
    _state.on = on
    try:
        yield
    finally:
        _state.on = prev


def cpu_has_bf16() -> bool:
    """Whether oneDNN has a native bf16 GEMM here (AVX512-BF16 / AMX); without it bf16 is emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class FastLinear:
    """One `nn.Linear`'s forward: in fast mode `bf16(x) @ bf16(W).T (+ b)` widened to float32;
    otherwise the forward it replaced (a cpu_kernels.PackedLinear or `F.linear`), unchanged."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self._module = weakref.ref(module)
        self.inner = module.__dict__.get("forward")  # a PackedLinear, or None: nn.Linear.forward
        self.weight = module.weight.detach().to(torch.bfloat16)
        self.bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            return self.inner(x)
        m = self._module()
        return F.linear(x, m.weight, m.bias)

    def fast16(self, x16: torch.Tensor) -> torch.Tensor:
        """bf16 in, bf16 out (the fused MLP chains these)."""
        return F.linear(x16, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not is_active() or x.dtype != torch.float32:
            return self.exact(x)
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias).float()


class FastMLP:
    """A Llama-style MLP (`down(act(gate(x)) * up(x))`, SiLU) in fast mode: gate and up as one bf16
    GEMM, SiLU and the multiply in place in bf16, then the down projection; otherwise unchanged."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = weakref.ref(module)
        self.inner = module.__dict__.get("forward")
        gate, up = module.gate_proj, module.up_proj
        self.split = gate.out_features
        self.weight = torch.cat([gate.weight.detach(), up.weight.detach()]).to(torch.bfloat16)
        self.bias = None if gate.bias is None else torch.cat([gate.bias.detach(), up.bias.detach()]).to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self._module()
        if not is_active() or x.dtype != torch.float32:
            return self.inner(x) if self.inner is not None else type(m).forward(m, x)
        gu = F.linear(x.to(torch.bfloat16), self.weight, self.bias)
        h = F.silu(gu[..., : self.split])  # a new tensor; then h *= up in place
        h.mul_(gu[..., self.split:])
        down = m.down_proj.forward
        if isinstance(down, FastLinear):
            return down.fast16(h).float()
        return down(h.float())


class FastRMSNorm:
    """`torch.rms_norm` (one fused op) for a Llama-style RMSNorm in fast mode; otherwise unchanged."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = weakref.ref(module)
        self.inner = module.__dict__.get("forward")
        self.shape = (int(module.weight.shape[0]),)
        self.eps = float(module.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self._module()
        if not is_active() or x.dtype != torch.float32:
            return self.inner(x) if self.inner is not None else type(m).forward(m, x)
        return torch.rms_norm(x, self.shape, m.weight, self.eps)


def _is_silu_mlp(m: torch.nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    return (all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")))


def _is_llama_rmsnorm(m: torch.nn.Module) -> bool:
    # transformers' plain RMSNorm: weight * norm(x) (Gemma's (1 + weight) form is a different class name)
    return (type(m).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
            and hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None), torch.Tensor))


def install(model: torch.nn.Module) -> dict[str, Any]:
    """Wrap the model's linears, MLPs and norms with their fast forwards (once per model; cheap when
    already done). Returns what was wrapped, for `report()`."""
    done = getattr(model, "_workbench_fast", None)
    if done is not None:
        return done
    start = time.perf_counter()
    linears = mlps = norms = 0
    fused: set[int] = set()  # gate/up projections the fused MLP computes (no bf16 copy of their own)
    for m in model.modules():
        if _is_silu_mlp(m):
            m.forward = FastMLP(m)
            fused.update((id(m.gate_proj), id(m.up_proj)))
            mlps += 1
        elif _is_llama_rmsnorm(m):
            m.forward = FastRMSNorm(m)
            norms += 1
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m) not in fused:
            m.forward = FastLinear(m)
            linears += 1
    bf16_bytes = sum(f.weight.numel() * 2 for m in model.modules()
                     for f in (m.__dict__.get("forward"),) if isinstance(f, (FastLinear, FastMLP)))
    done = {"linears": linears, "mlps": mlps, "norms": norms, "bf16_weight_bytes": bf16_bytes,
            "install_seconds": round(time.perf_counter() - start, 3)}
    model._workbench_fast = done
    return done


def report(installed: dict[str, Any]) -> dict[str, Any]:
    """What fast mode changes, for the engine config and the trace (cpu_kernels.checks["fast"])."""
    native = cpu_has_bf16()
    return {
        "mode": "fast: not transformers' numbers; greedy output can differ from the exact mode",
        "gemm": f"bf16 weights and inputs, float32 output, on {installed['linears']} linears "
                f"({'native AVX512-BF16/AMX in oneDNN' if native else 'no native bf16 on this CPU: emulated, slow'})",
        "mlp": f"gate+up as one bf16 GEMM, SiLU*up in place in bf16 ({installed['mlps']} MLPs)",
        "rmsnorm": f"torch.rms_norm, one fused op ({installed['norms']} norms)",
        "unchanged": "attention, rotary, residual adds, embeddings and the KV cache (float32, as in exact mode)",
        "bf16_weight_bytes": installed["bf16_weight_bytes"],
        "native_bf16": native,
    }
