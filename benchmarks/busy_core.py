"""What a busy neighbour costs a decode step: the engine's threads meet at a barrier after every
parallel region (MKL's GEMMs, the C kernels' OpenMP loops), so where another process keeps a core
busy, the thread sharing that core is preempted and the others wait for it.

    python benchmarks/busy_core.py [--model smollm2] [--batches 1 32] [--steps 20]

For libgomp's default waiting (spin, then sleep) and `OMP_WAIT_POLICY=PASSIVE` (sleep at once),
each in a fresh process (the variable is read when OpenMP starts), the median decode step of
greedy chat requests (exact mode, tracing off), first on a quiet machine, then beside one process
spinning on a core (`while True: pass`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLICIES = {"libgomp's default (spin, then sleep)": None, "OMP_WAIT_POLICY=PASSIVE (sleep at once)": "PASSIVE"}


def child(model: str, batches: list[int], steps: int) -> dict[str, float]:
    from benchmarks.step_profile import decoding_engine
    from workbench.models.loader import load_model

    loaded = load_model(model, device="cpu", huge_pages=True)
    out = {}
    for batch in batches:
        engine = decoding_engine(loaded, batch, new=steps + 20, trace_level="off")
        for _ in range(5):  # every request decoding, first-use checks done
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        engine.close()
        out[str(batch)] = statistics.median(times) * 1e3
    return out


def run(args: argparse.Namespace, policy: str | None) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    argv = [sys.executable, __file__, "--child", "--model", args.model, "--steps", str(args.steps),
            "--batches", *map(str, args.batches)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"the measuring process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.batches, args.steps)))
        return
    from benchmarks.throughput import cpu_flags, cpu_model

    print(f"{cpu_model()} ({cpu_flags()}), {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load average {os.getloadavg()[0]:.2f}")
    rows = {}
    for load in ("quiet", "one core busy"):
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "quiet" else None
        try:
            for name, policy in POLICIES.items():
                print(f"  {load}: {name} ...", file=sys.stderr, flush=True)
                rows[(name, load)] = run(args, policy)
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    batches = " / ".join(map(str, args.batches))
    print(f"| OpenMP waiting | quiet: batch {batches} | one core busy: batch {batches} |")
    print("|---|---|---|")
    for name in POLICIES:
        cells = [" / ".join(f"{rows[(name, load)][str(b)]:.1f}" for b in args.batches) + " ms"
                 for load in ("quiet", "one core busy")]
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
