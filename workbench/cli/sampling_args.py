"""The sampling parameters on the command line (`workbench generate`): `add_sampling_args(parser)` adds
`--temperature`, `--top-p`, ... `--json-schema`; `params_from_args(namespace)` builds the `SamplingParams`
(a ValueError names the flag). The record and its rules are the engine's (engine/sample/sampling_params.py)."""

from __future__ import annotations

import argparse
import json

from workbench.engine.sample.sampling_params import LOGPROBS_MODES, MAX_TOP_LOGPROBS, SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--temperature`, `--top-p`, ... `--json-schema` to `parser` (an argument group)."""
    g = parser.add_argument_group("sampling")
    d = SamplingParams()
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens to generate at most")
    g.add_argument("--min-new-tokens", type=int, default=d.min_new_tokens, help="no stop before this many")
    g.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=d.top_p, help="nucleus mass to keep, (0, 1]")
    g.add_argument("--top-k", type=int, default=d.top_k, help="keep the k most likely tokens; -1 = off")
    g.add_argument("--min-p", type=float, default=d.min_p, help="drop tokens below min_p * max prob")
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    g.add_argument("--seed", type=int, default=None, help="per-request random seed")
    g.add_argument("-n", "--n", type=int, default=d.n, dest="n", help="samples per prompt")
    g.add_argument("--stop", action="append", default=None, metavar="STR", help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=None, dest="stop_token_ids",
                   metavar="ID", help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    g.add_argument("--logprobs", action="store_true", help="return the chosen tokens' logprobs")
    g.add_argument("--top-logprobs", type=int, default=d.top_logprobs, help=f"0..{MAX_TOP_LOGPROBS}")
    g.add_argument("--prompt-logprobs", action="store_true")
    g.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=d.logprobs_mode)
    g.add_argument("--json-schema", default=None, metavar="JSON_OR_@FILE",
                   help="constrain output to a JSON schema (inline JSON, or @path to a file)")
    g.add_argument("--regex", default=None, help="constrain output to a regular expression")
    g.add_argument("--ebnf", default=None, metavar="GRAMMAR_OR_@FILE", help="constrain output to an EBNF grammar")
    return parser


def params_from_args(ns: argparse.Namespace) -> SamplingParams:
    """Build SamplingParams from a namespace parsed with `add_sampling_args`; ValueError on bad input."""
    bias = None
    if ns.logit_bias:
        bias = {}
        for item in ns.logit_bias:
            tid, sep, val = item.partition("=")
            try:
                bias[int(tid)] = float(val)
            except ValueError:
                raise ValueError(f"logit_bias: expected ID=BIAS (e.g. 42=-5), got {item!r}") from None
            if not sep:
                raise ValueError(f"logit_bias: expected ID=BIAS (e.g. 42=-5), got {item!r}")
    schema = _read_at_file("json_schema", ns.json_schema)
    if schema is not None:
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    return SamplingParams(
        max_new_tokens=ns.max_new_tokens, min_new_tokens=ns.min_new_tokens, temperature=ns.temperature,
        top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
        frequency_penalty=ns.frequency_penalty, presence_penalty=ns.presence_penalty, seed=ns.seed, n=ns.n,
        stop=tuple(ns.stop or ()), stop_token_ids=tuple(ns.stop_token_ids or ()), ignore_eos=ns.ignore_eos,
        logit_bias=bias, logprobs=ns.logprobs, top_logprobs=ns.top_logprobs, prompt_logprobs=ns.prompt_logprobs,
        logprobs_mode=ns.logprobs_mode, json_schema=schema, regex=ns.regex,
        ebnf=_read_at_file("ebnf", ns.ebnf))


def _read_at_file(name: str, value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{name}: cannot read {value[1:]!r} ({exc.strerror})") from None
