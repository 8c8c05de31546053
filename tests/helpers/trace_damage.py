"""One catalogue of ways a `.wbtrace` file gets damaged, for the damaged-trace tests and the
hostile-client sweep (benchmarks/hardening_sweep.py): each entry changes a copy of a good trace in
place. The header stays valid in most of them, so it is the reader's checks, not SQLite's, that
must report the damage."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

Damage = Callable[[Path], None]


def sql(*statements: str) -> Damage:
    def damage(path: Path) -> None:
        with sqlite3.connect(path) as db:
            for s in statements:
                db.execute(s)
    return damage


def flip_bytes(at: float, length: int, fill: int | None = None) -> Damage:
    """Invert (or overwrite with `fill`) `length` bytes from fraction `at` of the file, past its header page."""
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        start = max(4096, int(len(data) * at))
        for i in range(start, min(start + length, len(data))):
            data[i] = fill if fill is not None else data[i] ^ 0xFF
        path.write_bytes(bytes(data))
    return damage


def flip_page(path: Path) -> None:
    """Invert the bytes of one data page past the header pages (a bit-flipped disk page)."""
    data = bytearray(path.read_bytes())
    page = 4096
    start = (len(data) // page - 2) * page
    data[start + 8:start + 4000] = bytes(b ^ 0xFF for b in data[start + 8:start + 4000])
    path.write_bytes(bytes(data))


def truncate(frac: float) -> Damage:
    def damage(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * frac)])
    return damage


def row(n: int) -> str:
    """The id of the file's `n`-th events row (from 0): a row holds one event or a run of them."""
    return f"(SELECT id FROM events ORDER BY id LIMIT 1 OFFSET {n})"


def token_field(field: str, value: str) -> Damage:
    """Set `field` of the first token event's payload to the SQL `value`, in a row of its own or as
    the first member of a run row (format.py)."""
    return sql(f"UPDATE events SET payload = CASE WHEN req_id IS NULL "
               f"THEN json_set(payload, '$.\"@rows\"[0].p.{field}', {value}) "
               f"ELSE json_set(payload, '$.{field}', {value}) END "
               f"WHERE id = (SELECT min(id) FROM events WHERE kind = 'token')")


DAMAGES: dict[str, Damage] = {
    "bit-flipped page": flip_page,
    "bit-flipped page (middle)": flip_bytes(0.5, 3000), "bit-flipped page (end)": flip_bytes(0.9, 3000),
    "zeroed page": flip_bytes(0.6, 4096, 0), "truncated to half": truncate(0.5), "truncated to 90%": truncate(0.9),
    "payload not JSON": sql(f"UPDATE events SET payload = '{{not json' WHERE id = {row(4)}"),
    "payload not an object": sql(f"UPDATE events SET payload = '[1, 2]' WHERE id = {row(4)}"),
    "payload a number": sql(f"UPDATE events SET payload = '7' WHERE id = {row(5)}"),
    "payload empty": sql(f"UPDATE events SET payload = '' WHERE id = {row(6)}"),
    "payload unknown field": sql(f"UPDATE events SET payload = json_set(payload, '$.zzz', 1) WHERE id = {row(7)}"),
    "unknown event kind": sql(f"UPDATE events SET kind = 'mystery' WHERE id = {row(4)}"),
    "token position a string": token_field("position", "'x'"),
    "token id a string": token_field("token_id", "'7'"),
    "token logprob a list": token_field("logprob", "json('[1]')"),
    "token top_logprobs a dict": token_field("top_logprobs", "json('{}')"),
    "run member without a request": sql("UPDATE events SET payload = json_set(payload, '$.\"@rows\"[0].r', 5) "
                                        "WHERE id = (SELECT min(id) FROM events WHERE req_id IS NULL "
                                        "AND payload LIKE '{\"@rows\":%')"),
    "request prompt_ids strings": sql("UPDATE events SET payload = json_set(payload, '$.prompt_ids', "
                                      "json('[\"a\"]')) WHERE kind = 'request.added'"),
    "req_id a number": sql(f"UPDATE events SET req_id = 5 WHERE id = {row(8)}"),
    "step not a number": sql(f"UPDATE events SET step = 'x' WHERE id = {row(8)}"),
    "model meta a string": sql("UPDATE meta SET value = '\"tiny-random\"' WHERE key = 'model'"),
    "engine meta a list": sql("UPDATE meta SET value = '[1]' WHERE key = 'engine'"),
    "meta value not JSON": sql("UPDATE meta SET value = '{' WHERE key = 'engine'"),
    "schema_version a string": sql("UPDATE meta SET value = '\"2\"' WHERE key = 'schema_version'"),
    "step req_ids not JSON": sql("UPDATE steps SET req_ids = '[oops' WHERE step = 2"),
    "steps table dropped": sql("DROP TABLE steps"),
    "events table dropped": sql("DROP TABLE events"),
    "tensor bytes garbage": sql("INSERT INTO tensors (name, step, req_id, data) VALUES ('x', 1, NULL, x'00ff')"),
}
