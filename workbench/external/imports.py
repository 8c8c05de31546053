"""`workbench import`: logged generations (RL rollouts) into a trace that `check` scores.

Owns: reading rollouts that hold token ids and per-token logprobs, streamed and bounded (JSONL one
line at a time; Parquet a batch of rows at a time; never pickle), in the shapes the trainers log:

- TRL (vLLM generation, `vllm_client.generate` / `rollout_func`): `prompt_ids`, `completion_ids`,
  `logprobs` (one list per row, or a batch of lists in one row), `completion_mask` / `env_mask`;
- verl (rollout dumps): `prompts`, `responses`, `rollout_log_probs`, `response_mask`
  (right-padded responses: trailing masked tokens are dropped);
- vLLM's `RequestOutput` (`rows_from_request_outputs`, duck-typed: `.prompt_token_ids`,
  `.outputs[i].token_ids`, `.outputs[i].logprobs` as a list of `{token_id: Logprob}`), also as the
  JSON rows that function writes (`prompt_token_ids`, `token_ids`, `logprobs`, `top_logprobs`);

plus optional `temperature`, `top_p`, `top_k`, `seed` per row, a request id (`request_id`, `id`,
`uid`), the prompt text (`prompt`) and `finish_reason`. A masked token inside the output (a tool's
reply the engine did not sample) stays in the context with no logprob, so it is not scored.
The trace has `meta.source = "external"` and `meta.import` (file, format, rows, fields used,
logprobs mode), which makes `check` report importance ratios.

Bad input is a ValueError naming the row (line) and the field; limits (rows, tokens per row, bytes
per line) are checked before anything big is built. This module imports only the standard library
(the trace writer, the tokenizer and pyarrow load when used), so a script in vLLM's own
environment can call `rows_from_request_outputs`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_ROWS = 100_000
MAX_TOKENS = 65_536  # prompt + output ids per row
MAX_LINE_BYTES = 32 << 20
MAX_TOP = 64  # alternatives per position

PROMPT_FIELDS = ("prompt_ids", "prompt_token_ids", "prompts")
OUTPUT_FIELDS = ("completion_ids", "output_ids", "token_ids", "output_token_ids", "responses", "response_ids")
LOGPROB_FIELDS = ("logprobs", "rollout_log_probs", "sampling_logprobs", "sampling_per_token_logps",
                  "completion_logprobs", "output_logprobs")
MASK_FIELDS = ("response_mask", "completion_mask", "env_mask", "loss_mask")
ID_FIELDS = ("request_id", "req_id", "id", "uid")
PARAM_FIELDS = ("temperature", "top_p", "top_k", "seed")
LOGPROBS_MODES = ("raw", "processed")


@dataclass(slots=True)
class Rollout:
    """One generation: what the engine read, what it produced, and its logprob of each token."""

    req_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float | None]  # None: a token the engine did not sample (masked), or no figure
    top: list[list[list[Any]]] = field(default_factory=list)  # per position [[id, logprob], ...] (may be empty)
    params: dict[str, Any] = field(default_factory=dict)
    prompt: str | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class ImportResult:
    path: Path
    rows: int
    tokens: int
    fields: dict[str, str]  # which field of the file gave prompt ids, output ids, logprobs, mask


# --- reading --------------------------------------------------------------------------------------


def read_rollouts(path: str | os.PathLike[str], *, max_rows: int = MAX_ROWS, max_tokens: int = MAX_TOKENS,
                  fields: dict[str, str] | None = None) -> Iterator[Rollout]:
    """Rollouts from a `.jsonl` (`.json` lines) or `.parquet` file, one at a time.

    `fields` is filled with the field names found (prompt, output, logprobs, mask)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"import: no such file: {os.fspath(path)!r}")
    _check_limit("max_rows", max_rows)
    _check_limit("max_tokens", max_tokens)
    objects = _parquet_rows(path) if path.suffix.lower() in (".parquet", ".pq") else _jsonl_rows(path)
    n = 0
    for where, obj in objects:
        try:
            rows = list(_rollouts_of(obj, n, max_tokens, fields if fields is not None else {}))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"import: {path.name}: {where}: {exc}") from None
        for row in rows:
            n += 1
            if n > max_rows:
                raise ValueError(f"import: {path.name}: more than max_rows={max_rows} rollouts "
                                 "(raise --max-rows, or split the file)")
            yield row
    if n == 0:
        raise ValueError(f"import: {path.name}: no rollouts in the file")


def _check_limit(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        n = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            n += 1
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"import: {path.name}: line {n} is over {MAX_LINE_BYTES} bytes")
            if not line.strip():
                continue
            try:
                yield f"line {n}", json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"import: {path.name}: line {n} is not JSON ({exc})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("import: reading Parquet needs pyarrow (pip install pyarrow), or give JSONL") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises its own error types for a damaged file
        raise ValueError(f"import: {path.name} is not a Parquet file ({type(exc).__name__}: {exc})") from None
    known = set(PROMPT_FIELDS + OUTPUT_FIELDS + LOGPROB_FIELDS + MASK_FIELDS + ID_FIELDS + PARAM_FIELDS
                + ("top_logprobs", "prompt", "finish_reason"))
    columns = [c for c in pf.schema_arrow.names if c in known]
    n = 0
    for batch in pf.iter_batches(batch_size=64, columns=columns):
        for obj in batch.to_pylist():
            n += 1
            yield f"row {n}", obj


def _rollouts_of(obj: Any, index: int, max_tokens: int, fields: dict[str, str]) -> Iterator[Rollout]:
    if not isinstance(obj, dict):
        raise ValueError("expected an object with prompt ids, output ids and logprobs")
    prompt_key = _pick(obj, PROMPT_FIELDS, "prompt ids")
    output_key = _pick(obj, OUTPUT_FIELDS, "output ids")
    lp_key = next((k for k in LOGPROB_FIELDS if obj.get(k) is not None), None)
    if lp_key is None:
        raise ValueError(f"no per-token logprobs (one of {', '.join(LOGPROB_FIELDS)}); nothing to compare")
    mask_key = next((k for k in MASK_FIELDS if obj.get(k) is not None), None)
    fields.update(prompt=prompt_key, output=output_key, logprobs=lp_key, **({"mask": mask_key} if mask_key else {}))
    prompts, outputs, lps = obj[prompt_key], obj[output_key], obj[lp_key]
    masks, tops = obj.get(mask_key) if mask_key else None, obj.get("top_logprobs")
    batched = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], list)
    if not batched:  # one rollout: wrap so both shapes go through one loop
        prompts, outputs, lps = [prompts], [outputs], [lps]
        masks, tops = ([masks] if masks is not None else None), ([tops] if tops is not None else None)
    if not (isinstance(outputs, list) and isinstance(lps, list) and len(prompts) == len(outputs) == len(lps)):
        raise ValueError(f"{prompt_key}, {output_key} and {lp_key} hold different numbers of rollouts")
    base_id = obj.get(next((k for k in ID_FIELDS if obj.get(k) is not None), ""), None)
    params = {k: obj[k] for k in PARAM_FIELDS if obj.get(k) is not None}
    for i in range(len(prompts)):
        rid = f"{base_id if base_id is not None else f'row-{index}'}" + (f":{i}" if batched else "")
        yield _rollout(rid, prompts[i], outputs[i], lps[i], masks[i] if masks else None,
                       tops[i] if tops else None, params, obj, max_tokens, (prompt_key, output_key, lp_key))


def _pick(obj: dict[str, Any], names: tuple[str, ...], what: str) -> str:
    for name in names:
        if obj.get(name) is not None:
            return name
    raise ValueError(f"no {what} (one of {', '.join(names)}; found fields {sorted(obj)[:12]})")


def _rollout(rid: str, prompt: Any, output: Any, lps: Any, mask: Any, top: Any, params: dict[str, Any],
             obj: dict[str, Any], max_tokens: int, names: tuple[str, str, str]) -> Rollout:
    prompt_ids, output_ids = _ids(prompt, names[0]), _ids(output, names[1])
    if len(prompt_ids) + len(output_ids) > max_tokens:
        raise ValueError(f"{len(prompt_ids) + len(output_ids)} ids in one rollout, over max_tokens={max_tokens}")
    if not isinstance(lps, list) or len(lps) != len(output_ids):
        raise ValueError(f"{names[2]} must be a list with one logprob per output id "
                         f"({len(output_ids)}), got {len(lps) if isinstance(lps, list) else type(lps).__name__}")
    logprobs = [_logprob(v, names[2]) for v in lps]
    if mask is not None:
        if not isinstance(mask, list) or len(mask) != len(output_ids):
            raise ValueError("the mask must hold one 0/1 per output id")
        keep = len(mask)
        while keep and not mask[keep - 1]:  # right padding (verl's responses)
            keep -= 1
        output_ids, logprobs = output_ids[:keep], logprobs[:keep]
        logprobs = [lp if m else None for lp, m in zip(logprobs, mask)]
    tops = _tops(top, len(output_ids)) if top is not None else []
    text = obj.get("prompt") if isinstance(obj.get("prompt"), str) else None
    finish = obj.get("finish_reason") if isinstance(obj.get("finish_reason"), str) else None
    for k, v in params.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{k} must be a number, got {v!r}")
    return Rollout(rid, prompt_ids, output_ids, logprobs, tops, dict(params), text, finish)


def _ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 31:
            raise ValueError(f"{name} holds {v!r}; token ids are integers in [0, 2**31)")
    return list(value)


def _logprob(v: Any, name: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} holds {v!r}; logprobs are numbers <= 0 (or null)")
    if math.isnan(v):
        return None  # TRL logs NaN logprobs as missing
    if v > 1e-4 or v == -math.inf:
        raise ValueError(f"{name} holds {v!r}; logprobs are finite numbers <= 0")
    return float(min(v, 0.0))


def _tops(top: Any, n: int) -> list[list[list[Any]]]:
    """Per position [[id, logprob], ...] from lists of pairs or `{id: logprob}` objects."""
    if not isinstance(top, list):
        raise ValueError("top_logprobs must be a list (one entry per output id)")
    out = []
    for entry in top[:n]:
        pairs = list(entry.items()) if isinstance(entry, dict) else entry
        if not isinstance(pairs, list) or len(pairs) > MAX_TOP:
            raise ValueError(f"top_logprobs entries must be lists of [id, logprob] pairs (at most {MAX_TOP})")
        row = []
        for pair in pairs:
            if not isinstance(pair, (list, tuple)) or len(pair) < 2:
                raise ValueError("top_logprobs pairs are [id, logprob]")
            tid = int(pair[0]) if isinstance(pair[0], str) and pair[0].isdigit() else pair[0]
            row.append([_ids([tid], "top_logprobs")[0], _logprob(pair[1], "top_logprobs")])
        out.append(row)
    return out


# --- vLLM's RequestOutput -------------------------------------------------------------------------


def rows_from_request_outputs(outputs: Iterable[Any], params: dict[str, Any] | list[dict[str, Any]] | None = None,
                              ) -> list[dict[str, Any]]:
    """JSON-ready rows from vLLM `RequestOutput`s (duck-typed), one per completion (`n` > 1: `id:i`).

    `params`: the sampling fields each request ran with (one dict for all, or one per request);
    a RequestOutput does not carry them and `check` needs the temperature to read the logprobs."""
    rows = []
    for k, ro in enumerate(outputs):
        p = params[k] if isinstance(params, list) else (params or {})
        completions = list(ro.outputs)
        for i, c in enumerate(completions):
            ids = [int(t) for t in c.token_ids]
            entries = list(c.logprobs) if c.logprobs is not None else None
            if entries is None or len(entries) != len(ids):
                raise ValueError(f"RequestOutput {getattr(ro, 'request_id', k)}: no logprobs for every token "
                                 "(generate with SamplingParams(logprobs=k))")
            chosen, tops = [], []
            for tid, entry in zip(ids, entries):
                pairs = sorted(((int(a), _lp_value(b)) for a, b in dict(entry).items()), key=lambda x: -x[1])
                chosen.append(dict(pairs).get(tid))
                tops.append([[a, b] for a, b in pairs])
            rid = str(getattr(ro, "request_id", k))
            rows.append({"request_id": rid if len(completions) == 1 else f"{rid}:{i}",
                         "prompt": getattr(ro, "prompt", None) if isinstance(getattr(ro, "prompt", None), str) else None,
                         "prompt_token_ids": [int(t) for t in ro.prompt_token_ids], "token_ids": ids,
                         "logprobs": chosen, "top_logprobs": tops,
                         "finish_reason": getattr(c, "finish_reason", None), **{x: p[x] for x in PARAM_FIELDS if x in p}})
    return rows


def _lp_value(v: Any) -> float:
    return float(getattr(v, "logprob", v))


def import_request_outputs(outputs: Iterable[Any], out: str | os.PathLike[str], *,
                           params: dict[str, Any] | list[dict[str, Any]] | None = None, **kw: Any) -> ImportResult:
    """Write vLLM `RequestOutput`s (duck-typed) as a trace `check` scores; `kw` as for `write_rollouts`."""
    fields: dict[str, str] = {}
    rows = [r for i, obj in enumerate(rows_from_request_outputs(outputs, params))
            for r in _rollouts_of(obj, i, kw.pop("max_tokens", MAX_TOKENS), fields)]
    return write_rollouts(rows, out, origin={"file": None, "format": "vllm.RequestOutput"}, fields=fields, **kw)


# --- writing --------------------------------------------------------------------------------------


def import_generations(src: str | os.PathLike[str], out: str | os.PathLike[str], *, max_rows: int = MAX_ROWS,
                       max_tokens: int = MAX_TOKENS, **kw: Any) -> ImportResult:
    """Turn the rollouts file `src` into the trace `out`; `kw` as for `write_rollouts`."""
    fields: dict[str, str] = {}
    fmt = "parquet" if Path(src).suffix.lower() in (".parquet", ".pq") else "jsonl"
    rows = read_rollouts(src, max_rows=max_rows, max_tokens=max_tokens, fields=fields)
    return write_rollouts(rows, out, origin={"file": Path(src).name, "format": fmt}, fields=fields, **kw)


def write_rollouts(rows: Iterable[Rollout], out: str | os.PathLike[str], *, tokenizer: Any = "smollm2",
                   defaults: dict[str, Any] | None = None, logprobs_mode: str = "raw", model: str | None = None,
                   origin: dict[str, Any] | None = None, fields: dict[str, str] | None = None) -> ImportResult:
    """Write rollouts as a trace: per rollout `request.added`, one `token` per output id (source
    `imported`; text from `tokenizer`, a spec or an object, None for no text) and `request.finished`.

    `defaults`: sampling fields for rows without their own (temperature 1.0 unless set: RL rollouts
    sample); `logprobs_mode`: what the engine's logprobs are, `raw` or `processed` (recorded)."""
    from workbench.external.records import SAMPLING_FIELDS
    from workbench.trace.events import RequestAdded, RequestFinished, TokenChosen
    from workbench.trace.store import TraceWriter

    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
    unknown = set(defaults or {}) - set(SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling fields {sorted(unknown)}; allowed: {', '.join(PARAM_FIELDS)}")
    defaults = {"temperature": 1.0, **(defaults or {})}
    tok, spec = _tokenizer(tokenizer)
    out = Path(out)
    meta = {"source": "external", "model": {"name": model or "imported rollouts", "spec": None},
            "reference": {"tokenizer": spec}, "not_recorded": ["schedule", "forward_batch", "forward", "logits",
                                                               "sampling", "kv", "spec.draft", "spec.verify",
                                                               "detok", "finish"],
            "trace_level": "summary", "created": time.time()}
    if tok is not None:
        meta["tokenizer"] = {"name": getattr(tok, "name_or_path", ""), "vocab_size": len(tok),
                             "eos_token_id": tok.eos_token_id, "class": type(tok).__name__}
    text_of = _texts(tok)
    n = tokens = 0
    seen: dict[str, int] = {}
    writer = TraceWriter(out, meta)
    try:
        for n, r in enumerate(rows, 1):
            seen[r.req_id] = seen.get(r.req_id, 0) + 1
            if seen[r.req_id] > 1:  # verl gives a prompt's n samples one uid: each must stay a request
                r.req_id = f"{r.req_id}#{seen[r.req_id]}"
            params = {**defaults, **r.params}
            t = params.get("temperature")
            params["greedy"] = (isinstance(t, (int, float)) and t == 0) or params.get("top_k") == 1
            writer.write(RequestAdded(step=n, req_id=r.req_id, t=float(n), prompt=r.prompt, prompt_ids=r.prompt_ids,
                                      params={**params, "imported": True}))
            for i, (tid, lp) in enumerate(zip(r.output_ids, r.logprobs)):
                top = [[a, b, text_of(a)] for a, b in (r.top[i] if i < len(r.top) else [])]
                writer.write(TokenChosen(step=n, req_id=r.req_id, t=float(n), position=i, token_id=tid,
                                         text=text_of(tid), logprob=lp, rank=None, top_logprobs=top,
                                         source="imported" if lp is not None else "imported_masked"))
            tokens += len(r.output_ids)
            writer.write(RequestFinished(step=n, req_id=r.req_id, t=float(n), output_ids=r.output_ids,
                                         text="".join(text_of(t) for t in r.output_ids),
                                         finish_reason=r.finish_reason,
                                         usage={"prompt_tokens": len(r.prompt_ids),
                                                "completion_tokens": len(r.output_ids)}))
    finally:
        writer.set_meta("import", {**(origin or {}), "rows": n, "tokens": tokens, "fields": dict(fields or {}),
                                   "logprobs_mode": logprobs_mode, "defaults": defaults})
        writer.close()
    return ImportResult(out, n, tokens, dict(fields or {}))


def _tokenizer(tokenizer: Any) -> tuple[Any, str | None]:
    if tokenizer is None:
        return None, None
    if isinstance(tokenizer, str):
        from workbench.external.token_ids import load_reference_tokenizer

        return load_reference_tokenizer(tokenizer), tokenizer
    return tokenizer, getattr(tokenizer, "workbench_spec", None) or getattr(tokenizer, "name_or_path", None)


def _texts(tok: Any) -> Any:
    if tok is None:
        return lambda t: ""
    cache: dict[int, str] = {}
    size = len(tok)

    def text_of(t: int) -> str:
        if t not in cache:
            cache[t] = tok.decode([t]) if 0 <= t < size else ""
        return cache[t]

    return text_of
