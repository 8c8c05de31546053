"""Every layer of a decode step in one C call (kernels/decode_layers.py), at one row and at several:
the same tokens, logprobs and alternatives as the direct forward's Python path, step for step; a
step it must not take (a hook, a prefill) runs the Python path; a weight replaced after load is
read, not a stale one."""

from __future__ import annotations

import pytest
import torch

from workbench.engine.engine import Engine
from workbench.engine.kernels import decode_layers
from workbench.engine.run import exact_forward
from workbench.engine.sample.sampling_params import SamplingParams

PROMPT = "The lighthouse keeper counted the ships"
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=4)


def _generate(loaded, prompts=(PROMPT,), params=GREEDY, name=decode_layers.NAME) -> tuple[list, dict]:
    with Engine(loaded, trace_level="off") as engine:
        outs = engine.generate(list(prompts), params)
        report = engine.runner.kernel_report()["checks"]["replacements"][name]
    return [(o.token_ids, [(t.logprob, t.top_logprobs) for t in o.logprobs or ()]) for o in outs], report


def _python_path(monkeypatch) -> None:
    monkeypatch.setattr(decode_layers.DecodeLayers, "run", lambda self, *a, **kw: None)


def test_one_c_call_for_all_layers_gives_the_python_paths_tokens_and_logprobs(smollm2, monkeypatch):
    fused = exact_forward._decode_layers(smollm2.model)
    before = fused.calls
    fast, report = _generate(smollm2)
    calls = fused.calls - before
    verdicts = report["verdicts"]
    assert len(verdicts) == 1, verdicts
    if not verdicts[0]["ok"]:  # a CPU where one of its kernels was refused: the Python path ran throughout
        assert verdicts[0]["detail"].startswith("Python path:") and calls == 0
        pytest.skip(f"the C call does not apply on this CPU: {verdicts[0]['detail']}")
    assert "bit-identical" in verdicts[0]["detail"]
    assert calls >= 9  # the decode steps after the first (which decides the C decode kernel) and the check
    _python_path(monkeypatch)
    slow, _ = _generate(smollm2)
    assert fast == slow


BATCH = (PROMPT, "Water boils at", "def fibonacci(n):", "The three primary colours are", "Once upon a time, in a",
         "Translate to French: good morning", "1, 2, 3, 5, 8,", "The capital of Australia is not Sydney but")


def test_several_decode_rows_in_one_c_call_give_the_python_paths_tokens_and_logprobs(smollm2, monkeypatch):
    # Eight requests of different lengths: every decode step is eight rows over different KV
    # lengths, which the rows' call takes where every projection's blocked kernel passed at 8 rows.
    fused = exact_forward._decode_layers(smollm2.model)
    before = fused.calls
    fast, report = _generate(smollm2, BATCH, name=decode_layers.NAME_ROWS)
    calls = fused.calls - before
    verdicts = [v for v in report["verdicts"] if v["key"]["rows"] == 8]  # one per row count
    assert len(verdicts) == 1, report["verdicts"]
    if not verdicts[0]["ok"]:  # a CPU where one of its kernels was refused: the Python path ran
        assert verdicts[0]["detail"].startswith("Python path:") and calls == 0
        pytest.skip(f"the rows' C call does not apply on this CPU: {verdicts[0]['detail']}")
    assert "bit-identical" in verdicts[0]["detail"] and "8-row decode" in verdicts[0]["detail"]
    assert calls >= 9  # the decode steps after the first and the check's own
    _python_path(monkeypatch)
    slow, _ = _generate(smollm2, BATCH, name=decode_layers.NAME_ROWS)
    assert fast == slow and all(len(ids) == 12 for ids, _ in fast)


def test_a_hook_runs_the_python_path_at_one_row_and_at_several(smollm2):
    fused = exact_forward._decode_layers(smollm2.model)
    quick = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    _generate(smollm2, params=quick)  # decided
    _generate(smollm2, BATCH, quick)
    fired = []
    hook = smollm2.model.model.layers[3].mlp.register_forward_hook(lambda *a: fired.append(1))
    try:
        before = fused.calls
        _generate(smollm2, params=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
        _generate(smollm2, BATCH, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
        assert len(fired) >= 12 and fused.calls == before
    finally:
        hook.remove()


def test_a_second_thread_on_the_same_model_takes_the_python_path(smollm2):
    """The C call's buffers are one per model: while one thread is inside it, another thread's
    step on the same model runs the Python path (the same tokens), never the same buffers."""
    import threading

    fused = exact_forward._decode_layers(smollm2.model)
    alone, _ = _generate(smollm2)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with fused.lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        before = fused.calls
        beside, _ = _generate(smollm2)
        assert fused.calls == before
    finally:
        release.set()
        holder.join()
    assert beside == alone


def test_a_weight_replaced_after_load_is_the_one_read(monkeypatch):
    """A notebook assigns a new Parameter to a projection between two requests to the same engine:
    the C calls, at one row and at several, must read the new weight (their bound pointers are
    re-taken), as the Python path does."""
    from workbench.models import load_model

    loaded = load_model("smollm2", device="cpu")
    fused = exact_forward._decode_layers(loaded.model)
    with Engine(loaded, trace_level="off") as engine:
        engine.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        engine.generate(list(BATCH), SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        down = loaded.model.model.layers[5].mlp.down_proj
        with torch.no_grad():
            down.weight = torch.nn.Parameter(down.weight * 1.5)
        before = fused.calls
        out = engine.generate([PROMPT], GREEDY)[0]
        outs = engine.generate(list(BATCH), GREEDY)
        verdicts = [engine.runner.kernel_report()["checks"]["replacements"][name]["verdicts"][0]
                    for name in (decode_layers.NAME, decode_layers.NAME_ROWS)]
    if not all(v["ok"] for v in verdicts):
        pytest.skip(f"the C calls do not apply on this CPU: {[v['detail'] for v in verdicts]}")
    assert fused.calls - before >= 20  # the one-row request's steps and the batch's
    _python_path(monkeypatch)
    slow, _ = _generate(loaded)
    assert [(out.token_ids, [(t.logprob, t.top_logprobs) for t in out.logprobs])] == slow
    slow, _ = _generate(loaded, BATCH, name=decode_layers.NAME_ROWS)
    assert [(o.token_ids, [(t.logprob, t.top_logprobs) for t in o.logprobs]) for o in outs] == slow


def test_where_the_c_decode_kernel_passed_the_report_says_why_the_python_path_runs(monkeypatch):
    """On a CPU where `attention.decode_one_row` is bit-identical, the Python path attends through it,
    not through the flash replay this call makes: the call steps aside and its verdict says why."""
    from workbench.engine.kernels import BOOK, Verdict, decode_attention
    from workbench.models import load_model

    loaded = load_model("tiny-random", device="cpu")  # its own model object: its own verdict
    cfg = loaded.model.config
    layout = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    monkeypatch.setitem(BOOK.tables.setdefault(decode_attention.ONE_ROW, {}), layout,
                        Verdict(True, "kernel: bit-identical (this test's)", {}))
    fused = exact_forward._decode_layers(loaded.model)
    before = fused.calls
    _, report = _generate(loaded, params=SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert fused.calls == before
    assert [v["detail"] for v in report["verdicts"]] == [
        "Python path: attention.decode_one_row passed its check here and runs in place of the flash replay "
        "this call makes"]


SECOND = """
import json, sys
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.models import load_model

params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
with Engine(load_model("smollm2", device="cpu"), trace_level="off") as engine:
    engine.generate(json.loads(sys.argv[1]), params)  # eight decode rows
    engine.generate(json.loads(sys.argv[1])[:1], params)  # one
    report = engine.runner.kernel_report()["checks"]["replacements"]
    print(json.dumps({n: report[n]["verdicts"] for n in json.loads(sys.argv[2])}))
"""


def test_a_second_process_reads_the_one_call_verdicts_from_the_store():
    # The composed call's check (~0.2 s a row count on SmolLM2) ran in every process, at every new
    # decode batch size: a latency spike a server paid per batch size after each start. A passed
    # one is now kept on disk for the same model, machine and plan, and a fresh process reads it.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    names = [decode_layers.NAME, decode_layers.NAME_ROWS]
    root = Path(__file__).resolve().parents[2]

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", SECOND, json.dumps(BATCH), json.dumps(names)], cwd=root,
                             capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()  # the first checks now or reads what an earlier process kept
    passed = {(n, json.dumps(v["key"])): v for n in names for v in first[n] if v["ok"]}
    if not passed:
        pytest.skip(f"the C call does not apply on this CPU: {[v['detail'] for n in names for v in first[n]]}")
    assert {n for n, _ in passed} == set(names)  # one row and eight rows
    for n in names:
        for v in second[n]:
            kept = passed.get((n, json.dumps(v["key"])))
            if kept is not None:
                assert v["source"].startswith("cached from") and v["ok"] and v["detail"] == kept["detail"], v
