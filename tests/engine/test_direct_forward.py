"""The direct forward (run/exact_forward.py) stands in for the model's own forward only where it
computes the same bits: same tokens and logprobs as the model's forward on continuous batches
(extend, mixed, decode, prefix reuse), hooks still fire, and where its load-time check fails or the
model is not transformers' Llama, Mistral, Qwen2 or Qwen3 the model's forward runs and the report says why."""

from __future__ import annotations

import pytest

from workbench.engine.engine import Engine
from workbench.engine.run import exact_forward
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.models import load_model

PROMPTS = ["The quick brown fox", "Once upon a time there was", "a b c d e f g h i j k l m n o p",
           "The quick brown fox jumps over"]  # the last shares a prefix with the first


def _run(loaded, direct: bool, prompts=PROMPTS, **engine_kw):
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=4)
    with Engine(loaded, trace_level="off", chunk_size=8, max_running=3, **engine_kw) as engine:
        engine.runner.use_direct = direct and engine.runner.use_direct
        outs = engine.generate(prompts, params)
        report = _direct(engine.runner.kernel_report())
    return [(o.token_ids, [(t.logprob, t.top_logprobs) for t in o.logprobs]) for o in outs], report


def _direct(report: dict) -> dict:
    """The direct forward's entry in the report's one section: its state now (used, why, forwards)
    with its verdict's source and check time."""
    entry = report["checks"]["replacements"]["forward.direct"]
    verdicts = entry["verdicts"]
    assert len(verdicts) <= 1  # this model's only
    found = {"source": verdicts[0]["source"], "check_seconds": verdicts[0]["facts"]["seconds"]} if verdicts else {}
    return {**entry["state"], **found}


@pytest.fixture
def fresh():
    """A model object of its own (the verdict is cached per model object)."""
    return load_model("tiny-random", device="cpu")


def test_direct_forward_gives_the_model_forwards_tokens_and_logprobs(fresh):
    direct, report = _run(fresh, True, prefix_cache=True)
    own, own_report = _run(fresh, False, prefix_cache=True)
    assert report["used"] and "bit-identical" in report["why"]
    assert report["forwards"]["direct"] > 0 and report["forwards"]["model"] == 0
    assert own_report["forwards"]["direct"] == 0 and own_report["forwards"]["model"] > 0
    assert direct == own  # token ids, logprobs and top alternatives, exactly


def test_early_exit_drafts_through_the_direct_forward_change_nothing(fresh):
    """Self-speculation's draft forwards (the first layer, then norm and head) run direct too."""
    direct, report = _run(fresh, True, spec="early-exit:layers=1:k=3")
    own, own_report = _run(fresh, False, spec="early-exit:layers=1:k=3")
    assert report["forwards"]["model"] == 0 and report["forwards"]["direct"] == own_report["forwards"]["model"] > 0
    assert direct == own


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_windowed_and_qk_norm_families_match_their_own_forward(family):
    """Sliding windows of 32 tokens (Mistral; Qwen2's second layer) and Qwen3's q/k norms, on prompts
    longer than the window: the direct forward runs and gives the model's forward's outputs."""
    loaded = load_model(f"tiny-random:{family}", device="cpu")
    long = ["word " * 50 + "end", "one two three " * 15]
    direct, report = _run(loaded, True, prompts=long)
    own, _ = _run(loaded, False, prompts=long)
    assert report["used"] and report["forwards"]["direct"] > 0 and report["forwards"]["model"] == 0
    assert direct == own


def test_the_trace_says_which_forward_runs(tiny, tmp_path):
    from workbench.trace.reader import open_trace

    path = str(tmp_path / "t.wbtrace")
    with Engine(tiny, trace_level="summary", trace=path) as engine:
        engine.generate(["hello"], SamplingParams(temperature=0, max_new_tokens=2))
    with open_trace(path) as t:
        recorded = t.meta["engine"]["cpu_kernels"]["checks"]["replacements"]["forward.direct"]["state"]
    assert recorded["used"] is True and "bit-identical" in recorded["why"]
    assert "forwards" not in recorded  # counts are the live report's, not the load-time config's


def test_a_users_hook_still_fires_and_the_models_forward_runs(fresh):
    seen = []
    handle = fresh.model.model.layers[-1].mlp.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        hooked, report = _run(fresh, True)
    finally:
        handle.remove()
    assert seen, "the hook on the MLP never ran"
    assert report["forwards"]["direct"] == 0 and report["forwards"]["model"] > 0
    assert report["forwards"]["last_model_forward_because"] == "a forward hook is registered"
    unhooked, report = _run(fresh, True)
    assert report["forwards"]["direct"] > 0 and hooked == unhooked


def test_a_hook_added_mid_request_fires_at_the_next_step(fresh):
    # the per-forward hook scan is skipped while no hook was registered anywhere since the last scan
    # found none: a hook registered between two steps (a notebook, mid-request) must still be seen
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    with Engine(fresh, trace_level="off") as engine:
        engine.add_request("The quick brown fox", params)
        for _ in range(3):
            engine.step()
        forwards = engine.runner.forwards
        assert forwards["direct"] == 3 and forwards["model"] == 0
        seen = []
        handle = fresh.model.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: seen.append(1))
        engine.step()
        assert seen and forwards["model"] == 1 and forwards["last_model_forward_because"] == \
            "a forward hook is registered"
        handle.remove()
        engine.step()
        assert forwards["direct"] == 4 and len(seen) == 1


def test_a_module_swapped_in_after_load_runs(fresh):
    """A notebook replacing a layer's MLP after the check: the replacement (and a hook on a new
    leaf) runs, as in the model's own forward."""
    import torch

    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2

    baseline, _ = _run(fresh, True)  # checked and direct
    layers = fresh.model.model.layers
    original = layers[-1].mlp
    layers[-1].mlp = Doubled(original)
    try:
        swapped, report = _run(fresh, True)
        expected, _ = _run(fresh, False)
    finally:
        layers[-1].mlp = original
    assert swapped == expected != baseline
    assert not report["used"] and report["why"] == "layer 1 has LlamaDecoderLayer, LlamaAttention, Doubled"
    assert report["forwards"]["direct"] == 0
    # swapped while an engine runs: its next forward asks again
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    with Engine(fresh, trace_level="off", chunk_size=8, max_running=3) as engine:
        before = [o.token_ids for o in engine.generate(PROMPTS, params)]
        layers[-1].mlp = Doubled(original)
        try:
            after = [o.token_ids for o in engine.generate(PROMPTS, params)]
        finally:
            layers[-1].mlp = original
        live = _direct(engine.runner.kernel_report())
    assert before == [t for t, _ in baseline] and after == [t for t, _ in expected]
    assert live["why"] == "the model's modules changed after the check: layer 1 has LlamaDecoderLayer, " \
                          "LlamaAttention, Doubled" and not live["used"]
    seen = []
    q = layers[0].self_attn.q_proj
    layers[0].self_attn.q_proj = torch.nn.Linear(q.in_features, q.out_features, bias=False)
    layers[0].self_attn.q_proj.weight = q.weight
    handle = layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(1))
    try:
        _, report = _run(fresh, True)
    finally:
        handle.remove()
        layers[0].self_attn.q_proj = q
    assert seen and report["forwards"]["last_model_forward_because"] == "a forward hook is registered"
    restored, report = _run(fresh, True)
    assert report["used"] and report["forwards"]["direct"] > 0 and restored == baseline


def test_a_failed_check_keeps_the_models_forward(fresh, monkeypatch):
    monkeypatch.setenv("WORKBENCH_REPLACEMENTS", "fresh")  # an earlier load's passed check is not read
    real = exact_forward.forward
    monkeypatch.setattr(exact_forward, "forward", lambda model, fb: real(model, fb) + 0.5)
    out, report = _run(fresh, True)
    assert not report["used"]
    assert "EXTEND forward: logits differ from the model's forward by up to 0.5" in report["why"]
    assert report["forwards"]["direct"] == 0
    monkeypatch.undo()
    assert _run(fresh, False)[0] == out


def test_the_check_sees_a_missing_attention_keyword_that_changes_no_number_yet(monkeypatch):
    """A window longer than the check's 16 tokens changes no logit there; the keyword still counts."""
    monkeypatch.setenv("WORKBENCH_REPLACEMENTS", "fresh")
    monkeypatch.setitem(exact_forward.FAMILIES, "mistral", exact_forward.Family("Mistral", None, False))
    loaded = load_model("tiny-random:mistral", device="cpu")
    _, report = _run(loaded, True)
    assert not report["used"] and report["forwards"]["direct"] == 0
    assert "layer 0's attention keywords" in report["why"] and "'sliding_window'" in report["why"]


def test_the_direct_forward_does_not_make_the_runner_reread_the_models_structure(fresh, monkeypatch):
    # transformers' `self.layers[:n]` builds a new ModuleList, whose add_module calls count as
    # submodule assignments: a direct forward that did so made every next step re-check the model
    asked = []
    refusal = exact_forward.refusal
    monkeypatch.setattr(exact_forward, "refusal", lambda model: asked.append(1) or refusal(model))
    _, report = _run(fresh, True)
    assert report["forwards"]["direct"] > 10 and len(asked) <= 1, (report["forwards"], len(asked))


def test_a_passed_check_is_kept_for_the_next_load_of_the_same_model(monkeypatch, tmp_path):
    from workbench.models.loader import resolve_folder

    folder = str(resolve_folder("tiny-random")[0])  # from the usual cache, not rebuilt under tmp_path
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))  # its probe and check files all here
    monkeypatch.delenv("WORKBENCH_REPLACEMENTS", raising=False)
    checks = []
    verify = exact_forward.verify
    monkeypatch.setattr(exact_forward, "verify", lambda *a, **kw: checks.append(1) or verify(*a, **kw))
    _, first = _run(load_model(folder, device="cpu"), True)
    assert first["used"] and first["source"] == "checked in this process" and first["check_seconds"] > 0
    assert len(checks) == 1
    again = load_model(folder, device="cpu")  # another model object: its own verdict, from the file
    _, second = _run(again, True)
    assert second["used"] and second["source"].startswith("cached from 20") and len(checks) == 1  # no check ran
    assert second["forwards"]["direct"] > 0
    monkeypatch.setenv("WORKBENCH_REPLACEMENTS", "fresh")
    _, third = _run(load_model(folder, device="cpu"), True)
    assert third["source"] == "checked in this process" and len(checks) == 2


def test_a_model_that_is_not_transformers_llama_is_refused(fresh):
    class Custom(type(fresh.model)):  # e.g. a user's subclass with its own forward
        pass

    fresh.model.__class__ = Custom
    assert exact_forward.refusal(fresh.model) == "Custom is not transformers' LlamaForCausalLM"
    out, report = _run(fresh, True)
    assert not report["used"] and report["why"] == "Custom is not transformers' LlamaForCausalLM"
    assert report["forwards"]["direct"] == 0


def test_fast_mode_wrappers_on_a_shared_model_send_exact_to_the_models_forward(fresh):
    before, _ = _run(fresh, True)
    Engine(fresh, trace_level="off", kernels="fast").close()  # installs wrappers on the shared model
    after, report = _run(fresh, True)
    assert report["forwards"]["direct"] == 0 and after == before
