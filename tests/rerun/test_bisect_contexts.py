"""`workbench bisect` with batch contexts as suspects (issue 35): the reference run through the engine's
real scheduler batched, with its prefix from the prefix cache, or with chunked prefill of N.

What a user notices: on a trace this engine recorded in a known context (chunked prefill of 8, a
batch of six, a prompt served from the prefix cache), `bisect --against auto` says the engine
behaves like the reference in that context, reproducing its logprobs exactly while every other
candidate is off; against a context, bisect gives the per-layer growth of the difference and stores it.
"""

from __future__ import annotations

import pytest

from workbench.cli import main as cli_main
from workbench.engine.engine import Engine
from workbench.engine.layer_walk import runner_for
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.rerun.behaves_like import behaves_like
from workbench.trace.bisect_store import read_bisects

SYSTEM = "You are a careful assistant who answers questions about the history of lighthouses and ships. "
PROMPTS = [SYSTEM + f"Question {i}: who kept the lighthouse on island {i} and why?" for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3)
FEW = ("float32", "alone", "batched", "prefix-cache", "chunked:8", "chunked:16")


@pytest.fixture(scope="module")
def recorded(tiny, tmp_path_factory):
    """Three traces of tiny-random, each in a known context, and the reference runner."""
    root = tmp_path_factory.mktemp("contexts")
    paths = {name: str(root / f"{name}.wbtrace") for name in ("chunked", "batched", "cached")}
    with Engine(tiny, chunk_size=8, trace=paths["chunked"]) as engine:
        engine.generate(PROMPTS[:1], PARAMS)
    with Engine(tiny, trace=paths["batched"]) as engine:
        engine.generate(PROMPTS, PARAMS)
    with Engine(tiny, prefix_cache=True, trace=paths["cached"]) as engine:
        engine.generate(PROMPTS[:1], PARAMS)  # finished: its KV stays in the cache
        engine.generate(PROMPTS[1:2], PARAMS)  # shares the system prompt: served from the cache
    return paths, runner_for(tiny)


def _assert_only(fit, name: str) -> None:
    fits = {f.numerics: f.median_abs_delta for f in fit.fits}
    assert fit.best == name and fits[name] == 0.0, fit.describe()
    assert all(v > 0 for k, v in fits.items() if k != name), fit.describe()  # every other context is off


def test_a_batched_run_behaves_like_the_reference_batched(recorded):
    paths, runner = recorded
    fit = behaves_like(paths["batched"], "req-2:4", runner=runner, window=3, candidates=FEW, store=False)
    _assert_only(fit, "batched")
    assert "behaves like: batched" in fit.describe() and "batched with the trace's requests" in fit.describe()


def test_a_prompt_served_from_the_prefix_cache_behaves_like_the_prefix_cache(recorded):
    paths, runner = recorded
    fit = behaves_like(paths["cached"], "req-1:4", runner=runner, window=3, candidates=FEW, store=False)
    _assert_only(fit, "prefix-cache")
    cached = next(f for f in fit.fits if f.numerics == "prefix-cache")
    assert "prompt tokens from the prefix cache (computed by req-0)" in cached.note


def test_bisect_auto_names_chunked_prefill_and_bisects_it_layer_by_layer(recorded, capsys):
    """Every default candidate (the dtypes and each context that applies); the winner is bisected
    in the engine's own run: per layer the total difference from the run alone and its growth."""
    paths, _runner = recorded
    path = paths["chunked"]
    assert cli_main(["bisect", path, "--at", "req-0:4", "--against", "auto", "--window", "3",
                     "--model", "tiny-random"]) == 0
    out = capsys.readouterr().out
    assert "behaves like: chunked:8" in out and "chunked prefill of 8" in out
    assert "alone vs chunked:8" in out and "growth" in out
    rows = {r["against"]: r for r in read_bisects(path)}
    fit = rows["behaves-like"]
    names = [c["numerics"] for c in fit["candidates"]]
    assert fit["best"] == "chunked:8" and {"bfloat16", "alone", "prefix-cache", "chunked:16"} <= set(names)
    assert "batched" not in names  # one request: nothing to batch it with
    row = rows["chunked:8"]
    assert row["kind"] == "context" and len(row["layers"]) == 2
    assert row["embed_error"] == 0.0 and row["layers"][-1]["total"] > 0  # same embeddings; the layers differ
    assert all(x["propagated"] is None for x in row["layers"])
    from workbench.notebook.bisect import bisect_figure

    fig = bisect_figure(path, key="req-0:4:chunked:8")  # the notebook draws the growth, no carried line
    names = [t.name for t in fig.data]
    assert "growth by the layer" in names and "carried from before" not in names
    assert list(next(t for t in fig.data if t.name.startswith("total")).y) == [x["total"] for x in row["layers"]]


def test_bad_contexts_are_clear_errors(recorded, capsys):
    paths, runner = recorded
    with pytest.raises(SystemExit):
        cli_main(["bisect", paths["chunked"], "--at", "req-0:1", "--against", "chunked:0"])
    assert "chunked:N needs N an int in [1, 1048576]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bisect", paths["chunked"], "--at", "req-0:1", "--candidates", "float32,int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert cli_main(["bisect", paths["chunked"], "--at", "req-0:1", "--against", "batched", "--model",
                     "tiny-random"]) == 2
    assert "no other request to batch" in capsys.readouterr().err
