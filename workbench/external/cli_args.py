"""The `workbench probe` and `workbench check` command lines.

Owns: their arguments (the sampling flags `generate` has, with the OpenAI/vLLM names they are sent
as), turning them into `ProbeRequest`s and the run's defaults, printing the outcome, and the exit
status (probe: 0 when every request completed, 1 when any failed; check: 0 when no real
divergence, 1 otherwise). Does not own the probe or the check.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from workbench.external.records import ProbeRequest, load_prompts_jsonl

# command-line dest -> request field, and the value that means "not set, send nothing"
_SAMPLING_FLAGS = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
                   "presence_penalty": 0.0, "seed": None, "stop": None, "stop_token_ids": None, "ignore_eos": False,
                   "min_tokens": 0}


def add_probe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--out", required=True, metavar="T.wbtrace", help="the trace to write")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="one request a line: a prompt string, a list of messages, or an object with "
                        "prompt/messages and sampling fields")
    p.add_argument("--chat", action="store_true", help="send prompts as user messages to /v1/chat/completions")
    p.add_argument("--model", help="the model name to request (default: the first id of /v1/models)")
    p.add_argument("--tokenizer", "--reference", dest="tokenizer", default="smollm2", metavar="MODEL",
                   help="the reference model whose tokenizer gives prompt ids and recovers token ids (default smollm2)")
    p.add_argument("-n", "--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--top-logprobs", type=int, default=20, help="alternatives per token, 0..20 (default 20)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--api-key", default=None, help="bearer token for the server (default $WORKBENCH_API_KEY); "
                   "never written to the trace")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any chunk (default 120)")
    p.add_argument("--otlp-port", type=int, default=None, metavar="P",
                   help="also receive the server's OTLP/HTTP spans on 127.0.0.1:P (vLLM: "
                        "--otlp-traces-endpoint http://127.0.0.1:P/v1/traces) and join them to the requests")
    g = p.add_argument_group("sampling (sent to the server; a prompts file's own fields win)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, metavar="STR", help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=None, dest="stop_token_ids", metavar="ID")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0)


def probe_inputs(args: argparse.Namespace) -> tuple[list[ProbeRequest], dict[str, Any]]:
    """The requests and the run's sampling defaults from parsed arguments; ValueError when there are none."""
    requests = [ProbeRequest(messages=[{"role": "user", "content": t}]) if args.chat else ProbeRequest(prompt=t)
                for t in args.prompt]
    if args.prompts:
        requests += load_prompts_jsonl(args.prompts, chat=args.chat)
    if not requests:
        raise ValueError("give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    defaults: dict[str, Any] = {"temperature": args.temperature}
    for name, unset in _SAMPLING_FLAGS.items():
        value = getattr(args, name)
        if value != unset:
            defaults[name] = value
    return requests, defaults


def run_probe(args: argparse.Namespace) -> int:
    from workbench.external.probe import probe

    requests, defaults = probe_inputs(args)
    common = dict(model=args.model, concurrency=args.concurrency, top_logprobs=args.top_logprobs,
                  max_tokens=args.max_tokens, api_key=args.api_key, tokenizer=args.tokenizer,
                  progress=True, defaults=defaults, timeout=args.timeout)
    if args.otlp_port is not None:
        from workbench.external.otlp import OtlpReceiver

        with OtlpReceiver(port=args.otlp_port) as otlp:
            print(f"probe: receiving OTLP spans at {otlp.endpoint}", file=sys.stderr)
            result = probe(args.url, requests, args.out, otlp=otlp, **common)
    else:
        result = probe(args.url, requests, args.out, **common)
    for line in result.fallbacks:
        print(f"probe: note: {line}", file=sys.stderr)
    done = sum(1 for r in result.records if not r.error)
    print(f"probe: {done}/{len(result.records)} requests completed, {result.num_tokens} tokens from "
          f"{result.model} at {result.url}; trace: {result.path}")
    if result.errors:
        print(f"probe: {len(result.errors)} request(s) failed; the trace holds everything received:", file=sys.stderr)
        for line in result.errors[:10]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def add_check_args(p: argparse.ArgumentParser) -> None:
    from workbench.external.check import DEFAULT_TOLERANCE

    p.add_argument("trace", help="a .wbtrace file (from workbench probe, or this engine's own)")
    p.add_argument("--reference", default="smollm2", metavar="MODEL|URL",
                   help="the reference model spec (default smollm2; tiny-random, a folder, a .gguf file), or "
                        "the URL of a server that returns prompt logprobs (vLLM) to teacher-force through")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="with --reference URL: the tokenizer of the server's model (default: the one the "
                        "trace was probed with, else smollm2)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"nats: a greedy mismatch the reference prefers by less is a near tie; a sampled "
                        f"logprob off by more is a divergence (default {DEFAULT_TOLERANCE})")
    p.add_argument("--no-store", action="store_true", help="do not write the results into the trace")
    p.add_argument("--device", default="cpu", help="where the reference runs (default cpu: float32)")


def run_check(args: argparse.Namespace) -> int:
    from workbench.external.check import check_trace

    if not os.path.exists(args.trace):
        raise ValueError(f"no such trace file: {args.trace!r}")
    engine = None
    if args.reference.startswith(("http://", "https://")):
        from workbench.external.server_reference import ServerReference
        from workbench.trace.reader import open_trace

        tokenizer = args.tokenizer
        if tokenizer is None:
            with open_trace(args.trace) as trace:
                tokenizer = (trace.meta.get("reference") or {}).get("tokenizer") or "smollm2"
        engine = ServerReference(args.reference, tokenizer)
    elif args.device != "cpu":
        from workbench.engine.engine import Engine

        engine = Engine(args.reference, device=args.device, trace=None, trace_level="off")
    report = check_trace(args.trace, args.reference, tolerance=args.tolerance, store=not args.no_store,
                         engine=engine)
    print(report.render())
    if not args.no_store:
        print(f"results stored in {args.trace} (open it with workbench tui, or TraceViewer in a notebook)")
    return report.exit_code
