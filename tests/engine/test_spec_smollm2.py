"""Greedy output on smollm2 is token for token the same with every drafter as without speculation.

16 prompts in one batch, 24 new tokens; every drafter, at k = 2, 4 and 8 between them: n-gram, the
early-exit self-draft (20 of 30 layers), and a draft model (the random tiny model with SmolLM2's
tokenizer: nearly everything rejected; smollm2 itself: nearly everything accepted, so bonus
tokens and multi-token DRAFT_EXTEND catch-ups). About 35 s on an idle 2-core machine.
"""

from __future__ import annotations

import pytest

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams

TEXT = "The cat sat on the warm mat and watched the birds in the old oak tree."
CODE = "def add(a, b):\n    return a + b\n"
PROMPTS = [
    f"Repeat this sentence exactly: {TEXT}",
    f"Rewrite in the past tense: {TEXT.replace('sat', 'sits').replace('watched', 'watches')}",
    "Fix the spelling: Teh cat sat on teh warm mat and wacthed the brids.",
    f"Add type hints to this function:\n{CODE}",
    [{"role": "user", "content": f"Copy this text back to me: {TEXT}"}],
    [{"role": "user", "content": f"Rename the function to plus:\n{CODE}"}],
    [{"role": "user", "content": "Change every 'cat' to 'dog': the cat saw a cat near the cat bed."}],
    [{"role": "user", "content": "List the days of the week, then list them again."}],
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 12 times 7?\nA:",
    "def fibonacci(n):",
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
    [{"role": "user", "content": "What is the boiling point of water?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three planets."}],
]
PARAMS = SamplingParams(temperature=0, max_new_tokens=24)
# each drafter once, k = 2, 4 and 8 between them (the suite's time: each config is 7-27 s here)
SPECS = ["ngram:k=8", "early-exit:layers=20:k=2", "draft:tiny-random:k=2", "draft:smollm2:k=4"]


@pytest.fixture(scope="module")
def baseline(smollm2):
    return Engine(smollm2, trace_level="off").generate(PROMPTS, PARAMS)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_greedy_output_is_unchanged_by_speculation(smollm2, baseline, spec):
    engine = Engine(smollm2, trace_level="off", spec=spec)
    outs = engine.generate(PROMPTS, PARAMS)
    for i, (out, base) in enumerate(zip(outs, baseline)):
        assert out.token_ids == base.token_ids, (spec, i, out.text, base.text)
    metrics = engine.spec.metrics()
    assert metrics["draft_tokens"] > 0
    assert engine.memory.allocator.available_size() == engine.memory.allocator.size
