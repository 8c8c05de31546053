"""The `workbench watch` command line: its flags, and running the proxy in the foreground.

Owns: the arguments (upstream, port, sample fraction, trace folder and rotation, reference and
tolerance, the measured floor, the checker's queue and batch) and the start-up lines it prints.
Does not own the proxy (proxy.py) or its parts.
"""

from __future__ import annotations

import argparse
import sys


def add_watch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upstream", required=True, metavar="URL",
                   help="the OpenAI-compatible server to watch, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100)")
    p.add_argument("--sample", type=float, default=0.1, metavar="F",
                   help="fraction of generation requests checked against the reference, 0..1 (default 0.1)")
    p.add_argument("--out", default="watch-traces", metavar="DIR",
                   help="folder of the rolling trace files (default ./watch-traces)")
    p.add_argument("--max-trace-mb", type=float, default=64.0, help="size of one trace file before rotation (default 64)")
    p.add_argument("--keep", type=int, default=8, help="trace files kept; older ones are deleted (default 8)")
    p.add_argument("--reference", default="smollm2", metavar="MODEL|URL",
                   help="the reference model spec the checker teacher-forces through (default smollm2), or the "
                        "URL of a server that returns prompt logprobs (vLLM): a trusted deployment")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="the tokenizer of the model served (default: the reference's; smollm2 with a URL)")
    p.add_argument("--device", default="cpu", help="where the reference runs (default cpu: float32)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="nats: as `workbench check --tolerance` (default 0.05)")
    p.add_argument("--floor", default=None, metavar="FLOOR.json",
                   help="classify against the engine's measured noise floor (workbench floor): inside the floor / "
                        "near tie / real, as `workbench check --floor`; /metrics and the live view show it")
    p.add_argument("--top-logprobs", type=int, default=5,
                   help="alternatives per token asked of the upstream for sampled requests, 1..20 (default 5)")
    p.add_argument("--check-queue", type=int, default=256,
                   help="sampled requests waiting for the checker before new ones are dropped (default 256)")
    p.add_argument("--check-batch", type=int, default=8, help="requests teacher-forced in one prefill (default 8)")


def run_watch(args: argparse.Namespace) -> int:
    from workbench.watch.service import Watch, WatchServer

    if not 0.0 <= args.sample <= 1.0:
        raise ValueError(f"--sample must be a fraction in [0, 1], got {args.sample}")
    if not 1 <= args.top_logprobs <= 20:
        raise ValueError(f"--top-logprobs must be in [1, 20], got {args.top_logprobs}")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.max_trace_mb <= 0:
        raise ValueError(f"--max-trace-mb must be > 0, got {args.max_trace_mb}")
    watch = Watch(args.upstream, out=args.out, sample=args.sample, reference=args.reference, tokenizer=args.tokenizer,
                  tolerance=args.tolerance, device=args.device, top=args.top_logprobs,
                  max_bytes=int(args.max_trace_mb * (1 << 20)), keep=args.keep, check_capacity=args.check_queue,
                  check_batch=args.check_batch, floor=args.floor)
    server = WatchServer(watch, host=args.host, port=args.port)
    print(f"watch: proxying {watch.upstream} on {server.url} (sampling {args.sample:g} of generation requests); "
          f"traces in {args.out}/; live view {server.url}/watch/status, metrics {server.url}/metrics",
          file=sys.stderr, flush=True)
    if watch.floor is not None:
        src = watch.floor.source
        print(f"watch: classifying against the floor measured at {src.get('url') or '?'} ({watch.floor.positions} "
              f"positions, max |Δlogprob| {watch.floor.max_abs:.3g})", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        watch.close()
    return 0
