"""Who the server is and what it counted: `/v1/models`, `/version`, headers, Prometheus `/metrics`.

Owns: `server_identity` (the models list, the version endpoint where there is one, the response
headers with anything secret removed), `scrape_metrics` (the `/metrics` text, capped, and its
samples parsed into `{name{labels}: value}`), `safe_headers` (what may go into a trace: no
authorization, cookies or keys) and `first_model`. Every call is bounded in time and never raises
for a missing endpoint: it records why there is nothing. Does not own the requests (sse_stream.py).
"""

from __future__ import annotations

import math
from typing import Any

import httpx

MAX_METRICS_TEXT = 256 * 1024
MAX_SAMPLES = 4000
_SECRET_WORDS = ("authorization", "cookie", "key", "token", "secret", "auth", "password", "credential")


def safe_headers(headers: httpx.Headers | dict[str, str]) -> dict[str, str]:
    """Response or request headers minus anything that could be a credential."""
    return {k.lower(): v for k, v in dict(headers).items() if not any(w in k.lower() for w in _SECRET_WORDS)}


def _get(client: httpx.Client, path: str, headers: dict[str, str]) -> tuple[httpx.Response | None, str | None]:
    try:
        return client.get(path, headers=headers), None
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"[:200]


def server_identity(client: httpx.Client, headers: dict[str, str]) -> dict[str, Any]:
    """`{"models": ..., "version": ..., "headers": ..., "server": ...}`; unreachable parts say why."""
    out: dict[str, Any] = {}
    resp, err = _get(client, "/v1/models", headers)
    if resp is None:
        out["models"] = {"error": err}
    else:
        out["headers"] = safe_headers(resp.headers)
        out["server"] = resp.headers.get("server")
        try:
            out["models"] = resp.json() if resp.status_code == 200 else {"status": resp.status_code}
        except ValueError:
            out["models"] = {"status": resp.status_code, "error": "not JSON"}
    resp, err = _get(client, "/version", headers)
    if resp is not None and resp.status_code == 200:
        try:
            out["version"] = resp.json()
        except ValueError:
            out["version"] = resp.text[:200]
    else:
        out["version"] = None  # not every server has one (llama.cpp, this workbench)
    return out


def first_model(identity: dict[str, Any]) -> str | None:
    models = identity.get("models")
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return data[0]["id"]
    return None


def scrape_metrics(client: httpx.Client, headers: dict[str, str]) -> dict[str, Any]:
    """The server's Prometheus text (capped) and its samples; `{"status": ..}` when there is none."""
    resp, err = _get(client, "/metrics", headers)
    if resp is None:
        return {"error": err}
    if resp.status_code != 200:
        return {"status": resp.status_code}
    text = resp.text
    return {"status": 200, "truncated": len(text) > MAX_METRICS_TEXT, "text": text[:MAX_METRICS_TEXT],
            "samples": parse_prometheus(text)}


def parse_prometheus(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` for each sample line (comments skipped; at most MAX_SAMPLES)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.rpartition("}") if "}" in line else line.partition(" ")
        if "}" in line:
            name, value = name + "}", rest.split()[0] if rest.split() else ""
        else:
            value = rest.split()[0] if rest.split() else ""
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isfinite(number):
            out[name.strip()] = number
        if len(out) >= MAX_SAMPLES:
            break
    return out


def metrics_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The samples that changed between two scrapes (counters: what this probe added)."""
    a, b = before.get("samples") or {}, after.get("samples") or {}
    return {k: v - a.get(k, 0.0) for k, v in b.items() if v != a.get(k, 0.0)}
