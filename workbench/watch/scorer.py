"""Where the checker's teacher forcing runs: in its own process (the default), or on the checker's thread.

Owns: `ThreadScorer` (an engine, or a server reference, given or built by a factory: used in
tests that share one engine, and for `--reference URL`, which only waits on HTTP) and
`ProcessScorer` (a spawned process that loads the reference and scores batches sent over a pipe
as JSON: the reference's Python then never holds the proxy's interpreter lock; measured on the
2-core machine, the added p99 per chunk with everything sampled fell from hundreds of ms to tens).
Both offer `start()` (load; raises with the reason), `score(batch) -> list[RequestCheck]` and
`close()`, and score through `workbench.external.check.score`: the verdicts of `workbench check`
(with a measured floor, `check --floor`'s: the process gets the floor as its JSON).
Does not own the queue or what is done with the verdicts (checker.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from workbench.external.check import Scored
from workbench.external.check_report import PositionCheck, RequestCheck
from workbench.trace.events import TokenChosen


class ThreadScorer:
    """Scores on the calling thread with the engine `factory()` returns (against `floor` when given)."""

    def __init__(self, factory: Callable[[], Any], tolerance: float, floor: Any = None) -> None:
        self.factory, self.tolerance, self.floor, self.engine = factory, tolerance, floor, None

    def start(self) -> None:
        self.engine = self.factory()
        if self.engine is None:
            raise RuntimeError("no reference engine was given")

    def score(self, batch: list[Scored]) -> list[RequestCheck]:
        from workbench.external.check import score

        return score(self.engine, batch, self.tolerance, self.floor)

    def close(self) -> None:
        pass


class ProcessScorer:
    """Scores in a spawned process that loads `reference` on `device` with `threads` torch threads
    (against `floor`, a `Floor`, when given)."""

    def __init__(self, reference: str, *, device: str, tolerance: float, threads: int, floor: Any = None) -> None:
        self.args = (reference, device, tolerance, threads, json.dumps(floor.to_json()) if floor is not None else None)
        self.proc: Any = None
        self.conn: Any = None

    def start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, *self.args), name="watch-reference", daemon=True)
        self.proc.start()
        child.close()
        reply = self._receive()
        if "error" in reply:
            raise RuntimeError(reply["error"])

    def score(self, batch: list[Scored]) -> list[RequestCheck]:
        self.conn.send_bytes(json.dumps([scored_to_json(s) for s in batch]).encode())
        reply = self._receive()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return [check_from_json(row) for row in reply["checks"]]

    def _receive(self) -> dict[str, Any]:
        try:
            return json.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            code = self.proc.exitcode if self.proc is not None else None
            raise RuntimeError(f"the reference process ended (exit status {code})") from None

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def serve(conn: Any, reference: str, device: str, tolerance: float, threads: int,
          floor_json: str | None = None) -> None:
    """The reference process: load, say ready (or why not), then score each batch received."""
    try:
        import torch

        from workbench.engine.engine import Engine
        from workbench.external.check import score
        from workbench.external.floor import floor_from_json

        floor = floor_from_json(json.loads(floor_json)) if floor_json is not None else None
        if device == "cpu":
            torch.set_num_threads(threads)
        engine = Engine(reference, device=device, trace=None, trace_level="off")
    except Exception as exc:
        conn.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        return
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            batch = [scored_from_json(s) for s in json.loads(conn.recv_bytes())]
        except (EOFError, OSError):
            return
        try:
            reply: dict[str, Any] = {"checks": [rc.to_row() for rc in score(engine, batch, tolerance, floor)]}
        except Exception as exc:  # one bad batch: said, and the next one is scored
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(json.dumps(reply).encode())


def scored_to_json(s: Scored) -> dict[str, Any]:
    return {"req_id": s.req_id, "greedy": s.greedy, "prompt_ids": s.prompt_ids, "note": s.note,
            "tokens": [[t.position, t.token_id, t.text, t.logprob, t.top_logprobs] for t in s.tokens]}


def scored_from_json(obj: dict[str, Any]) -> Scored:
    tokens = [TokenChosen(step=0, req_id=obj["req_id"], t=0.0, position=p, token_id=tid, text=text, logprob=lp,
                          rank=None, top_logprobs=top, source="external") for p, tid, text, lp, top in obj["tokens"]]
    return Scored(obj["req_id"], bool(obj["greedy"]), list(obj["prompt_ids"]), tokens, obj.get("note", ""))


def check_from_json(row: dict[str, Any]) -> RequestCheck:
    return RequestCheck(row["req_id"], row["greedy"], [PositionCheck(**p) for p in row["positions"]],
                        row["first_divergence"], row["divergence_class"], row.get("note", ""))
