"""`workbench client`: N concurrent streaming requests, timed by the client and by the server, side by side.

Owns: running the benchmark (`run_benchmark`, which the command `workbench client` calls; its flags are in
cli_args.py): sends the requests, follows the server's `/debug/events` for the same request ids,
returns a `ClientReport`) and the report: TTFT and inter-token latency p50/p90/p99 as the client
measured them, as the engine measured them, at the server's socket (when each frame's write
returned), and the network gap (server write to client receive) in its own column. The gap needs
one clock: `time.perf_counter()` is the machine's monotonic clock, shared by every process on it,
so it is reported for a server on this machine (a loopback URL) and left out otherwise.
Does not own: the streaming and the server's event stream (client_stream.py).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from workbench.clients.loopback import is_loopback
from workbench.trace.latency import percentile

if TYPE_CHECKING:
    from workbench.clients.stream import ServerView, StreamRecord

QUANTILES = (50, 90, 99)
MODES = ("normal", "slow", "disconnect")  # stream.MODES, repeated so `workbench --help` needs no httpx



def _check(args: argparse.Namespace) -> None:
    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.disconnect_after < 1:
        raise ValueError(f"--disconnect-after must be >= 1, got {args.disconnect_after}")
    if urlsplit(args.url).scheme not in ("http", "https"):
        raise ValueError(f"--url must be an http(s) URL, got {args.url!r}")


def same_clock(url: str) -> bool:
    """A server on this machine shares our perf_counter clock (loopback host)."""
    return is_loopback(urlsplit(url).hostname or "")


@dataclass(slots=True)
class RequestResult:
    """One request: the client's record and the server's numbers for the same request id."""

    record: StreamRecord
    server_ttft: float | None = None  # engine: arrival -> first token
    socket_ttft: float | None = None  # server: arrival -> first token's frame written
    server_itl: list[float] = field(default_factory=list)  # engine, per token
    socket_itl: list[float] = field(default_factory=list)  # server, between frames written
    gaps: list[float] = field(default_factory=list)  # per content frame: client received - server written
    first_gap: float | None = None
    aborted: str | None = None  # the server's abort reason, if it aborted the stream
    finish: str | None = None  # the engine's finish reason


@dataclass(slots=True)
class ClientReport:
    mode: str
    concurrency: int
    results: list[RequestResult]
    same_clock: bool
    server_error: str | None = None
    dropped_events: int = 0

    def column(self, name: str) -> list[float]:
        """Every sample of one measurement across requests (seconds): a key of `SCALARS` or `SERIES`."""
        if name in SCALARS:
            return [v for r in self.results if (v := SCALARS[name](r)) is not None]
        return [v for r in self.results for v in SERIES[name](r)]

    def quantiles(self, name: str) -> dict[str, float | None]:
        values = self.column(name)
        return {f"p{q}": percentile(values, q) for q in QUANTILES}

    def to_json(self) -> dict[str, Any]:
        names = (*SCALARS, *SERIES)
        return {"mode": self.mode, "concurrency": self.concurrency, "requests": len(self.results),
                "ok": sum(r.record.error is None and r.record.status == 200 for r in self.results),
                "same_clock": self.same_clock, "server_error": self.server_error, "dropped_events": self.dropped_events,
                "seconds": {n: self.quantiles(n) for n in names},
                "per_request": [{"request_id": r.record.request_id, "mode": r.record.mode, "client_ttft": r.record.ttft,
                                 "server_ttft": r.server_ttft, "socket_ttft": r.socket_ttft, "first_gap": r.first_gap,
                                 "frames": len(r.record.content_frames), "finish": r.finish or r.record.finish_reason,
                                 "aborted": r.aborted, "error": r.record.error} for r in self.results]}


SCALARS = {"client_ttft": lambda r: r.record.ttft, "server_ttft": lambda r: r.server_ttft,
           "socket_ttft": lambda r: r.socket_ttft, "ttft_gap": lambda r: r.first_gap}
SERIES = {"client_itl": lambda r: r.record.itl, "server_itl": lambda r: r.server_itl,
          "socket_itl": lambda r: r.socket_itl, "gap": lambda r: r.gaps}


def match_server(record: StreamRecord, view: ServerView | None, shared_clock: bool) -> RequestResult:
    """Line the client's frames up with the server's stamps for the same request id."""
    result = RequestResult(record)
    lat = view.latency(record.request_id) if view is not None and record.request_id else None
    if lat is None:
        return result
    result.server_ttft, result.finish, result.aborted = lat.timings.get("ttft"), lat.finish_reason, lat.aborted
    result.server_itl = list(lat.timings.get("itl") or [])
    summary = lat.summary or {}
    result.socket_ttft, result.socket_itl = summary.get("ttft_socket"), list(summary.get("itl_socket") or [])
    if shared_clock:
        written = {int(e.detail.get("seq", -1)): e.t for e in lat.written}
        gaps = [f.received - written[f.seq] for f in record.content_frames if f.seq in written]
        result.gaps, result.first_gap = gaps, (gaps[0] if gaps else None)
    return result


async def _model_id(client: Any, url: str) -> str:
    resp = await client.get(url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{url} lists no models; pass --model")
    return str(data[0]["id"])


def request_body(args: argparse.Namespace, model: str, index: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                            "stream": True, "seed": index}
    if getattr(args, "ignore_eos", False):
        body["ignore_eos"] = True
    if args.completions:
        body["prompt"] = args.prompt
    else:
        body["messages"] = [{"role": "user", "content": args.prompt}]
    return body


async def run_benchmark(args: argparse.Namespace) -> ClientReport:
    """Send the requests, follow the server's events, and match them up."""
    import httpx

    from workbench.clients.stream import ServerView, slow_transport, stream_request

    _check(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        model = args.model or await _model_id(client, args.url)
        view = ServerView()
        follower = asyncio.create_task(view.follow(client, args.url))
        await asyncio.wait_for(view.ready.wait(), 30)
        slow_client = None
        if args.mode == "slow":
            slow_client = httpx.AsyncClient(timeout=args.timeout, headers=headers, transport=slow_transport(
                args.read_delay, args.read_size, args.recv_buffer))
        gate = asyncio.Semaphore(args.concurrency or args.requests)
        path = "/v1/completions" if args.completions else "/v1/chat/completions"
        slow_count = args.requests if args.slow is None else args.slow

        async def one(i: int) -> StreamRecord:
            slow = args.mode == "slow" and i < slow_count
            mode = "slow" if slow else ("disconnect" if args.mode == "disconnect" else "normal")
            async with gate:
                return await stream_request(slow_client if slow else client, args.url.rstrip("/") + path,
                                            request_body(args, model, i), index=i, mode=mode,
                                            disconnect_after=args.disconnect_after)

        try:
            records = await asyncio.gather(*(one(i) for i in range(args.requests)))
        finally:
            if slow_client is not None:
                await slow_client.aclose()
        await view.wait_for([r.request_id for r in records if r.request_id])
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
    shared = same_clock(args.url)
    results = [match_server(r, view if view.error is None else None, shared) for r in records]
    return ClientReport(args.mode, args.concurrency or args.requests, results, shared, view.error, view.dropped)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:8.1f}"


def format_report(report: ClientReport, per_request: bool = False) -> str:
    ok = sum(r.record.error is None and r.record.status == 200 for r in report.results)
    lines = [f"{len(report.results)} requests ({ok} ok) · mode {report.mode} · concurrency {report.concurrency}"]
    head = "".join(f"{h:>30}" for h in ("client", "server (engine)", "server (socket write)", "network gap"))
    lines += [f"{'ms':<6}{head}", f"{'':<6}" + f"{'p50     p90     p99':>30}" * 4]
    rows = (("TTFT", ("client_ttft", "server_ttft", "socket_ttft", "ttft_gap")),
            ("ITL", ("client_itl", "server_itl", "socket_itl", "gap")))
    for label, names in rows:
        cells = []
        for name in names:
            q = report.quantiles(name)
            cells.append(f"{_ms(q['p50'])}{_ms(q['p90'])}{_ms(q['p99'])}".rjust(30) if any(q.values()) else f"{'n/a':>30}")
        lines.append(f"{label:<6}" + "".join(cells))
    lines.append("ITL: client and socket per frame (a coalesced frame carries several tokens), engine per token; "
                 "gap = client receive - server write" + ("" if report.same_clock else " (n/a: not a loopback server)"))
    if report.server_error:
        lines.append(f"server columns unavailable: {report.server_error}")
    elif report.dropped_events:
        lines.append(f"warning: the server dropped {report.dropped_events} events for this client")
    aborted = [r for r in report.results if r.aborted]
    if aborted:
        reasons = sorted({str(r.aborted) for r in aborted})
        lines.append(f"{len(aborted)} aborted by the server ({', '.join(reasons)})")
    if per_request:
        lines.append(f"{'request id':<34}{'mode':<11}{'TTFT':>9}{'server':>9}{'socket':>9}{'gap':>9}{'frames':>8}  finish")
        for r in report.results:
            rec = r.record
            lines.append(f"{str(rec.request_id):<34}{rec.mode:<11}{_ms(rec.ttft):>9}{_ms(r.server_ttft):>9}"
                         f"{_ms(r.socket_ttft):>9}{_ms(r.first_gap):>9}{len(rec.content_frames):>8}  "
                         f"{r.aborted and 'aborted: ' + r.aborted or r.finish or rec.finish_reason or rec.error}")
    return "\n".join(lines)

