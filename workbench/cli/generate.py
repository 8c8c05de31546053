"""The commands that drive this engine directly: `generate`, `demo` and `make-traces`.

Owns: their flags (the engine's and, through sampling_args.py, the sampling parameters'), the status
line shown while a model loads (`loading`), and recording the demo trace (`record_demo`). The engine
itself has no argparse; this module turns flags into `Engine(...)` and `SamplingParams(...)`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Iterator
from pathlib import Path

from workbench.engine.config import KERNELS, EngineArgs

DEFAULTS = EngineArgs()

DEMO_CHATS = [
    [{"role": "user", "content": "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog."}],
    [{"role": "user", "content": "List three fruits, one per line."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model spec: smollm2, tiny-random, a folder, a .gguf file")
    p.add_argument("--device", default=DEFAULTS.device, help="auto, cpu or cuda[:N]")
    p.add_argument("--spec", default=None, help="speculative decoding: ngram[:k=4], draft:MODEL[:k=4], early-exit[:layers=N]")
    p.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size)
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULTS.max_batch_tokens)
    p.add_argument("--trace", default=None, help="record a .wbtrace file")
    p.add_argument("--trace-level", default="summary", choices=["off", "summary", "full"])
    p.add_argument("--kernels", default=DEFAULTS.kernels, choices=KERNELS,
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
        from workbench.models.loader import load_model

        # (argparse's choices refused a bad --kernels before this load.) A one-shot run keeps the
        # weights in their file mapping (load_model's default: the huge-page copy does not pay back)
        loaded = load_model(args.model, device=args.device)
        return Engine(loaded, device=args.device, spec=args.spec, chunk_size=args.chunk_size,
                  max_batch_tokens=args.max_batch_tokens, trace=trace if trace is not None else args.trace,
                  trace_level=args.trace_level if (trace or args.trace) else "off",
                  kernels=getattr(args, "kernels", "exact"))


def add_generate_args(p: argparse.ArgumentParser) -> None:
    from workbench.cli.sampling_args import add_sampling_args

    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    add_engine_args(p)
    add_sampling_args(p)


def run_generate(args: argparse.Namespace) -> int:
    from workbench.models.loader import gc_paused

    with gc_paused():  # from torch's import on (sampling_params imports it) to the loaded model
        from workbench.cli.sampling_args import params_from_args

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


def run_demo(args: argparse.Namespace) -> int:
    path = record_demo(args.out, args.model, args.spec)
    print(f"trace written to {path}")
    if args.no_tui or not sys.stdout.isatty():
        print(f"open it with: workbench tui {path}")
        return 0
    import tui

    return tui.run(path) or 0

def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo.wbtrace")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--spec", default="ngram:k=4")
    p.add_argument("--no-tui", action="store_true")


def add_make_traces_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", default="traces")
    p.add_argument("--model", default="smollm2")


def run_make_traces(args: argparse.Namespace) -> int:
    from workbench.cli.example_traces import make_example_traces

    for path in make_example_traces(Path(args.folder), model=args.model):
        print(path)
    return 0
