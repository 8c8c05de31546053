"""Admission fairness: a small request's TTFT while one client sends a 5,000-prompt request.

Two `workbench serve` processes (tiny-random by default, as the issue's sweep used):

1. default limits: the 5,000-prompt x n=16 request is refused with 400 (how fast, and the server's
   RSS before and after);
2. limits raised so it is admitted (`--max-prompts-per-request 5000 --max-request-tokens 2000000`):
   the small request's TTFT on the idle server, then while the big request streams (the client
   reads it as fast as it can), then the big client disconnects and we check the engine goes idle
   and the RSS comes back to its baseline (the idle RSS after one batched warm-up request, which
   packs the weights; `--rounds` times, default 2, with RSS by mapping kind from /proc/PID/smaps).

The small request is a streaming completion (max_tokens 2); TTFT is send -> first chunk with text.
The criterion (issue 19): loaded TTFT median within 2x the idle median.

    python benchmarks/admission_fairness.py [--model tiny-random] [--prompts 5000] [--n 16]
        [--max-tokens 16] [--samples 15] [--rounds 2] [--serve-arg=--max-running-per-request --serve-arg=8]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from workbench.server.background import ServerProcess
from workbench.server.heap import resident_by_kind

C = "/v1/completions"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ttft(url: str, model: str) -> float:
    body = {"model": model, "prompt": "hello there", "max_tokens": 2, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + C, json=body, timeout=120) as resp:
        resp.raise_for_status()
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                first = time.perf_counter() - t0
                for _ in lines:  # read the stream to its end
                    pass
                return first
    raise RuntimeError("no text chunk")


def samples(url: str, model: str, count: int, gap: float = 0.2) -> list[float]:
    out = []
    for _ in range(count):
        out.append(ttft(url, model))
        time.sleep(gap)
    return out


def big_body(model: str, prompts: int, n: int, max_tokens: int) -> dict:
    return {"model": model, "prompt": [f"story number {i}" for i in range(prompts)], "n": n,
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def big_client(url: str, body: dict, received: Any) -> None:
    with httpx.stream("POST", url + C, json=body, timeout=600) as resp:
        for raw in resp.iter_raw():
            received.value += len(raw)


def settle_rss(pid: int, seconds: float = 3.0) -> float:
    time.sleep(seconds)
    return rss_mb(pid)


def refused_phase(args: argparse.Namespace) -> dict:
    with ServerProcess(["--model", args.model, "--log-level", "warning", *args.serve_arg]) as srv:
        ttft(srv.url, args.model)
        base = settle_rss(srv.proc.pid, 1.0)
        t0 = time.perf_counter()
        resp = httpx.post(srv.url + C, json=big_body(args.model, args.prompts, args.n, args.max_tokens), timeout=60)
        took = time.perf_counter() - t0
        after = settle_rss(srv.proc.pid)
        return {"status": resp.status_code, "message": resp.json()["error"]["message"], "seconds": took,
                "rss_before_mb": base, "rss_after_mb": after}


def admitted_phase(args: argparse.Namespace) -> dict:
    flags = ["--model", args.model, "--log-level", "warning", "--max-prompts-per-request", str(args.prompts),
             "--max-request-tokens", str(args.prompts * args.n * args.max_tokens), *args.serve_arg]
    with ServerProcess(flags) as srv:
        samples(srv.url, args.model, 3)  # warm up
        cold = settle_rss(srv.proc.pid, 1.0)
        # one batched request: the first batched steps pack the weights for MKL (once per process,
        # kernels/gemm.PackedLinear) and page in code; the baseline is the server warmed up
        warm = {"model": args.model, "prompt": [f"warm {i}" for i in range(32)], "n": 2, "max_tokens": 8,
                "ignore_eos": True}
        httpx.post(srv.url + C, json=warm, timeout=300).raise_for_status()
        idle = samples(srv.url, args.model, args.samples)
        base = settle_rss(srv.proc.pid, 1.0)
        kinds = [resident_by_kind(srv.proc.pid)]
        body = big_body(args.model, args.prompts, args.n, args.max_tokens)
        loaded, peaks, afters, idle_after = [], [], [], []
        for _ in range(args.rounds):  # more than once: later rounds show whether anything stays behind
            received = multiprocessing.Value("q", 0)
            # the big client runs in its own process, so its reading does not slow this one's clock
            client = multiprocessing.Process(target=big_client, args=(srv.url, body, received), daemon=True)
            client.start()
            while received.value < 50_000:
                time.sleep(0.01)
            loaded += samples(srv.url, args.model, args.samples)
            peaks.append(rss_mb(srv.proc.pid))
            client.terminate()  # the client leaves mid-stream: its connection closes
            client.join(30)
            idle_after.append(wait_idle(srv.url))
            afters.append(settle_rss(srv.proc.pid))
            kinds.append(resident_by_kind(srv.proc.pid))
            idle += samples(srv.url, args.model, args.samples)  # idle again, in the same minute as the load
        return {"idle_ttft_ms": [x * 1e3 for x in idle], "loaded_ttft_ms": [x * 1e3 for x in loaded],
                "rss_cold_mb": cold, "rss_before_mb": base, "rss_peak_mb": peaks, "rss_after_mb": afters,
                "rss_by_kind_mb": kinds,
                "engine_idle_after_disconnect_s": idle_after}


def wait_idle(url: str, limit: float = 30.0) -> float:
    """Seconds until /metrics shows nothing running or waiting (the engine dropped the big request)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        values = {}
        for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("workbench_num_requests_running", "workbench_num_requests_waiting"):
                values[name] = float(value)  # prometheus_client writes gauges as floats ("0.0")
        if len(values) == 2 and not any(values.values()):
            break
        time.sleep(0.1)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--prompts", type=int, default=5000)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `workbench serve` argument for both servers (repeat; --serve-arg=--flag)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times the big client comes and leaves (RSS settles by round 6 or so; 12 shows it)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    refused = refused_phase(args)
    print(f"default limits: HTTP {refused['status']} in {refused['seconds'] * 1e3:.0f} ms "
          f"({refused['message'][:90]}...); RSS {refused['rss_before_mb']:.0f} -> {refused['rss_after_mb']:.0f} MB")
    admitted = admitted_phase(args)
    idle, loaded = statistics.median(admitted["idle_ttft_ms"]), statistics.median(admitted["loaded_ttft_ms"])
    ratio = loaded / idle
    print(f"small request TTFT: idle median {idle:.1f} ms (max {max(admitted['idle_ttft_ms']):.1f}), under the "
          f"{args.prompts}-prompt x n={args.n} request median {loaded:.1f} ms (max {max(admitted['loaded_ttft_ms']):.1f})"
          f" -> {ratio:.2f}x idle ({'within' if ratio <= 2 else 'ABOVE'} 2x)")
    base = admitted["rss_before_mb"]
    print(f"RSS {base:.1f} MB idle ({admitted['rss_cold_mb']:.1f} before the batched warm-up); under load / after "
          "the big client left: "
          + ", ".join(f"{p:.1f} / {a:.1f} MB" for p, a in zip(admitted["rss_peak_mb"], admitted["rss_after_mb"]))
          + " (" + ", ".join(f"{a - base:+.1f}" for a in admitted["rss_after_mb"]) + " MB from idle); engine idle "
          + ", ".join(f"{s:.1f}" for s in admitted["engine_idle_after_disconnect_s"]) + " s after it left")
    afters = admitted["rss_after_mb"]
    if len(afters) >= 4:
        print(f"RSS growth over the last 3 rounds: {afters[-1] - afters[-4]:+.1f} MB "
              f"(rounds {len(afters) - 2}-{len(afters)}; round 1 left {afters[0] - base:+.1f} MB)")
    print("RSS by mapping kind, idle then after each round: " + "; ".join(
        ", ".join(f"{k} {v:.1f}" for k, v in kind.items() if v >= 0.05) for kind in admitted["rss_by_kind_mb"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"refused": refused, "admitted": admitted, "ratio": ratio}, indent=1))
    return 0 if ratio <= 2 and refused["status"] == 400 else 1


if __name__ == "__main__":
    sys.exit(main())
