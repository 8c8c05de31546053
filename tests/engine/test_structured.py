"""Structured output with xgrammar: sampled (temperature 1) smollm2 outputs obey a JSON schema, a
regex and an EBNF choice grammar and end with `stop`; bad constraints are ValueErrors at admission;
the grammar mask composes with ignore_eos, min_new_tokens, speculative prefixes and tracing."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from workbench.engine.engine import Engine
from workbench.engine.sample.grammar import GrammarBackend
from workbench.engine.sample.sampler import Sampler, SamplingBatchInfo
from workbench.engine.sample.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog", "none"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,7} is [0-9]{1,2} years old\."
CHOICES = ("red", "green", "blue")
EBNF = 'root ::= "red" | "green" | "blue"'


@pytest.fixture(scope="module")
def smol_engine(smollm2):
    return Engine(smollm2, trace_level="off")


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.slow
def test_json_schema_samples_all_validate(smol_engine) -> None:
    params = SamplingParams(temperature=1.0, seed=100, n=20, max_new_tokens=48, json_schema=SCHEMA)
    outs = smol_engine.generate([_chat("Describe a person as JSON with name, age and pet.")], params)
    assert len(outs) == 20
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 1, "temperature 1 should not give 20 identical objects"


@pytest.mark.slow
def test_regex_samples_all_fullmatch(smol_engine) -> None:
    params = SamplingParams(temperature=1.0, seed=200, n=20, max_new_tokens=24, regex=REGEX)
    outs = smol_engine.generate([_chat("Tell me someone's name and age in one sentence.")], params)
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text


@pytest.mark.slow
def test_ebnf_choice_only_yields_its_choices(smol_engine) -> None:
    params = SamplingParams(temperature=1.0, seed=300, n=20, max_new_tokens=8, ebnf=EBNF)
    outs = smol_engine.generate([_chat("Name a colour.")], params)
    assert {o.text for o in outs} <= set(CHOICES)
    assert all(o.finish_reason == "stop" for o in outs)


# --- tiny model: admission, composition with other features ----------------------------------------


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, trace_level="summary", trace_topk=4)


@pytest.mark.parametrize(("kw", "param"), [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": 'root ::= "a" | missing'}, "ebnf"),
    ({"regex": "a", "json_schema": {"type": "string"}}, "mutually exclusive"),
])
def test_bad_constraints_are_refused_at_admission(engine, kw: dict, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        engine.add_request("hello", SamplingParams(**kw))
    assert not engine.has_work()


def test_compiled_grammars_are_cached(engine) -> None:
    backend: GrammarBackend = engine.grammars
    a = backend.compile("json_schema", {"type": "object", "properties": {"x": {"type": "integer"}}})
    b = backend.compile("json_schema", {"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert a is b and backend.compile("regex", "x+") is backend.compile("regex", "x+")


def test_grammar_stops_even_with_ignore_eos_and_survives_min_new_tokens(engine) -> None:
    outs = engine.generate(["abc", "abc"], [
        SamplingParams(temperature=1.0, seed=1, max_new_tokens=20, regex="ab?c", ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, max_new_tokens=20, regex="ab?c", min_new_tokens=4)])
    assert re.fullmatch("ab?c", outs[0].text) and outs[0].finish_reason == "stop"
    # min_new_tokens bans EOS, the finished grammar allows only EOS: the grammar wins, and the
    # request stops as soon as min_new_tokens allows it
    assert re.fullmatch("ab?c", outs[1].text) and outs[1].finish_reason == "stop"
    assert len(outs[1].token_ids) <= 5


def test_grammar_stage_is_traced(engine) -> None:
    engine.memory_sink.events.clear()
    (out,) = engine.generate(["pick"], SamplingParams(temperature=1.0, seed=3, max_new_tokens=8, ebnf=EBNF))
    assert out.text in CHOICES
    first = next(e for e in engine.memory_sink.events if e.kind == "sampling" and e.req_id == out.req_id)
    grammar = next(s for s in first.stages if s["name"] == "grammar")
    assert grammar["applied"] and grammar["kept_count"] < 20
    assert grammar["kept_mass"] < 1.0 and first.chosen in grammar["top_ids"]


def test_prefix_rows_get_the_mask_after_their_drafts(engine, tiny) -> None:
    """Speculative verify rows of one request: row j's mask is the grammar state after j drafts."""
    tok = tiny.tokenizer
    (rid,) = engine.add_request("x", SamplingParams(regex="ab", max_new_tokens=4))
    req = engine.reqs[rid]
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    info = SamplingBatchInfo.build([req] * 3, engine.vocab_size, "cpu", eos_token_ids=(tok.eos_token_id,),
                                   prefixes=[(), (a,), (a, b)])
    probs = Sampler().probs(torch.zeros(3, engine.vocab_size), info)
    assert probs[0, a] > 0 and probs[0, b] == 0
    assert probs[1, b] > 0 and probs[1, a] == 0
    assert probs[2, tok.eos_token_id] == 1.0
    engine.abort(rid)
    engine.step()
