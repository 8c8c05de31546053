"""Bisect results stored beside a trace's events: the `bisect` table of a `.wbtrace` file.

Owns: the table (`bisect(key TEXT PRIMARY KEY, payload TEXT)`: one JSON row per bisected position
and numerics, key `REQ:POS:AGAINST`, from `workbench bisect T`; bisecting the same key again
replaces that row, other keys stay) and reading the rows back (`read_bisects`, read-only and
defensive: a malformed row is skipped, a trace never bisected reads as an empty list). Older
readers ignore the table, so the schema version is unchanged. Standard library only. Does not own
computing the attribution (workbench/rerun/bisect.py).

Row payload: `{"key", "req_id", "position", "against", "reference", "factor", "recorded_token",
"reference_pick" / "suspect_pick": {"token_id", "text", "logprob", "margin"}, "embed_error",
"first_layer", "first_block", "note", "kind", "layers": [{"layer", "added", "propagated", "total",
"floor", "norm", "ratio", "blocks": [{"block", "added", "floor", "ratio"}]}]}` (errors are L2 norms
over the hidden vector of the row that picked the token at `position`; `ratio` = added / floor;
`kind` "numerics", or "context" against a batch context (`batched`, `prefix-cache`, `chunked:N`),
where `added` is the growth of the difference in the layer and `propagated` is None); a
`behaves_like` row (key `REQ:POS:behaves-like`) has `"candidates": [{"numerics", "kind", "text",
"note", "deltas", "median_abs_delta"}]` (best first; `numerics` names a numerics or a context),
`"best"` and `"best_text"` instead of layers.
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from typing import Any

from workbench.trace.annotations import writing
from workbench.trace.format import json_dumps

TABLE = "bisect"
# the numerics bisect can run (workbench/engine/layer_walk.py), the reference first
CANDIDATES = ("float32", "bfloat16", "float16", "fast", "fast-int8")
# the sub-blocks of a Llama-layout decoder layer, in the order the layer runs them, and their names
SUB_BLOCKS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
BLOCK_LABEL = {"input_layernorm": "norm (before attention)", "self_attn": "attention",
               "post_attention_layernorm": "norm (before MLP)", "mlp": "MLP", "layer": "whole layer"}


def store_bisect(path: str | os.PathLike[str], row: dict[str, Any]) -> None:
    """Write one bisect row (with a `key`) into the trace at `path`, replacing a row of the same key."""
    with writing(path) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE}(key TEXT PRIMARY KEY, payload TEXT NOT NULL)")
        conn.execute(f"INSERT OR REPLACE INTO {TABLE}(key, payload) VALUES (?, ?)", (str(row["key"]), json_dumps(row)))


def read_bisects(source: Any) -> list[dict[str, Any]]:
    """Every stored bisect row of a trace (`source`: a path or an open `Trace`), in key order."""
    path = source if isinstance(source, (str, os.PathLike)) else getattr(source, "path", None)
    if path is None or not os.path.isfile(path):
        return []
    uri = "file:" + urllib.parse.quote(os.path.abspath(os.fspath(path))) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True)
        rows = conn.execute(f"SELECT key, payload FROM {TABLE} ORDER BY key").fetchall()
    except sqlite3.Error:  # no table: never bisected
        return []
    finally:
        if "conn" in locals():
            conn.close()
    out = []
    for _key, payload in rows:
        try:
            value = json.loads(payload)
        except (TypeError, ValueError):
            continue
        if isinstance(value, dict) and isinstance(value.get("key"), str):
            out.append(value)
    return out
