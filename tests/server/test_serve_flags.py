"""`workbench serve` takes the flags vLLM users type (SGLang's names as aliases): they reach the engine,
a request past --max-model-len is refused, --speculative-config runs speculative decoding, and a bad
value is refused naming its flag before the model loads."""

from __future__ import annotations

import argparse

import httpx
import pytest

from workbench.server.background import BackgroundServer
from workbench.server.cli_args import add_serve_args, build_server, engine_kwargs

MODEL = "tiny-random"


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_serve_args(parser)
    return parser.parse_args(["--model", MODEL, "--device", "cpu", *flags])


def test_vllm_names_and_sglang_aliases_set_the_same_engine_options() -> None:
    vllm = engine_kwargs(_parse("--max-num-seqs", "8", "--max-model-len", "256", "--max-num-batched-tokens", "512",
                                "--chunked-prefill-size", "64", "--enable-prefix-caching", "--dtype", "float32",
                                "--seed", "5"))
    sglang = engine_kwargs(_parse("--max-running-requests", "8", "--context-length", "256",
                                  "--max-prefill-tokens", "512", "--chunked-prefill-size", "64", "--prefix-cache",
                                  "--dtype", "float", "--seed", "5"))
    assert vllm == sglang
    assert (vllm["max_running"], vllm["max_model_len"], vllm["max_batch_tokens"], vllm["chunk_size"],
            vllm["prefix_cache"], vllm["dtype"], vllm["seed"]) == (8, 256, 512, 64, True, "float32", 5)
    assert engine_kwargs(_parse("--no-enable-prefix-caching"))["prefix_cache"] is False


def test_speculative_config_takes_vllm_json() -> None:
    spec = engine_kwargs(_parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                '"prompt_lookup_max": 5}'))["spec"]
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    draft = engine_kwargs(_parse("--speculative-config", '{"model": "tiny-random", "num_speculative_tokens": 2}'))
    assert (draft["spec"].method, draft["spec"].draft_model) == ("draft", "tiny-random")


@pytest.mark.parametrize("flags,message", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be an integer >= 1"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be an integer >= 1"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'],
     "--speculative-config: num_speculative_tokens must be an integer in"),
    (["--speculative-config", '{"method": "medusa"}'], "--speculative-config: spec method must be one of"),
    (["--speculative-config", '{"method": "ngram"}', "--spec", "ngram"], "give one"),
])
def test_bad_engine_flags_name_the_flag_before_the_model_loads(flags, message) -> None:
    args = _parse(*flags)
    args.model = "no-such-model"  # a load would fail differently: the flag is checked first
    with pytest.raises(ValueError, match=message):
        build_server(args)


def test_malformed_speculative_json_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit):
        _parse("--speculative-config", "{ngram")
    assert "--speculative-config: not valid JSON" in capsys.readouterr().err


def test_flags_reach_the_running_server() -> None:
    args = _parse("--max-model-len", "96", "--max-num-seqs", "4", "--chunked-prefill-size", "16", "--seed", "3",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    engine, app = build_server(args)
    try:
        cfg = engine.config
        assert (cfg.max_running, cfg.chunk_size, cfg.seed) == (4, 16, 3)
        assert engine.spec is not None and cfg.spec["num_speculative_tokens"] == 2
        with BackgroundServer(app) as srv:
            models = httpx.get(srv.url + "/v1/models", timeout=30).json()
            assert models["data"][0]["max_model_len"] == 96
            ok = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "one two one two one two", "max_tokens": 8, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
            long = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "word " * 120, "max_tokens": 4})
            assert long.status_code == 400, long.text
    finally:
        engine.close()
