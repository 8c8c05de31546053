"""The torch paths for a while, in code (comparisons, benchmarks): what the switch's `torch` value
does for a whole process, `disabled()` does for one block and one model.

Owns: unloading the C kernels and putting a model's linears back on `nn.Linear.forward` (fast
mode's wrappers included) for the block, then restoring both. Does not own the kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from workbench.engine.kernels.gemm import PackedLinear
from workbench.engine.kernels.native import c_kernels_off


@contextlib.contextmanager
def disabled(model: torch.nn.Module | None = None) -> Iterator[None]:
    """Decode attention by gather + sdpa, the sampler's formulas and, for `model`, `F.linear`
    instead of the packed weights, while the block runs."""
    packers = [m.forward for m in (model.modules() if model is not None else ())
               if isinstance(m, torch.nn.Linear) and isinstance(m.forward, PackedLinear)]
    for p in packers:
        del p.module.forward  # back to nn.Linear.forward
    # fast mode's wrappers (fastmode.FastLinear) call a packed forward of their own when the mode is off
    wrapped = [m.forward for m in (model.modules() if model is not None else ())
               if isinstance(m, torch.nn.Linear) and isinstance(getattr(m.forward, "inner", None), PackedLinear)]
    for w in wrapped:
        w.inner, w.saved_inner = None, w.inner
    packed_bytes = getattr(model, "_workbench_packed_bytes", None)
    if packed_bytes is not None:
        model._workbench_packed_bytes = 0  # an Engine built meanwhile reports (and packs) nothing
    try:
        with c_kernels_off():
            yield
    finally:
        for p in packers:
            p.module.forward = p
        for w in wrapped:
            w.inner = w.saved_inner
        if packed_bytes is not None:
            model._workbench_packed_bytes = packed_bytes
