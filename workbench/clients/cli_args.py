"""`workbench client`: its flags (`add_client_args`) and running it (`run_client`); `python -m
workbench.clients.cli_args` runs it without the rest of the CLI. The benchmark itself is load.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from workbench.clients.load import MODES, format_report, run_benchmark


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (workbench serve, or any OpenAI server)")
    p.add_argument("--model", default=None, help="model id (default: the server's first /v1/models entry)")
    p.add_argument("-n", "--requests", type=int, default=8, help="requests to send")
    p.add_argument("-c", "--concurrency", type=int, default=None, help="streams open at once (default: all)")
    p.add_argument("--prompt", default="Write a short poem about the sea.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens (vLLM/SGLang extension)")
    p.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    p.add_argument("--mode", choices=MODES, default="normal",
                   help="normal; slow: read the socket late (see --read-delay); disconnect: hang up mid-stream")
    p.add_argument("--slow", type=int, default=None, metavar="K", help="with --mode slow: only the first K streams")
    p.add_argument("--read-delay", type=float, default=1.0, help="slow mode: seconds between socket reads")
    p.add_argument("--read-size", type=int, default=65536, help="slow mode: bytes per socket read at most")
    p.add_argument("--recv-buffer", type=int, default=None, help="slow mode: SO_RCVBUF bytes")
    p.add_argument("--disconnect-after", type=int, default=3, help="disconnect mode: content frames before hanging up")
    p.add_argument("--api-key", default=None)
    p.add_argument("--per-request", action="store_true", help="also print one line per request")
    p.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON")
    p.add_argument("--timeout", type=float, default=600.0)


def run_client(args: argparse.Namespace) -> int:
    """`workbench client`: 0 when every request streamed to its end (or hung up on purpose)."""
    report = asyncio.run(run_benchmark(args))
    print(format_report(report, args.per_request))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=1)
    failed = [r for r in report.results if r.record.error is not None or r.record.status != 200]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench client", description="N concurrent streaming requests, timed by the client and by the server")
    add_client_args(parser)
    return run_client(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
