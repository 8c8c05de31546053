"""Structured output is ready before the first constrained request, and each grammar compiles once
(issue 36): `workbench serve` starts the grammar worker and imports xgrammar as it starts
(`--grammar-prestart`, on by default), so the first request with a `response_format` finds the
worker ready instead of paying its seconds of imports; each new grammar is compiled once in the
worker (its budget) and once in the server, however many requests carry it at once, and a forced
tool call's grammar is not rebuilt per request; the trace records the GrammarLimits in force.
Read through `/metrics`, as an operator would."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import time
from pathlib import Path

import httpx
import pytest

from workbench.engine.engine import Engine
from workbench.server.app import create_app
from workbench.server.background import BackgroundServer
from workbench.trace.reader import open_trace

C = "/v1/completions"


def _schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}}}


def _metrics(http: httpx.Client) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        m = re.match(r"^(workbench_grammar_\w+?)(?:_total)?(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _constrained(http: httpx.Client, name: str) -> None:
    body = {"model": "tiny-random", "prompt": "x", "max_tokens": 6, "temperature": 0, "response_format": _schema(name)}
    resp = http.post(C, json=body)
    assert resp.status_code == 200, resp.text[:300]


def _compiles(m: dict[str, float], where: str, kind: str) -> float:
    return m.get(f'workbench_grammar_compiles{{kind="{kind}",where="{where}"}}', 0.0)


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    path = tmp_path_factory.mktemp("ready") / "serve.wbtrace"
    engine = Engine(tiny, trace=str(path), trace_level="summary")
    with BackgroundServer(create_app(engine, model_name="tiny-random", grammar_prestart=True)) as srv:
        yield srv, engine, path
    engine.close()


def test_the_first_constrained_request_finds_the_worker_started(served) -> None:  # noqa: ANN001
    srv = served[0]
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        deadline = time.monotonic() + 180
        while not _metrics(http).get("workbench_grammar_worker_ready_time_seconds"):
            assert time.monotonic() < deadline, "the grammar worker did not start with the server"
            time.sleep(0.1)
        before = _metrics(http)
        sent = time.time()
        _constrained(http, "first")
        after = _metrics(http)
    assert before["workbench_grammar_workers_started"] == after["workbench_grammar_workers_started"] == 1
    assert 0 < after["workbench_grammar_worker_ready_time_seconds"] < sent  # ready before the request came
    assert 0 < after["workbench_grammar_compiler_ready_time_seconds"] < sent  # xgrammar imported here too


def test_without_prestart_the_first_request_starts_the_worker(tiny) -> None:  # noqa: ANN001
    engine = Engine(tiny, trace_level="off")
    try:
        with BackgroundServer(create_app(engine, model_name="tiny-random")) as srv, \
                httpx.Client(base_url=srv.url, timeout=120) as http:
            assert _metrics(http)["workbench_grammar_workers_started"] == 0
            sent = time.time()
            _constrained(http, "late")
            after = _metrics(http)
        assert after["workbench_grammar_workers_started"] == 1
        assert after["workbench_grammar_worker_ready_time_seconds"] > sent  # it paid for the start
    finally:
        engine.close()


def test_each_grammar_compiles_once_however_many_requests_carry_it(served) -> None:  # noqa: ANN001
    srv = served[0]
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        before = _metrics(http)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # six requests with one new grammar at once
            list(pool.map(lambda _: _constrained(http, "together"), range(6)))
        _constrained(http, "together")
        after = _metrics(http)
        for where in ("worker", "server"):
            assert _compiles(after, where, "json_schema") - _compiles(before, where, "json_schema") == 1, where
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        body = {"model": "tiny-random", "max_tokens": 12, "temperature": 0, "tools": tools, "tool_choice": "required",
                "messages": [{"role": "user", "content": "weather?"}]}
        for _ in range(3):
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text[:300]
        tooled = _metrics(http)
    # the forced call's grammar: built once (wrapped), budget-checked once (ebnf), compiled here once
    for where, kind in (("worker", "wrapped"), ("worker", "ebnf"), ("server", "ebnf")):
        assert _compiles(tooled, where, kind) - _compiles(after, where, kind) == 1, (where, kind)


def test_the_trace_records_the_grammar_limits_in_force(served) -> None:  # noqa: ANN001
    _, engine, path = served
    engine.tracer.flush()
    with open_trace(Path(path)) as trace:
        recorded = trace.meta.get("grammar_limits")
    assert recorded == dataclasses.asdict(engine.grammars.limits)
    assert recorded["max_properties"] == 500 and recorded["compile_timeout"] == 10.0


def test_workbench_serve_prestarts_by_default() -> None:
    import argparse

    from workbench.server.cli_args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args([]).grammar_prestart is True
    assert parser.parse_args(["--no-grammar-prestart"]).grammar_prestart is False


def test_a_worker_whose_server_left_during_its_start_exits_quietly() -> None:
    """The server shut down while its grammar worker was still importing xgrammar: the worker's
    "ready" meets a closed pipe. It exits 0 and writes nothing to the server's log (a traceback
    there once failed the API-key log check of tests/server/test_server_hardening.py)."""
    import os
    import subprocess
    import sys

    import xgrammar as xgr

    from workbench.engine.sample.grammar_worker import _write

    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2]).serialize_json()
    frames, worker_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "workbench.engine.sample.grammar_worker"],
                            stdin=subprocess.PIPE, stdout=worker_end, stderr=subprocess.PIPE)
    os.close(worker_end)
    os.close(frames)  # the server is gone before the worker says it is ready
    _write(proc.stdin.fileno(), {"tokenizer_info": info, "memory_mb": 256})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == b"", err.decode()[-2000:]
