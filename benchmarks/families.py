"""Throughput of every tiny model family side by side: do the windowed, soft-capped and sink paths
cost anything unexpected?

Each family's `tiny-random:<family>` model (models/tiny.py: same sizes, 2-3 layers, 32-token
windows where the family has them) runs the same batch: 16 prompts of 40 to 300 tokens submitted
together, greedy, `--new` tokens each with ignore_eos, trace off. Families run round-robin
`--repeat` times (this machine's speed drifts between rounds); the table gives the best output
tok/s and each family's ratio to llama in the same round (median over rounds). Also printed: the
attention each family's layers run and which decode path (C kernel or torch) serves them.

    python benchmarks/families.py [--families llama mistral gemma2 ...] [--new 64] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers.prompts import LONG_TEXT  # noqa: E402
from workbench.engine.engine import Engine  # noqa: E402
from workbench.engine.kernels import native  # noqa: E402
from workbench.engine.sample.sampling_params import SamplingParams  # noqa: E402
from workbench.models import load_model, tiny  # noqa: E402

LENGTHS = [40 + (260 * i) // 15 for i in range(16)]  # 40..300 tokens


def _label(v: dict) -> str:
    parts = [f"window {v['window']}" if v["window"] else "full"]
    parts += [f"softcap {v['softcap']:g}"] if v["softcap"] is not None else []
    parts += ["sinks"] if v["sinks"] else []
    return " · ".join(parts)


def run_once(loaded, prompts: list[list[int]], new: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    with Engine(loaded, trace_level="off") as engine:
        engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2))  # warm-up
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t
    return seconds, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=sorted(tiny.FAMILIES), choices=sorted(tiny.FAMILIES))
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args()
    fams = ["llama"] + [f for f in ns.families if f != "llama"]
    models, layouts = {}, {}
    for fam in fams:
        print(f"loading tiny-random:{fam}", file=sys.stderr, flush=True)
        models[fam] = load_model(f"tiny-random:{fam}", device="cpu")
        with Engine(models[fam], trace_level="off") as engine:
            variants = engine.runner.attention_variants
        layouts[fam] = ("; ".join(f"L{v['layer']} {_label(v)}" for v in variants),
                        "C kernel" if native.available() else "torch")
    text = models["llama"].tokenizer(LONG_TEXT * 8, add_special_tokens=False)["input_ids"]
    prompts = [text[i:i + n] for i, n in enumerate(LENGTHS)]
    rounds: dict[str, list[tuple[float, int]]] = {f: [] for f in fams}
    for r in range(ns.repeat):
        for fam in fams:
            seconds, tokens = run_once(models[fam], prompts, ns.new)
            rounds[fam].append((seconds, tokens))
            print(f"round {r + 1}/{ns.repeat} {fam:8s} {tokens / seconds:8.1f} tok/s", file=sys.stderr, flush=True)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"\n{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"load average {' '.join(load)}; batch 16 (40-300-token prompts), {ns.new} new tokens, "
          f"{ns.repeat} rounds\n")
    print("| family | layers (attention) | decode path | best tok/s | / llama, same-round median |")
    print("|---|---|---|---:|---:|")
    result = {}
    for fam in fams:
        tps = [tok / s for s, tok in rounds[fam]]
        ratio = statistics.median(t / (tok / s) for t, (s, tok) in zip(tps, rounds["llama"], strict=True))
        result[fam] = {"best_tok_s": max(tps), "per_round": tps, "vs_llama": ratio, "layers": layouts[fam][0],
                       "decode_path": layouts[fam][1]}
        print(f"| {fam} | {layouts[fam][0]} | {layouts[fam][1]} | {max(tps):.1f} | {ratio:.2f}x |")
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
