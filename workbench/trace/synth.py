"""Synthetic `.wbtrace` files: a realistic engine run of any size, written fast by bulk insert.

Owns: `write_synthetic_trace`, used by tests and benchmarks (reader open time on a million-event
trace). It simulates continuous batching (arrivals, chunked prefill, MIXED and DECODE steps,
speculative draft/verify steps, finishes by length and stop) and emits every event kind with
payloads shaped like the engine's. It bypasses the writer thread, but writes the same layout
through format.py. It does not run a model: token ids, texts and probabilities are random.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workbench.trace import events as ev
from workbench.trace.events import Event
from workbench.trace.format import StepSummary, create_indexes, create_schema, json_dumps, upsert_steps

_WORDS = ["the", " cat", " sat", " on", " a", " mat", ".", "\n", " é", " naïve", " 日本", ' "q"', " \\", " ok",
          " token", " batch", " step", ",", " and", " then", " 🙂", " KV", " cache", " is", " full"]
_TEXT_JSON = [json.dumps(w) for w in _WORDS]  # pre-escaped: payloads are formatted, not dumped
_VOCAB = 49152
_FLUSH_ROWS = 50_000


_POOL = 1024  # pre-rendered per-token payload parts, so a million events format in seconds


class _Pools:
    """Random per-token payload fragments (top-k ids, probabilities, alternatives), rendered once."""

    def __init__(self, rng: random.Random) -> None:
        self.tid: list[int] = []
        self.logits: list[str] = []
        self.sampling: list[str] = []
        self.token: list[str] = []
        self.draft: list[str] = []
        self.verify: list[str] = []
        self.accepted: list[int] = []
        for k in range(_POOL):
            self.add_spec(rng)
            top = [rng.randrange(_VOCAB) for _ in range(5)]
            probs = sorted((round(rng.random() / 2, 4) for _ in range(5)), reverse=True)
            lp, draw, w = round(-rng.expovariate(2.0), 4), round(rng.random(), 4), k % len(_WORDS)
            stages = ",".join(f'{{"name":"{name}","top_ids":{top},"top_probs":{probs},"kept_mass":{mass},'
                              f'"kept_count":{count},"entropy":1.5,"applied":true}}'
                              for name, mass, count in (("temperature", 1.0, _VOCAB), ("top_k", 0.97, 50),
                                                        ("top_p", 0.9, 12)))
            alts = ",".join(f'[{i},{round(lp - j, 3)},{_TEXT_JSON[(w + j) % len(_WORDS)]}]'
                            for j, i in enumerate(top[:3]))
            self.tid.append(top[0])
            self.logits.append(f'"top_ids":{top},"top_logits":{[round(10 * p, 3) for p in probs]},'
                               f'"entropy":{round(rng.random() * 4, 3)}')
            self.sampling.append(f'"stages":[{stages}],"chosen":{top[0]},"greedy":false,"draw":{draw},'
                                 f'"seeded":true')
            self.token.append(f'"token_id":{top[0]},"text":{_TEXT_JSON[w]},"logprob":{lp},'
                              f'"rank":{1 + (draw > 0.7)},"top_logprobs":[{alts}]')


    def add_spec(self, rng: random.Random, k: int = 3) -> None:
        drafts = [rng.randrange(_VOCAB) for _ in range(k)]
        q = [round(rng.random(), 4) for _ in range(k)]
        n = next((i for i in range(k) if rng.random() < 0.35), k)
        self.accepted.append(n)
        self.draft.append(json_dumps({"drafter": "ngram", "tokens": drafts, "q": q,
                                      "texts": [rng.choice(_WORDS) for _ in range(k)]}))
        self.verify.append(json_dumps({
            "draft_tokens": drafts, "p": [round(rng.random(), 4) for _ in range(k)], "q": q,
            "u": [round(rng.random(), 4) for _ in range(k)], "accepted": [i < n for i in range(k)],
            "num_accepted": n, "extra_token": rng.randrange(_VOCAB), "extra_kind": "bonus" if n == k else "recovered",
            "target_argmax": drafts, "freed_slots": list(range(k - n)), "greedy": False}))


@dataclass(slots=True)
class _Req:
    rid: str
    prompt_len: int
    max_new: int
    prefilled: int = 0
    out: int = 0
    text_len: int = 0
    stop_at: int = -1  # output length at which a stop token ends it; -1: runs to max_new
    ids: list[int] = field(default_factory=list)


class _Sim:
    """The simulated engine: each `step()` appends that step's event rows and its summary."""

    def __init__(self, conn: sqlite3.Connection, seed: int, max_batch: int, spec_every: int) -> None:
        self.conn, self.rng = conn, random.Random(seed)
        self.pools = _Pools(self.rng)
        self.max_batch, self.spec_every = max_batch, spec_every
        self.budget, self.kv_total = 512, 32768
        self.rows: list[tuple[Any, ...]] = []
        self.summaries: list[StepSummary] = []
        self.next_id, self.t, self.num_requests = 1, 1000.0, 0
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.requests: list[dict[str, Any]] = []
        self.step_no, self.summary = 0, StepSummary(step=0)

    # --- rows ---------------------------------------------------------------------------------

    def emit(self, kind: str, req_id: str | None, payload: str | dict[str, Any]) -> None:
        text = payload if isinstance(payload, str) else json_dumps(payload)
        self.t += 0.00002
        self.rows.append((self.next_id, self.step_no, req_id, kind, self.t, text))
        self.next_id += 1

    def write_rows(self) -> None:
        self.conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", self.rows)
        upsert_steps(self.conn, self.summaries)
        self.rows, self.summaries = [], []

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> None:
        s = self.summary = StepSummary(step=self.step_no, first_id=self.next_id, t_start=self.t + 0.00002)
        self.arrivals()
        decode = list(self.running)
        spec = self.spec_every > 0 and bool(decode) and self.step_no % self.spec_every == 0
        prefill = [] if spec else self.plan_prefill(len(decode))
        if decode or prefill:
            self.batch(decode, prefill, bool(spec))
        s.num_events, s.last_id, s.t_end = self.next_id - s.first_id, self.next_id - 1, self.t
        if s.num_events:
            self.summaries.append(s)
        self.step_no += 1
        self.t += 0.0005
        if len(self.rows) >= _FLUSH_ROWS:
            self.write_rows()

    def arrivals(self) -> None:
        while len(self.waiting) + len(self.running) < self.max_batch + 4 and self.rng.random() < 0.6:
            rng, rid = self.rng, f"req-{self.num_requests}"
            req = _Req(rid, rng.randint(16, 400), rng.randint(8, 300))
            req.stop_at = rng.randint(4, req.max_new) if rng.random() < 0.5 else -1
            self.num_requests += 1
            prompt_ids = [int(rng.random() * _VOCAB) for _ in range(req.prompt_len)]
            params = {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_new_tokens": req.max_new,
                      "seed": rng.randrange(2**31), "stop": ["\n\n"], "logprobs": True, "top_logprobs": 3}
            prompt = "".join(rng.choice(_WORDS) for _ in range(min(req.prompt_len, 60)))
            self.emit("request.added", rid, {"prompt": prompt, "prompt_ids": prompt_ids, "params": params,
                                             "parent_id": None})
            self.emit("stamp", rid, {"stage": "arrival", "detail": {}})
            self.requests.append({"req_id": rid, "arrival_step": self.step_no, "params": params})
            self.waiting.append(req)

    def plan_prefill(self, num_decode: int) -> list[tuple[_Req, int, int]]:
        budget, out = self.budget - num_decode, []
        while self.waiting and budget > 0 and num_decode + len(out) < self.max_batch:
            req = self.waiting[0]
            length = min(req.prompt_len - req.prefilled, budget)
            out.append((req, req.prefilled, length))
            budget -= length
            if req.prefilled + length < req.prompt_len:
                break  # chunked: the rest of this prompt waits for the next step
            self.running.append(self.waiting.popleft())
        return out

    def batch(self, decode: list[_Req], prefill: list[tuple[_Req, int, int]], spec: bool) -> None:
        mode = "MIXED" if decode and prefill else ("DECODE" if decode else "EXTEND")
        reqs = [r.rid for r, _, _ in prefill] + [r.rid for r in decode]
        num_tokens = sum(n for _, _, n in prefill) + len(decode) * (4 if spec else 1)
        kv_used = sum(r.prefilled + r.out for r in self.running) + num_tokens
        self.emit("schedule", None, {
            "mode": mode, "waiting": [r.rid for r in self.waiting], "running": [r.rid for r in self.running],
            "prefill": [{"req_id": r.rid, "start": s, "length": n, "last_chunk": s + n == r.prompt_len}
                        for r, s, n in prefill],
            "decode": [r.rid for r in decode], "preempted": [], "rejected": [], "token_budget": self.budget,
            "tokens_scheduled": num_tokens, "kv_used": kv_used, "kv_total": self.kv_total})
        slots = list(range(kv_used - num_tokens + 1, kv_used + 1))
        self.emit("kv", None, {"op": "alloc", "slots": slots, "reason": "schedule", "kv_used": kv_used,
                               "kv_total": self.kv_total})
        fmode = "TARGET_VERIFY" if spec else mode
        if spec:
            self.forward("DRAFT_EXTEND", reqs, len(decode) * 3, "draft")
        self.forward(fmode, reqs, num_tokens, "target")
        s = self.summary
        s.mode, s.batch_size, s.num_tokens, s.req_ids = mode, len(reqs), num_tokens, reqs
        s.kv_used, s.kv_total = kv_used, self.kv_total
        for req, start, length in prefill:
            req.prefilled = start + length
            if req.prefilled == req.prompt_len:
                self.tokens(req, ["sample"])
        for req in decode:
            self.tokens(req, self.verify(req) if spec else ["sample"])
        self.finish_done()

    def forward(self, mode: str, reqs: list[str], num_tokens: int, model: str) -> None:
        rng = self.rng
        ids = [int(rng.random() * _VOCAB) for _ in range(num_tokens)]
        self.emit("forward_batch", None, {
            "forward_mode": mode, "batch_size": len(reqs), "input_ids": ids,
            "req_pool_indices": list(range(len(reqs))), "seq_lens": [rng.randint(16, 900) for _ in reqs],
            "out_cache_loc": list(range(num_tokens)), "positions": list(range(num_tokens)),
            "extend_prefix_lens": [], "extend_seq_lens": [], "return_logprob": True,
            "top_logprobs_nums": [3] * len(reqs), "req_ids": reqs,
            "sampling_info": [{"temperature": 0.7, "top_p": 0.9, "top_k": 50} for _ in reqs]})
        ms = 4.0 + 0.02 * num_tokens + rng.random()
        self.t += ms / 1000.0
        self.summary.forward_ms += ms
        self.emit("forward", None, {"forward_mode": mode, "num_tokens": num_tokens, "batch_size": len(reqs),
                                    "forward_ms": round(ms, 3), "sample_ms": 0.4, "model": model})

    def verify(self, req: _Req) -> list[str]:
        """A draft of 3 tokens and its verification; returns the sources of the tokens it yields."""
        k, pools = int(self.rng.random() * _POOL), self.pools
        n = pools.accepted[k]
        self.emit("spec.draft", req.rid, pools.draft[k])
        self.emit("spec.verify", req.rid, pools.verify[k])
        self.summary.spec_proposed += 3
        self.summary.spec_accepted += n
        return ["spec_accept"] * n + ["spec_bonus" if n == 3 else "spec_recover"]

    def tokens(self, req: _Req, sources: list[str]) -> None:
        """Logits, sampling stages, token, detokenizer and finish events for each new token."""
        rid, pools = req.rid, self.pools
        for source in sources:
            if req.stop_at == -2:
                return  # finished earlier in this step (a stop inside accepted drafts)
            k = int(self.rng.random() * _POOL)
            pos, tid, w = req.out, pools.tid[k], k % len(_WORDS)
            self.emit("logits", rid, f'{{"position":{pos},{pools.logits[k]},"tensor":null}}')
            self.emit("sampling", rid, f'{{"position":{pos},{pools.sampling[k]}}}')
            self.emit("token", rid, f'{{"position":{pos},{pools.token[k]},"source":"{source}"}}')
            req.out, req.text_len = req.out + 1, req.text_len + len(_WORDS[w])
            self.emit("detok", rid, f'{{"new_ids":[{tid}],"prefix_offset":{max(pos - 5, 0)},"read_offset":{pos},'
                      f'"decoded_len":{req.text_len},"held_text":"","held_reason":null,'
                      f'"delta":{_TEXT_JSON[w]},"stop_matched":null}}')
            self.summary.output_tokens += 1
            self.finish_check(req, tid)

    def finish_check(self, req: _Req, tid: int) -> None:
        length, stop = req.out >= req.max_new, req.out == req.stop_at
        if not (length or stop):  # the common case, formatted rather than dumped
            self.emit("finish", req.rid, f'{{"checks":[{{"name":"abort","inputs":{{}},"result":false}},'
                      f'{{"name":"length","inputs":{{"output_len":{req.out},"max_new_tokens":{req.max_new}}},'
                      f'"result":false}},{{"name":"stop_token","inputs":{{"token_id":{tid}}},"result":false}}],'
                      f'"finish_reason":null,"evidence":null}}')
            return
        reason = "length" if length else "stop"
        evidence = {"type": reason, "matched": tid if reason == "stop" else None}
        self.emit("finish", req.rid, {"checks": [
            {"name": "abort", "inputs": {}, "result": False},
            {"name": "length", "inputs": {"output_len": req.out, "max_new_tokens": req.max_new}, "result": length},
            {"name": "stop_token", "inputs": {"token_id": tid}, "result": stop and not length}],
            "finish_reason": reason, "evidence": evidence})
        req.stop_at, req.ids = -2, [reason]

    def finish_done(self) -> None:
        for req in [r for r in self.running if r.stop_at == -2]:
            self.running.remove(req)
            reason = req.ids[0]
            used = sum(r.prefilled + r.out for r in self.running)
            self.summary.kv_used = used
            self.emit("kv", None, {"op": "free", "slots": list(range(req.prompt_len + req.out)),
                                   "reason": "finish", "kv_used": used, "kv_total": self.kv_total})
            self.emit("request.finished", req.rid, {
                "text": "x" * req.text_len, "output_ids": [], "finish_reason": reason,
                "matched_stop": None, "evidence": {"type": reason}, "error": None, "spec": None,
                "usage": {"prompt_tokens": req.prompt_len, "completion_tokens": req.out},
                "timings": {"ttft_ms": 12.5, "itl_ms": [8.0] * min(req.out, 4)}})


def write_synthetic_trace(path: str | os.PathLike[str], num_events: int = 1_000_000, *, seed: int = 0,
                          max_batch: int = 32, spec_every: int = 4, finished: bool = True) -> dict[str, Any]:
    """Write a synthetic trace of at least `num_events` events (whole steps) to `path`, replacing it.

    `spec_every=n`: every n-th all-decode step is a speculative draft/verify step (0: never).
    `finished=False` leaves the `finished` flag unset, like a crashed run. Returns counts
    (events, steps, requests, bytes).
    """
    path = os.fspath(path)
    for suffix in ("", "-wal", "-shm", "-journal"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = OFF")  # a throwaway file: no rollback journal needed
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -131072")  # 128 MiB: building the indexes sorts in memory
        conn.execute("PRAGMA temp_store = MEMORY")
        meta = {"engine": {"synthetic": True, "max_batch": max_batch, "token_budget": 512},
                "model": {"name": "synthetic", "hash": "0" * 64}, "seeds": {"engine": seed}}
        create_schema(conn, meta, indexes=False)
        sim = _Sim(conn, seed, max_batch, spec_every)
        conn.execute("BEGIN")
        while sim.next_id <= num_events:
            sim.step()
        sim.write_rows()
        conn.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                         [("requests", json_dumps(sim.requests)), ("finished", json_dumps(finished))])
        conn.execute("COMMIT")
        create_indexes(conn)
        conn.execute("PRAGMA journal_mode = DELETE")
    finally:
        conn.close()
    num_steps = sim.step_no
    return {"events": sim.next_id - 1, "steps": num_steps, "requests": sim.num_requests,
            "bytes": os.path.getsize(path)}


def example_events(step: int = 0, req_id: str = "req-0", t: float = 1.0) -> list[Event]:
    """One hand-written event of every kind, with plausible payloads (for tests and docs)."""
    r, b = {"step": step, "req_id": req_id, "t": t}, {"step": step, "req_id": None, "t": t}
    return [
        ev.RequestAdded(**r, prompt=[{"role": "user", "content": "Hi é 🙂"}], prompt_ids=[1, 2, 3],
                        params={"temperature": 0.0, "max_new_tokens": 8, "stop": ["\n"]}),
        ev.ScheduleDecision(**b, mode="EXTEND", prefill=[{"req_id": req_id, "start": 0, "length": 3,
                                                          "last_chunk": True}], running=[req_id],
                            token_budget=512, tokens_scheduled=3, kv_used=3, kv_total=64),
        ev.KVEvent(**b, op="alloc", slots=[1, 2, 3], reason="schedule", kv_used=3, kv_total=64),
        ev.ForwardBatchBuilt(**b, forward_mode="EXTEND", batch_size=1, input_ids=[1, 2, 3], seq_lens=[3],
                             out_cache_loc=[1, 2, 3], positions=[0, 1, 2], extend_prefix_lens=[0],
                             extend_seq_lens=[3], req_ids=[req_id], sampling_info=[{"temperature": 0.0}]),
        ev.ForwardDone(**b, forward_mode="EXTEND", num_tokens=3, batch_size=1, forward_ms=2.5, sample_ms=0.1),
        ev.Logits(**r, position=0, top_ids=[7, 8], top_logits=[3.5, 1.25], entropy=0.4),
        ev.SamplingStages(**r, position=0, stages=[{"name": "temperature", "top_ids": [7, 8],
                                                    "top_probs": [0.9, 0.1], "kept_mass": 1.0, "applied": False}],
                          chosen=7, greedy=True),
        ev.SpecDraft(**r, drafter="ngram", tokens=[9, 10], q=[1.0, 1.0], texts=[" a", " b"]),
        ev.SpecVerify(**r, draft_tokens=[9, 10], p=[0.5, 0.2], q=[1.0, 1.0], u=[None, None],
                      accepted=[True, False], num_accepted=1, extra_token=11, extra_kind="target"),
        ev.TokenChosen(**r, position=0, token_id=7, text=" é", logprob=-0.105, rank=1,
                       top_logprobs=[[7, -0.105, " é"], [8, -2.3, "\n"]]),
        ev.DetokState(**r, new_ids=[7], read_offset=1, decoded_len=2, delta=" é"),
        ev.FinishDecision(**r, checks=[{"name": "length", "inputs": {"output_len": 1}, "result": False}]),
        ev.Stamp(**r, stage="sampled", detail={"ms": 1.5}),
        ev.EngineError(**b, message="boom", affected=[req_id]),
        ev.RequestFinished(**r, text=" é", output_ids=[7], finish_reason="stop", matched_stop=7,
                           evidence={"type": "stop", "matched": 7}, usage={"prompt_tokens": 3}),
    ]
