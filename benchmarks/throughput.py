"""Output tokens/s of every engine on the same prompts, in alternating rounds: this engine (tracing
off, and at summary), transformers `generate()` (static left-padded batch), transformers
`generate_batch()` (continuous batching), vLLM's CPU build eager and compiled, and llama.cpp; at
batch 1 (requests one after another) and batch 32 (all at once), each with `ignore_eos` and with
stopping at EOS. Beside the results: the batch-1 memory-bandwidth floor and the batched compute
ceiling, measured in the same run (limits.py: before the first round and after each, the best of
each rate kept).

    python benchmarks/throughput.py [--prompts 32] [--new 64] [--repeat 2] [--batch 1 32] [--stop both]
    python benchmarks/throughput.py --peers none      # only this engine and transformers
    python benchmarks/throughput.py --peers none --skip-trace --kernels fast fast-int8   # + the fast modes

vLLM and llama.cpp run in their own environments (peers.py): WORKBENCH_VLLM_PYTHON /
WORKBENCH_LLAMACPP_PYTHON, else `.venv-vllm` / `.venv-llamacpp` at the repository root (make
peers). A peer that fails to start is reported as failed, with the reason. llama.cpp runs the
GGUF file SmolLM2 ships in (Q4_1; the other engines run its float32 dequantization) and, having
no batched multi-sequence API in llama-cpp-python, its requests one after another.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOPICS = ["the ocean", "a city at night", "coffee", "mountains", "a robot learning to paint", "winter",
          "the history of bread", "black holes", "a lighthouse keeper", "jazz", "honeybees", "trains",
          "the moon", "volcanoes", "a library", "origami"]
TASKS = ["Write a short poem about {}.", "Explain {} to a child in a few sentences."]


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": TASKS[i % 2].format(TOPICS[i % len(TOPICS)])}] for i in range(n)]


def bench_engine(loaded, prompts, new: int, trace_level: str = "off", trace_path: str | None = None,
                 cpu_kernels: bool = True, eos: bool = False, **engine_kwargs) -> dict:
    from workbench.engine.engine import Engine
    from workbench.engine.kernels.torch_paths import disabled
    from workbench.engine.sample.sampling_params import SamplingParams

    engine_kwargs.setdefault("kv_tokens", 64 * 1024)  # 0.4 GiB for SmolLM2 instead of 1 GiB: a shared machine
    engine = Engine(loaded, trace=trace_path, trace_level=trace_level, **engine_kwargs)
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=not eos)
    if cpu_kernels:
        result = _bench_engine(engine, prompts, params)
    else:
        with disabled(loaded.model):  # torch's gather + sdpa and F.linear, for comparison
            result = _bench_engine(engine, prompts, params)
    del engine
    gc.collect()  # the engine's KV pool goes before the next runner allocates its own
    return result


def _bench_engine(engine, prompts, params) -> dict:
    # warm-up on the whole batch, as a server has run such batches before: the row counts this run
    # will see get their one-time kernel checks, races and weight packing here, not in the timing
    # (no prefix cache: nothing from it is reused); the token-text table traces and logprobs read
    # filled as `workbench serve` fills it at start (0.3 s; a fresh table decodes each new token once)
    engine.fill_token_text()
    engine.generate(prompts, params.replace(max_new_tokens=2))
    _sync(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync(engine.device)
    secs = time.perf_counter() - t0
    engine.close()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_hf_static(folder, tok, prompts, new: int, device: str, dtype: torch.dtype, eos: bool = False) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=2, do_sample=False)  # warm-up on the whole batch, as the engine
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new, min_new_tokens=1 if eos else new, do_sample=False,
                             pad_token_id=tok.eos_token_id)
        _sync(device)
        secs = time.perf_counter() - t0
    gen = out[:, enc["input_ids"].shape[1]:]
    if eos:  # count each row up to and including its first EOS, as the engine's outputs do
        stops = torch.tensor(_eos_ids(model, tok), device=gen.device)
        hit = torch.isin(gen, stops)
        first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(hit[:, 0], gen.shape[1], dtype=torch.long))
        tokens = int(first.sum())
    else:
        tokens = gen.numel()
    return {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs}


def _eos_ids(model, tok) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return ids or [tok.eos_token_id]


def bench_hf_continuous(folder, tok, prompts, new: int, device: str, dtype: torch.dtype, eos: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="paged|sdpa").to(device).eval()
    ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"] for p in prompts]
    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=tok.eos_token_id,
                           eos_token_id=_eos_ids(model, tok) if eos else -1)
    with torch.inference_mode():
        t0 = time.perf_counter()
        outs = model.generate_batch(inputs=ids, generation_config=cfg, progress_bar=False)
        _sync(device)
        secs = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs}


ENGINE = "engine (trace off)"
PEERS = ("vLLM CPU eager", "vLLM CPU compiled", "llama.cpp")


def local_runs(loaded, prompts, new: int, eos: bool, batch: int, args, tmp: str) -> list[tuple[str, object]]:
    """The in-process runners of one scenario; batch 1 runs the prompts one after another."""
    def each(fn):
        if batch > 1:
            return fn(prompts)
        parts = [fn([p]) for p in prompts]
        tokens, secs = sum(r["tokens"] for r in parts), sum(r["seconds"] for r in parts)
        return {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs}

    dtype = getattr(torch, loaded.dtype)
    runs = [(ENGINE, lambda: each(lambda ps: bench_engine(loaded, ps, new, eos=eos)))]
    if not args.skip_trace:
        path = os.path.join(tmp, "summary.wbtrace")
        runs.append(("engine (trace summary)", lambda: each(lambda ps: bench_engine(loaded, ps, new, "summary", path,
                                                                                   eos=eos))))
    for kernels in getattr(args, "kernels", []):  # the opt-in non-exact numerics modes (run/fastmode.py)
        runs.append((f"engine (kernels {kernels})", lambda k=kernels: each(
            lambda ps: bench_engine(loaded, ps, new, eos=eos, kernels=k))))
    if args.kernels_off:
        runs.append(("engine (no CPU kernels)", lambda: each(lambda ps: bench_engine(loaded, ps, new, eos=eos,
                                                                                    cpu_kernels=False))))
    if not args.skip_hf:
        runs.append(("transformers generate() static batch", lambda: each(
            lambda ps: bench_hf_static(loaded.folder, loaded.tokenizer, ps, new, args.device, dtype, eos))))
        runs.append(("transformers generate_batch() continuous", lambda: each(
            lambda ps: bench_hf_continuous(loaded.folder, loaded.tokenizer, ps, new, args.device, dtype, eos))))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=32, help="prompts of the batched scenarios")
    ap.add_argument("--prompts-b1", type=int, default=4, help="prompts of the batch-1 scenarios (run one by one)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32], choices=[1, 32])
    ap.add_argument("--stop", default="both", choices=["both", "ignore_eos", "eos"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-trace", action="store_true", help="no engine run at trace summary")
    ap.add_argument("--kernels-off", action="store_true", help="also the engine without its CPU kernels")
    ap.add_argument("--kernels", nargs="+", default=[], choices=["fast", "fast-int8"],
                    help="also the engine in these non-exact numerics modes (same rounds)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), help=f"any of {PEERS}, or none")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time the engine's first run too (its kernel checks and races, made once per machine "
                    "and code version, then read from the verdict store); by default one untimed run of each "
                    "scenario comes first, as vLLM warms up at load")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeat", type=int, default=2, help="rounds; each runner runs once per round")
    from benchmarks import limits as limits_mod

    limits_mod.add_isa_argument(ap)
    args = ap.parse_args()
    limits_mod.run_capped(args.isa)
    from tqdm.auto import tqdm

    from benchmarks.peers import make_peers
    from workbench.engine.prompts import tokenize_prompt
    from workbench.models import load_model
    from workbench.server.heap import freeze_startup_heap

    loaded = load_model(args.model, device=args.device, huge_pages=True)
    freeze_startup_heap()  # as `workbench serve` does: see server/heap.py
    vocab = int(loaded.model.config.vocab_size)
    wanted = [p for p in args.peers if p != "none"] if args.device == "cpu" else []
    scenarios = [(b, eos) for b in args.batch for eos in {"both": (False, True), "ignore_eos": (False,),
                                                          "eos": (True,)}[args.stop]]
    limits = limits_mod.measure(loaded.model)
    for line in limits.lines():
        tqdm.write(line)
    prompts_of = {b: chat_prompts(args.prompts if b > 1 else args.prompts_b1) for b in args.batch}
    ids_of = {b: [tokenize_prompt(loaded.tokenizer, vocab, p) for p in ps] for b, ps in prompts_of.items()}
    rounds: dict[tuple, dict[str, list[dict]]] = {}

    def record(scenario: tuple, name: str, r: dict) -> None:
        msg = f"FAILED: {r['error'][:300]}" if "error" in r else \
            f"{r['tok_s']:8.1f} tok/s ({r['tokens']} tokens, {r['seconds']:.1f} s)"
        tqdm.write(f"  batch {scenario[0]:2d}{' eos' if scenario[1] else '    '}  {name:42s} {msg}")
        rounds.setdefault(scenario, {}).setdefault(name, []).append(r)

    with tempfile.TemporaryDirectory() as tmp:
        for batch, eos in scenarios if not args.no_warmup else ():
            tqdm.write(f"warm-up: the engine at batch {batch}, untimed")
            local_runs(loaded, prompts_of[batch], args.new, eos, batch, args, tmp)[0][1]()
            gc.collect()
        for rnd in range(args.repeat):
            tqdm.write(f"round {rnd + 1} of {args.repeat}")
            for batch, eos in scenarios:
                for name, fn in local_runs(loaded, prompts_of[batch], args.new, eos, batch, args, tmp):
                    record((batch, eos), name, fn())
                    gc.collect()
            # One peer process at a time (each holds its model and a 2 GB KV cache), every scenario
            # while it is loaded; its runs fall in the same round as the in-process runners'.
            for peer in make_peers(Path(loaded.folder), wanted, torch.get_num_threads()):
                peer.wait_ready()
                tqdm.write(f"  {peer.name}: " + (f"FAILED to start: {peer.error}" if peer.error
                                                 else f"loaded in {peer.load_s:.0f} s"))
                try:
                    for batch, eos in scenarios:
                        record((batch, eos), peer.name, peer.run(ids_of[batch], args.new, eos, batch))
                finally:
                    peer.close()
            again = limits_mod.measure(loaded.model)  # after each round: the floor is the run's best
            tqdm.write(f"limits after round {rnd + 1}: " + "; ".join(again.lines()[1:]))
            limits = limits_mod.best(limits, again)
    report(args, loaded, limits, rounds)


def report(args, loaded, limits, rounds: dict) -> None:
    from benchmarks import limits as limits_mod

    cpu = cpu_model()
    print(f"\n{args.model} {loaded.dtype} on {cpu} ({cpu_flags()}){limits_mod.isa_label()}, {torch.get_num_threads()} threads, {args.repeat} rounds, "
          f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}")
    print("\n".join(limits.lines()))
    out = {"args": vars(args), "cpu": cpu, "cpu_flags": cpu_flags(), "isa": limits_mod.isa_label(), "limits": {**{k: getattr(limits, k) for k in limits.__slots__},
                                                      "floor_tok_s": limits.floor_tok_s,
                                                      "ceiling_tok_s": limits.ceiling_tok_s,
                                                      "peak_tok_s": limits.peak_tok_s}, "scenarios": []}
    for (batch, eos), by_name in rounds.items():
        n = args.prompts if batch > 1 else args.prompts_b1
        print(f"\nbatch {batch}, {n} chat prompts, greedy, {'up to ' if eos else ''}{args.new} new tokens"
              f"{' (stop at EOS)' if eos else ' (ignore_eos)'}")
        limit, limit_name = (limits.floor_tok_s, "floor") if batch == 1 else (limits.ceiling_tok_s, "ceiling")
        print(f"| run | best tok/s | of the {limit_name} | {ENGINE} / this, same-round median (each round) |")
        print("|---|---:|---:|---:|")
        base = [r.get("tok_s") for r in by_name[ENGINE]]
        scen = {"batch": batch, "eos": eos, "runs": {}}
        for name, rs in by_name.items():
            ok = [r["tok_s"] for r in rs if "error" not in r]
            if not ok:
                print(f"| {name} | FAILED: {rs[-1]['error'][:200]} | | |")
                scen["runs"][name] = {"error": rs[-1]["error"]}
                continue
            ratios = [a / r["tok_s"] for a, r in zip(base, rs, strict=True) if "error" not in r and a]
            med = statistics.median(ratios) if ratios else float("nan")
            print(f"| {name} | {max(ok):.1f} | {max(ok) / limit:.0%} | {med:.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in ratios)}) |")
            scen["runs"][name] = {"tok_s": ok, "tokens": [r["tokens"] for r in rs if "error" not in r],
                                  "ratio_median": med}
        hf = by_name.get("transformers generate() static batch")
        for name, rs in by_name.items():
            if name.startswith("engine (kernels") and hf:
                ratios = [r["tok_s"] / h["tok_s"] for r, h in zip(rs, hf) if "error" not in r and "error" not in h]
                print(f"{name} / transformers generate() static: same-round median {statistics.median(ratios):.2f}x "
                      f"({', '.join(f'{x:.2f}' for x in ratios)})")
            if name.startswith("engine (kernels") and batch == 1:
                print(f"{name} at batch 1: {max(r['tok_s'] for r in rs) / limits.floor_tok_s:.0%} of the float32 "
                      "bandwidth floor (its weights are bf16 / int8: fewer bytes than that floor assumes)")
        if batch == 1:
            best = max(r["tok_s"] for r in by_name[ENGINE] if "error" not in r)
            print(f"engine at batch 1: {best / limits.floor_tok_s:.0%} of the bandwidth floor's "
                  f"{limits.floor_tok_s:.1f} tok/s")
        else:
            best = max(r["tok_s"] for r in by_name[ENGINE] if "error" not in r)
            peak = f"; {best / limits.peak_tok_s:.0%} of the FMA peak's {limits.peak_tok_s:.0f}" if limits.peak_tok_s else ""
            print(f"engine batched: {best / limits.ceiling_tok_s:.0%} of the compute ceiling's "
                  f"{limits.ceiling_tok_s:.0f} tok/s (MKL's 256-row rate){peak}")
        out["scenarios"].append(scen)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


def cpu_flags() -> str:
    """The vector extensions that decide MKL's and the kernels' code paths on this CPU."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "flags unknown"
    have = set(flags.split(":", 1)[1].split())
    shown = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in have]
    return " ".join(shown) or "no AVX2"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
