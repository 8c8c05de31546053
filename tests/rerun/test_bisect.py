"""`workbench bisect` (issue 35): which layer, and which sub-block in it, adds error beyond the floor
of its dtype, and which numerics a probed engine behaves like.

What a user notices: a module swapped into one layer of SmolLM2 that changes its output by a small,
known amount is named, layer and sub-block, and no other layer adds anything; the reference against
itself names nothing; at a position where fast mode picks another token, bisect says how much each
layer added and the notebook figure draws it; the result is stored in the trace and read back
without torch; a probed trace of this project's own `serve --dtype bfloat16` behaves like bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.rerun.bisect import bisect
from workbench.trace.bisect_store import read_bisects

DELTA = 1e-4  # the swapped module's relative change: far under bf16's rounding, far over float32's


class Scaled(torch.nn.Module):
    """`inner`'s output times (1 + delta): the hidden perturbation."""

    def __init__(self, inner: torch.nn.Module, delta: float) -> None:
        super().__init__()
        self.inner, self.delta = inner, delta

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * (1 + self.delta), *out[1:])
        return out * (1 + self.delta)


@pytest.fixture(scope="module")
def short(smollm2, tmp_path_factory):
    """A short greedy SmolLM2 trace and the engine's runner (the reference numerics)."""
    path = tmp_path_factory.mktemp("bisect") / "short.wbtrace"
    with Engine(smollm2, trace=str(path)) as engine:
        engine.generate(["The lighthouse keeper counted"], SamplingParams(temperature=0, max_new_tokens=3))
    return str(path), engine.runner


@pytest.mark.parametrize("layer, block", [(7, "mlp"), (12, "self_attn")])
def test_a_module_swapped_into_one_layer_is_named_with_its_sub_block(short, layer, block):
    path, runner = short
    target = f"model.layers.{layer}.{block}"
    original = runner.model.get_submodule(target)
    result = bisect(path, "req-0:2", against={target: Scaled(original, DELTA)}, runner=runner, store=False)
    assert result.first == (layer, block), result.describe()
    assert runner.model.get_submodule(target) is original  # put back
    for x in result.layers:
        if x.layer != layer:
            assert x.added == 0.0, (x.layer, x.added)  # the same code on the same input
        else:
            named = next(b for b in x.blocks if b.block == block)
            assert named.ratio > 100 and all(b.added == 0.0 for b in x.blocks if b.block != block)
    assert all(x.propagated > 0 for x in result.layers if x.layer > layer)  # carried on, not added
    assert f"layer {layer}" in result.describe()


def test_the_reference_against_itself_exceeds_no_floor(short):
    path, runner = short
    result = bisect(path, "req-0:2", against="float32", runner=runner, store=False)
    assert result.first is None and all(x.added == 0.0 and x.total == 0.0 for x in result.layers)
    assert all(x.floor > 0 for x in result.layers)
    assert "no layer adds more than" in result.describe()


@pytest.fixture(scope="module")
def fast_divergence(smollm2, tmp_path_factory):
    """An exact greedy SmolLM2 trace and the first position where fast mode picks another token in
    bisect's own runs: the prefill of the prompt and the tokens before that position, its last row
    picking (a bf16 GEMM's bits depend on its row count, so a walk over the whole sequence can pick
    differently at a row: it did on an AVX2-only EPYC)."""
    import workbench.engine.layer_walk as lw

    path = str(tmp_path_factory.mktemp("bisect") / "poem.wbtrace")
    chat = [{"role": "user", "content": "Write a short poem about the moon."}]
    with Engine(smollm2, trace=path) as engine:
        (out,) = engine.generate([chat], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    ids, start = out.prompt_token_ids + out.token_ids, len(out.prompt_token_ids)
    numerics = {name: lw.numerics_for(name, engine.runner, None) for name in ("float32", "fast")}
    differs = []
    for p in range(len(out.token_ids)):
        seq = ids[: start + p]
        lp = {name: lw.walk(num, seq, [len(seq) - 1]).logprobs[0] for name, num in numerics.items()}
        if int(lp["float32"].argmax()) != int(lp["fast"].argmax()):
            top2 = lp["fast"].topk(2).values
            if top2[0] > top2[1]:  # prefer a position fast mode does not tie
                return path, p, engine.runner
            differs.append(p)
    assert differs, "fast mode agreed with exact at every position of this prompt on this CPU"
    return path, differs[0], engine.runner


def test_bisect_against_fast_mode_says_what_each_layer_added_where_the_token_differs(fast_divergence):
    from workbench.notebook.bisect import bisect_figure

    path, position, runner = fast_divergence
    result = bisect(path, f"req-0:{position}", against="fast", runner=runner)
    assert result.suspect_pick.token_id != result.reference_pick.token_id, result.describe()
    assert len(result.layers) == 30 and all(x.added > 0 and x.floor > 0 for x in result.layers)
    text = result.describe()
    assert "the suspect picks" in text and text.count("\n") > 30
    (row,) = [r for r in read_bisects(path) if r["against"] == "fast"]
    assert row["position"] == position and len(row["layers"]) == 30
    named = row["first_layer"] if row["first_layer"] is not None else max(row["layers"], key=lambda x: x["ratio"])["layer"]
    assert f"layer {named}" in text
    fig = bisect_figure(path)
    added = next(t for t in fig.data if t.name == "added by the layer")
    carried = next(t for t in fig.data if t.name == "carried from before")
    assert list(added.y) == pytest.approx([x.added for x in result.layers])
    assert list(carried.y[1:]) == pytest.approx([x.propagated for x in result.layers][1:])


@pytest.mark.slow
def test_a_probed_bfloat16_server_behaves_like_bfloat16(tiny, tmp_path, capsys):
    """This project's own server in bfloat16 (tiny-random, its own process), probed; bisect's auto mode
    fits each candidate numerics to the logprobs it reported and bisects the winner."""
    from workbench.cli import main as cli_main
    from workbench.external.probe import probe
    from workbench.external.records import ProbeRequest
    from workbench.external.token_ids import load_reference_tokenizer
    from workbench.server.background import ServerProcess
    from workbench.trace.reader import open_trace

    path = tmp_path / "bf16.wbtrace"
    requests = [ProbeRequest(prompt="Once upon a time", params={"temperature": 0.8, "seed": 7})]
    with ServerProcess(["--model", "tiny-random", "--dtype", "bfloat16"], start_timeout=180) as srv:
        probe(srv.url + "/v1", requests, path, max_tokens=10, tokenizer=load_reference_tokenizer("tiny-random"),
              progress=False)
    with open_trace(path) as t:
        (rid,) = [r.req_id for r in t.requests()]
    assert cli_main(["bisect", str(path), "--at", f"{rid}:5", "--model", "tiny-random"]) == 0
    out = capsys.readouterr().out
    assert "behaves like: bfloat16" in out and "vs bfloat16" in out
    rows = {r["against"]: r for r in read_bisects(path)}
    assert rows["behaves-like"]["best"] == "bfloat16"
    fits = {c["numerics"]: c["median_abs_delta"] for c in rows["behaves-like"]["candidates"]}
    assert fits["bfloat16"] < min(v for k, v in fits.items() if k != "bfloat16")
    assert len(rows["bfloat16"]["layers"]) == 2


def test_bad_arguments_are_clear_errors(tiny, tmp_path, capsys):
    from workbench.cli import main as cli_main

    path = tmp_path / "one.wbtrace"
    with Engine(tiny, trace=str(path)) as engine:
        engine.generate(["hello there"], SamplingParams(temperature=0, max_new_tokens=2))
    with pytest.raises(SystemExit):
        cli_main(["bisect", str(path), "--at", "req-0:1", "--against", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert cli_main(["bisect", str(path), "--at", "req-0:7", "--against", "fast"]) == 2
    assert "position must be in [0, 2)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no module 'model.layers.9.mlp'"):
        bisect(str(path), "req-0:1", against={"model.layers.9.mlp": torch.nn.Identity()}, store=False)
