"""The small hand-made trace every notebook test reads.

`scenario_events()` is a two-request run whose every number is chosen here, so the widget tests can
assert that a figure shows exactly the event of the selected step or request:
- req-a: sampled tokens at steps 1-4 (positions 0-3), finishes by length at step 4;
- req-b: a sampled token at step 1, then speculative steps 2 (drafts 11 12 13: two accepted, the
  third rejected, 99 recovered) and 3 (drafts 21 22 23 all accepted, bonus 24), waits at step 4,
  and stops at step 5 on a sampled token, holding back an incomplete character at step 3.
"""

from __future__ import annotations

from pathlib import Path

from workbench.trace import events as ev
from workbench.trace.store import TraceWriter

KV_TOTAL = 1000
BATCH = {1: ["req-a", "req-b"], 2: ["req-a", "req-b"], 3: ["req-a", "req-b"], 4: ["req-a"], 5: ["req-b"]}
A_TOKENS = {1: (101, " The"), 2: (102, " cat"), 3: (103, " sat"), 4: (104, " down")}
B_SPEC = {2: ([11, 12, 13], [True, True, False], 99, "recovered"), 3: ([21, 22, 23], [True, True, True], 24, "bonus")}


def _stages(step: int) -> list[dict]:
    """Three stages whose probabilities depend on the step, so each step's waterfall differs."""
    base = [0.5 - 0.05 * step, 0.3, 0.1 + 0.05 * step]
    ids = [100 + step, 200 + step, 300 + step]
    return [{"name": "temperature", "top_ids": ids, "top_probs": base, "kept_count": 49152, "kept_mass": 1.0},
            {"name": "top_k", "top_ids": ids, "top_probs": [p / sum(base) for p in base], "kept_count": 3,
             "kept_mass": sum(base)},
            {"name": "top_p", "top_ids": ids[:2], "top_probs": [base[0] / sum(base[:2]), base[1] / sum(base[:2])],
             "kept_count": 2, "kept_mass": sum(base[:2])}]


def _sampled(step: int, rid: str, position: int, tid: int, text: str, t: float) -> list[ev.Event]:
    stages = _stages(step)
    return [
        ev.SamplingStages(step=step, req_id=rid, t=t, position=position, stages=stages, chosen=tid, greedy=False,
                          draw=0.1 * step, seeded=True),
        ev.TokenChosen(step=step, req_id=rid, t=t, position=position, token_id=tid, text=text,
                       logprob=-0.5 * step, rank=1, top_logprobs=[[tid, -0.5 * step, text], [7, -3.0, " dog"]]),
    ]


def _finish(step: int, rid: str, n_out: int, reason: str | None, t: float) -> ev.FinishDecision:
    checks = [{"name": "max_new_tokens", "inputs": {"num_output_tokens": n_out, "max_new_tokens": 4},
               "result": reason == "length"},
              {"name": "stop_string", "inputs": {"matched": "x" if reason == "stop" else None},
               "result": reason == "stop"}]
    evidence = {"type": reason} if reason else None
    return ev.FinishDecision(step=step, req_id=rid, t=t, checks=checks, finish_reason=reason, evidence=evidence)


def _req_a(step: int, t: float) -> list[ev.Event]:
    tid, text = A_TOKENS[step]
    out = _sampled(step, "req-a", step - 1, tid, text, t)
    out.append(ev.DetokState(step=step, req_id="req-a", t=t, new_ids=[tid], delta=text))
    out.append(_finish(step, "req-a", step, "length" if step == 4 else None, t))
    if step == 4:
        out.append(ev.RequestFinished(step=4, req_id="req-a", t=t, text=" The cat sat down",
                                      output_ids=[101, 102, 103, 104], finish_reason="length"))
    return out


def _req_b(step: int, b_pos: list[int], t: float) -> list[ev.Event]:
    out: list[ev.Event] = []
    if step in B_SPEC:
        drafts, accepted, extra, kind = B_SPEC[step]
        n_ok = accepted.index(False) if False in accepted else len(accepted)
        out.append(ev.SpecDraft(step=step, req_id="req-b", t=t, drafter="ngram", tokens=drafts,
                                q=[1.0] * 3, texts=[f" b{d}" for d in drafts]))
        out.append(ev.SpecVerify(step=step, req_id="req-b", t=t, draft_tokens=drafts, p=[0.9, 0.8, 0.1],
                                 q=[1.0] * 3, u=[None] * 3, accepted=accepted, num_accepted=n_ok,
                                 extra_token=extra, extra_kind=kind, target_argmax=drafts[:n_ok] + [extra]))
        new = [(d, "spec_accept") for d in drafts[:n_ok]] + [(extra, f"spec_{kind[:7].rstrip('e')}")]
        for tid, source in new:
            out.append(ev.TokenChosen(step=step, req_id="req-b", t=t, position=b_pos[0], token_id=tid,
                                      text=f" b{tid}", logprob=-0.1, rank=1, source=source))
            b_pos[0] += 1
        held = ("\ufffd", "incomplete_char") if step == 3 else ("", None)
        out.append(ev.DetokState(step=step, req_id="req-b", t=t, new_ids=[x for x, _ in new], delta=f"<{step}>",
                                 held_text=held[0], held_reason=held[1]))
        out.append(_finish(step, "req-b", b_pos[0], None, t))
        return out
    tid = 50 + step
    out += _sampled(step, "req-b", b_pos[0], tid, f" b{tid}", t)
    b_pos[0] += 1
    out.append(ev.DetokState(step=step, req_id="req-b", t=t, new_ids=[tid], delta=f"<{step}>"))
    out.append(_finish(step, "req-b", b_pos[0], "stop" if step == 5 else None, t))
    if step == 5:
        out.append(ev.RequestFinished(step=5, req_id="req-b", t=t, text="<1><2><3><5>", finish_reason="stop"))
    return out


def scenario_events() -> list[ev.Event]:
    events: list[ev.Event] = [
        ev.RequestAdded(step=1, req_id="req-a", t=0.0, prompt="A cat", prompt_ids=[1, 2]),
        ev.RequestAdded(step=1, req_id="req-b", t=0.0, prompt=[{"role": "user", "content": "Say b"}],
                        prompt_ids=[3, 4, 5]),
    ]
    b_pos = [0]
    for step, batch in BATCH.items():
        t = float(step)
        events.append(ev.ScheduleDecision(step=step, t=t, mode="EXTEND" if step == 1 else "DECODE",
                                          running=batch, decode=batch if step > 1 else [],
                                          kv_used=10 * step, kv_total=KV_TOTAL))
        events.append(ev.ForwardBatchBuilt(step=step, t=t, batch_size=len(batch), req_ids=batch))
        for rid in batch:
            events += _req_a(step, t) if rid == "req-a" else _req_b(step, b_pos, t)
    return events


def write_scenario(path: Path) -> Path:
    with TraceWriter(path, meta={"engine": {"model": "hand-made"}}) as writer:
        for event in scenario_events():
            writer.write(event)
    return path
