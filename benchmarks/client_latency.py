"""Client vs server latency at 1, 8 and 32 concurrent streams: TTFT and inter-token latency p50/p99 as the
client measured them, as the engine measured them, at the server's socket (when each frame's write
returned), and the network gap (server write to client receive), for the same request ids.

The server runs as `python -m workbench.server` in its own process (trace level summary: its
`/debug/events` carries the stamps); the client is `workbench client` (workbench/clients/load.py) in
this process. Both read `time.perf_counter()`, the machine's one monotonic clock, so the gap is a
plain subtraction. Each level sends `--rounds` x concurrency requests, `--new` tokens each
(`ignore_eos`), after one warm-up request. Results are printed, and written to BENCHMARKS.md
between this script's markers (replacing its previous section) and optionally as JSON.

Then a slow reader next to a fast one (`--slow-rounds`, 0 skips it): each round streams a fast request
alone, then starts a slow reader (one read of at most 8 KiB a second, an 8 KiB receive buffer, 20 top
logprobs a token so each frame is ~2 KB), waits until the engine has generated all of it (so the two never
share a batch), and streams the same fast request while the server still drains the slow one. The fast
client's inter-token p99 beside the slow reader over its p99 alone is the isolation ratio (target: within
20%, i.e. <= 1.2).

    python benchmarks/client_latency.py [--model smollm2] [--levels 1,8,32] [--new 16] [--rounds 2]
        [--slow-rounds 3] [--json out.json] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import httpx

from workbench.clients.cli_args import add_client_args
from workbench.clients.load import ClientReport, run_benchmark
from workbench.clients.stream import ServerView, StreamRecord, slow_transport, stream_request
from workbench.server.background import ServerProcess
from workbench.trace.latency import percentile

ROOT = Path(__file__).resolve().parent.parent

BEGIN, END = "<!-- client_latency: begin -->", "<!-- client_latency: end -->"
HEADING = "## Client vs server latency (queue to socket)"
COLUMNS = (("client", "client_ttft", "client_itl"), ("server engine", "server_ttft", "server_itl"),
           ("server socket", "socket_ttft", "socket_itl"), ("network gap", "ttft_gap", "gap"))


def client_args(url: str, requests: int, concurrency: int, new: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_client_args(parser)
    return parser.parse_args(["--url", url, "-n", str(requests), "-c", str(concurrency), "--max-tokens", str(new),
                              "--ignore-eos", "--prompt", "Write a short poem about the sea."])


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.1f}"


def table(reports: list[ClientReport]) -> str:
    """One markdown table: per level, p50 / p99 of each column, TTFT then ITL."""
    head = "| streams | ok | metric | " + " | ".join(f"{name} p50 / p99 (ms)" for name, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for rep in reports:
        ok = sum(r.record.error is None and r.record.status == 200 for r in rep.results)
        for metric, pick in (("TTFT", 1), ("ITL", 2)):
            cells = []
            for column in COLUMNS:
                q = rep.quantiles(column[pick])
                cells.append(f"{ms(q['p50'])} / {ms(q['p99'])}")
            lines.append(f"| {rep.concurrency} | {ok}/{len(rep.results)} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SLOW_PROMPT = "Tell me a very long story about a lighthouse."


def chat_body(model: str, new: int, top_logprobs: int = 0) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": SLOW_PROMPT}], "max_tokens": new,
            "temperature": 0, "stream": True, "ignore_eos": True}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    return body


def _generated(view: ServerView, request_id: str | None) -> bool:
    return request_id is not None and any(e.kind == "request.finished" for e in view.events.get(request_id, ()))


async def slow_reader_isolation(url: str, model: str, rounds: int, new: int, slow_new: int) -> list[dict]:
    """Per round: the fast stream's inter-token p99 alone and beside a slow reader, and what the slow one saw."""
    path = url + "/v1/chat/completions"
    out = []
    async with httpx.AsyncClient(timeout=600) as client, \
            httpx.AsyncClient(timeout=600, transport=slow_transport(1.0, 8192, 8192)) as slow_client:
        view = ServerView()
        follower = asyncio.create_task(view.follow(client, url))
        await asyncio.wait_for(view.ready.wait(), 30)
        try:
            for r in range(rounds):
                alone = await stream_request(client, path, chat_body(model, new))
                slow = StreamRecord(r, "slow")
                task = asyncio.create_task(stream_request(slow_client, path, chat_body(model, slow_new, 20),
                                                          mode="slow", record=slow))
                while not _generated(view, slow.request_id) and not task.done():
                    await asyncio.sleep(0.05)
                beside = await stream_request(client, path, chat_body(model, new))
                draining = not task.done()  # the server was still writing to the slow socket throughout
                await task
                errors = [rec.error for rec in (alone, beside, slow) if rec.error]
                out.append({"alone_p99": percentile(alone.itl, 99), "beside_p99": percentile(beside.itl, 99),
                            "draining": draining, "slow_frames": len(slow.content_frames),
                            "slow_seconds": slow.frames[-1].received - slow.sent if slow.frames else None,
                            "errors": errors})
                print(f"slow reader round {r + 1}/{rounds}: done", file=sys.stderr, flush=True)
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
    return out


def slow_table(rows: list[dict], new: int, slow_new: int) -> str:
    lines = ["| round | fast alone p99 (ms) | beside a slow reader p99 (ms) | ratio | slow reader: frames for "
             f"{slow_new} tokens, seconds | still draining |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(rows, 1):
        ratio = row["beside_p99"] / row["alone_p99"]
        lines.append(f"| {i} | {ms(row['alone_p99'])} | {ms(row['beside_p99'])} | {ratio:.2f} | "
                     f"{row['slow_frames']}, {row['slow_seconds']:.1f} | {'yes' if row['draining'] else 'no'} |")
    best = min(r["beside_p99"] for r in rows) / min(r["alone_p99"] for r in rows)
    ratios = sorted(r["beside_p99"] / r["alone_p99"] for r in rows)
    return ("\n".join(lines) + f"\n\nFast stream: {new} tokens. Best-of-rounds ratio {best:.2f}, median same-round "
            f"ratio {ratios[len(ratios) // 2]:.2f} (target <= 1.2).")


def write_section(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old and END in old:
        new = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, old, flags=re.S)
    else:
        new = old.rstrip("\n") + f"\n\n{HEADING}\n\n{block}\n"
    path.write_text(new, encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--new", type=int, default=16, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream at each level")
    ap.add_argument("--slow-rounds", type=int, default=3, help="slow-reader rounds (0: skip that part)")
    ap.add_argument("--slow-new", type=int, default=120, help="the slow reader's output tokens")
    ap.add_argument("--fast-new", type=int, default=64, help="the fast stream's output tokens beside it")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    server = ServerProcess(["--model", args.model, "--trace-level", "summary", "--log-level", "warning"],
                           cwd=str(ROOT)).start()
    url = server.url
    reports, slow_rows = [], []
    try:
        asyncio.run(run_benchmark(client_args(url, 1, 1, 4)))  # warm up
        for level in levels:
            report = asyncio.run(run_benchmark(client_args(url, level * args.rounds, level, args.new)))
            reports.append(report)
            print(f"{level} streams: done", file=sys.stderr, flush=True)
        if args.slow_rounds > 0:
            served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            slow_rows = asyncio.run(slow_reader_isolation(url, served, args.slow_rounds, args.fast_new, args.slow_new))
    finally:
        server.stop()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    text = (f"`python benchmarks/client_latency.py` — {args.model}, {args.new} output tokens per request "
            f"(ignore_eos), {args.rounds} requests per stream, server in its own process (trace level summary), "
            f"client on the same machine; {platform.machine()}, {os.cpu_count()} CPUs, load average after the run "
            f"{load}, {time.strftime('%Y-%m-%d')}.\n\n{table(reports)}\n\n"
            "TTFT: client = request sent → first content frame received; engine = arrival → first token sampled; "
            "socket = arrival → that token's frame written. ITL: client and socket per frame, engine per token. "
            "Network gap = client receive − server write for the same frame (the first content frame for TTFT).")
    if slow_rows:
        text += ("\n\n### A slow reader next to a fast stream\n\n"
                 "A slow reader (8 KiB a second, 20 top logprobs a token) has been generated in full and is still "
                 "being drained by the server while a fast stream runs; the fast stream's inter-token p99 beside "
                 "it against the same stream alone, same round.\n\n" + slow_table(slow_rows, args.fast_new, args.slow_new))
    print(f"{HEADING}\n\n{text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"levels": [r.to_json() for r in reports], "slow_reader": slow_rows},
                                              indent=1), encoding="utf-8")
    if not args.no_write:
        write_section(text)
    ok = all(r.record.error is None for rep in reports for r in rep.results) and not any(r["errors"] for r in slow_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
