"""The floor, resend + diff and imported rollouts against the real vLLM and llama.cpp (issue 33, 4-6).

The session's vLLM server (conftest `vllm_server`, fp32 SmolLM2) and llama.cpp server (Q4_1) are
reused. What a user relies on: `floor` measures how far vLLM disagrees with itself when the same
requests are sent twice (and says so in figures); `resend` sends the same traffic to llama.cpp and
`diff` names every request whose tokens differ, with a verdict against that floor; rollouts made
with vLLM's Python API (in its own venv, `processed_logprobs` mode) import and `check` scores them
with importance ratios: at temperature 1 no token is clipped or dropped, at 0.6 the processed
logprobs are (and the check says that is why). The vLLM script starts first and loads while the
other tests run.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.prompts import CHAT, PLAIN
from workbench.external.floor import Floor, load_floor, measure_floor
from workbench.external.records import ProbeRequest
from workbench.trace.reader import open_trace

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12  # llama.cpp's server answers one request at a time: keep its share of the suite short


def _cli(*argv: str) -> tuple[int, str]:
    from workbench.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def _requests() -> list[ProbeRequest]:
    greedy = {"temperature": 0.0}
    reqs = [ProbeRequest(prompt=p, params=greedy) for p in PLAIN]
    reqs += [ProbeRequest(messages=[{"role": "user", "content": c}], params=greedy) for c in CHAT[:2]]
    reqs += [ProbeRequest(prompt=p, params={"temperature": 0.8, "seed": 500 + i}) for i, p in enumerate(PLAIN[:2])]
    return reqs


@dataclass(slots=True)
class Rollouts:
    proc: subprocess.Popen
    out: Path
    log: Path


@pytest.fixture(scope="module")
def vllm_rollouts(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """vLLM's Python API generating rollouts (tests/vllm_rollouts.py), started at once, awaited later."""
    from workbench.external.peers import peer_python, smollm2_folder

    folder = tmp_path_factory.mktemp("rollouts")
    out, log = folder / "rollouts.jsonl", folder / "vllm_rollouts.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(peer_python("vllm")), "-P", str(ROOT / "tests" / "helpers" / "vllm_rollouts.py"),
                                 str(smollm2_folder()), str(out)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    yield Rollouts(proc, out, log)
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        proc.wait(30)


@pytest.fixture(scope="module")
def reference():
    from workbench.engine.engine import Engine

    return Engine("smollm2", trace=None, trace_level="off")


@dataclass(slots=True)
class FloorRun:
    floor: Floor
    path: Path
    a: Path
    b: Path


@pytest.fixture(scope="module")
def vllm_floor(vllm_rollouts, vllm_server, tmp_path_factory) -> FloorRun:
    folder = tmp_path_factory.mktemp("floor")
    a, b = folder / "a.wbtrace", folder / "b.wbtrace"
    floor = measure_floor(vllm_server.check_alive().url, _requests(), folder / "floor.json", traces=(a, b),
                          concurrency=8, top_logprobs=20, max_tokens=MAX_TOKENS, progress=False)
    print(f"\n{floor.describe()}")  # the figures for the closing note
    return FloorRun(floor, folder / "floor.json", a, b)


def _tokens(path: Path) -> list[tuple[str, list[int], list[float | None]]]:
    with open_trace(path) as trace:
        out = []
        for info in trace.requests():
            toks = trace.timeline(info.req_id).tokens
            out.append((info.req_id, [t.token_id for t in toks], [t.logprob for t in toks]))
    return out


def test_floor_measures_vllms_disagreement_with_itself(vllm_floor: FloorRun) -> None:
    floor, runs = vllm_floor.floor, list(zip(_tokens(vllm_floor.a), _tokens(vllm_floor.b)))
    assert floor.requests == len(runs) == 12
    # every position both runs reached with the same token so far is compared, and no other
    shared, flips, deltas = 0, 0, []
    for (_, ids_a, lps_a), (_, ids_b, lps_b) in runs:
        for ta, tb, la, lb in zip(ids_a, ids_b, lps_a, lps_b):
            if ta != tb:
                flips += 1
                break
            shared += 1
            deltas.append(abs(la - lb))
    assert floor.positions == shared > 0 and floor.flips == flips
    assert max(b.chosen_max for b in floor.bands) == pytest.approx(max(deltas))
    # an fp32 engine on one machine: its own spread is far below the check's tolerance (0.05 nats)
    assert floor.max_abs < 0.05
    assert load_floor(vllm_floor.path).summary() == floor.summary()


def test_check_shows_the_floor_beside_its_figures(vllm_floor: FloorRun, reference) -> None:
    from workbench.external.check import check_trace

    report = check_trace(vllm_floor.a, "smollm2", engine=reference, floor=vllm_floor.path, store=False,
                         progress=False)
    table = report.render()
    print(table)
    assert f"floor             measured at {vllm_floor.floor.source['url']}" in table
    assert "beyond the floor" in table and report.exit_code == 0
    assert all(p.floor is not None for r in report.requests for p in r.positions)


def test_resend_to_llamacpp_and_diff_names_the_requests_that_differ(vllm_floor: FloorRun, llamacpp_server,
                                                                    tmp_path: Path) -> None:
    t2 = tmp_path / "llamacpp.wbtrace"
    code, out = _cli("resend", str(vllm_floor.a), "--to", llamacpp_server.check_alive().url, "--out", str(t2),
                     "--set", "repeat_penalty=1.0", "--top-logprobs", "10")
    assert code == 0, out
    with open_trace(t2) as trace:
        resent = trace.meta["resent_from"]
        sent = [i.added for i in trace.requests()]
    assert resent["set"] == {"repeat_penalty": 1.0}
    with open_trace(vllm_floor.a) as trace:
        original = [i.added for i in trace.requests()]
    for old, new in zip(original, sent, strict=True):  # the same prompts, the same sampling fields and seeds
        assert new.prompt == old.prompt
        for k in ("temperature", "seed", "max_tokens"):
            assert new.params.get(k) == old.params.get(k)
    code, text = _cli("diff", str(vllm_floor.a), str(t2), "--floor", str(vllm_floor.path))
    print(text)
    differ = [ra for (ra, ids_a, _), (_, ids_b, _) in zip(_tokens(vllm_floor.a), _tokens(t2)) if ids_a != ids_b]
    assert differ, "fp32 vLLM and Q4_1 llama.cpp agreed on every token of 12 requests: nothing to name"
    assert code == 1 and f"requests that differ: {len(differ)} of 12" in text
    named = [line.split()[0] for line in text.split("requests that differ:")[1].splitlines()[1:] if line.startswith("  ")]
    assert named == differ
    assert "floor: measured at" in text
    with open_trace(vllm_floor.a) as trace:
        greedy = {i.req_id: i.added.params["greedy"] for i in trace.requests()}
    for line in text.split("requests that differ:")[1].splitlines()[1:]:
        if line.startswith("  "):  # a sampled request's draw is "sampled"; a greedy one gets a verdict
            assert ("sampled (" in line) != greedy[line.split()[0]], line


def test_import_of_vllm_python_api_rollouts_is_checked_with_importance_ratios(vllm_rollouts, reference,
                                                                              tmp_path: Path) -> None:
    from workbench.external.check import check_trace

    try:
        vllm_rollouts.proc.wait(timeout=480)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vLLM's Python API did not finish in time; log: {vllm_rollouts.log}")
    log = vllm_rollouts.log.read_text(errors="replace")
    assert vllm_rollouts.proc.returncode == 0 and "@@rollouts 12 rows" in log, log[-3000:]
    rows = [json.loads(line) for line in vllm_rollouts.out.read_text().splitlines()]
    code, out = _cli("import", str(vllm_rollouts.out), "--out", str(tmp_path / "r.wbtrace"),
                     "--logprobs-mode", "processed", "--model", "vLLM SmolLM2 (Python API)")
    assert code == 0, out
    report = check_trace(tmp_path / "r.wbtrace", "smollm2", engine=reference, progress=False)
    print(report.render())
    imp = report.importance
    assert imp is not None and imp.tokens == sum(len(r["token_ids"]) for r in rows)
    temps = {r["request_id"]: r["temperature"] for r in rows}
    hot_affected = 0
    for rc in report.requests:
        acted = [p for p in rc.positions if p.tis or p.mis]
        if temps[rc.req_id] == 1.0:  # processed == raw at temperature 1: fp32 agrees with fp32
            assert not acted and max(abs(p.log_ratio) for p in rc.positions) < 0.05, rc.req_id
        else:
            hot_affected += len(acted)
            assert all(p.is_reason is not None for p in acted)
    # at 0.6 the engine's logprobs are after temperature and the reference's are raw: tokens are
    # dropped, and the check names that as the reason for most of them
    assert hot_affected > 0 and imp.dropped + imp.clipped >= hot_affected
    assert imp.reasons["processed"] >= hot_affected / 2
    assert all(math.isfinite(x) for x in imp.log_ratios)
