"""The example trace the TUI tests look at, and checks that it reads back as written.

`write_example_trace(path)` writes, through `TraceWriter`, a six-step run of three requests with
real SmolLM2 token ids (payload shapes as the engine, spec worker, detokenizer and finish.py emit):

- step 1, EXTEND: prefill req-0 "The capital of France is" (greedy, stop "\\n\\n") and req-1 (a
  haiku, temperature 0.7 / top-p 0.9 / top-k 50, seeded); req-0 gets " Paris", req-1 " Waves".
- step 2, MIXED: prefill req-2 "Count: one, two," (greedy) + decodes; req-2 gets " three".
- step 3, DECODE with speculative decoding (ngram, k=4; a TARGET_VERIFY forward): req-1's drafts
  " on", " the" are accepted, " shore" rejected (u 0.57 >= p 0.12), " rocks" recovered; req-2's 4
  drafts all accepted plus a bonus ","; req-0 decodes "\\n", held back as a possible stop string.
- step 4, DECODE: req-0's second "\\n" completes the stop string "\\n\\n": finish reason stop.
  req-1 gets the first byte of "🙂" (held: incomplete character); req-2 " six".
- step 5: req-1 completes "🙂"; req-2 reaches max_new_tokens=8 (length).
- step 6: req-1 samples <|im_end|> (EOS): stop.

The `example_trace` fixture (conftest.py) writes it once per session.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from workbench.trace import events as ev
from workbench.trace.store import TraceWriter

EOS = 2
REQS = {
    "req-0": ("The capital of France is", {"temperature": 0.0, "max_new_tokens": 16, "stop": ["\n\n"]}),
    "req-1": ("Write a haiku about the sea:", {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 7,
                                                 "max_new_tokens": 32}),
    "req-2": ("Count: one, two,", {"temperature": 0.0, "max_new_tokens": 8}),
}


def smollm2_tokenizer_folder() -> Path:
    """SmolLM2's model folder (its tokenizer.json); built from the GGUF package on first use."""
    from workbench.models.loader import cache_root, resolve_folder

    folder = cache_root() / "models" / "smollm2-135m-instruct"
    return folder if (folder / "tokenizer.json").exists() else resolve_folder("smollm2")[0]


class _Run:
    """A tiny bookkeeping engine: KV slots, positions, output counts and event times."""

    def __init__(self, writer: TraceWriter, tokenizer: Any) -> None:
        self.w, self.tok = writer, tokenizer
        self.t, self.step, self.slot = 100.0, 0, 1
        self.kv: dict[str, int] = {}
        self.out: dict[str, list[int]] = {r: [] for r in REQS}
        self.text: dict[str, str] = {r: "" for r in REQS}
        self.pool = {r: i for i, r in enumerate(REQS)}

    def id(self, text: str) -> int:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens")
        return ids[0]

    def piece(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def emit(self, cls: type[ev.Event], req_id: str | None = None, **payload: Any) -> None:
        self.t = round(self.t + 0.0005, 6)
        self.w.write(cls(step=self.step, req_id=req_id, t=self.t, **payload))

    def add(self, rid: str) -> None:
        prompt, params = REQS[rid]
        ids = self.tok.encode(prompt, add_special_tokens=False).ids
        self.emit(ev.RequestAdded, rid, prompt=prompt, prompt_ids=ids, params=params)
        self.kv[rid] = 0

    def schedule(self, mode: str, prefill: list[str], decode: list[str], tokens: int, waiting: list[str] = ()) -> None:
        chunks = [{"req_id": r, "start": 0, "length": len(self.prompt_ids(r)), "last_chunk": True} for r in prefill]
        self.emit(ev.ScheduleDecision, mode=mode, waiting=list(waiting), running=prefill + decode, prefill=chunks,
                  decode=decode, token_budget=2048, tokens_scheduled=tokens, kv_used=self.slot - 1 + tokens,
                  kv_total=4096)

    def prompt_ids(self, rid: str) -> list[int]:
        return self.tok.encode(REQS[rid][0], add_special_tokens=False).ids

    def forward(self, mode: str, rows: list[tuple[str, list[int]]], ms: float) -> None:
        """One ForwardBatchBuilt (KV slots allocated in order) and its ForwardDone."""
        ids, pos, loc = [], [], []
        for rid, row in rows:
            ids += row
            pos += list(range(self.kv[rid], self.kv[rid] + len(row)))
            loc += list(range(self.slot, self.slot + len(row)))
            self.slot += len(row)
        prefix = [self.kv[r] for r, _ in rows]
        for rid, row in rows:
            self.kv[rid] += len(row)
        info = [{"temperature": REQS[r][1]["temperature"], "top_p": REQS[r][1].get("top_p", 1.0),
                 "top_k": REQS[r][1].get("top_k", -1)} for r, _ in rows]
        self.emit(ev.KVEvent, op="alloc", slots=loc, reason="schedule", kv_used=self.slot - 1, kv_total=4096)
        self.emit(ev.ForwardBatchBuilt, forward_mode=mode, batch_size=len(rows), input_ids=ids,
                  req_pool_indices=[self.pool[r] for r, _ in rows], seq_lens=[self.kv[r] for r, _ in rows],
                  out_cache_loc=loc, positions=pos, extend_prefix_lens=prefix,
                  extend_seq_lens=[len(r) for _, r in rows], return_logprob=True,
                  top_logprobs_nums=[3] * len(rows), req_ids=[r for r, _ in rows], sampling_info=info)
        self.emit(ev.ForwardDone, forward_mode=mode, num_tokens=len(ids), batch_size=len(rows), forward_ms=ms,
                  sample_ms=0.25)

    def token(self, rid: str, text: str | int, lp: float, alts: list[tuple[str | int, float]],
              source: str = "sample", draw: float | None = None) -> int:
        """Logits (+ sampling stages for a sampled token) and the TokenChosen of one appended token."""
        tid = text if isinstance(text, int) else self.id(text)
        pos = len(self.out[rid])
        top = [(a if isinstance(a, int) else self.id(a), v) for a, v in alts]
        self.emit(ev.Logits, rid, position=pos, top_ids=[i for i, _ in top],
                  top_logits=[round(12 + 2 * v, 3) for _, v in top], entropy=round(-sum(math.exp(v) * v for _, v in top), 3))
        if source == "sample":
            self.stages(rid, pos, tid, top, draw)
        rank = 1 + sum(1 for _, v in top if v > lp)
        self.emit(ev.TokenChosen, rid, position=pos, token_id=tid, text=self.piece(tid), logprob=lp, rank=rank,
                  top_logprobs=[[i, v, self.piece(i)] for i, v in top], source=source)
        self.out[rid].append(tid)
        return tid

    def stages(self, rid: str, pos: int, tid: int, top: list[tuple[int, float]], draw: float | None) -> None:
        params = REQS[rid][1]
        probs = [round(math.exp(v), 4) for _, v in top]
        ids = [i for i, _ in top]
        greedy = params["temperature"] == 0
        kept = [("temperature", 49152, 1.0), ("top_k", params.get("top_k", 49152), 0.97),
                ("top_p", 3, min(1.0, round(sum(probs), 4)))]
        stages = [{"name": n, "top_ids": ids, "top_probs": [round(p / (m if n == "top_p" else 1.0), 4) for p in probs],
                   "kept_mass": m, "kept_count": c, "entropy": 1.2, "applied": not greedy and n in params or n == "temperature"}
                  for n, c, m in kept]
        self.emit(ev.SamplingStages, rid, position=pos, stages=stages, chosen=tid, greedy=greedy,
                  draw=None if greedy else draw, seeded="seed" in params)

    def detok(self, rid: str, new: list[int], delta: str, held: str = "", reason: str | None = None,
              stop: str | None = None) -> None:
        self.text[rid] += delta
        n = len(self.out[rid])
        self.emit(ev.DetokState, rid, new_ids=new, prefix_offset=max(0, n - 5), read_offset=n,
                  decoded_len=len(self.text[rid]) + len(held), held_text=held, held_reason=reason, delta=delta,
                  stop_matched=stop)

    def finish(self, rid: str, *, eos: bool = False, stop: str | None = None) -> str | None:
        n, params = len(self.out[rid]), REQS[rid][1]
        tok = self.out[rid][-1]
        hit_max = n >= params["max_new_tokens"]
        checks = [
            {"name": "abort", "inputs": {"reason": None}, "result": False},
            {"name": "max_new_tokens", "inputs": {"num_output_tokens": n, "max_new_tokens": params["max_new_tokens"]},
             "result": hit_max},
            {"name": "context_full", "inputs": {"seq_len": self.kv[rid] + 1, "context_limit": 8192}, "result": False},
            {"name": "before_min_new_tokens", "inputs": {"num_output_tokens": n, "min_new_tokens": 0}, "result": False},
            {"name": "eos_token", "inputs": {"token_id": tok, "eos_token_ids": [EOS], "ignore_eos": False}, "result": eos},
            {"name": "stop_token_ids", "inputs": {"token_id": tok, "stop_token_ids": []}, "result": False},
            {"name": "stop_string", "inputs": {"matched": stop}, "result": stop is not None},
            {"name": "tool_calls", "inputs": {"has_complete_tool_call": False, "replaces": None}, "result": False},
        ]
        reason, evidence, matched = None, None, None
        if hit_max:
            reason, evidence = "length", {"type": "length", "length": n, "cause": "max_new_tokens"}
        elif eos or stop:
            matched = tok if eos else stop
            reason, evidence = "stop", {"type": "stop", "matched": matched}
        if reason:
            checks[-1]["inputs"]["replaces"] = reason
        self.emit(ev.FinishDecision, rid, checks=checks, finish_reason=reason, evidence=evidence)
        if reason:
            self.emit(ev.KVEvent, rid, op="free", slots=list(range(1, 1 + self.kv[rid])), reason=reason,
                      kv_used=self.slot - 1 - self.kv[rid], kv_total=4096)
            prompt_n = len(self.prompt_ids(rid))
            self.emit(ev.RequestFinished, rid, text=self.text[rid], output_ids=list(self.out[rid]), finish_reason=reason,
                      matched_stop=matched, evidence=evidence, usage={"prompt_tokens": prompt_n, "completion_tokens": n},
                      timings={"ttft_ms": 12.5})
        return reason


def _steps_1_2(r: _Run) -> None:
    r.step = 1
    r.add("req-0")
    r.add("req-1")
    r.schedule("EXTEND", ["req-0", "req-1"], [], 5 + 7, waiting=[])
    r.forward("EXTEND", [("req-0", r.prompt_ids("req-0")), ("req-1", r.prompt_ids("req-1"))], 6.5)
    r.detok("req-0", [r.token("req-0", " Paris", -0.08, [(" Paris", -0.08), (" a", -3.1), (" the", -3.5)])], " Paris")
    r.finish("req-0")
    r.detok("req-1", [r.token("req-1", " Waves", -1.2, [(" The", -0.9), (" Waves", -1.2), ("\n", -1.9)], draw=0.53)],
            " Waves")
    r.finish("req-1")
    r.step = 2
    r.add("req-2")
    r.schedule("MIXED", ["req-2"], ["req-0", "req-1"], 7 + 2)
    r.forward("MIXED", [("req-2", r.prompt_ids("req-2")), ("req-0", [r.out["req-0"][-1]]),
                        ("req-1", [r.out["req-1"][-1]])], 5.25)
    r.detok("req-2", [r.token("req-2", " three", -0.05, [(" three", -0.05), (" two", -3.4), ("\n", -4.0)])], " three")
    r.finish("req-2")
    r.detok("req-0", [r.token("req-0", ".", -0.4, [(".", -0.4), (",", -1.5), ("\n", -2.2)])], ".")
    r.finish("req-0")
    r.detok("req-1", [r.token("req-1", " crash", -0.7, [(" crash", -0.7), (" roll", -1.3), (" foam", -2.0)], draw=0.21)],
            " crash")
    r.finish("req-1")


def _step_3(r: _Run) -> None:
    """Speculative decode: req-1 sampled (one rejection), req-2 greedy (all accepted + bonus), req-0 plain."""
    r.step = 3
    r.schedule("DECODE", [], ["req-0", "req-1", "req-2"], 11)
    d1 = [r.id(t) for t in (" on", " the", " shore", " and")]
    d2 = [r.id(t) for t in (",", " four", ",", " five")]
    r.emit(ev.SpecDraft, "req-1", drafter="ngram", tokens=d1, q=[1.0] * 4, texts=[r.piece(t) for t in d1], position=2)
    r.emit(ev.SpecDraft, "req-2", drafter="ngram", tokens=d2, q=[1.0] * 4, texts=[r.piece(t) for t in d2], position=1)
    r.forward("TARGET_VERIFY", [("req-1", [r.out["req-1"][-1]] + d1), ("req-2", [r.out["req-2"][-1]] + d2),
                                ("req-0", [r.out["req-0"][-1]])], 9.75)
    freed1 = list(range(r.slot - 11 + 3, r.slot - 11 + 5))  # req-1's rejected " shore", " and"
    r.kv["req-1"] -= 2
    r.emit(ev.KVEvent, "req-1", op="rollback", slots=freed1, reason="spec: rejected drafts", kv_used=r.slot - 3,
           kv_total=4096)
    rocks = r.id(" rocks")
    r.emit(ev.SpecVerify, "req-1", draft_tokens=d1, p=[0.62, 0.55, 0.12, 0.3], q=[1.0] * 4, u=[0.41, 0.2, 0.57, None],
           accepted=[True, True, False, False], num_accepted=2, extra_token=rocks, extra_kind="recovered",
           target_argmax=[d1[0], d1[1], rocks, d1[3]], freed_slots=freed1, greedy=False, position=2,
           emitted=d1[:2] + [rocks], extra_draw=0.33, draft_freed_slots=[])
    toks = [r.token("req-1", " on", -0.48, [(" on", -0.48), (" against", -1.4), (" upon", -2.1)], "spec_accept"),
            r.token("req-1", " the", -0.6, [(" the", -0.6), (" a", -1.1), (" rocks", -2.9)], "spec_accept"),
            r.token("req-1", " rocks", -1.1, [(" sand", -0.95), (" rocks", -1.1), (" shore", -2.1)], "spec_recover")]
    comma = r.id(",")
    r.emit(ev.SpecVerify, "req-2", draft_tokens=d2, p=[0.97, 0.93, 0.95, 0.9], q=[1.0] * 4, u=[None] * 4,
           accepted=[True] * 4, num_accepted=4, extra_token=comma, extra_kind="bonus", target_argmax=d2,
           freed_slots=[], greedy=True, position=1, emitted=d2 + [comma], extra_draw=None, draft_freed_slots=[])
    toks2 = [r.token("req-2", t, lp, [(t, lp), (" and", -4.0), ("\n", -5.0)], "spec_accept")
             for t, lp in ((",", -0.03), (" four", -0.07), (",", -0.05), (" five", -0.1))]
    toks2.append(r.token("req-2", ",", -0.04, [(",", -0.04), (" and", -3.5), ("\n", -4.1)], "spec_bonus"))
    r.detok("req-0", [r.token("req-0", "\n", -0.3, [("\n", -0.3), (" It", -1.6), (" The", -2.4)])], "", held="\n",
            reason="possible_stop")
    r.finish("req-0")
    r.detok("req-1", toks, " on the rocks")
    r.finish("req-1")
    r.detok("req-2", toks2, ", four, five,")
    r.finish("req-2")


def _steps_4_6(r: _Run) -> None:
    r.step = 4
    r.schedule("DECODE", [], ["req-0", "req-1", "req-2"], 3)
    r.forward("DECODE", [(x, [r.out[x][-1]]) for x in ("req-0", "req-1", "req-2")], 4.5)
    r.detok("req-0", [r.token("req-0", "\n", -0.2, [("\n", -0.2), ("The", -2.0), ("It", -2.6)])], "", stop="\n\n")
    r.finish("req-0", stop="\n\n")
    byte1, byte2 = r.tok.encode("🙂", add_special_tokens=False).ids
    r.detok("req-1", [r.token("req-1", byte1, -2.3, [(" sand", -1.0), ("\n", -1.5), (byte1, -2.3)], draw=0.91)], "",
            held="\ufffd", reason="incomplete_char")
    r.finish("req-1")
    r.detok("req-2", [r.token("req-2", " six", -0.06, [(" six", -0.06), (" and", -3.2), ("\n", -4.4)])], " six")
    r.finish("req-2")
    r.step = 5
    r.schedule("DECODE", [], ["req-1", "req-2"], 2)
    r.forward("DECODE", [(x, [r.out[x][-1]]) for x in ("req-1", "req-2")], 4.25)
    r.detok("req-1", [r.token("req-1", byte2, -0.01, [(byte2, -0.01), (" ", -5.0), ("\n", -6.0)], draw=0.4)], "🙂")
    r.finish("req-1")
    r.detok("req-2", [r.token("req-2", ",", -0.08, [(",", -0.08), (" and", -2.9), ("\n", -3.3)])], ",")
    r.finish("req-2")
    r.step = 6
    r.schedule("DECODE", [], ["req-1"], 1)
    r.forward("DECODE", [("req-1", [r.out["req-1"][-1]])], 4.0)
    r.detok("req-1", [r.token("req-1", EOS, -0.35, [(EOS, -0.35), ("\n", -1.4), (" The", -3.0)], draw=0.12)], "")
    r.finish("req-1", eos=True)


def write_example_trace(path: Path, tokenizer_folder: Path) -> Path:
    """Write the six-step example run (see the module docstring) to `path`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    meta = {"engine": {"model": "smollm2", "spec": "ngram:k=4", "max_batch_tokens": 2048},
            "model": {"spec": "smollm2", "name": "SmolLM2-135M-Instruct", "hash": "example"},
            "tokenizer": {"name": str(tokenizer_folder), "vocab_size": 49152, "eos_token_id": EOS},
            "requests": [{"req_id": r, "arrival_step": 1 if r != "req-2" else 2} for r in REQS]}
    with TraceWriter(path, meta) as writer:
        run = _Run(writer, tok)
        _steps_1_2(run)
        _step_3(run)
        _steps_4_6(run)
    return path

