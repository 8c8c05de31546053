"""The flip-risk map on 16 requests (issue 35): where could the batch context flip a token, and is
that where tokens did flip?

Records 16 greedy chat requests in one batch (`benchmarks.throughput.chat_prompts`), then runs
`workbench invariance` on the trace (each request re-run in its recorded batch and alone) and
prints the flip-risk map: per position, the largest logprob drift between the two contexts over
the top-2 margin. Reported: positions compared, positions with risk above 1, exact ties (margin 0),
flips (a request's first differing token) and how many flips sit at a risk above 1.

    python benchmarks/flip_risk.py [--model smollm2] [--dtype bfloat16] [--kernels exact] [--new 32]
                                   [--out /tmp/flip_risk.wbtrace] [--threads N]
                                   [--context chunked:16 --context prefix-cache --context speculative]

With `--context`, each of those contexts is a column of the map too (`workbench invariance --context`),
and the summary counts flips per context.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--kernels", default="exact", choices=("exact", "fast", "fast-int8"))
    ap.add_argument("--new", type=int, default=32, help="tokens per request")
    ap.add_argument("--out", default="/tmp/flip_risk.wbtrace")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 on a loaded machine)")
    ap.add_argument("--context", action="append", default=[], help="another context besides alone (repeatable)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.throughput import chat_prompts
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams
    from workbench.rerun.invariance import invariance

    Path(args.out).unlink(missing_ok=True)
    t0 = time.perf_counter()
    with Engine(args.model, device="cpu", dtype=args.dtype, kernels=args.kernels, trace=args.out) as engine:
        engine.generate(chat_prompts(16), SamplingParams(temperature=0, max_new_tokens=args.new, ignore_eos=True))
    report = invariance(args.out, contexts=args.context)
    print(report.describe())
    print(report.risk_table(20))
    flips = [{"req_id": r.req_id, "context": c, "position": p, "risk": next(
              (q.risk for q in r.positions if q.position == p), None)}
             for r in report.requests for c, p in r.flips.items() if p is not None]
    print(json.dumps({**report.risk_summary(), "flips_at": flips, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
