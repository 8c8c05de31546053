"""Every tutorial notebook runs top to bottom without errors (nbclient, a real kernel, smollm2 on the CPU).

The notebooks assert their own claims (the trace holds what the engine returned, top-k kept k
tokens, a stop string is cut, ...), so a notebook whose story stops being true fails here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT = 180  # seconds per cell; the first smollm2 load on a fresh machine dequantizes the GGUF
# A notebook that fails only because of a known bug elsewhere: (text of that exact failure, reason).
# Any other failure of the notebook still fails the test; once the bug is fixed the notebook passes.
KNOWN_FAILURES = {
    "05_replay_and_diff": ("field 'num_steps'", "workbench.replay counts the step-0 stamp events as a step, so "
                                                "every replay reports num_steps N+1 vs N (issue 6)"),
}


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_the_five_tutorials_are_there() -> None:
    names = [p.stem for p in notebook_paths()]
    assert names == ["01_quickstart", "02_sampling", "03_speculative_decoding", "04_detokenizer",
                     "05_replay_and_diff"]


@pytest.mark.slow
@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    env = {"TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "agg"}
    os.environ.update(env)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as exc:
        known = KNOWN_FAILURES.get(path.stem)
        if known is not None and known[0] in str(exc):
            pytest.xfail(known[1])  # reported as XFAIL, never as a pass
        raise
    elapsed = time.perf_counter() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    print(f"{path.name}: {elapsed:.1f} s")
