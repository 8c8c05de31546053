"""Where one decode step's time goes, at batch 1, 8 and 32: the model's GEMMs, attention, the rest
of the model's ops, the sampler, batch building, output processing (detokenizer, finish checks),
tracing, and the Python around them. `--kernels exact fast` profiles both numerics modes, alternating
per batch size in one process (same model, same moment: a same-round comparison); in fast mode the
fused MLP (its SiLU*up included) counts as "gemm". `--forward direct model` does the same for exact
mode's direct forward (run/exact_forward.py) against the model's own forward.

    python benchmarks/step_profile.py [--model smollm2] [--batches 1 8 32] [--steps 24] [--trace off]
        [--threads N] [--clock wall|cpu] [--kernels exact [fast]] [--forward direct model] [--floor]

Each batch size starts that many chat requests (greedy, ignore_eos), runs until every request is
decoding, then times `--steps` decode steps with timers wrapped around the pipeline's functions.
The timers cost about 1 us per call (~250 calls per step). "python" is the step's wall time minus
every timed part: the engine's own loop, bookkeeping and the calls between stages.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARTS = ("layers_c", "gemm", "attention", "model_other", "sampler", "batch_build", "sampling_info", "output", "tracing")


class Timers:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)
        self.clock = clock

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth[name]:  # nested (a timed function calling itself): count once
                return fn(*args, **kwargs)
            self.depth[name] += 1
            t = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += self.clock() - t
                self.depth[name] -= 1
        return timed


@contextlib.contextmanager
def patched(obj: Any, attr: str, new: Any) -> Iterator[None]:
    old = getattr(obj, attr)
    setattr(obj, attr, new)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def instrument(engine, timers: Timers, layers_c: bool = True) -> contextlib.ExitStack:
    """Wrap the pipeline's functions in timers (undone when the returned stack closes). `layers_c`:
    a decode step's layers may run as one C call (kernels/decode_layers.py, timed as "layers_c");
    attention is then not timed on its own (a timer registered in its place is a different function,
    for which the C call steps aside), so on a step the Python path takes it counts as the model's
    other ops. Without it the C call is off and attention is timed."""
    from transformers import AttentionInterface

    import workbench.engine.engine as engine_mod
    from workbench.engine import tracing
    from workbench.engine.kernels import gemm
    from workbench.engine.run import attention

    stack = contextlib.ExitStack()
    stack.enter_context(patched(engine_mod, "build_forward_batch",
                                timers.wrap("batch_build", engine_mod.build_forward_batch)))
    info_cls = engine_mod.SamplingBatchInfo
    stack.enter_context(patched(engine_mod, "SamplingBatchInfo", type("TimedInfo", (), {
        "build": staticmethod(timers.wrap("sampling_info", info_cls.build))})))
    stack.enter_context(patched(engine.runner, "forward", timers.wrap("forward", engine.runner.forward)))
    stack.enter_context(patched(engine, "sampler", timers.wrap("sampler", engine.sampler)))
    stack.enter_context(patched(engine.outputs, "append_tokens", timers.wrap("output", engine.outputs.append_tokens)))
    stack.enter_context(patched(engine.outputs, "process_token", timers.wrap("output", engine.outputs.process_token)))
    stack.enter_context(patched(engine.scheduler, "schedule", timers.wrap("schedule", engine.scheduler.schedule)))
    stack.enter_context(patched(gemm.PackedLinear, "__call__", timers.wrap("gemm", gemm.PackedLinear.__call__)))
    stack.enter_context(patched(gemm.RowdotGroup, "__call__", timers.wrap("gemm", gemm.RowdotGroup.__call__)))
    from workbench.engine.run import fastmode

    for cls in (fastmode.FastLinear, fastmode.FastMLP):  # fast mode's GEMMs (they call PackedLinear when off)
        stack.enter_context(patched(cls, "__call__", timers.wrap("gemm", cls.__call__)))
    from workbench.engine.kernels import decode_layers

    if layers_c:
        run = decode_layers.DecodeLayers.run

        def timed_run(self, *args, **kw):  # a step it declines counts as the model's other ops
            t = timers.clock()
            out = run(self, *args, **kw)
            if out is not None:
                timers.acc["layers_c"] += timers.clock() - t
            return out

        stack.enter_context(patched(decode_layers.DecodeLayers, "run", timed_run))
    else:
        stack.enter_context(patched(decode_layers.DecodeLayers, "run", lambda self, *a, **kw: None))
        timed_attention = timers.wrap("attention", attention.workbench_attention)
        AttentionInterface.register(attention.ATTN_NAME, timed_attention)
        stack.callback(AttentionInterface.register, attention.ATTN_NAME, attention.workbench_attention)
    for name in dir(tracing):
        fn = getattr(tracing, name)
        if callable(fn) and (name.endswith("_event") or name.startswith("emit_")):
            stack.enter_context(patched(tracing, name, timers.wrap("tracing", fn)))
    stack.enter_context(patched(engine.tracer, "emit", timers.wrap("tracing", engine.tracer.emit)))
    obs = engine.observer  # every seam of the trace observer (a no-op while tracing is off)
    for name in ("scheduled", "batch_built", "forward_done", "sampled", "output_processed", "stamped", "finished",
                 "kv", "forked", "evicted"):
        stack.enter_context(patched(obs, name, timers.wrap("tracing", getattr(obs, name))))
    return stack


def decoding_engine(loaded, batch: int, new: int = 100, **engine_kw):
    """An Engine running `batch` greedy chat requests (ignore_eos, `new` tokens), stepped until
    every one of them decodes."""
    from benchmarks.throughput import chat_prompts
    from workbench.engine.engine import Engine
    from workbench.engine.sample.sampling_params import SamplingParams

    # a KV pool sized for the run (a prompt and `new` tokens a request), not the default 1 GiB: the machine is shared
    engine = Engine(loaded, trace=None, max_running=max(batch, 1), kv_tokens=batch * max(600, new + 200), **engine_kw)
    engine.fill_token_text()  # as `workbench serve` does at start: traced steps look texts up, never decode
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    for p in chat_prompts(batch):
        engine.add_request(p, params)
    while len(engine.scheduler.running) < batch or any(r.kv_len < len(r.prompt_ids) for r in engine.scheduler.running):
        engine.step()
    return engine


def profile_batch(loaded, batch: int, steps: int, trace_level: str, new: int = 100,
                  clock: Callable[[], float] = time.perf_counter, kernels: str = "exact",
                  direct: bool = True, layers_c: bool = True) -> dict[str, float]:
    engine = decoding_engine(loaded, batch, new, trace_level=trace_level, kernels=kernels)
    engine.runner.use_direct = direct and engine.runner.use_direct
    for _ in range(3):  # warm: every request decoding, first-use kernel checks done
        engine.step()
    timers = Timers(clock)
    walls = []
    with instrument(engine, timers, layers_c):
        for _ in range(steps):
            t = clock()
            engine.step()
            walls.append(clock() - t)
    kv_tokens = engine.memory.allocator.size - engine.memory.allocator.available_size()
    engine.close()
    del engine
    gc.collect()
    acc = {k: v / steps * 1000 for k, v in timers.acc.items()}  # ms per step
    forward = acc.pop("forward", 0.0)
    acc["model_other"] = forward - acc.get("gemm", 0.0) - acc.get("attention", 0.0) - acc.get("layers_c", 0.0)
    acc["schedule"] = acc.get("schedule", 0.0)
    step = statistics.median(walls) * 1000
    mean = sum(walls) / len(walls) * 1000
    acc["python"] = mean - sum(acc.values())
    acc["step_median"], acc["step_mean"] = step, mean
    acc["kv_tokens"] = kv_tokens
    return acc


def floor_table(model, rows: dict[str, dict[str, float]]) -> list[str]:
    """Each line of a step against what the hardware allows for it (benchmarks/limits.py, measured
    now): the GEMMs can not beat the larger of the weights read at the read bandwidth and their FLOP
    at MKL's 256-row rate; attention can not beat reading the KV cache, the sampler one read of the
    logits; the rest of the step does no arithmetic the model needs to be bounded by, so all of it
    is gap."""
    from benchmarks import limits as limits_mod

    limits = limits_mod.measure(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_dim = cfg.num_key_value_heads * head_dim
    kv_bytes_per_token = cfg.num_hidden_layers * 2 * kv_dim * 4
    bw = limits.read_bandwidth
    out = [*limits.lines(), "", "| line | " + " | ".join(f"batch {b}: ms, floor, gap" for b in rows) + " |",
           "|---|" + "---|" * len(rows)]

    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()

    def floors(name: str, r: dict[str, float]) -> dict[str, float]:
        batch = int(name.split()[0])
        gemm = 1e3 * max(limits.weight_bytes_per_token / bw, batch * limits.flop_per_token / (limits.gemm_gflop_s * 1e9))
        attention = 1e3 * r["kv_tokens"] * kv_bytes_per_token / bw
        if not r.get("layers_c"):
            return {"gemm": gemm, "attention": attention, "sampler": 1e3 * batch * cfg.vocab_size * 4 / bw}
        # the layers' GEMMs and attention inside the one C call; the head's GEMM outside it
        head = gemm * head_bytes / limits.weight_bytes_per_token
        return {"gemm": head, "layers_c": gemm - head + attention, "sampler": 1e3 * batch * cfg.vocab_size * 4 / bw}

    lines = [("the layers in one C call (their GEMMs, attention, norms)", ["layers_c"]),
             ("GEMMs (beside the C call: the head only)", ["gemm"]), ("attention", ["attention"]),
             ("the model's other ops", ["model_other"]),
             ("sampler", ["sampler"]), ("tracing", ["tracing"]),
             ("batch building, output, scheduler, Python", ["batch_build", "sampling_info", "output", "schedule",
                                                            "python"])]
    for label, parts in [*lines, ("step", None)]:
        cells = []
        for name, r in rows.items():
            f = floors(name, r)
            ms = r["step_mean"] if parts is None else sum(r.get(p, 0.0) for p in parts)
            fl = sum(f.values()) if parts is None else sum(f.get(p, 0.0) for p in parts)
            share = f" ({fl / ms:.0%} of floor)" if parts is None and ms else ""
            cells.append(f"{ms:.2f}, {fl:.2f}, **{ms - fl:.2f}**{share}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--trace", default="off", choices=["off", "summary"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="cpu: the main thread's CPU time (time.thread_time), which time spent descheduled on a "
                    "shared machine does not inflate; only meaningful with --threads 1")
    ap.add_argument("--kernels", nargs="+", default=["exact"], choices=["exact", "fast", "fast-int8"],
                    help="numerics modes to profile, alternated per batch size (default: exact)")
    ap.add_argument("--forward", nargs="+", default=["direct"], choices=["direct", "model"],
                    help="exact mode's forward: the direct one where its check passed, or the model's own; "
                    "both: alternated per batch size")
    ap.add_argument("--layers", nargs="+", default=["c"], choices=["c", "python"],
                    help="exact mode's layers at one decode row: one C call where it applies (what the engine "
                    "runs), or the Python path per layer with attention timed; both: alternated per batch size")
    ap.add_argument("--floor", action="store_true",
                    help="also measure this machine's limits and print every line of the step against its floor")
    from benchmarks import limits as limits_mod

    limits_mod.add_isa_argument(ap)
    args = ap.parse_args()
    limits_mod.run_capped(args.isa)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from workbench.models import load_model
    from workbench.server.heap import freeze_startup_heap

    loaded = load_model(args.model, device="cpu", huge_pages=True)
    freeze_startup_heap()  # as `workbench serve` does: see server/heap.py
    cols = [*PARTS, "schedule", "python", "step_mean", "step_median"]
    rows = {}
    for b in args.batches:
        for mode in args.kernels:
            for fwd in args.forward if mode == "exact" else ["direct"]:
                for lay in args.layers if mode == "exact" and fwd == "direct" else ["python"]:
                    print(f"batch {b}: profiling {args.steps} decode steps (trace {args.trace}, kernels {mode}, "
                          f"{fwd} forward, layers {lay})...", file=sys.stderr, flush=True)
                    name = " ".join([str(b)] + [mode] * (len(args.kernels) > 1) + [fwd] * (len(args.forward) > 1)
                                    + [f"layers {lay}"] * (len(args.layers) > 1))
                    rows[name] = profile_batch(loaded, b, args.steps, args.trace, kernels=mode, direct=fwd == "direct",
                                               clock=time.thread_time if args.clock == "cpu" else time.perf_counter,
                                               layers_c=lay == "c")
    load = os.getloadavg()
    print(f"\nms per decode step ({args.clock} clock), {args.model}, trace {args.trace}, {torch.get_num_threads()} "
          f"threads, {platform.processor() or platform.machine()}{limits_mod.isa_label()}, load average {load[0]:.2f} at the end\n")
    print("| part | " + " | ".join(f"batch {b}" for b in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for c in cols:
        print(f"| {c} | " + " | ".join(f"{rows[b].get(c, 0.0):.2f}" for b in rows) + " |")
    if args.floor:
        print("\nAgainst the floor (ms per step: measured, the hardware's floor for it, the gap):\n")
        print("\n".join(floor_table(loaded.model, rows)))


if __name__ == "__main__":
    main()
