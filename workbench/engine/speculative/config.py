"""Speculative decoding: the configuration, per-request metrics and the worker factory.

Owns: `SpecConfig` (which drafter, how many tokens, its parameters) and its parsing from the
`spec=` value of `Engine` / `--spec` of the CLI (a string such as `"ngram:k=4"`,
`"draft:smollm2:k=4"`, `"early-exit:layers=8:k=4"`, a dict, or a `SpecConfig`), validation with
ValueErrors naming the parameter, `SpecStats` (what `RequestOutput.spec` carries) and
`Target` (the parts of the target model the worker and the drafters are given). Does not own:
drafting (drafters.py), verification (verify.py) or the speculative step itself (worker.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.engine.run.model_runner import ModelRunner
    from workbench.engine.sample.sampler import Sampler
    from workbench.engine.sched.memory import Memory

METHODS = ("ngram", "draft", "early-exit")
_METHOD_ALIASES = {"ngram": "ngram", "prompt-lookup": "ngram", "draft": "draft", "draft-model": "draft",
                   "early-exit": "early-exit", "early_exit": "early-exit", "self-draft": "early-exit"}
_KEY_ALIASES = {"k": "num_speculative_tokens", "num_speculative_tokens": "num_speculative_tokens",
                "min": "prompt_lookup_min", "prompt_lookup_min": "prompt_lookup_min",
                "max": "prompt_lookup_max", "prompt_lookup_max": "prompt_lookup_max",
                "model": "draft_model", "draft_model": "draft_model",
                "layers": "exit_layer", "exit_layer": "exit_layer"}
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Which drafter proposes how many tokens per step.

    `ngram`: prompt lookup of the longest suffix of `prompt_lookup_max` down to `prompt_lookup_min`
    tokens in the context so far (earliest occurrence). `draft`: a separate model `draft_model`
    (any model spec) sharing the target's tokenizer. `early-exit`: the target's first `exit_layer`
    layers with its final norm and head (default: half the layers).
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    exit_layer: int | None = None

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"spec method must be one of {METHODS}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, MAX_PROMPT_LOOKUP)
        if self.method == "draft" and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise ValueError("draft_model: the 'draft' method needs a model spec, e.g. 'draft:tiny-random'")
        if self.exit_layer is not None:
            _check_int("exit_layer", self.exit_layer, 1, None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The drafter's name as traces show it, e.g. `ngram[2..4]`, `draft(tiny-random)`."""
        if self.method == "ngram":
            return f"ngram[{self.prompt_lookup_min}..{self.prompt_lookup_max}]"
        if self.method == "draft":
            return f"draft({self.draft_model})"
        return f"early-exit({self.exit_layer})"


def _check_int(name: str, value: Any, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi if hi is not None else 'num_layers - 1'}], "
                         f"got {value!r}")


def parse_spec(spec: str | dict[str, Any] | SpecConfig) -> SpecConfig:
    """Turn the `spec=` value into a validated SpecConfig.

    String form: `method[:model][:key=value]...`; keys `k`, `min`, `max`, `layers`, `model` or the
    field names. For `draft`, parts without `=` form the draft model spec (so a path with ':' works).
    """
    if isinstance(spec, SpecConfig):
        cfg = spec
    elif isinstance(spec, dict):
        unknown = set(spec) - {f.name for f in dataclasses.fields(SpecConfig)}
        if unknown:
            raise ValueError(f"spec: unknown keys {sorted(unknown)}; allowed: "
                             f"{[f.name for f in dataclasses.fields(SpecConfig)]}")
        if "method" not in spec:
            raise ValueError(f"spec: 'method' is required, one of {METHODS}")
        cfg = SpecConfig(**{**spec, "method": _METHOD_ALIASES.get(spec["method"], spec["method"])})
    elif isinstance(spec, str):
        cfg = _parse_string(spec)
    else:
        raise ValueError(f"spec must be a string, a dict or a SpecConfig, got {type(spec).__name__}")
    cfg.validate()
    return cfg


def _parse_string(spec: str) -> SpecConfig:
    head, *parts = spec.split(":")
    method = _METHOD_ALIASES.get(head.strip())
    if method is None:
        raise ValueError(f"spec method must be one of {METHODS}, got {head!r}")
    fields: dict[str, Any] = {}
    model_parts = []
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq:
            model_parts.append(part)
            continue
        name = _KEY_ALIASES.get(key.strip())
        if name is None:
            raise ValueError(f"spec: unknown key {key!r}; allowed: {sorted(set(_KEY_ALIASES))}")
        if name == "draft_model":
            fields[name] = value
            continue
        try:
            fields[name] = int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if model_parts:
        if method != "draft":
            raise ValueError(f"spec: unexpected part {':'.join(model_parts)!r} for method {method!r}")
        fields["draft_model"] = ":".join(model_parts)
    return SpecConfig(method=method, **fields)


@dataclass(slots=True)
class SpecStats:
    """Speculation metrics of one request (or, summed, of the engine). Stored in `Req.spec_stats`."""

    drafts: int = 0  # verification rounds with at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens appended by those rounds (accepted + recovered/bonus, after stop cuts)
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, accepted: list[bool], emitted: int) -> None:
        k = len(accepted)
        grow = k - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        self.drafts += 1
        self.draft_tokens += k
        self.emitted_tokens += emitted
        n = 0
        while n < k and accepted[n]:
            n += 1
        self.accepted_tokens += n
        for i in range(k):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += int(i < n)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: counts, acceptance rate, acceptance per draft position and mean acceptance length
        (tokens gained per verification round: 1 + accepted / rounds, as vLLM reports it)."""
        return {
            "drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "acceptance_per_position": [a / p if p else None for p, a in
                                        zip(self.proposed_per_position, self.accepted_per_position)],
            "mean_acceptance_length": 1 + self.accepted_tokens / self.drafts if self.drafts else None,
        }


@dataclass(frozen=True, slots=True)
class Target:
    """What the speculative worker and the drafters get of the target model: its runner, KV memory
    and sampler, and the facts they need about it (never the engine)."""

    runner: ModelRunner
    memory: Memory
    sampler: Sampler
    tokenizer: Any
    device: str
    dtype: Any  # the loaded model's dtype spec (a draft model loads with the same)
    vocab_size: int
    eos_token_ids: tuple[int, ...]
