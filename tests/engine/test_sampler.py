"""The batched sampler: stage semantics against transformers' processors, the empirical distribution of
draws against the processed distribution (and a wrong stage order caught), penalties, greedy, seeded
rows independent of their batch, explicit uniforms, per-stage trace records, and n > 1 sharing the
prompt's prefill in the engine."""

from __future__ import annotations

import math
import shutil
from collections import Counter

import pytest
import torch
from transformers.generation import logits_process as hf

from tests.helpers.stats import chisquare_pvalue
from workbench.engine.sample.sampler import STAGES, Sampler, SamplingBatchInfo
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.sched.request import Req

V = 40
EOS = 2


def _logits(seed: int = 0, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, V), generator=g) * 2.0


def _req(rid: str = "r", prompt: list[int] | None = None, output: list[int] | None = None,
         seed: int | None = None, **params) -> Req:
    req = Req(rid, "p", list(prompt or [5, 6, 7]), SamplingParams(seed=seed, **params))
    req.output_ids = list(output or [])
    if seed is not None:
        req.generator = torch.Generator().manual_seed(seed)
    return req


def _info(reqs: list[Req], **kw) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(reqs, V, "cpu", eos_token_ids=(EOS,), **kw)


def _hf_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order: temperature, top-k, top-p, min-p."""
    x = logits.clone()
    warpers = [hf.TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(hf.TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(hf.TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(hf.MinPLogitsWarper(p.min_p))
    ids = torch.zeros((x.shape[0], 1), dtype=torch.long)
    for w in warpers:
        x = w(ids, x)
    return torch.softmax(x, dim=-1)


COMBOS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=10),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
    dict(temperature=2.0, top_p=0.6),
    dict(temperature=0.5, top_k=5, min_p=0.1),
    dict(temperature=1.6, min_p=0.15, top_p=0.95),
]
DRAWS = 20_000
WRONG_ORDER = ("penalties", "logit_bias", "grammar", "top_k", "top_p", "min_p", "temperature")


def _chi_square_p(sampler: Sampler, params: dict, expected_probs: torch.Tensor) -> float:
    """Draw DRAWS tokens for one request repeated on DRAWS rows; chi-square p-value against
    expected_probs (0 when a token outside the expected support was drawn at all)."""
    torch.manual_seed(1234)
    req = _req(**params)
    info = _info([req] * DRAWS)
    out = sampler(_logits().expand(DRAWS, V), info)
    counts = Counter(out.next_token_ids)
    expected = expected_probs * DRAWS
    if any(expected[t] == 0 for t in counts):
        return 0.0
    big = [t for t in range(V) if expected[t] >= 5]
    small = [t for t in range(V) if 0 < expected[t] < 5]
    obs = [counts[t] for t in big] + ([sum(counts[t] for t in small)] if small else [])
    exp = [float(expected[t]) for t in big] + ([float(expected[small].sum())] if small else [])
    scale = sum(obs) / sum(exp)  # renormalise float dust so the totals match exactly
    return chisquare_pvalue(obs, [e * scale for e in exp])


@pytest.mark.parametrize("params", COMBOS, ids=[str(c) for c in COMBOS])
def test_processed_distribution_matches_transformers_warpers(params: dict) -> None:
    logits = _logits()
    got = Sampler().probs(logits, _info([_req(**params)]))
    want = _hf_reference(logits, SamplingParams(**params))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params", COMBOS, ids=[str(c) for c in COMBOS])
def test_draws_follow_the_processed_distribution(params: dict) -> None:
    want = _hf_reference(_logits(), SamplingParams(**params))[0]
    assert _chi_square_p(Sampler(), params, want) > 0.001


ORDER_SENSITIVE = [c for c in COMBOS if c["temperature"] != 1.0 and ("top_p" in c or "min_p" in c)]


@pytest.mark.parametrize("params", ORDER_SENSITIVE, ids=[str(c) for c in ORDER_SENSITIVE])
def test_the_same_check_rejects_a_wrong_stage_order(params: dict) -> None:
    """Temperature applied after the filters cuts a different set: the chi-square test must notice."""
    want = _hf_reference(_logits(), SamplingParams(**params))[0]
    assert _chi_square_p(Sampler(stage_order=WRONG_ORDER), params, want) < 0.001


def test_stage_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="stage_order"):
        Sampler(stage_order=STAGES[:-1])


# --- penalties, min_new_tokens, logit bias ------------------------------------------------------


def _processed(reqs: list[Req], logits: torch.Tensor, **kw) -> torch.Tensor:
    return Sampler().process(logits, _info(reqs, **kw))


def test_repetition_penalty_matches_transformers() -> None:
    reqs = [_req("a", prompt=[1, 3, 3], output=[4, 9, 9, 30], repetition_penalty=1.5),
            _req("b", prompt=[7], output=[7, 8], repetition_penalty=0.7),
            _req("c", prompt=[1, 3], output=[4], temperature=0.0)]  # no penalty: untouched
    logits = _logits(rows=3)
    got = _processed(reqs, logits)
    for i, req in enumerate(reqs[:2]):
        proc = hf.RepetitionPenaltyLogitsProcessor(req.params.repetition_penalty)
        want = proc(torch.tensor([req.prompt_ids + req.output_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)
    torch.testing.assert_close(got[2], logits[2])


def test_presence_and_frequency_follow_vllm_semantics() -> None:
    """vLLM/OpenAI: over output tokens only, logit -= frequency * count + presence * (count > 0);
    applied after the repetition penalty (which also covers prompt tokens)."""
    req = _req(prompt=[11, 12], output=[4, 4, 4, 9, 11], frequency_penalty=0.5, presence_penalty=1.25,
               repetition_penalty=1.2)
    logits = _logits()
    want = hf.RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([[11, 12, 4, 4, 4, 9, 11]]), logits.clone())[0]
    for tok, count in Counter(req.output_ids).items():
        want[tok] -= 0.5 * count + 1.25
    torch.testing.assert_close(_processed([req], logits)[0], want)
    assert _processed([req], logits)[0, 12] == want[12], "a prompt-only token got a frequency penalty"


def test_min_new_tokens_matches_transformers_and_covers_stop_ids() -> None:
    reqs = [_req("a", output=[9, 9], min_new_tokens=3, stop_token_ids=(17,)),
            _req("b", output=[9, 9, 9], min_new_tokens=3, stop_token_ids=(17,))]
    logits = _logits(rows=2)
    got = _processed(reqs, logits)
    proc = hf.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=3, eos_token_id=[EOS, 17])
    for i, req in enumerate(reqs):
        want = proc(torch.tensor([req.prompt_ids + req.output_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)
    assert math.isinf(got[0, EOS]) and math.isfinite(got[1, EOS])


def test_logit_bias_is_added_and_greedy_takes_the_processed_argmax() -> None:
    logits = _logits()
    loser = int(logits[0].argmin())
    req = _req(temperature=0.0, logit_bias={loser: 100.0, 3: -2.5})
    got = _processed([req], logits)[0]
    assert got[loser] == pytest.approx(float(logits[0, loser]) + 100.0)
    assert got[3] == pytest.approx(float(logits[0, 3]) - 2.5)
    out = Sampler()(logits, _info([req]))
    assert out.next_token_ids == [loser] and out.draws == [None]


def test_greedy_repetition_penalty_moves_the_choice() -> None:
    logits = torch.zeros((1, V))
    logits[0, 10], logits[0, 11] = 3.0, 2.5
    free = Sampler()(logits, _info([_req(temperature=0.0)]))
    penalised = Sampler()(logits, _info([_req(temperature=0.0, output=[10], repetition_penalty=1.5)]))
    assert free.next_token_ids == [10] and penalised.next_token_ids == [11]


def test_rows_of_one_request_see_their_prefix_tokens() -> None:
    """A request repeated on several rows (speculative positions): row j's penalties and
    min_new_tokens count the tokens that precede it."""
    req = _req(output=[4], frequency_penalty=1.0, min_new_tokens=3)
    logits = _logits().expand(3, V)
    got = _processed([req] * 3, logits, prefixes=[(), (4,), (4, 8)])
    for j, extra in enumerate([[], [4], [4, 8]]):
        alone = _req(output=[4] + extra, frequency_penalty=1.0, min_new_tokens=3)
        torch.testing.assert_close(got[j], _processed([alone], logits[:1])[0])
    assert math.isinf(got[1, EOS]) and math.isfinite(got[2, EOS])


# --- draws ------------------------------------------------------------------------------------------


def test_seeded_rows_do_not_depend_on_their_batch() -> None:
    logits = _logits(rows=9)
    alone, batched = [], []
    a1, a2 = _req("a", seed=99), _req("a", seed=99)
    others = [_req(f"o{i}", temperature=0.5 + i / 10, top_p=0.9, seed=i if i % 2 else None) for i in range(8)]
    for _ in range(40):
        alone += Sampler()(logits[:1], _info([a1])).next_token_ids
        batched.append(Sampler()(logits, _info([a2] + others)).next_token_ids[0])
    assert alone == batched
    assert len(set(alone)) > 3, "the check needs a request that actually samples"


def test_probs_draws_nothing_and_greedy_rows_are_one_hot() -> None:
    req, greedy = _req(seed=5, top_k=4), _req(temperature=0.0)
    before = req.generator.get_state()
    probs = Sampler().probs(_logits(rows=2), _info([req, greedy]))
    assert torch.equal(req.generator.get_state(), before)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert int((probs[0] > 0).sum()) == 4
    assert float(probs[1].max()) == 1.0 and int((probs[1] > 0).sum()) == 1
    assert int(probs[1].argmax()) == int(_logits(rows=2)[1].argmax())


def test_explicit_uniform_is_an_inverse_cdf_draw() -> None:
    probs = torch.tensor([[0.25, 0.25, 0.0, 0.5]] * 5)  # exact in binary: CDF 0.25, 0.5, 0.5, 1
    info = SamplingBatchInfo.build([_req()] * 5, 4, "cpu")
    uniforms = [0.0, 0.2499, 0.25, 0.5, 0.9999]
    ids, u = Sampler().draw(probs, info, u=torch.tensor(uniforms, dtype=torch.float64))
    assert ids.tolist() == [0, 0, 1, 3, 3]  # the zero-probability token 2 is never chosen
    assert u.tolist() == uniforms


# --- trace records ----------------------------------------------------------------------------------


def test_stage_records_show_what_each_stage_kept() -> None:
    logits = _logits(rows=2)
    reqs = [_req("a", temperature=0.5, top_k=3, top_p=0.9, seed=1), _req("b", temperature=0.0)]
    out = Sampler()(logits, _info(reqs), trace_topk=5)
    stages = out.stages[0]
    assert [s["name"] for s in stages] == ["logits", *STAGES]
    by_name = {s["name"]: s for s in stages}
    assert [by_name[n]["applied"] for n in STAGES] == [False, False, False, True, True, True, False]
    before_k = torch.softmax(logits[0] / 0.5, dim=-1)
    assert by_name["top_k"]["kept_count"] == 3
    assert by_name["top_k"]["kept_mass"] == pytest.approx(float(before_k.topk(3).values.sum()), abs=1e-6)
    assert by_name["temperature"]["top_ids"] == before_k.topk(5).indices.tolist()
    final = torch.tensor(by_name["min_p"]["top_probs"][:by_name["min_p"]["kept_count"]])
    assert float(final.sum()) == pytest.approx(1.0, abs=1e-6)
    assert out.next_token_ids[0] in by_name["min_p"]["top_ids"][:by_name["min_p"]["kept_count"]]
    assert 0.0 <= out.draws[0] < 1.0 and out.draws[1] is None
    assert not any(s["applied"] for s in out.stages[1][1:])
    assert Sampler()(logits, _info(reqs)).stages is None  # tracing off records nothing


def test_all_greedy_batch_records_the_same_stages_as_a_mixed_one() -> None:
    # A batch of greedy rows takes the argmax shortcut; its records must equal what the full
    # stage pipeline records for the same rows when a sampled row forces it.
    logits = _logits(seed=3, rows=3)
    greedy = [_req("g0", temperature=0.0), _req("g1", temperature=0.0)]
    fast = Sampler()(logits[:2], _info(greedy), trace_topk=5)
    full = Sampler()(logits, _info([*greedy, _req("s", temperature=0.7, seed=0)]), trace_topk=5)
    assert fast.next_token_ids == full.next_token_ids[:2] == logits[:2].argmax(-1).tolist()
    for fast_row, full_row in zip(fast.stages, full.stages[:2], strict=True):
        for a, b in zip(fast_row, full_row, strict=True):
            assert {k: a[k] for k in ("name", "applied", "top_ids", "kept_count")} == \
                {k: b[k] for k in ("name", "applied", "top_ids", "kept_count")}
            assert a["top_probs"] == pytest.approx(b["top_probs"], abs=1e-6)
            assert (a["kept_mass"], a["entropy"]) == pytest.approx((b["kept_mass"], b["entropy"]), abs=1e-5)
    assert fast.stages[0][0]["entropy"] == pytest.approx(float(torch.distributions.Categorical(
        logits=logits[0]).entropy()), abs=1e-5)


# --- engine: n > 1 shares the prefill; seeded runs repeat -----------------------------------------


@pytest.fixture(scope="module")
def engine(tiny):
    from workbench.engine.engine import Engine

    return Engine(tiny, trace_level="summary")


PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def test_n_siblings_share_the_prompt_prefill(engine) -> None:
    sink = engine.memory_sink
    sink.events.clear()
    outs = engine.generate([PROMPT], SamplingParams(temperature=1.0, seed=11, n=4, max_new_tokens=5))
    p = len(outs[0].prompt_token_ids)
    forwarded = sum(e.num_tokens for e in sink.events if e.kind == "forward")
    assert forwarded == p + 3 * 1 + 4 * 4, "each sibling should recompute only the last prompt token"
    assert [o.usage["cached_prompt_tokens"] for o in outs] == [0, p - 1, p - 1, p - 1]
    for i, out in enumerate(outs):  # the copied KV is right: each equals the same seed run alone
        (alone,) = engine.generate([PROMPT], SamplingParams(temperature=1.0, seed=11 + i, max_new_tokens=5))
        assert out.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size


def test_seeded_request_repeats_in_the_same_batch_composition(engine) -> None:
    prompts = [PROMPT, "The three primary colors are", "def fibonacci(n):"]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_new_tokens=12) for s in (1, 2, 3)]
    first = [o.token_ids for o in engine.generate(prompts, params)]
    second = [o.token_ids for o in engine.generate(prompts, params)]
    assert first == second


def test_the_blocked_greedy_argmax_is_torch_argmax_exactly() -> None:
    """The sampler's two-level argmax picks the index `torch.argmax` picks: ties (the first wins),
    NaN, infinities, signed zeros, rows shorter than a block and tails after the last block."""
    from workbench.engine.sample.argmax import BLOCK, MIN_ROWS, first_argmax

    assert MIN_ROWS <= 9  # the rows below take the blocked path

    gen = torch.Generator().manual_seed(0)
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, 49152]
    for trial in range(400):
        v = lengths[trial % len(lengths)]
        x = torch.randint(-3, 3, (9, v), generator=gen).float()  # few distinct values: many ties
        if trial % 3 == 0:
            x[0, int(torch.randint(0, v, (1,), generator=gen))] = float("nan")
        if trial % 4 == 0:
            x[1] = float("-inf")
        if trial % 5 == 0:
            x[2] = torch.where(torch.rand(v, generator=gen) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
        if trial % 7 == 0:
            x[3, -1] = x[3].max()  # a tie between the last logit and an earlier one
        if trial % 2 == 0:
            x = torch.randn(9, v, generator=gen)  # distinct values: one maximum per row
        assert torch.equal(first_argmax(x), x.argmax(dim=-1)), (trial, v)


def test_a_sampler_reused_across_steps_records_what_a_fresh_one_does() -> None:
    # The sampler keeps its vocabulary-sized buffer between steps (the raw log-softmax). Steps of
    # different batch sizes and mixes, one after another, must record exactly what a sampler used
    # once records: the buffer never leaks one step into the next.
    reused = Sampler()
    steps = [(_logits(seed=s, rows=n), reqs) for s, (n, reqs) in enumerate([
        (4, [_req(f"g{i}", temperature=0.0) for i in range(4)]),
        (2, [_req("s", temperature=0.8, top_p=0.9, seed=2), _req("g", temperature=0.0)]),
        (5, [_req(f"h{i}", temperature=0.0, logprobs=True, top_logprobs=3) for i in range(5)]),
        (3, [_req("m", temperature=0.7, min_p=0.1, seed=4), *[_req(f"k{i}", temperature=0.0) for i in range(2)]]),
    ])]
    for logits, reqs in steps:
        for r in reqs:
            r.generator = torch.Generator().manual_seed(9) if r.params.seed is not None else None
        a = reused(logits, _info(reqs), trace_topk=5)
        a_lp = a.raw_logprobs.clone()
        for r in reqs:
            r.generator = torch.Generator().manual_seed(9) if r.params.seed is not None else None
        b = Sampler()(logits, _info(reqs), trace_topk=5)
        assert (a.next_token_ids, a.stages, a.logprobs, a.ranks, a.top_logprobs) == \
            (b.next_token_ids, b.stages, b.logprobs, b.ranks, b.top_logprobs)
        assert torch.equal(a_lp, torch.log_softmax(logits.float(), dim=-1))


def test_which_stages_apply_to_which_rows_matches_the_sampling_tensors() -> None:
    # The traced sampler's per-stage "applied" flags (what the trace shows as a stage that did
    # something) come from the request's params, rounded to float32 as the tensors hold them: a
    # temperature or top_p that rounds to 1.0, or a min_p that rounds to 0, applies to nothing.
    vocab = 50
    cases = [dict(temperature=0), dict(temperature=1.0), dict(temperature=1.00000001), dict(temperature=0.7),
             dict(temperature=1.0, top_p=0.999999999), dict(top_p=0.9), dict(min_p=1e-50), dict(min_p=0.05),
             dict(top_k=0), dict(top_k=-1), dict(top_k=5), dict(top_k=vocab), dict(top_k=vocab + 1),
             dict(temperature=0, top_p=0.5, min_p=0.2, top_k=3)]
    reqs = [Req(f"r{i}", "p", [1, 2], SamplingParams(**kw)) for i, kw in enumerate(cases)]
    info = SamplingBatchInfo.build(reqs, vocab, "cpu")
    for stage in ("temperature", "top_k", "top_p", "min_p"):
        assert info.applied(stage) == info._applied_now(stage), stage
    assert info.applied("temperature")[:4] == [False, False, False, True]
    assert info.applied("top_p")[4:6] == [False, True] and info.applied("min_p")[6:8] == [False, True]
    assert info.applied("top_k")[8:13] == [False, False, True, False, False]


def test_greedy_ranks_skip_the_count_and_still_equal_it() -> None:
    # Rows that take the argmax of the logits get rank 1 without reading the row again
    # (logprobs.token_logprobs): log-softmax is monotone, so no logprob is above the argmax's. The
    # ranks must equal the counted ones on ties, on logits far apart enough that distinct values
    # round to one logprob, on a NaN row, and on a forced row (not the argmax: counted).
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn((6, V), generator=g) * 3).round()  # many ties, the maximum among them
    logits[1] = torch.linspace(1e6, 1e6 + 0.25, V)  # distinct logits, equal logprobs after rounding
    logits[2, 3] = float("nan")
    logits[3] = logits[3].max()  # one value everywhere
    reqs = [_req(f"g{i}", temperature=0.0, logprobs=True) for i in range(6)]
    reqs[4].forced_tokens = {0: 7}
    out = Sampler()(logits, _info(reqs))
    lp = torch.log_softmax(logits, dim=-1)
    counted = [1 + int((lp[r] > lp[r, t]).sum()) for r, t in enumerate(out.next_token_ids)]
    assert out.ranks == counted and out.forced == [4] and out.next_token_ids[4] == 7
    assert out.ranks[4] == 1 + int((lp[4] > lp[4, 7]).sum()) > 1


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="KERNEL NOT CHECKED: no C compiler on this machine")
def test_the_native_log_softmax_pass_records_what_torchs_ops_record(monkeypatch) -> None:
    # A traced, logprob-asking greedy batch over a real-sized vocabulary, through the native pass
    # (kernels/sampling.log_softmax: logprobs, argmax and the model's record in one) and through
    # torch's ops: the same tokens, logprobs, ranks, top logprobs, stage records and raw logprobs.
    from workbench.engine.kernels import sampling as sample_kernels

    g = torch.Generator().manual_seed(8)
    logits = torch.randn((6, 49152), generator=g) * 3
    logits[2] = (logits[2] * 2).round() / 2  # ties for the maximum
    reqs = [_req(f"g{i}", temperature=0.0, logprobs=True, top_logprobs=3) for i in range(6)]
    info = SamplingBatchInfo.build(reqs, 49152, "cpu", eos_token_ids=(EOS,))
    calls = []
    real = sample_kernels.log_softmax
    monkeypatch.setattr(sample_kernels, "log_softmax", lambda *a: calls.append(real(*a)) or calls[-1])
    native = Sampler()(logits, info, trace_topk=5)
    monkeypatch.setattr(sample_kernels, "log_softmax", lambda *a: None)
    torch_ops = Sampler()(logits, info, trace_topk=5)
    assert calls and calls[0] is not None  # the native pass ran (its checks passed on this CPU)
    assert (native.next_token_ids, native.logprobs, native.ranks, native.top_logprobs, native.stages) == \
        (torch_ops.next_token_ids, torch_ops.logprobs, torch_ops.ranks, torch_ops.top_logprobs, torch_ops.stages)
    assert torch.equal(native.raw_logprobs, torch_ops.raw_logprobs)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="KERNEL NOT CHECKED: no C compiler on this machine")
@pytest.mark.parametrize("rows", [5, 1])
def test_a_traced_greedy_batch_records_without_storing_the_log_softmax_what_torchs_ops_record(rows, monkeypatch) -> None:
    # A traced batch of plain greedy rows (the common traced decode step) asking for no top or named
    # logprobs: the native pass records the model's distribution without writing the [R, V]
    # log-softmax; each pick's logprob, and the logprobs the trace shows at the record's ids, come
    # from each row's maximum and log-sum. All of it must be what torch's ops give, to the bit. One
    # row is cut between two threads.
    from workbench.engine.kernels import sampling as sample_kernels

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _lean_and_torch_ops_record_the_same(rows, monkeypatch, sample_kernels)
    finally:
        torch.set_num_threads(before)


def _lean_and_torch_ops_record_the_same(rows: int, monkeypatch, sample_kernels) -> None:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn((5, 49152), generator=g) * 3
    logits[1] = (logits[1] * 2).round() / 2  # ties for the maximum
    logits[3, :20000] = float("-inf")
    logits = logits[:rows] if rows > 1 else logits[3:4]  # one row: the masked one
    reqs = [_req(f"g{i}", temperature=0.0, min_new_tokens=0, ignore_eos=True) for i in range(rows)]
    info = SamplingBatchInfo.build(reqs, 49152, "cpu")
    lean = Sampler()(logits, info, trace_topk=7)
    assert lean.raw_logprobs is None and lean.lp_stats is not None  # the path that stores no [R, V]
    monkeypatch.setattr(sample_kernels, "log_softmax", lambda *a: None)
    torch_ops = Sampler()(logits, info, trace_topk=7)
    assert torch_ops.raw_logprobs is not None
    assert (lean.next_token_ids, lean.logprobs, lean.ranks, lean.top_logprobs) == \
        (torch_ops.next_token_ids, torch_ops.logprobs, torch_ops.ranks, torch_ops.top_logprobs)
    assert repr(lean.stages) == repr(torch_ops.stages)  # repr: the masked row's entropy is NaN in both
    assert torch.equal(lean.record_ids, torch_ops.record_ids)
    index = torch.randint(0, 49152, (rows, 50), generator=g)
    index[min(3, rows - 1), :10] = torch.arange(10)  # the masked row: -inf logprobs
    want = torch.log_softmax(logits, dim=-1).gather(1, index)
    assert torch.equal(lean.raw_logprobs_at(index), want) and torch.equal(torch_ops.raw_logprobs_at(index), want)
