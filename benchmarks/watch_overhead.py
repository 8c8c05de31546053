"""What `workbench watch` costs: the proxy's added latency per chunk, and its checker's rate.

Latency: a fake upstream (a subprocess of this script) streams chunks that carry the moment each was
written (`time.perf_counter()`, CLOCK_MONOTONIC: one clock for every process of the machine); the
client takes the moment each arrives. The same streams go straight to the fake and through
`workbench watch` (a subprocess, sampling none and sampling all: the sampled path rewrites every
chunk and its checker runs on the same cores); the added latency is the difference of the
percentiles. Checker rate (`--vllm URL`): greedy requests through a watch in front of that vLLM,
sampling all; the upstream's generation rate (completion tokens / wall time, seen by the client)
beside the checker's (positions scored / time spent scoring, from /watch/status).

    python benchmarks/watch_overhead.py [--streams 32] [--chunks 64] [--vllm http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --- the fake upstream (run as `--serve-fake PORT`) ---------------------------------------------------


async def _fake_app(scope, receive, send):  # noqa: ANN001, ANN202 (an ASGI callable)
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["path"] == "/v1/models":
        data = b'{"object":"list","data":[{"id":"fake"}]}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})
        return
    req = json.loads(body)
    n, gap = int(req.get("max_tokens", 64)), float(req.get("gap", 0.01))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(n):
        await asyncio.sleep(gap)
        lp = None
        if req.get("logprobs") is not None:
            lp = {"tokens": ["token_id:504"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:504": -0.5}],
                  "text_offset": [i]}
        obj = {"id": "cmpl-b", "object": "text_completion", "created": 0, "model": "fake",
               "choices": [{"index": 0, "text": "The", "logprobs": lp, "finish_reason": "length" if i == n - 1 else None,
                            "token_ids": [504] if req.get("return_token_ids") else None}],
               "sent": time.perf_counter()}
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(obj).encode() + b"\n\n",
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not start in {timeout} s")


def _start_watch(upstream: str, sample: float, out: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "watch", "--upstream", upstream, "--port", str(port),
                             "--sample", str(sample), "--out", out], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc)
    import httpx

    deadline = time.monotonic() + 300  # the checker's reference loads on its thread: measure after that
    while httpx.get(url + "/watch/status", timeout=10).json()["reference_state"] == "loading":
        if time.monotonic() > deadline:
            raise RuntimeError("the watch's reference did not load in 300 s")
        time.sleep(0.5)
    return proc, url


# --- measuring ----------------------------------------------------------------------------------------


async def _latencies(url: str, streams: int, chunks: int, concurrency: int) -> list[float]:
    import httpx

    out: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> None:
            async with sem, client.stream("POST", url + "/v1/completions", json={
                    "model": "fake", "prompt": f"The capital of France is {i}", "max_tokens": chunks, "stream": True,
                    "temperature": 0}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        out.append(time.perf_counter() - json.loads(line[6:])["sent"])
        await asyncio.gather(*(one(i) for i in range(streams)))
    return out


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def chunk_latency(streams: int, chunks: int, concurrency: int) -> None:
    port = _free_port()
    fake = subprocess.Popen([sys.executable, __file__, "--serve-fake", str(port)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    fake_url = f"http://127.0.0.1:{port}"
    procs = [fake]
    try:
        _wait(fake_url, fake)
        rows = {"direct": asyncio.run(_latencies(fake_url, streams, chunks, concurrency))}
        for sample in (0.0, 1.0):
            with tempfile.TemporaryDirectory() as out:
                proc, url = _start_watch(fake_url, sample, out)
                procs.append(proc)
                asyncio.run(_latencies(url, 4, 8, 4))  # warm: connections, the checker's reference
                rows[f"watch --sample {sample:g}"] = asyncio.run(_latencies(url, streams, chunks, concurrency))
                proc.terminate()
                proc.wait(30)
        base50, base99 = _pct(rows["direct"], 50), _pct(rows["direct"], 99)
        print(f"per-chunk latency, {streams} streams x {chunks} chunks, {concurrency} at a time (ms):")
        for name, values in rows.items():
            p50, p99 = _pct(values, 50), _pct(values, 99)
            added = "" if name == "direct" else f"   added p50 {1e3 * (p50 - base50):+.2f}  p99 {1e3 * (p99 - base99):+.2f}"
            print(f"  {name:<18} p50 {1e3 * p50:7.2f}  p99 {1e3 * p99:7.2f}  (n={len(values)}){added}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)


def checker_rate(vllm: str, requests: int, max_tokens: int) -> None:
    import httpx

    model = httpx.get(vllm + "/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = ["The capital of France is", "def fibonacci(n):", "The three primary colours are",
               "Water boils at a temperature of", "Once upon a time, in a small village,", "The quick brown fox",
               "In 1969, the first person to walk on the Moon was", "1, 2, 3, 5, 8, 13,"]
    with tempfile.TemporaryDirectory() as out:
        proc, url = _start_watch(vllm, 1.0, out)
        try:
            async def send(n: int) -> int:
                async with httpx.AsyncClient(timeout=300) as client:
                    rs = await asyncio.gather(*(client.post(url + "/v1/completions", json={
                        "model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True}) for i in range(n)))
                return sum(r.json()["usage"]["completion_tokens"] for r in rs)

            asyncio.run(send(2))  # warm: the reference loads, its first forward
            while httpx.get(url + "/watch/status").json()["totals"]["requests_checked"] < 2:
                time.sleep(0.2)
            before = httpx.get(url + "/watch/status").json()
            t0 = time.perf_counter()
            tokens = asyncio.run(send(requests))
            gen_s = time.perf_counter() - t0
            while httpx.get(url + "/watch/status").json()["totals"]["requests_checked"] < requests + 2:
                time.sleep(0.2)
            after = httpx.get(url + "/watch/status").json()
        finally:
            proc.terminate()
            proc.wait(30)
    positions = sum(after["totals"]["positions"].values()) - sum(before["totals"]["positions"].values())
    busy = after["checker"]["busy_s"] - before["checker"]["busy_s"]
    print(f"vLLM at {vllm}: {requests} greedy requests x {max_tokens} tokens, all at once")
    print(f"  upstream generation {tokens / gen_s:8.1f} tokens/s ({tokens} tokens in {gen_s:.1f} s, seen by the client)")
    print(f"  checker             {positions / busy:8.1f} positions/s ({positions} positions in {busy:.1f} s of scoring)")
    print(f"  so it keeps up with --sample <= {min(1.0, positions / busy / (tokens / gen_s)):.2f} of this traffic")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--vllm", default=None, metavar="URL", help="also measure the checker's rate against this vLLM")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fake is not None:
        import uvicorn

        uvicorn.run(_fake_app, host="127.0.0.1", port=args.serve_fake, log_level="warning")
        return
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (shared: numbers are noisy)")
    chunk_latency(args.streams, args.chunks, args.concurrency)
    if args.vllm:
        checker_rate(args.vllm.rstrip("/"), args.requests, args.max_tokens)


if __name__ == "__main__":
    main()
