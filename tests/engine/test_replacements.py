"""One mechanism for every checked replacement (engine/kernels/): each replacement in the registry
reports through the one section of the engine report, with the one verdict shape and the one
wording of where its verdict came from; verdicts kept on disk land in the one store under the cache
root, and a second process reads them from there; the one switch turns the native ones off and
the store off. Each engine runs in a fresh interpreter, as a user's next process would."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.engine.kernels import CHECKED_NOW, REGISTRY

ROOT = Path(__file__).resolve().parents[2]
CACHED = re.compile(r"^cached from \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$")
ON_DISK = {name for name, r in REGISTRY.items() if r.on_disk != "none"}
NATIVE = {name for name, r in REGISTRY.items() if r.native}

# a batch (several decode rows), then one row; sampled with logprobs (the draw and the rank count),
# traced at summary (the recorded top-k and entropy), then one greedy row under a repetition penalty
# (the argmax of the processed logits: a traced row's raw argmax comes from the log-softmax pass)
ENGINE = """
import json, sys
from workbench.engine.engine import Engine
from workbench.engine.sample.sampling_params import SamplingParams
from workbench.models import load_model

with Engine(load_model(sys.argv[1], device="cpu"), trace_level="summary") as engine:
    params = SamplingParams(temperature=0.8, max_new_tokens=4, logprobs=True, seed=3, ignore_eos=True)
    engine.generate(["a b c", "hello there", "one two three four"], params)
    engine.generate(["x"], params)
    engine.generate(["y z"], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, repetition_penalty=1.2))
    print(json.dumps(engine.runner.kernel_report()))
"""


def _engine_report(model: Path, cache: Path, switch: str | None = None) -> dict:
    """kernel_report() of an engine on the model folder `model`, run in a new interpreter with its
    cache root at `cache`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_")}
    env.update(PYTHONPATH=str(ROOT), WORKBENCH_CACHE=str(cache))
    if switch is not None:
        env["WORKBENCH_REPLACEMENTS"] = switch
    out = subprocess.run([sys.executable, "-c", ENGINE, str(model)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_section(section: dict) -> dict[str, set[str]]:
    """Every registered replacement is in the one section with the registry's description, every
    verdict has the one shape; returns each replacement's verdict sources."""
    assert set(section) >= {"switch", "store", "replacements"}
    assert list(section["replacements"]) == list(REGISTRY)
    sources: dict[str, set[str]] = {}
    for name, entry in section["replacements"].items():
        rep = REGISTRY[name]
        assert {k: entry[k] for k in rep.describe()} == rep.describe(), name
        for v in entry["verdicts"]:
            assert set(v) == {"key", "ok", "detail", "facts", "source"}, name
            assert list(v["key"]) == list(rep.key) and isinstance(v["ok"], bool) and v["detail"], name
            assert v["source"] == CHECKED_NOW or CACHED.match(v["source"]), (name, v["source"])
        sources[name] = {v["source"] for v in entry["verdicts"]}
    return sources


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A cold process, a warm one on the same cache root, and one with the switch at `torch,fresh`."""
    from workbench.models.loader import resolve_folder

    model = resolve_folder("tiny-random")[0]  # from the usual cache: the runs' own cache roots start empty
    cache = tmp_path_factory.mktemp("cache")
    cold = _engine_report(model, cache)
    files_after_cold = sorted(p.name for p in (cache / "verdicts").glob("*.json"))
    warm = _engine_report(model, cache)
    off_cache = tmp_path_factory.mktemp("off")
    off = _engine_report(model, off_cache, "torch,fresh")
    return cache, cold, files_after_cold, warm, off_cache, off


def test_every_registered_replacement_reports_through_the_one_mechanism(runs):
    cache, cold, files, warm, _, _ = runs
    sources = _check_section(cold["checks"])
    assert cold["checks"]["switch"] == "WORKBENCH_REPLACEMENTS=on"
    assert cold["checks"]["store"] == str(cache / "verdicts")
    for name in REGISTRY:  # each one was decided in this run, here and now
        assert sources[name] == {CHECKED_NOW}, (name, sources[name])
    # the one store: a file per environment under <cache root>/verdicts, holding the on-disk ones
    kept = {}
    for f in files:
        data = json.loads((cache / "verdicts" / f).read_text())
        assert set(data) == {"environment", "verdicts"}
        for name, entries in data["verdicts"].items():
            kept.setdefault(name, set()).update(entries)
    assert set(kept) == {n for n in ON_DISK if any(v["ok"] or REGISTRY[n].on_disk == "all"
                                                   for v in cold["checks"]["replacements"][n]["verdicts"])}
    assert sorted(p.name for p in cache.iterdir()) == ["kernels", "verdicts"]  # the C build and the verdicts


def test_a_second_process_reads_each_kept_verdict_from_the_store(runs):
    from workbench.engine.kernels.gemm import RACE_BUSY_SHARE

    _, cold, _, warm, _, _ = runs
    sources = _check_section(warm["checks"])
    # a race the cold process timed while its threads waited for a CPU (a busy machine) is kept but
    # run again by the next process (gemm._quiet_race): the one verdict a second process may re-decide
    busy = {json.dumps(v["key"]) for v in cold["checks"]["replacements"]["linear.route"]["verdicts"]
            if v["facts"].get("waited", 0.0) > RACE_BUSY_SHARE}
    raced_again = {json.dumps(v["key"]) for v in warm["checks"]["replacements"]["linear.route"]["verdicts"]
                   if v["source"] == CHECKED_NOW}
    assert raced_again <= busy, raced_again - busy
    for name in REGISTRY:
        cold_ok = {json.dumps(v["key"]): v["ok"] for v in cold["checks"]["replacements"][name]["verdicts"]}
        for v in warm["checks"]["replacements"][name]["verdicts"]:
            key = json.dumps(v["key"])
            if name == "linear.route" and v["source"] == CHECKED_NOW:
                continue  # raced again (above)
            # kept where the store keeps it: every verdict, or (on_disk "passed") the passed ones; a
            # refusal (the one-call layers on tiny-random's shapes) and the millisecond checks run again
            kept = name in ON_DISK and (REGISTRY[name].on_disk == "all" or cold_ok.get(key, False))
            assert bool(CACHED.match(v["source"])) == kept, (name, key, v["source"])
    assert all(sources[n] for n in ON_DISK - {"forward.decode_layers", "forward.decode_layers_rows"})
    for name in REGISTRY:  # the same verdicts, whichever process decided them (the cold one decided
        # more: the direct forward's check ran forwards of its own row counts)
        got = {json.dumps(v["key"]): v["ok"] for v in warm["checks"]["replacements"][name]["verdicts"]}
        want = {json.dumps(v["key"]): v["ok"] for v in cold["checks"]["replacements"][name]["verdicts"]}
        assert got and got.items() <= want.items(), name


def test_the_one_switch_turns_the_native_kernels_and_the_store_off(runs):
    _, _, _, _, off_cache, off = runs
    sources = _check_section(off["checks"])
    assert off["checks"]["switch"] == "WORKBENCH_REPLACEMENTS=fresh,torch" and off["checks"]["store"] is None
    assert off["decode_attention"] is False and off["packed_linear_bytes"] == 0
    assert all(not sources[n] for n in NATIVE)  # none loaded, so none checked
    assert all(sources[n] == {CHECKED_NOW} for n in set(REGISTRY) - NATIVE)
    assert not (off_cache / "verdicts").exists() and not (off_cache / "kernels").exists()


def test_one_verdict_type_one_store_one_switch_in_the_code():
    """No module of the engine defines a verdict record, writes a cache file or reads a switch of
    its own: those live in engine/kernels/ (verdict.py, store.py, switch.py)."""
    engine = ROOT / "workbench" / "engine"
    verdicts, writers, switches = [], [], []
    for path in sorted(engine.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and "Verdict" in node.name:
                verdicts.append(f"{rel}:{node.name}")
        if "mkstemp" in text or "os.replace" in text:
            writers.append(rel)
        names = {n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant)
                 and n.value in ("WORKBENCH_CPU_KERNELS", "WORKBENCH_FASTPATH_CACHE", "WORKBENCH_PROBE_CACHE",
                                 "WORKBENCH_REPLACEMENTS")}  # the variables' names as code uses them
        if names:
            switches.append(rel)
    assert verdicts == ["workbench/engine/kernels/verdict.py:Verdict"]
    # store.py writes verdicts; native.py renames the compiler's output into place (a build, not a verdict)
    assert writers == ["workbench/engine/kernels/native.py", "workbench/engine/kernels/store.py"]
    assert switches == ["workbench/engine/kernels/switch.py"]


def test_the_kernels_package_sits_below_run_and_sample():
    """engine/kernels/ imports neither engine/run/ nor engine/sample/ (they import it)."""
    offenders = []
    for path in sorted((ROOT / "workbench" / "engine" / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name}: {n}" for n in names
                          if n.startswith(("workbench.engine.run", "workbench.engine.sample"))]
    assert offenders == []


def test_the_switch_reads_its_words_and_the_old_variables_only_as_aliases(monkeypatch):
    from workbench.engine.kernels import switch

    for name in (switch.VARIABLE, *switch.ALIASES):
        monkeypatch.delenv(name, raising=False)
    assert switch.describe() == "WORKBENCH_REPLACEMENTS=on" and switch.native() and not switch.exact()
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "0")
    monkeypatch.setenv("WORKBENCH_PROBE_CACHE", "0")
    assert not switch.native() and switch.fresh() and switch.describe() == "WORKBENCH_REPLACEMENTS=fresh,torch"
    monkeypatch.setenv("WORKBENCH_CPU_KERNELS", "exact")
    assert switch.exact() and switch.native()
    monkeypatch.setenv(switch.VARIABLE, "on")  # the new variable wins: the old ones are not read
    assert switch.native() and not switch.exact() and not switch.fresh()
    monkeypatch.setenv(switch.VARIABLE, " exact , fresh")
    assert switch.exact() and switch.fresh() and switch.native()
    monkeypatch.setenv(switch.VARIABLE, "exact,fast")
    with pytest.raises(ValueError, match=r"WORKBENCH_REPLACEMENTS='exact,fast': expected .*on, exact, torch, fresh"):
        switch.words()


def test_one_replacement_switched_off_by_name_is_refused_and_its_check_never_runs(monkeypatch):
    from workbench.engine.kernels import Book, switch
    from workbench.engine.kernels.verdict import Verdict

    monkeypatch.setenv(switch.VARIABLE, "fresh,-sample.topk")
    book, ran = Book(), []

    def check() -> Verdict:
        ran.append(1)
        return Verdict(True, "identical", {})

    assert not book.decide("sample.topk", (), check).ok and not ran  # off: what it replaces runs
    assert book.decide("sample.draw", (), check).ok and ran == [1]  # the others as before
    assert "switched off" in book.report()["replacements"]["sample.topk"]["verdicts"][0]["detail"]
    monkeypatch.setenv(switch.VARIABLE, "-sample.topkk")
    with pytest.raises(ValueError, match=r"-NAME for one of .*sample\.topk.*got -sample\.topkk"):
        switch.words()
