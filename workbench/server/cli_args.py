"""`workbench serve`: its command-line arguments and running the app under uvicorn.

Owns: `add_serve_args(parser)` (importable without FastAPI, so `workbench --help` stays fast),
`run_serve(args)` (builds the engine with the live-event hub and, with `--trace-dir`, a trace file
per run as its only trace sinks, so nothing accumulates in memory; serves it with uvicorn; on
SIGINT/SIGTERM drains: drain.py), and `serve_main(argv)`.
Does not own: the app (app.py).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.clients.loopback import is_loopback
from workbench.engine.config import KERNELS

log = logging.getLogger("workbench.server")
SWITCH_INTERVAL = 0.001  # seconds a thread may hold the GIL while another waits (Python's default: 0.005)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="model spec (smollm2, tiny-random, folder, .gguf)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--trace-dir", default=None, help="write one .wbtrace per run here (downloadable)")
    parser.add_argument("--trace-level", default="summary", choices=("off", "summary", "full"))
    parser.add_argument("--api-key", default=os.environ.get("WORKBENCH_API_KEY"),
                        help="require this key on every route but /health (default: $WORKBENCH_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prefix-sharing", action=argparse.BooleanOptionalAction, default=True,
                        help="a request whose prompt starts like one still prefilling copies that KV (default: on)")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20)
    parser.add_argument("--default-max-tokens", type=int, default=1024, help="chat max_tokens when not given")
    parser.add_argument("--graceful-timeout", type=float, default=10.0,
                        help="seconds running requests get to finish on shutdown")
    parser.add_argument("--stream-buffer-bytes", type=int, default=4 << 20,
                        help="unsent output one streaming request may hold for a slow client before it is aborted")
    parser.add_argument("--send-timeout", type=float, default=60.0,
                        help="seconds one blocked write may take before the request is aborted (0: no limit)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_hardening_args(parser)
    add_engine_flags(parser)


def add_hardening_args(parser: argparse.ArgumentParser) -> None:
    """Limits one client cannot get past (issue 19): admission, hosts, headers."""
    parser.add_argument("--max-prompts-per-request", type=int, default=2048,
                        help="prompts one /v1/completions request may carry (0: no limit)")
    parser.add_argument("--max-request-tokens", type=int, default=1 << 20,
                        help="tokens one request may ask for, prompts x n x max_tokens (0: no limit)")
    parser.add_argument("--max-running-per-request", type=int, default=0,
                        help="unfinished requests (prompts x n) one HTTP request may hold in the engine at once, so "
                             "others are not held behind it (0: a quarter of --max-running)")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host names the server answers (default: loopback names, plus "
                             "--host when it is not a wildcard; '*' allows any, as behind a proxy)")
    parser.add_argument("--max-debug-subscribers", type=int, default=32,
                        help="/debug/events streams at once (each costs the server its sends; 503 past it)")
    parser.add_argument("--max-request-headers", type=int, default=100,
                        help="request headers one request may carry (uvicorn's h11 limit is per line)")
    add_grammar_args(parser)


def add_grammar_args(parser: argparse.ArgumentParser) -> None:
    """Limits and budgets of structured output (issue 36; engine/sample/grammar_limits.py, docs/limits.md)."""
    from workbench.engine.sample.grammar_limits import GrammarLimits

    d = GrammarLimits()
    g = parser.add_argument_group("structured output limits (response_format, regex, ebnf, forced tool calls)")
    g.add_argument("--grammar-max-bytes", type=int, default=d.max_bytes, metavar="CHARS",
                   help=f"size of one constraint's source, a schema as JSON (default: {d.max_bytes})")
    g.add_argument("--grammar-max-depth", type=int, default=d.max_depth, metavar="N",
                   help=f"nested JSON objects and arrays in a schema (default: {d.max_depth})")
    g.add_argument("--grammar-max-nodes", type=int, default=d.max_nodes, metavar="N",
                   help=f"JSON values in a schema (default: {d.max_nodes})")
    g.add_argument("--grammar-max-properties", type=int, default=d.max_properties, metavar="N",
                   help=f"object properties in a schema, all objects together (default: {d.max_properties})")
    g.add_argument("--grammar-max-repeat", type=int, default=d.max_repeat, metavar="N",
                   help=f"largest {{m,n}} bound in a pattern, and minLength/maxLength/minItems/maxItems "
                        f"(default: {d.max_repeat})")
    g.add_argument("--grammar-compile-timeout", type=float, default=d.compile_timeout, metavar="SECONDS",
                   help=f"time one compile may take in the grammar worker process (default: {d.compile_timeout:g})")
    g.add_argument("--grammar-compile-memory-mb", type=int, default=d.compile_memory_mb, metavar="MB",
                   help=f"memory one compile may add in the worker (default: {d.compile_memory_mb})")
    g.add_argument("--grammar-workers", type=int, default=d.workers, metavar="N",
                   help=f"grammar worker processes compiling at once (default: {d.workers})")
    g.add_argument("--grammar-cache-mb", type=int, default=d.cache_mb, metavar="MB",
                   help=f"compiled grammars kept in the server (default: {d.cache_mb})")
    g.add_argument("--grammar-prestart", action=argparse.BooleanOptionalAction, default=True,
                   help="start the grammar worker and import xgrammar when the server starts, so the first "
                        "constrained request does not wait seconds for it (default: on)")


def grammar_limits(args: argparse.Namespace) -> Any:
    """The GrammarLimits the flags ask for; ValueError naming the flag, before any load."""
    from workbench.engine.sample.grammar_limits import FLAGS, GrammarLimits

    d = GrammarLimits()
    values = {name: getattr(args, "grammar_" + name, getattr(d, name)) for name in FLAGS}
    try:
        return GrammarLimits(**values)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise ValueError(f"{FLAGS.get(name, name)}: {exc}") from None


# --- engine flags, named as vLLM names them (SGLang's names as aliases where they differ) ------------

DTYPES = {"auto": None, "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}


def _spec_json(text: str) -> dict[str, Any]:
    """`--speculative-config` as vLLM takes it: a JSON object (method, num_speculative_tokens, model, ...)."""
    import json

    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(cfg).__name__}")
    return cfg


def spec_from_vllm(cfg: dict[str, Any]) -> dict[str, Any]:
    """vLLM's speculative config dict as this engine's `spec=` dict (`model` without a method: a draft)."""
    cfg = dict(cfg)
    if "model" in cfg:
        cfg["draft_model"] = cfg.pop("model")
        cfg.setdefault("method", "draft")
    if cfg.get("method") in ("draft_model", "draft-model"):
        cfg["method"] = "draft"
    return cfg


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (vLLM names; SGLang names as aliases)")
    g.add_argument("--max-num-seqs", "--max-running-requests", "--max-running", dest="max_running", type=int,
                   default=64, metavar="N", help="requests decoding at once (default: 64)")
    g.add_argument("--max-model-len", "--context-length", dest="max_model_len", type=int, default=None,
                   metavar="TOKENS", help="longest prompt + output a request may have (default: the model's)")
    g.add_argument("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_batch_tokens", type=int,
                   default=2048, metavar="TOKENS", help="tokens one step may compute (default: 2048)")
    g.add_argument("--chunked-prefill-size", dest="chunk_size", type=int, default=512, metavar="TOKENS",
                   help="a long prompt is prefilled in chunks of this many tokens (default: 512)")
    g.add_argument("--kv-tokens", "--max-total-tokens", dest="kv_tokens", type=int, default=None,
                   metavar="TOKENS", help="KV pool size in tokens (default: up to 1 GiB)")
    g.add_argument("--enable-prefix-caching", "--prefix-cache", dest="prefix_cache",
                   action=argparse.BooleanOptionalAction, default=False,
                   help="keep finished requests' KV; a later prompt starting the same way (a chat's next turn) "
                        "copies it instead of recomputing; evicted when memory is needed (default: off)")
    g.add_argument("--speculative-config", dest="speculative_config", type=_spec_json, default=None,
                   metavar="JSON", help='speculative decoding, as vLLM: \'{"method": "ngram", '
                   '"num_speculative_tokens": 4}\', \'{"model": "tiny-random", "num_speculative_tokens": 3}\' '
                   "or method early-exit with exit_layer")
    g.add_argument("--spec", default=None, help="speculative decoding, workbench form: ngram:k=4, draft:MODEL:k=4")
    g.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                   help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--kernels", default="exact", choices=KERNELS,
                   help="numerics: exact (default: transformers' numbers), fast (bf16 GEMMs, fused MLP and norm) or "
                        "fast-int8 (int8 weights); CPU float32 only; the fast ones' output can differ")
    g.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own (default: 0)")
    o = parser.add_argument_group("tool calls (vLLM names)")
    o.add_argument("--tool-call-parser", default="hermes", choices=("hermes", "llama3_json", "mistral", "pythonic"),
                   help="the format the model writes tool calls in (default: hermes, SmolLM2's)")
    o.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice 'auto' is always on")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine keyword arguments the engine flags ask for; ValueError naming the flag, before any load."""
    from workbench.engine.speculative.config import parse_spec

    def get(name: str, default: Any) -> Any:
        return getattr(args, name, default)

    for flag, name, lo in (("--max-num-seqs", "max_running", 1), ("--max-model-len", "max_model_len", 1),
                           ("--max-num-batched-tokens", "max_batch_tokens", 1),
                           ("--chunked-prefill-size", "chunk_size", 1), ("--kv-tokens", "kv_tokens", 2)):
        value = get(name, None)
        if value is not None and value < lo:
            raise ValueError(f"{flag} must be an integer >= {lo}, got {value}")
    spec_cfg, spec = get("speculative_config", None), get("spec", None)
    if spec_cfg is not None and spec is not None:
        raise ValueError("--speculative-config and --spec are two forms of one setting; give one")
    spec = spec_from_vllm(spec_cfg) if spec_cfg is not None else spec
    if spec is not None:
        try:
            spec = parse_spec(spec)
        except ValueError as exc:
            raise ValueError(f"--speculative-config: {exc}") from None
    kernels = get("kernels", "exact")
    if kernels != "exact" and DTYPES.get(get("dtype", "auto")) not in (None, "float32"):
        raise ValueError(f"--kernels {kernels} replaces a float32 model's GEMMs; it cannot run with --dtype "
                         f"{get('dtype', 'auto')} (use --dtype float32 or auto)")
    kw = {"max_running": get("max_running", 64), "kv_tokens": get("kv_tokens", None),
          "max_batch_tokens": get("max_batch_tokens", 2048), "chunk_size": get("chunk_size", 512),
          "prefix_cache": get("prefix_cache", False), "spec": spec, "dtype": DTYPES[get("dtype", "auto")],
          "seed": get("seed", 0), "kernels": kernels, "grammar_limits": grammar_limits(args)}
    if get("max_model_len", None) is not None:
        kw["max_model_len"] = args.max_model_len
    return kw



def build_server(args: argparse.Namespace) -> tuple[Any, Any]:
    """(engine, app) as `run_serve` builds them; tests and benchmarks reuse it."""
    from workbench.engine.engine import Engine
    from workbench.server.app import create_app
    from workbench.server.event_hub import EventHub
    from workbench.server.output_buffer import StreamLimits

    # a bad flag is refused, naming it and its allowed range, before the model loads
    try:
        limits = StreamLimits(max_buffer_bytes=getattr(args, "stream_buffer_bytes", 4 << 20),
                              send_timeout=getattr(args, "send_timeout", 60.0) or None)
    except ValueError as exc:
        flag = "--stream-buffer-bytes" if "max_buffer_bytes" in str(exc) else "--send-timeout"
        raise ValueError(f"{flag}: {exc}") from None
    admission = hardening_options(args)
    engine_kw = engine_kwargs(args)
    subscribers = getattr(args, "max_debug_subscribers", 32)
    if isinstance(subscribers, bool) or not isinstance(subscribers, int) or subscribers < 1:
        raise ValueError(f"--max-debug-subscribers: must be an integer >= 1, got {subscribers!r}")
    hub = EventHub(max_subscribers=subscribers)
    sinks: list[Any] = [hub]
    writer, trace_dir = None, None
    if args.trace_dir and args.trace_level != "off":
        from workbench.trace.store import TraceWriter

        trace_dir = Path(args.trace_dir)
        trace_dir.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        writer = TraceWriter(trace_dir / f"serve-{stamp}-{os.getpid()}.wbtrace")
        sinks.append(writer)
    # a server decodes for hours: its weights in 2 MB pages take 4-6% off every batch-1 step, which
    # wins back the copy's 1-9 s at load (load_model) within minutes of traffic
    engine = Engine(args.model, device=args.device, trace_level=args.trace_level, trace_sinks=sinks,
                    prefix_sharing=getattr(args, "prefix_sharing", True), huge_pages=True, **engine_kw)
    app = create_app(engine, model_name=args.served_model_name or args.model, hub=hub, trace_dir=trace_dir,
                     trace_writer=writer, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     default_max_tokens=args.default_max_tokens, close_engine=True, stream_limits=limits,
                     admission=admission.limits, allowed_hosts=admission.hosts,
                     max_headers=admission.max_headers, grammar_prestart=getattr(args, "grammar_prestart", True))
    app.state.workbench.extra["tool_call_parser"] = getattr(args, "tool_call_parser", "hermes")
    return engine, app


@dataclass(frozen=True, slots=True)
class HardeningOptions:
    """The issue-19 flags, checked before the model loads."""

    limits: Any  # AdmissionLimits
    hosts: list[str]  # "*" among them: any host
    max_headers: int


def allowed_hosts(value: str | None, bind: str) -> list[str]:
    """The Host names to answer: `--allowed-hosts` (added to the loopback names), or the loopback
    names and a specific --host."""
    names = ["localhost", "127.0.0.1", "[::1]"]
    if value is not None:
        return names + [h.strip().lower() for h in value.split(",") if h.strip()]
    if bind not in ("0.0.0.0", "::", "") and bind.lower() not in names:
        names.append(bind.lower())
    return names


def hardening_options(args: argparse.Namespace) -> HardeningOptions:
    from workbench.server.admission import AdmissionLimits

    prompts = getattr(args, "max_prompts_per_request", 2048)
    tokens = getattr(args, "max_request_tokens", 1 << 20)
    share = getattr(args, "max_running_per_request", 0)
    try:
        limits = AdmissionLimits(max_prompts=prompts, max_tokens=tokens, max_running=share)
    except ValueError as exc:
        flags = {"max_prompts": "--max-prompts-per-request", "max_tokens": "--max-request-tokens",
                 "max_running": "--max-running-per-request"}
        raise ValueError(f"{flags[str(exc).split(' ', 1)[0]]}: {exc}") from None
    headers = getattr(args, "max_request_headers", 100)
    if isinstance(headers, bool) or not isinstance(headers, int) or headers < 1:
        raise ValueError(f"--max-request-headers: must be an integer >= 1, got {headers!r}")
    return HardeningOptions(limits, allowed_hosts(getattr(args, "allowed_hosts", None), getattr(args, "host", "")),
                            headers)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from workbench.server.drain import FLUSH_WAIT, DrainingServer
    from workbench.server.guard import redact_access_log
    from workbench.server.heap import freeze_startup_heap, pin_mmap_threshold

    if not is_loopback(args.host) and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use the engine",
                    args.host)
    pin_mmap_threshold()  # before the model and the threads: see server/heap.py
    try:
        engine, app = build_server(args)
    except ValueError as exc:
        print(f"workbench serve: error: {exc}", file=sys.stderr)
        return 2
    state = app.state.workbench
    started = time.perf_counter()
    n = engine.fill_token_text()  # before the freeze: the table lives as long as the process
    log.info("decoded the vocabulary's %d tokens for traces and logprobs in %.1f s", n, time.perf_counter() - started)
    # Everything loaded so far (model, tokenizer, app) lives as long as the process: freeze it so that
    # the collector never rescans it, and a full collection cannot pause a stream (as vLLM does)
    freeze_startup_heap()
    # The engine thread holds the GIL through its Python work; at the default 5 ms switch interval
    # the event loop waits up to that long at every hand-off, which adds up to steps of delay for
    # a request that arrives while a big one runs. 1 ms keeps the event loop responsive.
    sys.setswitchinterval(SWITCH_INTERVAL)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=FLUSH_WAIT + 1.0)  # the drain itself is DrainingServer's
    redact_access_log()  # after uvicorn configured its loggers
    try:
        # on SIGTERM uvicorn re-raises the signal after shutdown: the app's lifespan closes the
        # engine (and its trace) before that
        DrainingServer(config, state, args.graceful_timeout).run()
    finally:
        engine.close()
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench serve", description="OpenAI-compatible server")
    add_serve_args(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(serve_main())
