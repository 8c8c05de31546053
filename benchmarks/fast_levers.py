"""What each lever of `kernels="fast"` buys, one at a time: decode steps at batch 1, 8 and 32 with
bf16 GEMMs alone (the MLP's gate, up and down as three GEMMs, SiLU and the multiply out of place,
transformers' six-op RMSNorm), then with the fused MLP, then with the fused RMSNorm too (= fast),
and exact mode for reference; alternated per batch size in one process (same model, same moment).

    python benchmarks/fast_levers.py [--batches 1 8 32] [--steps 12] [--threads 1] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.step_profile import patched, profile_batch  # noqa: E402
from workbench.engine.run import fastmode  # noqa: E402


def _unfused_mlp(self, x):
    """FastMLP without the fusion: gate and up as two bf16 GEMMs (the halves of the fused weight)."""
    m = self._module()
    mode = fastmode.current()
    if mode is None:
        return type(m).forward(m, x)
    w = self.by_mode[mode]
    x16 = x.to(torch.bfloat16)
    gate = F.linear(x16, w.weight[: self.split]).float()
    up = F.linear(x16, w.weight[self.split:]).float()
    return m.down_proj.forward(F.silu(gate) * up)


def _unfused_norm(self, x):
    m = self._module()
    return type(m).forward(m, x)


CONFIGS = {
    "exact": ("exact", []),
    "bf16 GEMMs only": ("fast", [(fastmode.FastMLP, _unfused_mlp), (fastmode.FastRMSNorm, _unfused_norm)]),
    "+ fused MLP": ("fast", [(fastmode.FastRMSNorm, _unfused_norm)]),
    "+ fused RMSNorm (= fast)": ("fast", []),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from workbench.models import load_model

    loaded = load_model(args.model, device="cpu", huge_pages=True)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    rows: dict[str, dict[int, float]] = {name: {} for name in CONFIGS}
    for b in args.batches:
        for name, (kernels, patches) in CONFIGS.items():
            with contextlib.ExitStack() as stack:
                for cls, fn in patches:
                    stack.enter_context(patched(cls, "__call__", fn))
                rows[name][b] = profile_batch(loaded, b, args.steps, "off", kernels=kernels, clock=clock)["step_median"]
            print(f"batch {b} {name}: {rows[name][b]:.1f} ms", file=sys.stderr, flush=True)
    print(f"\nms per decode step (median, {args.clock} clock, {args.threads} thread(s))\n")
    print("| config | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|" + "---:|" * len(args.batches))
    for name, by_batch in rows.items():
        print(f"| {name} | " + " | ".join(f"{by_batch[b]:.1f}" for b in args.batches) + " |")


if __name__ == "__main__":
    main()
