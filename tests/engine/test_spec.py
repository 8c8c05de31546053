"""Speculative decoding on tiny models: configuration, drafters, greedy equivalence, stops inside
accepted runs, KV rollback, trace events and metrics.

The drafters are chosen so that every path runs: the target itself as draft model (everything
accepted: bonus tokens, multi-token DRAFT_EXTEND catch-up), a differently seeded tiny model and a
one-layer early exit (mostly rejected: recovered tokens and rollbacks), n-gram prompt lookup.
"""

from __future__ import annotations

import pytest

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.speculative.config import SpecConfig, parse_spec
from workbench.engine.speculative.drafters import lookup

PROMPTS = [
    "hello there hello there hello",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "one, two, three, four, one, two, three,",
    "Speculative decoding drafts tokens cheaply.",
]
GREEDY = SamplingParams(temperature=0, max_new_tokens=20)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A tiny model with the same tokenizer as tiny-random-sp but other random weights."""
    from workbench.models import tiny

    return str(tiny.build_tiny_sp(tmp_path_factory.mktemp("draft") / "tiny-sp-seed1", seed=1))


@pytest.fixture(scope="module")
def baseline(tiny_sp):
    return Engine(tiny_sp, trace_level="off").generate(PROMPTS, GREEDY)


def _specs(other_draft: str) -> list[str]:
    return ["ngram:k=3:min=1", "early-exit:layers=1:k=3", f"draft:{other_draft}:k=3", "draft:tiny-random-sp:k=4",
            "draft:tiny-random-sp:k=1"]


def _kv_full(engine: Engine) -> bool:
    memories = [engine.memory] + ([engine.spec.drafter.memory] if hasattr(engine.spec.drafter, "seqs") else [])
    return all(m.allocator.available_size() == m.allocator.size
               and m.req_to_token_pool.available_size() == m.req_to_token_pool.size for m in memories)


# --- configuration ---------------------------------------------------------------------------


def test_spec_strings_dicts_and_configs_parse():
    assert parse_spec("ngram") == SpecConfig("ngram")
    assert parse_spec("ngram:k=6:min=1:max=3") == SpecConfig("ngram", 6, 1, 3)
    assert parse_spec("draft:smollm2:k=4") == SpecConfig("draft", 4, draft_model="smollm2")
    assert parse_spec("draft:/models/a:b") == SpecConfig("draft", draft_model="/models/a:b")
    assert parse_spec("early-exit:layers=8:k=4") == SpecConfig("early-exit", 4, exit_layer=8)
    assert parse_spec({"method": "ngram", "num_speculative_tokens": 2}) == SpecConfig("ngram", 2)
    cfg = SpecConfig("early-exit", 3, exit_layer=1)
    assert parse_spec(cfg) is cfg


@pytest.mark.parametrize("spec, names", [
    ("beam", "method"), ("ngram:k=0", "num_speculative_tokens"), ("ngram:k=99", "num_speculative_tokens"),
    ("ngram:k=x", "num_speculative_tokens"), ("ngram:min=3:max=2", "prompt_lookup_max"),
    ("ngram:min=0", "prompt_lookup_min"), ("ngram:depth=2", "depth"), ("draft", "draft_model"),
    ("ngram:smollm2", "smollm2"), ({"method": "ngram", "k": 2}, "unknown keys"), (42, "spec must be"),
])
def test_bad_spec_values_name_the_parameter(spec, names):
    with pytest.raises(ValueError, match=names):
        parse_spec(spec)


def test_engine_refuses_an_exit_layer_out_of_range_and_a_foreign_tokenizer(tiny_sp):
    with pytest.raises(ValueError, match=r"exit_layer must be in \[1, 1\]"):
        Engine(tiny_sp, trace_level="off", spec="early-exit:layers=2")
    with pytest.raises(ValueError, match="draft_model 'tiny-random' does not share the target's tokenizer"):
        Engine(tiny_sp, trace_level="off", spec="draft:tiny-random")


def test_ngram_lookup_takes_the_longest_suffix_at_its_earliest_occurrence():
    ids = [5, 1, 2, 3, 9, 8, 2, 3, 4, 1, 2, 3]
    assert lookup(ids, 1, 3, 2) == [9, 8]  # [1, 2, 3] first occurs at 1
    assert lookup(ids, 1, 2, 3) == [9, 8, 2]  # [2, 3] first occurs at 2
    assert lookup(ids, 1, 3, 10) == [9, 8, 2, 3, 4, 1, 2, 3]  # cut at the end of the context
    assert lookup([1, 2, 3, 4], 1, 3, 2) == []
    assert lookup([7, 1, 7], 2, 3, 2) == []  # only a 1-token match, below prompt_lookup_min


# --- greedy output is unchanged ----------------------------------------------------------------


def test_greedy_output_with_every_drafter_is_the_output_without_speculation(tiny_sp, baseline, other_draft):
    for spec in _specs(other_draft):
        engine = Engine(tiny_sp, trace_level="off", spec=spec)
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [b.token_ids for b in baseline], spec
        assert [o.text for o in outs] == [b.text for b in baseline], spec
        assert engine.spec.metrics()["draft_tokens"] > 0, spec
        assert _kv_full(engine), spec


def test_greedy_logprobs_are_the_target_logprobs(tiny_sp):
    params = GREEDY.replace(logprobs=True, top_logprobs=3)
    base = Engine(tiny_sp, trace_level="off").generate(PROMPTS[:2], params)
    spec = Engine(tiny_sp, trace_level="off", spec="draft:tiny-random-sp:k=4").generate(PROMPTS[:2], params)
    for b, s in zip(base, spec):
        assert [t.token_id for t in s.logprobs] == [t.token_id for t in b.logprobs]
        assert [t.rank for t in s.logprobs] == [t.rank for t in b.logprobs]
        assert [t.logprob for t in s.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-4)
        assert [[i for i, _, _ in t.top_logprobs] for t in s.logprobs] == \
            [[i for i, _, _ in t.top_logprobs] for t in b.logprobs]


def test_stops_and_max_new_tokens_cut_an_accepted_run(tiny_sp, baseline):
    ids = baseline[1].token_ids
    j = next(i for i in range(5, len(ids)) if ids[i] not in ids[:i])  # a token first seen mid-output
    cases = {"stop_token_ids": GREEDY.replace(stop_token_ids=(ids[j],)), "max_new_tokens": GREEDY.replace(max_new_tokens=7),
             "stop": GREEDY.replace(stop=(baseline[1].text[len(baseline[1].text) // 2:][:3],))}
    for name, params in cases.items():
        (plain,) = Engine(tiny_sp, trace_level="off").generate([PROMPTS[1]], params)
        engine = Engine(tiny_sp, trace_level="summary", spec="draft:tiny-random-sp:k=8")
        (out,) = engine.generate([PROMPTS[1]], params)
        assert (out.token_ids, out.text, out.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
        assert out.finish_reason == ("length" if name == "max_new_tokens" else "stop")
        assert len(out.token_ids) < len(ids)
        last = engine.memory_sink.of_kind("spec.verify")[-1]
        if name == "stop_token_ids":  # the stop token was accepted mid-run: the run is cut right after it
            assert last.emitted[-1] == ids[j] and len(last.emitted) < last.num_accepted + 1
        assert _kv_full(engine)


# --- KV rollback, trace events and metrics -----------------------------------------------------


def test_rejected_drafts_free_their_slots_at_once_and_the_pool_ends_full(tiny_sp, other_draft):
    engine = Engine(tiny_sp, trace_level="summary", spec=f"draft:{other_draft}:k=4")
    params = [SamplingParams(temperature=t, max_new_tokens=24, seed=s, ignore_eos=True)
              for t, s in [(0, None), (1.0, 1), (0.7, 2), (1.0, 3)]]
    outs = engine.generate(PROMPTS, params)
    sink = engine.memory_sink
    rollbacks = {(e.step, e.req_id): e.slots for e in sink.of_kind("kv") if e.op == "rollback"}
    verifies = sink.of_kind("spec.verify")
    assert sum(len(v.draft_tokens) - v.num_accepted for v in verifies) > 40  # heavy rejection
    for v in verifies:
        kept = len(v.emitted) - 1  # the drafts whose K/V stay: all emitted but the final token
        assert len(v.freed_slots) == len(v.draft_tokens) - kept
        assert rollbacks.get((v.step, v.req_id), []) == v.freed_slots
        assert len(v.draft_freed_slots) <= len(v.draft_tokens)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert _kv_full(engine)


def test_trace_shows_drafts_verdicts_and_where_each_token_came_from(tiny_sp, other_draft):
    engine = Engine(tiny_sp, trace_level="summary", spec="early-exit:layers=1:k=3")
    outs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, seed=5))
    sink = engine.memory_sink
    drafts = {(e.step, e.req_id): e for e in sink.of_kind("spec.draft")}
    for v in sink.of_kind("spec.verify"):
        d = drafts[(v.step, v.req_id)]
        assert d.tokens == v.draft_tokens and d.q == v.q and len(d.texts) == len(d.tokens)
        k = len(v.draft_tokens)
        assert len(v.p) == len(v.u) == len(v.accepted) == k and len(v.target_argmax) == k + 1
        assert v.accepted == [i < v.num_accepted for i in range(k)]
        for i in range(v.num_accepted + (v.num_accepted < k)):  # every examined position has its draw
            assert v.accepted[i] == (v.u[i] * v.q[i] < v.p[i])
        assert v.extra_kind == ("bonus" if v.num_accepted == k else "recovered")
        assert v.emitted == (v.draft_tokens[:v.num_accepted] + [v.extra_token])[:len(v.emitted)]
    tokens = sink.of_kind("token")
    sources = {e.source for e in tokens}
    assert {"sample", "spec_accept", "spec_recover"} <= sources
    finished = {e.req_id: e.spec for e in sink.of_kind("request.finished")}
    for out in outs:
        assert finished[out.req_id] == out.spec and out.spec["drafts"] > 0
        assert [e.token_id for e in tokens if e.req_id == out.req_id] == out.token_ids
        assert [e.position for e in tokens if e.req_id == out.req_id] == list(range(len(out.token_ids)))
    modes = {(e.forward_mode, e.model) for e in sink.of_kind("forward_batch")}
    assert {("TARGET_VERIFY", "target"), ("DRAFT_EXTEND", "draft"), ("DECODE", "draft")} <= modes


def test_metrics_per_request_add_up_to_the_engine_metrics(tiny_sp, other_draft):
    engine = Engine(tiny_sp, trace_level="off", spec="draft:tiny-random-sp:k=3")
    outs = engine.generate(PROMPTS, GREEDY)
    for out in outs:
        s = out.spec
        assert s["acceptance_rate"] > 0.9 and len(s["acceptance_per_position"]) == 3  # the target drafts itself
        assert s["accepted_tokens"] == round(s["acceptance_rate"] * s["draft_tokens"])
        assert s["mean_acceptance_length"] == 1 + s["accepted_tokens"] / s["drafts"]
    total = engine.spec.metrics()
    for key in ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens"):
        assert total[key] == sum(o.spec[key] for o in outs)
    assert all(o.spec["emitted_tokens"] < len(o.token_ids) for o in outs)  # the first token is the prefill's
    mixed = Engine(tiny_sp, trace_level="off", spec=f"draft:{other_draft}:k=2").generate(PROMPTS, GREEDY)
    assert all(0 <= o.spec["acceptance_rate"] < 1 for o in mixed)
    assert all(len(o.spec["acceptance_per_position"]) == 2 for o in mixed)


def test_preemption_under_speculation_keeps_greedy_output(tiny_sp, baseline, other_draft):
    for spec in ("ngram:k=3:min=1", f"draft:{other_draft}:k=3", "early-exit:layers=1:k=3"):
        engine = Engine(tiny_sp, trace_level="summary", spec=spec, kv_tokens=64)
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [b.token_ids for b in baseline], spec
        assert engine.memory_sink.of_kind("schedule") and any(
            e.preempted for e in engine.memory_sink.of_kind("schedule")), spec
        assert _kv_full(engine), spec


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(tiny_sp):
    params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=123)
    spec = "early-exit:layers=1:k=3"
    (alone,) = Engine(tiny_sp, trace_level="off", spec=spec).generate([PROMPTS[0]], params)
    batch = Engine(tiny_sp, trace_level="off", spec=spec).generate(
        PROMPTS, [params] + [SamplingParams(temperature=1.0, max_new_tokens=16)] * 3)
    assert batch[0].token_ids == alone.token_ids
