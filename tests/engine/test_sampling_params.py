"""SamplingParams validation: every invalid value is a ValueError naming the parameter (table-driven),
the natural forms are normalised, and the CLI helpers build the same params a Python caller would."""

from __future__ import annotations

import argparse
import math

import pytest

from workbench.cli.sampling_args import add_sampling_args, params_from_args
from workbench.engine.sample.sampling_params import (
    MAX_N,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    SamplingParams,
)

VOCAB = 1000

INVALID = [
    # (parameter named in the message, field overrides)
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": True}),
    ("temperature", {"temperature": "1"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("top_k", {"top_k": True}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.01}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("frequency_penalty", {"frequency_penalty": math.inf}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("max_new_tokens", {"max_new_tokens": 0}),
    ("max_new_tokens", {"max_new_tokens": -1}),
    ("max_new_tokens", {"max_new_tokens": 1.5}),
    ("max_new_tokens", {"max_new_tokens": False}),
    ("min_new_tokens", {"min_new_tokens": 11, "max_new_tokens": 10}),
    ("min_new_tokens", {"min_new_tokens": -1}),
    ("stop", {"stop": [1, 2]}),
    ("stop", {"stop": ("ok", "")}),
    ("stop", {"stop": ["x" * (MAX_STOP_LEN + 1)]}),
    ("stop", {"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}),
    ("stop", {"stop": 5}),
    ("stop_token_ids", {"stop_token_ids": (VOCAB,)}),
    ("stop_token_ids", {"stop_token_ids": (-1,)}),
    ("stop_token_ids", {"stop_token_ids": (True,)}),
    ("logit_bias", {"logit_bias": {VOCAB: 1.0}}),
    ("logit_bias", {"logit_bias": {-5: 1.0}}),
    ("logit_bias", {"logit_bias": {"7": 1.0}}),
    ("logit_bias", {"logit_bias": {7: math.nan}}),
    ("logit_bias", {"logit_bias": {7: "high"}}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("n", {"n": 0}),
    ("n", {"n": MAX_N + 1}),
    ("n", {"n": True}),
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": -(2**63) - 1}),
    ("seed", {"seed": 1.0}),
    ("top_logprobs", {"top_logprobs": 21}),
    ("top_logprobs", {"top_logprobs": -1}),
    ("token_ids_logprob", {"token_ids_logprob": (VOCAB + 3,)}),
    ("logprobs", {"logprobs": 5}),
    ("prompt_logprobs", {"prompt_logprobs": 1}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("logprobs_mode", {"logprobs_mode": "logits"}),
    ("json_schema", {"json_schema": {"type": "object"}, "regex": "a+"}),
    ("regex", {"regex": "a+", "ebnf": 'root ::= "a"'}),
    ("json_schema", {"json_schema": "{not json"}),
    ("json_schema", {"json_schema": {"type": 5}}),
    ("json_schema", {"json_schema": 42}),
    ("regex", {"regex": "[a-"}),
    ("regex", {"regex": ""}),
    ("ebnf", {"ebnf": "root ::= undefined_rule"}),
    ("extra", {"extra": []}),
]


@pytest.mark.parametrize(("param", "overrides"), INVALID, ids=[f"{p}-{i}" for i, (p, _) in enumerate(INVALID)])
def test_invalid_value_names_the_parameter(param: str, overrides: dict) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**overrides).validate(VOCAB)
    assert param in str(info.value)


def test_range_messages_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0.0, 1.0\], got 0.0"):
        SamplingParams(top_p=0.0).validate(VOCAB)
    with pytest.raises(ValueError, match=r"token ids in \[0, 999\]"):
        SamplingParams(stop_token_ids=(1000,)).validate(VOCAB)
    with pytest.raises(ValueError, match=r"regex is invalid: .*Unclosed"):
        SamplingParams(regex="[a-").validate(VOCAB)
    with pytest.raises(ValueError) as info:
        SamplingParams(regex="[a-").validate(VOCAB)
    assert ".cc:" not in str(info.value), "xgrammar's C++ source location leaks into the message"


VALID = [
    {},
    {"temperature": 0},
    {"temperature": 2, "top_p": 1, "top_k": 0, "min_p": 1},
    {"top_k": -1}, {"top_k": 1},
    {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 0.5},
    {"max_new_tokens": 0, "prompt_logprobs": True},
    {"min_new_tokens": 5, "max_new_tokens": 5},
    {"seed": 2**63 - 1}, {"seed": -(2**63)},
    {"n": MAX_N, "top_logprobs": 20, "logprobs": True, "logprobs_mode": "processed"},
    {"stop": ["a", "bb"], "stop_token_ids": [0, VOCAB - 1], "token_ids_logprob": [3]},
    {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"json_schema": '{"type": "string"}'},
    {"regex": r"\d{3}"},
    {"ebnf": 'root ::= "yes" | "no"'},
]


@pytest.mark.parametrize("overrides", VALID)
def test_valid_values_pass(overrides: dict) -> None:
    SamplingParams(**overrides).validate(VOCAB)


def test_natural_forms_are_normalised() -> None:
    p = SamplingParams(stop="x", stop_token_ids=[1, 2], logit_bias={3: 250.0, 4: -1000, 5: 1.5})
    assert p.stop == ("x",)
    assert p.stop_token_ids == (1, 2)
    assert p.logit_bias == {3: 100.0, 4: -100.0, 5: 1.5}
    p.validate(VOCAB)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams.from_dict(p.to_dict()) == p


def _parse(argv: list[str]) -> SamplingParams:
    parser = add_sampling_args(argparse.ArgumentParser())
    return params_from_args(parser.parse_args(argv))


def test_cli_args_build_sampling_params(tmp_path) -> None:
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    p = _parse(["--temperature", "0.7", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05", "--seed", "7",
                "--max-new-tokens", "12", "--stop", "END", "--stop", "\n\n", "--stop-token-id", "5",
                "--logit-bias", "42=-5", "--logprobs", "--top-logprobs", "3", "--logprobs-mode", "processed",
                "--repetition-penalty", "1.1", "--presence-penalty", "0.5", "--frequency-penalty", "0.2",
                "-n", "2", "--json-schema", f"@{schema}"])
    assert p == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, max_new_tokens=12,
                               stop=("END", "\n\n"), stop_token_ids=(5,), logit_bias={42: -5.0}, logprobs=True,
                               top_logprobs=3, logprobs_mode="processed", repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=0.2, n=2, json_schema={"type": "object"})
    assert _parse([]) == SamplingParams()


@pytest.mark.parametrize(("argv", "param"), [
    (["--logit-bias", "42"], "logit_bias"),
    (["--logit-bias", "x=1"], "logit_bias"),
    (["--json-schema", "{oops"], "json_schema"),
    (["--ebnf", "@/nonexistent/grammar.ebnf"], "ebnf"),
])
def test_cli_bad_values_are_value_errors(argv: list[str], param: str) -> None:
    with pytest.raises(ValueError, match=param):
        _parse(argv)


def test_cli_values_are_validated_like_python_ones() -> None:
    with pytest.raises(ValueError, match="top_p"):
        _parse(["--top-p", "0"]).validate(VOCAB)
