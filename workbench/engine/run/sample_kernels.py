"""The sampler's native kernels: its inverse-CDF draw and its token-rank count, each with the
torch formula it replaces and the probe that checks it.

Owns: `sample_draw` (sampler.Sampler.draw's float64-cumsum draw) and `count_above` (logprobs._ranks'
compare-and-count), their formulas (`draw_formula`, `count_formula`) and the probe inputs each is
checked on. Both kernels live in kernels/sample_draw.c and are built and loaded with the others
(cpu_kernels.load); each is compared with its formula on seeded probe rows at first use
(fastpath.FastPathChecks.sampler_kernel_ok) and used only where they agree. Does not own the
sampling itself (engine/sample/).
"""

from __future__ import annotations

import torch

from workbench.engine.run.cpu_kernels import load
from workbench.engine.run.fastpath import CHECKS


def draw_formula(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's inverse-CDF draw as torch computes it (sampler.Sampler.draw): ids `[R]`."""
    cdf = probs.detach().to(torch.float64).cpu().cumsum(dim=-1)  # [R, V]
    return (cdf <= u.to(torch.float64).cpu()[:, None] * cdf[:, -1:]).sum(dim=-1).clamp(max=probs.shape[-1] - 1)


def count_formula(lp: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """How many of each row's values are strictly above `picked` (logprobs._ranks, less one)."""
    return (lp > picked[:, None]).sum(dim=-1)


def _draw_probe(logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    u = torch.rand(logits.shape[0], generator=gen, dtype=torch.float64)
    u[-1] = 1.0 - 2.0 ** -53  # the top end, where rounding could step past the last kept token
    return torch.softmax(logits, dim=-1), u


def _count_probe(logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities against a picked one of each row: ties, -inf and a NaN row included."""
    lp = torch.log_softmax(logits, dim=-1)
    picked = lp.gather(1, torch.randint(0, lp.shape[1], (lp.shape[0], 1), generator=gen))[:, 0].clone()
    picked[0], lp[1, 0] = float("-inf"), float("nan")
    return lp, picked


def _rows_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def count_above(lp: torch.Tensor, picked: torch.Tensor) -> torch.Tensor | None:
    """Per row of `lp [R, V]` (CPU float32), how many values are strictly above `picked [R]`:
    `count_formula` by the native kernel, without the `[R, V]` mask. None where it does not apply
    (not built, not CPU float32) or was not found identical (fastpath.py)."""
    if not _rows_ok(lp) or picked.dtype != torch.float32:
        return None
    if load() is None or not CHECKS.sampler_kernel_ok("count_above", _unchecked_count, count_formula, _count_probe):
        return None
    return _unchecked_count(lp, picked)


def sample_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """The sampler's inverse-CDF draw (`draw_formula`: float64 cumsum, count of the cdf at or below
    `u * total`) for `probs [R, V]` CPU float32 and `u [R]` float64, by the native kernel
    (kernels/sample_draw.c): ids `[R]` int64, -1 for a row it leaves to the formula (NaN
    probabilities). None where the kernel does not apply: not built, not CPU float32, or not found
    identical to the formula on this CPU (fastpath.py)."""
    if not _rows_ok(probs):
        return None
    if load() is None or not CHECKS.sampler_kernel_ok("sample_draw", _unchecked_draw, draw_formula, _draw_probe):
        return None
    return _unchecked_draw(probs, u)


def _per_row(kernel: str, rows: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """Run the native `kernel(rows, R, V, row stride, per_row, out, threads)`: one int64 per row."""
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    getattr(load(), kernel)(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), per_row.data_ptr(),
                            out.data_ptr(), torch.get_num_threads())
    return out


def _unchecked_count(lp: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    return _per_row("wb_count_above", lp, picked.contiguous())


def _unchecked_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return _per_row("wb_sample_draw", probs, u.to(torch.float64).contiguous())
