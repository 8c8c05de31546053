"""The `workbench` command: generate, demo, tui, serve, client, probe, check, replay, diff, fork,
invariance, export, bench, make-traces.

Owns: argument parsing and wiring subcommands to library calls (the ones that re-run or compare
runs live in cli_runs.py). Heavy imports (torch, the engine,
textual, fastapi) happen inside each subcommand so `workbench --help` and the viewers start fast.
User errors (bad values, unreadable traces) print one line and exit 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from workbench.cli_runs import RUN_PARSERS, _add
from workbench.engine.config import KERNELS

DEMO_CHATS = [
    [{"role": "user", "content": "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."}],
    [{"role": "user", "content": "List three fruits, one per line."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
]


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model spec: smollm2, tiny-random, a folder, a .gguf file")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--spec", default=None, help="speculative decoding: ngram[:k=4], draft:MODEL[:k=4], early-exit[:layers=N]")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--trace", default=None, help="record a .wbtrace file")
    p.add_argument("--trace-level", default="summary", choices=["off", "summary", "full"])
    p.add_argument("--kernels", default="exact", choices=KERNELS,
                   help="numerics: exact (default, transformers' numbers), fast (bf16 GEMMs, fused MLP and norm) "
                        "or fast-int8 (int8 weights); the fast ones are faster on CPU and their output can differ")


@contextlib.contextmanager
def loading(what: str) -> Iterator[None]:
    """A status line on stderr while something loads: `loading smollm2 … 12 s`, ticking on a terminal."""
    import threading
    import time

    start, done = time.monotonic(), threading.Event()
    tty = sys.stderr.isatty()
    print(f"loading {what} …", end="" if tty else "\n", file=sys.stderr, flush=True)

    def tick() -> None:
        while not done.wait(1.0):
            print(f"\rloading {what} … {time.monotonic() - start:.0f} s", end="", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, daemon=True) if tty else None
    if ticker is not None:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        print(f"{chr(13) if tty else ''}loaded {what} in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def _make_engine(args: argparse.Namespace, trace: str | None = None):
    from workbench.models.loader import gc_paused

    with loading(args.model), gc_paused():  # torch's and the engine's imports too (loader.gc_paused)
        from workbench.engine.engine import Engine

        return Engine(args.model, device=args.device, spec=args.spec, chunk_size=args.chunk_size,
                  max_batch_tokens=args.max_batch_tokens, trace=trace if trace is not None else args.trace,
                  trace_level=args.trace_level if (trace or args.trace) else "off",
                  kernels=getattr(args, "kernels", "exact"))


def cmd_generate(args: argparse.Namespace) -> int:
    from workbench.models.loader import gc_paused

    with gc_paused():  # from torch's import on (sampling_params imports it) to the loaded model
        from workbench.engine.sample.sampling_params import params_from_args

        params = params_from_args(args)  # a bad flag fails here, before the model loads
        params._validate_grammar()
        engine = _make_engine(args)
        # This process's start-up heap (torch, transformers, the model: about 400,000 objects) stays
        # for good: frozen before the collector is back (what vLLM does after start-up), so its first
        # collection does not traverse it all (0.2-0.3 s) before the first token. Unfrozen at the
        # end, so the exit collects as usual (triton's bindings complain of leaks otherwise).
        gc.freeze()
    if engine.config.kernels != "exact":
        print(f"kernels={engine.config.kernels}: not transformers' numbers; the output can differ from the default "
              "(exact) mode", file=sys.stderr)
    try:
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        final = None
        for out in engine.stream(prompt, params):
            sys.stdout.write(out.delta)
            sys.stdout.flush()
            final = out.output
        engine.close()
    finally:
        gc.unfreeze()
    if final is not None:
        print(f"\n[{final.finish_reason}] {final.usage['completion_tokens']} tokens", file=sys.stderr)
    return 0


def record_demo(path: str, model: str = "smollm2", spec: str | None = "ngram:k=4") -> str:
    """Record the demo trace: concurrent chats, a stop string and speculative decoding."""
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    Path(path).unlink(missing_ok=True)
    with loading(f"{model} (the first run converts its GGUF file once)"):
        engine = Engine(model, trace=path, trace_level="summary", spec=spec)
    with engine:
        params = [SamplingParams(temperature=0, max_new_tokens=48),
                  SamplingParams(temperature=0, max_new_tokens=48, stop=["\n3"]),
                  SamplingParams(temperature=0.8, seed=7, max_new_tokens=40),
                  SamplingParams(temperature=0, max_new_tokens=40, top_logprobs=5, logprobs=True)]
        outs = engine.generate(DEMO_CHATS, params, progress=True)
    for o in outs:
        print(f"[{o.req_id}] {o.finish_reason:>6}  {o.text[:70]!r}")
    return path


def cmd_demo(args: argparse.Namespace) -> int:
    path = record_demo(args.out, args.model, args.spec)
    print(f"trace written to {path}")
    if args.no_tui or not sys.stdout.isatty():
        print(f"open it with: workbench tui {path}")
        return 0
    import tui

    return tui.run(path) or 0


def cmd_tui(args: argparse.Namespace) -> int:
    import tui

    return tui.main(args.rest) or 0


def cmd_probe(args: argparse.Namespace) -> int:
    from workbench.external.cli_args import run_probe

    return run_probe(args)


def cmd_check(args: argparse.Namespace) -> int:
    from workbench.external.cli_args import run_check

    return run_check(args)


def cmd_export(args: argparse.Namespace) -> int:
    from workbench.trace.export import export_perfetto, export_tokens
    from workbench.trace.reader import open_trace

    if not args.perfetto and not args.tokens:
        raise ValueError("export: give --perfetto OUT.json and/or --tokens OUT.parquet|csv")
    with open_trace(args.trace) as trace:
        if args.perfetto:
            export_perfetto(trace, args.perfetto)
            print(f"perfetto trace: {args.perfetto}")
        if args.tokens:
            export_tokens(trace, args.tokens)
            print(f"token table: {args.tokens}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from workbench.server.cli_args import run_serve

    return run_serve(args) or 0


def cmd_client(args: argparse.Namespace) -> int:
    from workbench.client import run_client

    return run_client(args)


def cmd_bench(args: argparse.Namespace) -> int:
    import runpy

    script = Path(__file__).resolve().parent.parent / "benchmarks" / f"{args.name}.py"
    if not script.exists():
        raise ValueError(f"bench: no benchmark named {args.name!r} in benchmarks/")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_make_traces(args: argparse.Namespace) -> int:
    from workbench.examples import make_example_traces

    for path in make_example_traces(Path(args.folder), model=args.model):
        print(path)
    return 0


def _bench_names() -> list[str]:
    """The benchmarks in benchmarks/ (a source checkout); empty when the folder is not there."""
    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))


# One function per subcommand's parser: adding a subcommand is adding a function to SUBCOMMANDS.


def _p_generate(sub) -> None:
    from workbench.engine.sample.sampling_params import add_sampling_args

    p = _add(sub, "generate", "stream a completion to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    _engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def _p_demo(sub) -> None:
    p = _add(sub, "demo", "record a demo trace on the default model, then open the TUI")
    p.add_argument("--out", default="demo.wbtrace")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--spec", default="ngram:k=4")
    p.add_argument("--no-tui", action="store_true")
    p.set_defaults(func=cmd_demo)


def _p_tui(sub) -> None:
    p = _add(sub, "tui", "step through a trace, or follow a live server (FILE | --live URL; "
             "--step N --request ID --screenshot OUT.svg ...)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_tui)


def _p_serve(sub) -> None:
    from workbench.server.cli_args import add_serve_args

    p = _add(sub, "serve", "OpenAI-compatible server with a live trace stream")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


def _p_client(sub) -> None:
    from workbench.client import add_client_args

    p = _add(sub, "client", "concurrent streaming requests: client vs server TTFT and inter-token latency")
    add_client_args(p)
    p.set_defaults(func=cmd_client)


def _p_probe(sub) -> None:
    from workbench.external.cli_args import add_probe_args

    p = _add(sub, "probe", "record any OpenAI-compatible server (vLLM, llama.cpp, SGLang) into a trace")
    add_probe_args(p)
    p.set_defaults(func=cmd_probe)


def _p_check(sub) -> None:
    from workbench.external.cli_args import add_check_args

    p = _add(sub, "check", "score a trace token by token against the reference model (teacher forcing)")
    add_check_args(p)
    p.set_defaults(func=cmd_check)


def _p_export(sub) -> None:
    p = _add(sub, "export", "export a trace to Perfetto JSON or a per-token table")
    p.add_argument("trace")
    p.add_argument("--perfetto", metavar="OUT.json")
    p.add_argument("--tokens", metavar="OUT.parquet|csv")
    p.set_defaults(func=cmd_export)


def _p_bench(sub) -> None:
    names = _bench_names()
    p = _add(sub, "bench", "run a benchmark from benchmarks/ (" + (", ".join(names) or "none found") + ")")
    p.add_argument("name", choices=names or None, metavar="NAME",
                   help="one of: " + (", ".join(names) or "(no benchmarks/ folder)"))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (NAME --help)")
    p.set_defaults(func=cmd_bench)


def _p_make_traces(sub) -> None:
    p = _add(sub, "make-traces", "regenerate the example traces in traces/")
    p.add_argument("folder", nargs="?", default="traces")
    p.add_argument("--model", default="smollm2")
    p.set_defaults(func=cmd_make_traces)


SUBCOMMANDS = [_p_generate, _p_demo, _p_tui, _p_serve, _p_client, _p_probe, _p_check, *RUN_PARSERS, _p_export,
               _p_bench, _p_make_traces]


def build_parser() -> argparse.ArgumentParser:
    from workbench import __version__

    parser = argparse.ArgumentParser(prog="workbench", description="See inside an LLM inference engine.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse; an unknown flag after a subcommand is reported with that subcommand's usage."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tui"]:  # the TUI parses its own options (tui.main), --help included
        import tui

        return int(tui.main(argv[1:]) or 0)
    parser = build_parser()
    args = _parse(parser, argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"workbench {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
