"""Start-up: a warm load reuses the attention probe's result instead of running the model, and gets
exactly what a probe finds; anything the result depends on changing probes afresh; the load's
paused garbage collector is handed back as it was."""

from __future__ import annotations

import gc
import json

import pytest
import transformers

from workbench.engine.engine import Engine
from workbench.engine.kernels import CHECKED_NOW, environment
from workbench.engine.run import attention, exact_forward, variants
from workbench.engine.run.model_runner import ModelRunner
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.models import load_model
from workbench.models.loader import gc_paused

# full, window + full, soft-cap + window, sinks + window + MoE, per-type RoPE
FAMILIES = ["llama", "qwen2", "gemma2", "gpt_oss", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    return load_model(f"tiny-random:{request.param}", device="cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh verdict store (the models themselves were loaded from the usual cache)."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.delenv("WORKBENCH_REPLACEMENTS", raising=False)
    return tmp_path / "verdicts"


def _probe_files(cache) -> list:
    """The verdict files holding a probe's result (beside them: the GEMMs' and the direct forward's)."""
    return [p for p in cache.glob("*.json") if variants.NAME in json.loads(p.read_text()).get("verdicts", {})]


def _layers(data: dict) -> list:
    (entry,) = data["verdicts"][variants.NAME].values()
    return entry["facts"]["layers"]


def _with_layers(data: dict, layers: list) -> dict:
    (key,) = data["verdicts"][variants.NAME]
    entry = data["verdicts"][variants.NAME][key]
    return {**data, "verdicts": {**data["verdicts"], variants.NAME: {key: {**entry, "facts": {"layers": layers}}}}}


def _runner_and_forwards(loaded) -> tuple[ModelRunner, int]:
    """A ModelRunner built on `loaded`, and how many forwards of the model its construction ran."""
    calls = []
    hook = loaded.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        runner = ModelRunner(loaded)
    finally:
        hook.remove()
    return runner, len(calls)


def _probed_now(loaded) -> list[variants.AttentionVariant]:
    found = variants.probe(loaded.model)
    loaded.model.set_attn_implementation(attention.ATTN_NAME)
    return found


def _cold_forwards(loaded) -> int:
    """A first runner's forwards on a model object: the attention probe's, and the direct forward's
    check (run/exact_forward.py) on the families it covers (kept on the object, and on disk)."""
    return 1 + (exact_forward.CHECK_FORWARDS if exact_forward.refusal(loaded.model) is None else 0)


def test_a_warm_load_runs_no_forward_and_gets_what_the_probe_finds(loaded, cache):
    first, forwards = _runner_and_forwards(loaded)
    assert forwards == _cold_forwards(loaded) and first.variants_source == CHECKED_NOW
    assert len(_probe_files(cache)) == 1
    second, forwards = _runner_and_forwards(loaded)
    assert forwards == 0, "a warm load ran the model"
    assert second.variants_source.startswith("cached from 20")
    assert second.variants == first.variants == _probed_now(loaded)
    # and the engine built on the cached result generates what one built on a fresh probe does
    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,"]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    warm = [o.token_ids for o in Engine(loaded, trace_level="off").generate(prompts, params)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBENCH_REPLACEMENTS", "fresh")
        cold = Engine(loaded, trace_level="off")
        assert cold.runner.variants_source == CHECKED_NOW
        assert warm == [o.token_ids for o in cold.generate(prompts, params)]


def test_a_damaged_or_foreign_cache_file_is_probed_again(loaded, cache):
    ModelRunner(loaded)
    (path,) = _probe_files(cache)
    data = json.loads(path.read_text())
    layers = _layers(data)
    bad_files = ["{not json", json.dumps(_with_layers(data, layers[:-1])),  # one layer short
                 json.dumps(_with_layers(data, [{**e, "window": -1} for e in layers])),
                 json.dumps({**data, "environment": {**data["environment"], "transformers": "0.0"}})]
    for text in bad_files:
        path.write_text(text)
        runner, forwards = _runner_and_forwards(loaded)
        assert forwards == 1 and runner.variants_source == CHECKED_NOW
        assert runner.variants == _probed_now(loaded)
        assert _layers(json.loads(path.read_text())) == layers  # rewritten whole


def test_another_transformers_config_or_switch_probes_afresh(tmp_path, monkeypatch):
    loaded = load_model("tiny-random:llama", device="cpu")  # from the usual cache, then a fresh variants cache
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    monkeypatch.delenv("WORKBENCH_REPLACEMENTS", raising=False)
    cache = tmp_path / "verdicts"
    assert _runner_and_forwards(loaded)[1] == _cold_forwards(loaded)
    assert _runner_and_forwards(loaded)[1] == 0
    model = environment.model
    monkeypatch.setattr(environment, "model", lambda *a: {**model(*a), "transformers": "9.0.0"})
    assert _runner_and_forwards(loaded)[1] == 1, "a new transformers version reused the old probe"
    monkeypatch.setattr(environment, "model", model)
    loaded.model.config.attention_chunk_size = 8  # config changed in memory: a new key, and refused
    with pytest.raises(ValueError, match=r"^llama: chunked attention"):
        ModelRunner(loaded)
    del loaded.model.config.attention_chunk_size  # LlamaConfig has none: the original config again
    assert _runner_and_forwards(loaded)[1] == 0
    monkeypatch.setenv("WORKBENCH_REPLACEMENTS", "fresh")
    assert _runner_and_forwards(loaded)[1] == 1
    assert len(_probe_files(cache)) == 2  # this transformers' and "9.0.0"'s


def test_a_refused_model_is_not_cached(cache):
    mpt = transformers.AutoModelForCausalLM.from_config(
        transformers.MptConfig(vocab_size=128, d_model=32, n_heads=2, n_layers=2, max_seq_len=64)).eval()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^mpt: attention outside transformers' AttentionInterface"):
            variants.variants_for(mpt, "0" * 16)
    assert not cache.exists() or not _probe_files(cache)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_load_hands_the_garbage_collector_back_as_it_was(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                pass
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError("a load that fails")
        assert gc.isenabled() == enabled
        Engine(load_model("tiny-random", device="cpu"), trace_level="off")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
