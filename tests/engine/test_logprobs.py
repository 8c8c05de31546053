"""Logprobs as a user reads them: raw logprobs equal transformers' log-softmax (tiny model and one
smollm2 check), processed logprobs are the log of the distribution actually sampled from, ranks and
top alternatives agree, named ids are reported, and prompt logprobs (first token none) survive
chunked prefill, n > 1 siblings and prompt-only scoring."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.hf_reference import stock_model
from workbench.engine.engine import Engine
from workbench.engine.sample.sampler import Sampler, SamplingBatchInfo
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.sched.request import Req

PROMPT = "The quick brown fox jumps over the lazy dog. Then it"


@torch.inference_mode()
def _hf_logprobs(folder: str, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of `ids` `[len(ids), V]`."""
    return torch.log_softmax(stock_model(folder)(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_raw(out, lp_ref: torch.Tensor, k: int) -> None:
    p = len(out.prompt_token_ids)
    for j, tok in enumerate(out.logprobs):
        row = lp_ref[p - 1 + j]
        assert tok.logprob == pytest.approx(float(row[tok.token_id]), abs=1e-4)
        assert tok.rank == int((row > row[tok.token_id] + 1e-4).sum()) + 1
        vals, ids = row.topk(k)
        assert [t[0] for t in tok.top_logprobs] == ids.tolist()
        # alternatives deep in the tail: tiny-random's logits reach ~60 (its head is scaled up), so the
        # packed forward's float32 noise there is relative; the chosen token is held to 1e-4 above
        assert [t[2] for t in tok.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4, rel=3e-5)


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, trace_level="off", chunk_size=8)


def test_raw_logprobs_equal_transformers_log_softmax(engine, tiny) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=10, logprobs=True, top_logprobs=5,
                            token_ids_logprob=(13, 42), prompt_logprobs=True)
    (out,) = engine.generate([PROMPT], params)
    ref = _hf_logprobs(str(tiny.folder), out.prompt_token_ids + out.token_ids)
    _check_raw(out, ref, 5)
    assert any(t.rank > 1 for t in out.logprobs), "a sampled run should pick some non-argmax token"
    named = out.token_ids_logprobs
    assert len(named) == len(out.token_ids)
    p = len(out.prompt_token_ids)
    for j, d in enumerate(named):
        assert d == pytest.approx({13: float(ref[p - 1 + j, 13]), 42: float(ref[p - 1 + j, 42])}, abs=1e-4)
    # prompt logprobs (chunk_size=8 splits this prompt): the first token has none
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == p
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry["token_id"] == out.prompt_token_ids[i]
        assert entry["logprob"] == pytest.approx(float(ref[i - 1, out.prompt_token_ids[i]]), abs=1e-4)
        assert [t[0] for t in entry["top_logprobs"]] == ref[i - 1].topk(5).indices.tolist()


def test_processed_logprobs_are_the_sampled_distribution(engine, tiny) -> None:
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, max_new_tokens=8, logprobs=True, top_logprobs=6,
                            logprobs_mode="processed")
    (out,) = engine.generate([PROMPT], params)
    ref = _hf_logprobs(str(tiny.folder), out.prompt_token_ids + out.token_ids)
    p = len(out.prompt_token_ids)
    for j, tok in enumerate(out.logprobs):
        logits = ref[p - 1 + j] / 0.7  # log-softmax shifts do not change top-k or the temperature softmax
        keep = logits.topk(5).indices
        want = torch.full_like(logits, -math.inf)
        want[keep] = torch.log_softmax(logits[keep], dim=-1)
        assert tok.logprob == pytest.approx(float(want[tok.token_id]), abs=1e-4)
        assert sum(math.exp(t[2]) for t in tok.top_logprobs[:5]) == pytest.approx(1.0, abs=1e-5)
        assert tok.top_logprobs[5][2] == -math.inf  # the sixth token was cut by top-k


def test_processed_logprob_is_log_of_sampler_probs() -> None:
    """Across penalties, bias, filters and temperature, the processed logprob of the drawn token is
    the log of `Sampler.probs` at that token, and the raw one is the model's log-softmax."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    reqs = []
    for i, kw in enumerate([dict(temperature=0.6, top_p=0.8), dict(temperature=1.4, min_p=0.05, top_k=9),
                            dict(repetition_penalty=1.3, presence_penalty=0.4, logit_bias={3: 2.0}),
                            dict(temperature=0.9, frequency_penalty=1.0)]):
        req = Req(f"r{i}", "p", [1, 2, 3], SamplingParams(logprobs_mode="processed", seed=i, **kw))
        req.output_ids = [3, 3, 7]
        req.generator = torch.Generator().manual_seed(i)
        reqs.append(req)
    info = SamplingBatchInfo.build(reqs, 50, "cpu")
    probs = Sampler().probs(logits, info)
    out = Sampler()(logits, info)
    for r, tok in enumerate(out.next_token_ids):
        assert out.logprobs[r] == pytest.approx(math.log(float(probs[r, tok])), abs=1e-5)
    raw_info = SamplingBatchInfo.build([Req("x", "p", [1], SamplingParams(seed=1))], 50, "cpu")
    raw = Sampler()(logits[:1], raw_info)
    assert raw.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[raw.next_token_ids[0]]))


def test_prompt_scoring_without_generation(engine, tiny) -> None:
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=True, top_logprobs=2)
    outs = engine.generate([PROMPT, "Hello"], params)
    for out in outs:
        assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
        ref = _hf_logprobs(str(tiny.folder), out.prompt_token_ids)
        got = [e["logprob"] for e in out.prompt_logprobs[1:]]
        want = [float(ref[i - 1, t]) for i, t in enumerate(out.prompt_token_ids) if i]
        assert got == pytest.approx(want, abs=1e-4)
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size


def test_siblings_report_the_shared_prompt_logprobs(engine) -> None:
    outs = engine.generate([PROMPT], SamplingParams(n=3, seed=1, max_new_tokens=2, prompt_logprobs=True))
    assert outs[1].usage["cached_prompt_tokens"] > 0
    assert outs[0].prompt_logprobs == outs[1].prompt_logprobs == outs[2].prompt_logprobs
    assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids)


def test_greedy_chosen_token_has_rank_one(engine) -> None:
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=6, logprobs=True))
    assert [t.rank for t in out.logprobs] == [1] * 6


@pytest.mark.slow
def test_smollm2_raw_and_prompt_logprobs(smollm2) -> None:
    engine = Engine(smollm2, trace_level="off")
    params = SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=True, top_logprobs=3,
                            prompt_logprobs=True)
    (out,) = engine.generate(["The capital of France is"], params)
    ref = _hf_logprobs(str(smollm2.folder), out.prompt_token_ids + out.token_ids)
    _check_raw(out, ref, 3)
    got = [e["logprob"] for e in out.prompt_logprobs[1:]]
    want = [float(ref[i - 1, t]) for i, t in enumerate(out.prompt_token_ids) if i]
    assert got == pytest.approx(want, abs=1e-4)


def test_rank_is_one_plus_the_count_of_strictly_better_tokens() -> None:
    """Ranks from token_logprobs (a row whose pick is its maximum is found rank 1 without counting)
    equal the definition on picks of every kind: the argmax, ties, others, NaN rows, -inf picks."""
    from workbench.engine.sample.logprobs import token_logprobs

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        x = torch.randint(-3, 3, (6, 40), generator=gen).float()
        if trial % 4 == 0:
            x[0, 3] = float("nan")
        if trial % 5 == 0:
            x[1, :5] = float("-inf")
        lp = torch.log_softmax(x, dim=-1)
        chosen = x.argmax(dim=-1) if trial % 2 else torch.randint(0, 40, (6,), generator=gen)
        want = ((lp > lp.gather(1, chosen[:, None])).sum(dim=-1) + 1).tolist()
        assert token_logprobs(lp, chosen, 0).ranks == want, trial
