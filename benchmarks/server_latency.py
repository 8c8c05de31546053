"""Server latency under concurrent streaming clients: TTFT and inter-token latency p50/p99 at 1, 8 and
32 clients, with every request accounted for (completed, failed).

The server runs as `python -m workbench.server` in its own process (as a user runs it); each client
is an asyncio task that sends streaming chat requests back to back (`ignore_eos`, a fixed number of
output tokens) and timestamps every SSE chunk. TTFT is send -> first content chunk; ITL is the gap
between consecutive content chunks. A request counts as completed only if its stream ends with
`[DONE]` and reports exactly the asked number of tokens.

    python benchmarks/server_latency.py [--model smollm2] [--clients 1,8,32] [--new 64]
        [--requests-per-client 2] [--trace-level summary] [--engine-baseline] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import httpx

from workbench.server.background import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["the ocean", "a city at night", "coffee", "mountains", "a robot learning to paint", "winter",
          "bread", "black holes", "a lighthouse keeper", "jazz", "honeybees", "trains", "the moon", "origami"]


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, new: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": new,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage, done, error = None, False, None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"ok": False, "error": f"HTTP {resp.status_code}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                usage = chunk.get("usage") or usage
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return {"ok": False, "error": type(exc).__name__}
    ok = done and error is None and usage is not None and usage["completion_tokens"] == new and bool(stamps)
    return {"ok": ok, "error": error, "ttft": stamps[0] - t0 if stamps else None,
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": usage["completion_tokens"] if usage else 0}


async def run_level(url: str, model: str, clients: int, per_client: int, new: int) -> dict:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as http:
        async def client(i: int) -> list[dict]:
            return [await one_request(http, model, f"Write about {TOPICS[(i + k) % len(TOPICS)]}.", new)
                    for k in range(per_client)]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(i) for i in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    good = [r for r in results if r["ok"]]
    ttft = sorted(r["ttft"] for r in good)
    itl = sorted(x for r in good for x in r["itl"])
    return {"clients": clients, "requests": len(results), "completed": len(good), "failed": len(results) - len(good),
            "errors": sorted({str(r.get("error")) for r in results if not r["ok"]}),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), "output_tok_s": sum(r["tokens"] for r in good) / wall, "wall_s": wall}


def engine_baseline(engine, clients: int, per_client: int, new: int) -> dict:
    """The same work through `Engine.generate` in-process (no HTTP): what the server's numbers compare to."""
    from workbench.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    engine.generate([[{"role": "user", "content": "warm up"}]], params.replace(max_new_tokens=4))
    outs: list = []

    def work() -> None:
        for k in range(per_client):
            chats = [[{"role": "user", "content": f"Write about {TOPICS[(i + k) % len(TOPICS)]}."}]
                     for i in range(clients)]
            outs.extend(engine.generate(chats, params))

    # On a worker thread, as the server steps its engine: on a busy 2-core machine a main-thread decode
    # with 2 OpenMP threads ran ~5x slower than the same decode on a worker thread (measured).
    t0 = time.perf_counter()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    wall = time.perf_counter() - t0
    ttft = sorted(o.timings["ttft"] for o in outs)
    itl = sorted(x for o in outs for x in o.timings["itl"])
    return {"ttft_p50_ms": pct(ttft, 50), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "output_tok_s": sum(len(o.token_ids) for o in outs) / wall}


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, in milliseconds."""
    if not values:
        return None
    k = max(0, min(len(values) - 1, round(q / 100 * len(values) + 0.5) - 1))
    return round(values[k] * 1e3, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--new", type=int, default=64, help="output tokens per request")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--trace-level", default="summary", choices=("off", "summary", "full"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine-baseline", action="store_true",
                    help="also run the same batches through Engine.generate in-process, for the ratio")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    engine = None
    if args.engine_baseline:
        from workbench.engine.engine import Engine

        engine = Engine(args.model, trace_level=args.trace_level, huge_pages=True)  # as serve loads
    server = ServerProcess(["--model", args.model, "--trace-level", args.trace_level, "--log-level", "warning"],
                           cwd=str(ROOT)).start()
    url = server.url
    rows = []
    try:
        asyncio.run(run_level(url, args.model, 2, 1, 8))  # warm-up (first-request costs)
        for n in levels:
            if engine is not None:  # right before the server's turn (the idle server uses no CPU meanwhile)
                b = engine_baseline(engine, n, args.requests_per_client, args.new)
                print(f"engine   clients={n:>3}  TTFT p50 {b['ttft_p50_ms']} ms  ITL p50/p99 {b['itl_p50_ms']}/"
                      f"{b['itl_p99_ms']} ms  {b['output_tok_s']:.1f} tok/s", flush=True)
            rows.append(asyncio.run(run_level(url, args.model, n, args.requests_per_client, args.new)))
            r = rows[-1]
            if engine is not None:
                r["engine_baseline"] = b
                r["server_vs_engine_tok_s"] = round(r["output_tok_s"] / b["output_tok_s"], 3)
            print(f"clients={n:>3}  requests={r['requests']:>3}  completed={r['completed']:>3}  "
                  f"failed={r['failed']}  TTFT p50/p99 {r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms  "
                  f"ITL p50/p99 {r['itl_p50_ms']}/{r['itl_p99_ms']} ms  {r['output_tok_s']:.1f} tok/s"
                  + (f"  ({r['server_vs_engine_tok_s']:.2f}x the engine alone)" if engine is not None else ""), flush=True)
    finally:
        server.stop()
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
               "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}  # a shared machine's load skews latency
    report = {"model": args.model, "new_tokens": args.new, "requests_per_client": args.requests_per_client,
              "trace_level": args.trace_level, "machine": machine, "levels": rows}
    print(f"load average (1 min) at the end: {machine['load_avg_1m_at_end']} on {machine['cpus']} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
