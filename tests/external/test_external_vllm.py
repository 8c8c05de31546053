"""A real vLLM (CPU build, fp32) recorded by `probe` and checked against the reference.

The session's vLLM (conftest `vllm_server`, started once: it takes minutes) serves the same
dequantized SmolLM2 folder the reference loads. One probe sends 16 greedy and 8 seeded-sampling
requests, plain and chat, 8 at a time; `workbench check --reference smollm2` then scores every
output position by teacher forcing. What a user relies on: every request recorded with the
server's own token ids and logprobs, the trace opens in the reader, the TUI and the notebook, and
an fp32 vLLM agrees with the fp32 reference except where the reference itself is a near tie.
"""

from __future__ import annotations

import contextlib
import io
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.prompts import CHAT, PLAIN
from tests.helpers.tui_pilot import pane, tui
from workbench.external.probe import probe
from workbench.external.records import ID_SERVER, ProbeRequest, ProbeResult
from workbench.trace.checks import read_checks
from workbench.trace.reader import open_trace

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
TOP = 20


def _requests() -> list[ProbeRequest]:
    greedy = {"temperature": 0.0}
    reqs = [ProbeRequest(prompt=p, params=greedy) for p in PLAIN]
    reqs += [ProbeRequest(messages=[{"role": "user", "content": c}], params=greedy) for c in CHAT]
    sampled = [{"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i} for i in range(8)]
    reqs += [ProbeRequest(prompt=p, params=s) for p, s in zip(PLAIN[:4], sampled[:4])]
    reqs += [ProbeRequest(messages=[{"role": "user", "content": c}], params=s) for c, s in zip(CHAT[:4], sampled[4:])]
    return reqs


@dataclass(slots=True)
class VllmRun:
    path: Path
    result: ProbeResult
    table: str
    exit_code: int
    checks: dict[str, dict[str, Any]]
    summary: dict[str, Any]


@pytest.fixture(scope="module")
def vllm_run(vllm_server, otlp_receiver, tmp_path_factory) -> VllmRun:
    from workbench.cli import main

    path = tmp_path_factory.mktemp("vllm") / "vllm.wbtrace"
    result = probe(vllm_server.check_alive().url, _requests(), path, concurrency=8, top_logprobs=TOP, max_tokens=MAX_TOKENS,
                   otlp=otlp_receiver, progress=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["check", str(path), "--reference", "smollm2"])
    with open_trace(path) as trace:
        summary = dict(trace.meta.get("check") or {})
    run = VllmRun(path, result, out.getvalue(), code, read_checks(path), summary)
    print(f"\nvLLM startup {vllm_server.startup_s:.0f} s\n{run.table}")  # the figures for the closing note
    return run


def test_every_request_is_recorded_with_the_servers_token_ids_and_logprobs(vllm_run: VllmRun) -> None:
    from transformers import AutoTokenizer

    from workbench.external.peers import smollm2_folder

    res = vllm_run.result
    assert res.errors == [] and res.fallbacks == []  # vLLM took return_tokens_as_token_ids
    assert len(res.records) == 24
    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    for rec in res.records:
        assert rec.tokens and rec.finish_reason in ("length", "stop")
        assert len(rec.tokens) == MAX_TOKENS or rec.finish_reason == "stop"
        assert all(t.id_source == ID_SERVER for t in rec.tokens)  # the server's ids, not recovered
        assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in rec.tokens)
        for t in rec.tokens:  # the top 20, and the chosen token beside them when it is not among them
            ids = [alt[0] for alt in t.top]
            assert t.token_id in ids and len(ids) == (TOP if t.token_id in ids[:TOP] else TOP + 1)
        # the ids recorded are the ones that make the text the server streamed (a stop token is
        # recorded with its logprob, and is not part of the text)
        assert tok.decode([t.token_id for t in rec.tokens], skip_special_tokens=True) == rec.text
        assert rec.usage["completion_tokens"] == len(rec.tokens)
    with open_trace(vllm_run.path) as trace:
        assert trace.meta["source"] == "external"
        assert trace.meta["external"]["identity"]["version"]["version"] == "0.32.0"
        tokens = list(trace.events(kind="token"))
        assert len(tokens) == sum(len(r.tokens) for r in res.records)
        assert {e.source for e in tokens} == {"external"}
        assert len(trace.requests()) == 24 and all(r.finished is not None for r in trace.requests())


def test_check_prints_the_table_and_fp32_vllm_agrees_with_the_reference(vllm_run: VllmRun) -> None:
    table = vllm_run.table
    for line in ("argmax agreement", "max |Δlogprob|", "near ties", "real divergences"):
        assert line in table
    assert all(r.req_id in table for r in vllm_run.result.records)  # a row per request
    assert vllm_run.exit_code == 0 and "no real divergence" in table
    assert set(vllm_run.checks) == {r.req_id for r in vllm_run.result.records}
    for req_id, row in vllm_run.checks.items():
        positions = row["positions"]
        assert len(positions) == len(next(r for r in vllm_run.result.records if r.req_id == req_id).tokens)
        # same weights, same precision: every reported logprob within the tolerance of the reference
        assert max(abs(p["delta"]) for p in positions) < 0.05
        if row["greedy"]:
            assert row["divergence_class"] in (None, "near_tie"), (req_id, row["first_divergence"])
            for p in positions[: row["first_divergence"]]:  # up to the first divergence it is the argmax
                assert p["token_id"] == p["ref_argmax"]
        else:
            assert row["divergence_class"] is None  # sampled: logprobs agree everywhere
    assert vllm_run.summary  # the run's summary is stored with the trace


def test_the_trace_holds_vllms_own_queue_and_prefill_times_per_request(vllm_run: VllmRun) -> None:
    """vLLM exported its spans to the session's receiver; the probe joined one to every request."""
    with open_trace(vllm_run.path) as trace:
        finished = {e.req_id: e for e in trace.events(kind="request.finished")}
        spans = {e.req_id: e.detail["spans"] for e in trace.events(kind="stamp") if e.stage == "otlp"}
    assert set(spans) == set(finished) and len(spans) == 24
    for req_id, span in spans.items():
        assert span is not None, f"no vLLM span joined to {req_id}"
        assert span["completion_tokens"] == len(finished[req_id].output_ids)
        assert span["queue_s"] >= 0 and span["prefill_s"] > 0
        assert span["ttft_s"] <= finished[req_id].timings["ttft"] + 0.05
    med = {k: statistics.median(s[k] for s in spans.values()) for k in ("queue_s", "prefill_s", "decode_s", "ttft_s")}
    client = statistics.median(f.timings["ttft"] for f in finished.values())
    print("vLLM's own timings, median of 24 (ms): " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in med.items())
          + f"; client TTFT {client * 1000:.1f}")


@pytest.mark.anyio
async def test_the_vllm_trace_opens_in_the_tui(vllm_run: VllmRun) -> None:
    rec = next(r for r in vllm_run.result.records if r.request.prompt == "The capital of France is")
    async with tui(vllm_run.path, request=rec.req_id) as (pilot, screen):
        assert screen.sel.req_id == rec.req_id
        text = pane(screen, "tokens")
        assert "The capital of France is" in text
        assert rec.tokens[0].text.strip() in text


def test_the_vllm_trace_opens_in_the_notebook_viewer(vllm_run: VllmRun) -> None:
    from workbench.notebook import TraceViewer

    rec = vllm_run.result.records[8]  # the first chat
    viewer = TraceViewer(str(vllm_run.path), req_id=rec.req_id, widgets=False)
    assert viewer.req_id == rec.req_id
    tokens = next(t for t in viewer.figures["tokens"].data if t.name == "tokens")
    assert len(tokens.x) >= len(rec.tokens)
