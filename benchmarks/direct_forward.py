"""Exact mode's direct forward (run/exact_forward.py) against the model's own forward, on the same
decode batches: what the module dispatch it skips costs, with nothing else in the comparison.

    python benchmarks/direct_forward.py [--model smollm2] [--batches 1 8 32] [--steps 16] [--threads N]

Each batch size starts that many chat requests (greedy, ignore_eos) and runs until all decode. Then,
for `--steps` engine steps, each decode forward runs four times on the same ForwardBatch: the
model's forward and the direct one twice each, in an order that alternates per step (a burst of
load on a shared machine hits both), and the step goes on with the model's logits. The logits of
every run are compared bit for bit (writing the same K/V to the same slots again changes nothing).
Printed: the median forward time of each path, the difference, and whether every pair was identical.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(loaded, batch: int, steps: int) -> dict[str, float]:
    import torch

    from benchmarks.step_profile import decoding_engine
    from workbench.engine.run import exact_forward

    engine = decoding_engine(loaded, batch, trace_level="off")
    runner = engine.runner
    if not runner.use_direct:
        raise SystemExit(f"the direct forward does not run for this model: {runner.direct['why']}")
    times: dict[str, list[float]] = {"model": [], "direct": []}
    identical = []
    paths = {"model": runner._model_forward, "direct": lambda fb: exact_forward.forward(runner.model, fb)}
    timing = {"on": False, "step": 0}
    original = runner._forward

    def both(fb):
        if not timing["on"]:
            return original(fb)
        order = ["model", "direct"] if timing["step"] % 2 == 0 else ["direct", "model"]
        timing["step"] += 1
        out = {}
        with torch.inference_mode():
            for name in order * 2:
                t = time.perf_counter()
                logits = paths[name](fb)
                times[name].append(time.perf_counter() - t)
                if name in out:
                    identical.append(torch.equal(out[name], logits))
                out[name] = logits
        identical.append(torch.equal(out["model"], out["direct"]))
        return out["model"]

    runner._forward = both
    for _ in range(3):
        engine.step()
    timing["on"] = True
    for i in range(steps):
        print(f"\r  batch {batch}: step {i + 1}/{steps}", end="", file=sys.stderr, flush=True)
        engine.step()
    print(file=sys.stderr)
    engine.close()
    model_ms = statistics.median(times["model"]) * 1000
    direct_ms = statistics.median(times["direct"]) * 1000
    return {"model_ms": model_ms, "direct_ms": direct_ms, "saved_ms": model_ms - direct_ms,
            "identical": all(identical), "pairs": len(identical)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    import platform

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from workbench.models import load_model

    loaded = load_model(args.model, device="cpu", huge_pages=True)
    rows = {b: measure(loaded, b, args.steps) for b in args.batches}
    print(f"\nforward of one decode step (ms, median of {2 * args.steps}), {args.model}, {torch.get_num_threads()} "
          f"threads, {platform.processor() or platform.machine()}\n")
    print("| batch | model's forward | direct forward | saved | identical logits |")
    print("|---:|---:|---:|---:|---|")
    for b, r in rows.items():
        print(f"| {b} | {r['model_ms']:.2f} | {r['direct_ms']:.2f} | {r['saved_ms']:.2f} "
              f"({r['saved_ms'] / r['model_ms'] * 100:.1f}%) | {'yes' if r['identical'] else 'NO'}, {r['pairs']} pairs |")


if __name__ == "__main__":
    main()
