"""A json_schema's properties come out in the order the schema lists them, not sorted."""

from __future__ import annotations

import json

import pytest

from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9}, "mid": {"type": "boolean"},
                                           "alpha": {"type": "string", "maxLength": 4}},
          "required": ["zeta", "mid", "alpha"], "additionalProperties": False}


@pytest.mark.slow  # compiles the grammar against the 49k-token vocabulary
def test_properties_keep_the_schema_order() -> None:
    with Engine("tiny-random", device="cpu", trace_level="off") as engine:
        (out,) = engine.generate(["Give me JSON:"], SamplingParams(temperature=0, max_new_tokens=60,
                                                                  json_schema=SCHEMA))
    assert out.finish_reason == "stop", out.text
    assert list(json.loads(out.text)) == ["zeta", "mid", "alpha"]
