"""Speculative sampling keeps the target's distribution: tested, not assumed.

Engine level (tiny-random-sp, vocabulary 400): 2,500 seeded requests sample their first tokens with
and without speculation; a chi-square test on each position finds no difference (p > 0.001), at
temperature 1 and with top-p, and it does find one when the acceptance rule is deliberately wrong.
The drafter is a flatter copy of the target (its head scaled by 0.5, so q = the target at
temperature 2): about two thirds of the drafts are accepted, so accepted, recovered and bonus
tokens all occur often; the wrong rule's p-values are below 1e-130 at this size, far inside the
test's power. (A one-layer early exit of this random model is nearly one-hot on a token
the target rarely picks: it would test little but the recovery path.)
Unit level: `verify_sampled` against a known p, for a drafter distribution q and for the n-gram
case (q one-hot), in fewer samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.stats import chisquare_pvalue, contingency_pvalue
from workbench.engine.engine import Engine
from workbench.engine.sample.sampler import Sampler, SamplingBatchInfo
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.engine.sched.request import Req
from workbench.engine.speculative.verify import sampler_draw, verify_sampled

N = 2_500
GROUP = 125  # requests with n=GROUP siblings share one prompt prefill
POSITIONS = 4  # output positions compared: the prefill's token, then k = 2 drafts verified and one more
PROMPT = "The quick brown fox"
ALPHA = 0.001


def wrong_rule(p: float, q: float, u: float) -> bool:
    """A plausible bug: the ratio upside down, accept iff u < q / p."""
    return u * p < q


@pytest.fixture(scope="module")
def one_thread():
    """Thousands of tiny requests: one intra-op thread is several times faster than two here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def first_tokens(model, spec: str | None, params: SamplingParams, seed0: int, rule=None) -> np.ndarray:
    """`[N, POSITIONS]` first output tokens of N requests seeded seed0 .. seed0 + N - 1."""
    engine = Engine(model, trace_level="off", spec=spec, max_running=1024, kv_tokens=32_768,
                    max_batch_tokens=8192, enable_mixed=False)
    if rule is not None:
        engine.spec.accept_rule = rule
    groups = N // GROUP
    plist = [params.replace(n=GROUP, seed=seed0 + g * GROUP) for g in range(groups)]
    outs = engine.generate([PROMPT] * groups, plist)
    if spec is not None:
        metrics = engine.spec.metrics()
        assert metrics["draft_tokens"] >= 2 * N  # every request drafted k = 2 tokens after its first
        assert 0.2 < metrics["acceptance_rate"] < 0.95  # both verdicts occurred often
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size
    return np.array([o.token_ids[:POSITIONS] for o in outs])


def two_sample_p(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test of homogeneity; tokens with fewer than 10 draws in both samples share a bin."""
    tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = set(tokens[counts >= 10].tolist())
    bins = sorted(common)
    index = {t: i for i, t in enumerate(bins)}
    table = np.zeros((2, len(bins) + 1))
    for row, sample in enumerate((a, b)):
        for t in sample.tolist():
            table[row, index.get(t, len(bins))] += 1
    table = table[:, table.sum(0) > 0]
    return contingency_pvalue(table)


PARAMS = {
    "temperature-1": SamplingParams(temperature=1.0, max_new_tokens=POSITIONS, ignore_eos=True),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=POSITIONS, ignore_eos=True),
}


@pytest.fixture(scope="module")
def flat_draft(tiny_sp, tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("flat-draft")
    model = AutoModelForCausalLM.from_pretrained(tiny_sp.folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    model.save_pretrained(folder)
    tiny_sp.tokenizer.save_pretrained(folder)
    return f"draft:{folder}:k=2"


@pytest.fixture(scope="module")
def baselines(tiny_sp, one_thread) -> dict[str, np.ndarray]:
    return {name: first_tokens(tiny_sp, None, params, seed0=0) for name, params in PARAMS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_samples_follow_the_target_distribution(tiny_sp, baselines, flat_draft, name):
    spec = first_tokens(tiny_sp, flat_draft, PARAMS[name], seed0=10 * N)
    pvalues = [two_sample_p(baselines[name][:, i], spec[:, i]) for i in range(POSITIONS)]
    assert min(pvalues) > ALPHA, pvalues


@pytest.mark.slow
def test_a_wrong_acceptance_rule_is_caught(tiny_sp, baselines, flat_draft):
    spec = first_tokens(tiny_sp, flat_draft, PARAMS["temperature-1"], seed0=10 * N, rule=wrong_rule)
    pvalues = [two_sample_p(baselines["temperature-1"][:, i], spec[:, i]) for i in range(1, POSITIONS)]
    assert min(pvalues) < ALPHA, pvalues


# --- unit level: one verification against a known p ------------------------------------------------


def _peaked(seed: int, vocab: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=g) * 2.0, dim=-1)


def _emitted(p: torch.Tensor, q: torch.Tensor | None, draft_token: int | None, trials: int, rule=None) -> np.ndarray:
    """The first token each of `trials` one-draft verifications emits (draft ~ q, or a fixed n-gram draft)."""
    sampler = Sampler()
    req = Req("r", "x", [1], SamplingParams(temperature=1.0, seed=7), generator=torch.Generator().manual_seed(7))
    draw = sampler_draw(sampler, SamplingBatchInfo.build([req], p.shape[0], "cpu"))
    target = torch.stack([p, p])  # position 0 verifies the draft; position 1 would give the bonus token
    g = torch.Generator().manual_seed(11)
    out = []
    kwargs = {"rule": rule} if rule is not None else {}
    for _ in range(trials):
        if q is None:
            d, q_tok, q_dist = draft_token, 1.0, None
        else:
            d = int(torch.multinomial(q, 1, generator=g))
            q_tok, q_dist = float(q[d]), q[None]
        res = verify_sampled(req, [d], [q_tok], q_dist, target, [0, 0], draw, **kwargs)
        out.append(res.tokens[0])
    return np.array(out)


def _goodness_p(sample: np.ndarray, p: torch.Tensor) -> float:
    expected = p.double().numpy() * len(sample)
    keep = expected >= 5
    observed = np.bincount(sample, minlength=len(expected))
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    return chisquare_pvalue(obs, exp * obs.sum() / exp.sum())


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_one_verification_emits_the_target_distribution(drafter):
    p, q = _peaked(1), _peaked(2)
    draft_token = int(p.argsort()[-2])  # an n-gram proposal the target likes, but not most
    sample = _emitted(p, q if drafter == "model" else None, draft_token, 6000)
    assert _goodness_p(sample, p) > ALPHA


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_one_verification_with_a_wrong_rule_is_caught(drafter):
    p, q = _peaked(1), _peaked(2)
    draft_token = int(p.argsort()[-2])
    sample = _emitted(p, q if drafter == "model" else None, draft_token, 6000, rule=wrong_rule)
    assert _goodness_p(sample, p) < ALPHA
