"""Start-up times a user waits for, each in a fresh process (Python start-up included).

- `workbench --help` and every subcommand's `--help` (the slowest is reported);
- `Engine("smollm2")`: cold (an empty model cache: the GGUF is dequantized and cached) and warm (the
  cache filled), split into importing the engine and loading the model;
- first token of `workbench generate "The capital of France is"` (warm cache): from starting the
  command until its first byte of output reaches the terminal (a pipe here).

Usage: python benchmarks/startup.py [--repeats 3] [--no-cold] [--json OUT] [--root CHECKOUT]
(`--root` measures another checkout, e.g. the main branch, for a before/after under the same load).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKBENCH = [sys.executable, "-m", "workbench.cli"]
LOAD = ("import time; t0 = time.perf_counter()\n"
        "from workbench.engine.engine import Engine\n"
        "t1 = time.perf_counter(); e = Engine('smollm2'); t2 = time.perf_counter()\n"
        "print(f'{t1 - t0:.3f} {t2 - t1:.3f}')\n")


def _env(**extra: str) -> dict[str, str]:
    # with cwd=ROOT too: `python -c` and `python -m` put the working directory first on sys.path,
    # ahead of PYTHONPATH, so run from another checkout they would import that one's workbench
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def help_times(repeats: int) -> dict[str, float]:
    """Median wall seconds of `workbench [SUB] --help` per subcommand."""
    from workbench.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    subs = [""] + list(sub.choices)  # the names a user types (not the parser functions' names)
    out = {}
    for sub in subs:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            subprocess.run([*WORKBENCH, *([sub] if sub else []), "--help"], env=_env(), check=True,
                           stdout=subprocess.DEVNULL, timeout=60, cwd=ROOT)
            runs.append(time.perf_counter() - t0)
        out[sub or "(top level)"] = statistics.median(runs)
    return out


def _child_cpu() -> float:
    """CPU seconds (user + system) used so far by finished child processes."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def engine_load(cache: str | None) -> dict[str, float]:
    """One fresh process: wall seconds, its CPU seconds (less sensitive to other load on the machine
    than wall time), and the import / load split it prints."""
    env = _env(**({"WORKBENCH_CACHE": cache} if cache else {}))
    t0, c0 = time.perf_counter(), _child_cpu()
    done = subprocess.run([sys.executable, "-c", LOAD], env=env, check=True, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    wall = time.perf_counter() - t0
    imp, load = (float(x) for x in done.stdout.split()[-2:])
    return {"wall_s": wall, "cpu_s": _child_cpu() - c0, "import_s": imp, "load_s": load}


def first_token() -> dict[str, float]:
    """Seconds from starting `workbench generate` until its first output byte, and until it exits."""
    t0, c0 = time.perf_counter(), _child_cpu()
    proc = subprocess.Popen([*WORKBENCH, "generate", "The capital of France is", "--temperature", "0",
                             "--max-new-tokens", "8"], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.stdout.read()
    proc.wait(timeout=600)
    return {"first_token_s": first, "exit_s": time.perf_counter() - t0, "cpu_s": _child_cpu() - c0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache load (about 20 s or more)")
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--root", default=None, metavar="CHECKOUT", help="the checkout to measure (default: this one)")
    args = ap.parse_args()
    global ROOT
    ROOT = Path(args.root).resolve() if args.root else ROOT
    res: dict[str, object] = {"load_average_before": os.getloadavg()}
    print("load average before the run: " + " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    print(f"--help (median of {args.repeats}, s):", flush=True)
    res["help"] = helps = help_times(args.repeats)
    for k, v in helps.items():
        print(f"  {k:<14} {v:.3f}")
    print(f"  slowest: {max(helps, key=helps.get)} {max(helps.values()):.3f}", flush=True)
    if not args.no_cold:
        with tempfile.TemporaryDirectory() as cache:
            res["engine_cold"] = cold = engine_load(cache)
        print(f"Engine('smollm2') cold: {cold['wall_s']:.2f} s (imports {cold['import_s']:.2f}, load "
              f"{cold['load_s']:.2f})", flush=True)
    warm = [engine_load(None) for _ in range(args.repeats)]
    res["engine_warm"] = med = {k: statistics.median(w[k] for w in warm) for k in warm[0]}
    print(f"Engine('smollm2') warm (median of {args.repeats}): {med['wall_s']:.2f} s (imports "
          f"{med['import_s']:.2f}, load {med['load_s']:.2f}; CPU {med['cpu_s']:.2f} s)", flush=True)
    runs = [first_token() for _ in range(args.repeats)]
    res["generate"] = gen = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"workbench generate, first token (median of {args.repeats}): {gen['first_token_s']:.2f} s "
          f"(exits at {gen['exit_s']:.2f} s; CPU {gen['cpu_s']:.2f} s to exit); each run: "
          + ", ".join(f"{r['first_token_s']:.2f}" for r in runs))
    res["load_average"] = os.getloadavg()
    print("load average after the run: " + " ".join(f"{x:.2f}" for x in res["load_average"]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
