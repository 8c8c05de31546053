"""The `workbench probe`, `check`, `floor`, `resend` and `import` command lines.

Owns: their arguments (the sampling flags `generate` has, with the OpenAI/vLLM names they are sent
as), turning them into `ProbeRequest`s and the run's defaults, printing the outcome, and the exit
status (probe, resend: 0 when every request completed, 1 when any failed; check: 0 when no real
divergence, 1 otherwise; floor, import: 0 when written). Does not own the probe, the check, the
floor, the resend or the import.
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
    add_request_args(p)
    p.add_argument("--otlp-port", type=int, default=None, metavar="P",
                   help="also receive the server's OTLP/HTTP spans on 127.0.0.1:P (vLLM: "
                        "--otlp-traces-endpoint http://127.0.0.1:P/v1/traces) and join them to the requests")


def add_request_args(p: argparse.ArgumentParser) -> None:
    """What to send and how (probe, floor): prompts, model, concurrency, logprobs, sampling."""
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
    p.add_argument("--floor", default=None, metavar="FLOOR.json",
                   help="classify against the engine's measured noise floor (workbench floor): inside the "
                        "floor / near tie / real, instead of the constant tolerance alone")
    g = p.add_argument_group("importance ratios (on for `workbench import` traces; any of these turns them on)")
    g.add_argument("--tis-cap", type=float, default=None, metavar="C",
                   help="truncated IS: count tokens whose ratio reference/engine exceeds C (default 2)")
    g.add_argument("--mis-low", type=float, default=None, metavar="LO", help="masked IS: drop ratios below LO (default 0.5)")
    g.add_argument("--mis-high", type=float, default=None, metavar="HI", help="masked IS: drop ratios above HI (default 2)")


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
    importance = None
    given = {k: getattr(args, k) for k in ("tis_cap", "mis_low", "mis_high") if getattr(args, k) is not None}
    if given:
        from workbench.external.importance import Thresholds

        importance = Thresholds(**given)
    report = check_trace(args.trace, args.reference, tolerance=args.tolerance, store=not args.no_store,
                         engine=engine, floor=args.floor, importance=importance)
    print(report.render())
    if not args.no_store:
        print(f"results stored in {args.trace} (open it with workbench tui, or TraceViewer in a notebook)")
    return report.exit_code


def add_floor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="the server whose self-disagreement to measure (sent everything twice)")
    p.add_argument("--url2", default=None, help="a replica: send once to --url and once to --url2")
    p.add_argument("--traces", nargs=2, default=None, metavar=("A", "B"),
                   help="measure from two traces of the same requests already recorded (no server)")
    p.add_argument("--keep", nargs=2, default=None, metavar=("A.wbtrace", "B.wbtrace"),
                   help="keep the two probe traces (default: temporary)")
    p.add_argument("--out", required=True, metavar="FLOOR.json", help="the floor file to write")
    add_request_args(p)


def run_floor(args: argparse.Namespace) -> int:
    from workbench.external.floor import floor_from_traces, measure_floor

    if args.traces:
        if args.url or args.url2:
            raise ValueError("floor: give --url (and --url2) or --traces A B, not both")
        floor = floor_from_traces(*args.traces)
        floor.save(args.out)
    else:
        if not args.url:
            raise ValueError("floor: give --url URL (the server to measure), or --traces A B")
        requests, defaults = probe_inputs(args)
        floor = measure_floor(args.url, requests, args.out, url2=args.url2, traces=args.keep, model=args.model,
                              concurrency=args.concurrency, top_logprobs=args.top_logprobs,
                              max_tokens=args.max_tokens, api_key=args.api_key, tokenizer=args.tokenizer,
                              progress=True, defaults=defaults, timeout=args.timeout)
    print(floor.describe())
    print(f"floor written to {args.out} (use it: workbench check T --floor {args.out}; workbench diff A B --floor ...)")
    return 0


def add_resend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a recorded trace (from probe, or this engine's own)")
    p.add_argument("--to", required=True, metavar="URL", help="the upstream to send the same requests to")
    p.add_argument("--out", required=True, metavar="T2.wbtrace", help="the trace to write")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a sampling field for every request (e.g. repeat_penalty=1.0 for llama.cpp)")
    p.add_argument("--model", help="the model name to request (default: the first id of /v1/models)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL", help="reference tokenizer (default: the trace's)")
    p.add_argument("-n", "--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--top-logprobs", type=int, default=None, help="alternatives per token (default: the trace's)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: each request's recorded max_tokens")
    p.add_argument("--api-key", default=None, help="bearer token (default $WORKBENCH_API_KEY); never written")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any chunk (default 120)")


def run_resend(args: argparse.Namespace) -> int:
    from workbench.external.resend import parse_set, resend

    if not os.path.exists(args.trace):
        raise ValueError(f"no such trace file: {args.trace!r}")
    result, rec = resend(args.trace, args.to, args.out, set_params=parse_set(args.set), model=args.model,
                         tokenizer=args.tokenizer, concurrency=args.concurrency, top_logprobs=args.top_logprobs,
                         max_tokens=args.max_tokens, api_key=args.api_key, timeout=args.timeout, progress=True)
    for rid, why in rec.skipped.items():
        print(f"resend: not resent: {rid} ({why})", file=sys.stderr)
    done = sum(1 for r in result.records if not r.error)
    print(f"resend: {done}/{len(result.records)} requests of {args.trace} sent to {result.url} ({result.model}); "
          f"trace: {result.path}\ncompare: workbench diff {args.trace} {result.path} [--floor FLOOR.json]")
    for line in result.errors[:10]:
        print(f"  {line}", file=sys.stderr)
    return 1 if result.errors else 0


def add_import_args(p: argparse.ArgumentParser) -> None:
    from workbench.external.imports import MAX_ROWS, MAX_TOKENS

    p.add_argument("file", help="logged generations: .jsonl or .parquet with prompt ids, output ids and "
                                "per-token logprobs (TRL, verl and vLLM RequestOutput field names)")
    p.add_argument("--out", required=True, metavar="T.wbtrace", help="the trace to write")
    p.add_argument("--tokenizer", default="smollm2", metavar="MODEL",
                   help="the reference tokenizer, for token text (default smollm2; 'none' for no text)")
    p.add_argument("--temperature", type=float, default=None,
                   help="the rollouts' temperature where a row does not say (default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="the rollouts' top-p where a row does not say")
    p.add_argument("--top-k", type=int, default=None, help="the rollouts' top-k where a row does not say")
    p.add_argument("--logprobs-mode", choices=["raw", "processed"], default="raw",
                   help="what the engine's logprobs are (vLLM logprobs_mode; default raw)")
    p.add_argument("--model", default=None, help="the engine's model name, for the trace")
    p.add_argument("--max-rows", type=int, default=MAX_ROWS, help=f"refuse files with more rollouts (default {MAX_ROWS})")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"refuse rollouts with more prompt + output ids (default {MAX_TOKENS})")


def run_import(args: argparse.Namespace) -> int:
    from workbench.external.imports import import_generations

    defaults = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
                if v is not None}
    result = import_generations(args.file, args.out, max_rows=args.max_rows, max_tokens=args.max_tokens,
                                tokenizer=None if args.tokenizer == "none" else args.tokenizer, defaults=defaults,
                                logprobs_mode=args.logprobs_mode, model=args.model)
    fields = ", ".join(f"{k}={v}" for k, v in result.fields.items())
    print(f"import: {result.rows} rollouts, {result.tokens} output tokens from {args.file} ({fields}); "
          f"trace: {result.path}\nscore it: workbench check {result.path} --reference MODEL "
          "[--tis-cap C --mis-low LO --mis-high HI]")
    return 0
