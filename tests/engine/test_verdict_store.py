"""The verdict store (engine/kernels/store.py): one file per environment, keyed by everything the
verdicts depend on, parsed once a process until another process writes it."""

from __future__ import annotations

import os

import torch

from workbench.engine.kernels import Store


def test_the_store_parses_its_file_again_only_after_another_process_wrote_it(tmp_path, monkeypatch):
    """A machine's verdict file grows to thousands of verdicts (~1 MB, ~30 ms to parse): a process
    parses it once, and again only when another process has written it since (then it sees that
    process's verdicts); a damaged file is ignored, as before."""
    import json

    from workbench.engine.kernels import store as store_mod
    from workbench.engine.kernels.verdict import Verdict

    parses = []
    loads = json.loads
    monkeypatch.setattr(store_mod.json, "loads", lambda text, *a, **kw: parses.append(1) or loads(text, *a, **kw))
    env = {"machine": "test"}
    here = Store(tmp_path)
    here.put("linear.packed", env, "k1", Verdict(True, "identical", {"n": 1}))
    assert here.get("linear.packed", env, "k1").facts == {"n": 1} and parses == []  # what it wrote
    for _ in range(5):
        assert here.get("linear.packed", env, "k2") is None
    assert parses == []
    # another process adds a verdict (its writer: the whole file, renamed over this one)
    data = json.loads(here.path(env).read_text())
    data["verdicts"]["linear.packed"]["k2"] = {**data["verdicts"]["linear.packed"]["k1"], "ok": False}
    store_mod.write_json(here.path(env), data)
    parses.clear()
    assert here.get("linear.packed", env, "k2").ok is False and here.get("linear.packed", env, "k1").ok
    assert len(parses) == 1
    here.path(env).write_text("{not json")  # damaged in place
    assert here.get("linear.packed", env, "k1") is None


def test_the_verdict_file_is_keyed_by_what_the_verdicts_depend_on(monkeypatch):
    from workbench.engine.kernels import BOOK, REGISTRY, environment

    monkeypatch.delenv("WORKBENCH_REPLACEMENTS", raising=False)
    here = BOOK.store.path(BOOK.environment(REGISTRY["linear.packed"]))
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert BOOK.store.path(BOOK.environment(REGISTRY["linear.packed"])) != here
    assert environment.machine()["torch"].endswith("+other")
    # MKL narrowed to AVX2 (or ATen's AVX2 build, or the C kernels built without AVX512) computes
    # other bits on the same CPU: its verdicts are not this process's
    other_torch = BOOK.store.path(BOOK.environment(REGISTRY["linear.packed"]))
    capped = "AVX" if os.environ.get("MKL_ENABLE_INSTRUCTIONS") == "AVX2" else "AVX2"  # not this run's value
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", capped)
    assert BOOK.store.path(BOOK.environment(REGISTRY["linear.packed"])) != other_torch
    assert f"MKL_ENABLE_INSTRUCTIONS={capped}" in environment.machine()["isa_settings"].split()
    monkeypatch.setenv("WORKBENCH_REPLACEMENTS", "fresh")
    assert BOOK.store is None
    monkeypatch.delenv("WORKBENCH_REPLACEMENTS")
    monkeypatch.setenv("WORKBENCH_FASTPATH_CACHE", "0")  # the old variable, an alias
    assert BOOK.store is None
