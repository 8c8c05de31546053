"""The example traces in `traces/`, made by one command (`workbench make-traces` / `make traces`).

Owns: the recipes of the small example traces that the tests open and replay and the viewers
show: concurrent chats, speculative decoding, a stop string, structured output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EDIT_TEXT = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day long."


def _recipes() -> dict[str, dict[str, Any]]:
    from workbench.engine.sample.sampling_params import SamplingParams

    chat = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return {
        "concurrent_chats": {
            "engine": {"chunk_size": 32},
            "prompts": [chat("Name three planets."), chat("Write a haiku about rain."),
                        chat("What is 7 times 8?"), chat("Give me a word that rhymes with cat.")],
            "params": [SamplingParams(temperature=0, max_new_tokens=24),
                       SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_new_tokens=24),
                       SamplingParams(temperature=0, max_new_tokens=16, logprobs=True, top_logprobs=5),
                       SamplingParams(temperature=1.0, top_k=20, seed=3, max_new_tokens=16)],
        },
        "speculative": {
            "engine": {"spec": "ngram:k=4"},
            "prompts": [chat(f"Repeat this text exactly: {EDIT_TEXT}"), chat("Count from one to ten in words.")],
            "params": [SamplingParams(temperature=0, max_new_tokens=32), SamplingParams(temperature=0, max_new_tokens=24)],
        },
        "stop_string": {
            "engine": {},
            "prompts": [chat("List the days of the week, one per line."), "1, 2, 3, 4, 5,"],
            "params": [SamplingParams(temperature=0, max_new_tokens=40, stop=["Wednesday"]),
                       SamplingParams(temperature=0, max_new_tokens=30, stop=[" 9,"], include_stop_str_in_output=True)],
        },
        "structured": {
            "engine": {},
            "prompts": [chat("Describe a cat as JSON with a name and an age.")],
            "params": [SamplingParams(temperature=0, max_new_tokens=40, json_schema={
                "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"], "additionalProperties": False})],
        },
    }


def make_example_traces(folder: Path, model: str = "smollm2", names: list[str] | None = None) -> list[Path]:
    """Record each example into `folder/<name>.wbtrace` (overwriting) and return the paths."""
    from workbench.engine.engine import Engine
    from workbench.models.loader import load_model

    folder.mkdir(parents=True, exist_ok=True)
    loaded = load_model(model)
    paths = []
    for name, recipe in _recipes().items():
        if names and name not in names:
            continue
        path = folder / f"{name}.wbtrace"
        for suffix in ("", "-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)
        with Engine(loaded, trace=str(path), trace_level="summary", **recipe["engine"]) as engine:
            engine.generate(recipe["prompts"], recipe["params"])
        paths.append(path)
    return paths
