"""A reference that is a server: teacher forcing through any OpenAI-compatible server with prompt logprobs.

Owns `ServerReference`, which stands where `check` and `watch` use an `Engine` on the reference
(`generate(inputs, params)` with prompt logprobs, `vocab_size`, `max_context_len()`,
`token_text(id)`, `loaded.name`: the part of EngineAPI a check asks): each input (prompt + output ids) is sent as a token-id
prompt to `/v1/completions` with vLLM's `prompt_logprobs` (top 20) and `max_tokens: 1`, and its
per-position rows come back in the engine's shape (`logprob` and `rank` of the token there, the
top alternatives best first). So a model that does not fit this machine is checked against a
trusted deployment of it (fp32, another version, another parallelism) running where it fits.
Token texts come from the reference tokenizer. Errors (unreachable, a server without
`prompt_logprobs`) are ValueErrors naming the server and its answer. Does not own the verdicts
(check.py).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

REF_TOP = 20


@dataclass(slots=True)
class _Output:
    prompt_logprobs: list[dict[str, Any] | None]


@dataclass(slots=True)
class _Loaded:
    name: str


class ServerReference:
    """The reference behind `url` (vLLM: any server whose completions take token-id prompts and
    `prompt_logprobs`); `tokenizer` is a model spec or a tokenizer (ids and texts)."""

    def __init__(self, url: str, tokenizer: Any = "smollm2", *, model: str | None = None,
                 api_key: str | None = None, concurrency: int = 8, timeout: float = 300.0) -> None:
        from workbench.external.probe import API_KEY_ENV, base_url
        from workbench.external.token_ids import load_reference_tokenizer

        if not 1 <= concurrency <= 64:
            raise ValueError(f"concurrency must be in [1, 64], got {concurrency}")
        self.url = base_url(url)
        self.tokenizer = load_reference_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.tokenizer_spec = getattr(self.tokenizer, "workbench_spec", None)
        key = api_key or os.environ.get(API_KEY_ENV)
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=10.0),
                                   headers={"Authorization": f"Bearer {key}"} if key else {})
        self.concurrency = concurrency
        try:
            listed = self.client.get("/v1/models").json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"reference server {self.url}: /v1/models did not list a model ({exc})") from None
        self.model = model or str(listed["id"])
        self.vocab_size = len(self.tokenizer)
        self._max_context_len = int(listed.get("max_model_len") or 2048)
        self._texts: dict[int, str] = {}
        self.loaded = _Loaded(f"{self.model} at {self.url}")

    def max_context_len(self) -> int:
        return self._max_context_len

    def token_text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._texts[token_id]

    def generate(self, inputs: list[list[int]], params: Any) -> list[_Output]:
        """Prompt logprobs of each input, in the engine's row shape (`params` is not read: always top 20)."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, inputs))

    def _one(self, ids: list[int]) -> _Output:
        body = {"model": self.model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": REF_TOP}
        try:
            resp = self.client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise ValueError(f"reference server {self.url}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise ValueError(f"reference server {self.url} answered HTTP {resp.status_code}: {resp.text[:300]}")
        rows = (resp.json().get("choices") or [{}])[0].get("prompt_logprobs")
        if not isinstance(rows, list) or len(rows) != len(ids):
            raise ValueError(f"reference server {self.url} returned no prompt_logprobs for {len(ids)} tokens "
                             "(it needs vLLM's prompt_logprobs)")
        out: list[dict[str, Any] | None] = [None]
        for token, row in zip(ids[1:], rows[1:]):
            entries = {int(k): v for k, v in (row or {}).items()}
            mine = entries.get(int(token))
            if mine is None:
                raise ValueError(f"reference server {self.url}: no logprob for prompt token {token}")
            top = sorted((v["rank"], t, v["logprob"]) for t, v in entries.items() if v["rank"] <= REF_TOP)
            out.append({"token_id": token, "token": self.token_text(token), "logprob": float(mine["logprob"]),
                        "rank": int(mine["rank"]),
                        "top_logprobs": [(t, self.token_text(t), float(lp)) for _, t, lp in top]})
        return _Output(out)

    def close(self) -> None:
        self.client.close()
