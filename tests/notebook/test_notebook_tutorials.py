"""Every tutorial notebook runs top to bottom without errors (nbclient, a real kernel, smollm2 on the CPU).

The notebooks assert their own claims (the trace holds what the engine returned, top-k kept k
tokens, a stop string is cut, ...), so a notebook whose story stops being true fails here.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
CELL_TIMEOUT = 180  # seconds per cell; the first smollm2 load on a fresh machine dequantizes the GGUF


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_the_seven_tutorials_are_there() -> None:
    names = [p.stem for p in notebook_paths()]
    assert names == ["01_quickstart", "02_sampling", "03_speculative_decoding", "04_detokenizer",
                     "05_replay_and_diff", "06_what_if", "07_inside_the_forward"]


@pytest.mark.slow
@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the kernel inherits it
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    kernel = resource.getrusage(resource.RUSAGE_CHILDREN)  # the kernel was a child process, now reaped
    cpu_s = kernel.ru_utime + kernel.ru_stime - cpu.ru_utime - cpu.ru_stime
    print(f"{path.name}: {time.perf_counter() - start:.1f} s wall, {cpu_s:.1f} s kernel CPU")
