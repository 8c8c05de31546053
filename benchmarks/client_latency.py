"""Client vs server latency at 1, 8 and 32 concurrent streams: TTFT and inter-token latency p50/p99 as the
client measured them, as the engine measured them, at the server's socket (when each frame's write
returned), and the network gap (server write to client receive), for the same request ids.

The server runs as `python -m workbench.server` in its own process (trace level summary: its
`/debug/events` carries the stamps); the client is `workbench client` (workbench/client.py) in
this process. Both read `time.perf_counter()`, the machine's one monotonic clock, so the gap is a
plain subtraction. Each level sends `--rounds` x concurrency requests, `--new` tokens each
(`ignore_eos`), after one warm-up request. Results are printed, and written to BENCHMARKS.md
between this script's markers (replacing its previous section) and optionally as JSON.

    python benchmarks/client_latency.py [--model smollm2] [--levels 1,8,32] [--new 16] [--rounds 2]
        [--json out.json] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path

from workbench.client import ClientReport, add_client_args, run_benchmark

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when run through `workbench bench`

from server_latency import start_server  # noqa: E402  (one launcher for both latency benchmarks)

BEGIN, END = "<!-- client_latency: begin -->", "<!-- client_latency: end -->"
HEADING = "## Client vs server latency (queue to socket)"
COLUMNS = (("client", "client_ttft", "client_itl"), ("server engine", "server_ttft", "server_itl"),
           ("server socket", "socket_ttft", "socket_itl"), ("network gap", "ttft_gap", "gap"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args.model, port)
    reports = []
    try:
        asyncio.run(run_benchmark(client_args(url, 1, 1, 4)))  # warm up
        for level in levels:
            report = asyncio.run(run_benchmark(client_args(url, level * args.rounds, level, args.new)))
            reports.append(report)
            print(f"{level} streams: done", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    text = (f"`python benchmarks/client_latency.py` — {args.model}, {args.new} output tokens per request "
            f"(ignore_eos), {args.rounds} requests per stream, server in its own process (trace level summary), "
            f"client on the same machine; {platform.machine()}, {os.cpu_count()} CPUs, load average after the run "
            f"{load}, {time.strftime('%Y-%m-%d')}.\n\n{table(reports)}\n\n"
            "TTFT: client = request sent → first content frame received; engine = arrival → first token sampled; "
            "socket = arrival → that token's frame written. ITL: client and socket per frame, engine per token. "
            "Network gap = client receive − server write for the same frame (the first content frame for TTFT).")
    print(f"{HEADING}\n\n{text}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in reports], indent=1), encoding="utf-8")
    if not args.no_write:
        write_section(text)
    return 0 if all(r.record.error is None for rep in reports for r in rep.results) else 1


if __name__ == "__main__":
    sys.exit(main())
