"""Tiny model folders are built once under a file lock (issue 19): two processes asking for the same
folder at once both get it complete (the second waits and reuses it), and a `.partial` folder a crashed
build left behind is cleaned up."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from workbench.models.loader import build_once


def _slow_build(tmp: Path) -> None:
    (tmp / "config.json").write_text("{}")
    time.sleep(0.5)  # long enough for the other process to arrive mid-build
    (tmp / "model.safetensors").write_bytes(b"weights")
    with open(tmp.parent / "builds.log", "a") as log:
        log.write("built\n")


def _ask(folder: str, results: multiprocessing.Queue) -> None:
    try:
        out = build_once(Path(folder), _slow_build)
        results.put(("ok", (out / "model.safetensors").read_bytes().decode()))
    except Exception as exc:  # reported to the parent, which fails the test with it
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def test_two_processes_building_the_same_folder_both_get_it_built_once(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-random"
    results: multiprocessing.Queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_ask, args=(str(folder), results)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    got = [results.get(timeout=5) for _ in procs]
    assert got == [("ok", "weights"), ("ok", "weights")], got
    assert (tmp_path / "builds.log").read_text().count("built") == 1
    assert not list(tmp_path.glob("tiny-random.partial*"))


def test_a_stale_partial_folder_is_cleaned_up(tmp_path: Path) -> None:
    stale = tmp_path / "tiny-random.partial"
    stale.mkdir()
    (stale / "half-written.bin").write_bytes(b"x" * 100)
    folder = build_once(tmp_path / "tiny-random", _slow_build)
    assert (folder / "model.safetensors").exists() and not stale.exists()
    assert not list(tmp_path.glob("tiny-random.partial*"))
