"""The tutorials are stored with their outputs (a reader on GitHub sees the results), and those
outputs come from the code as it is now: `make notebooks` stamps each notebook with the hash of its
code cells, and a notebook edited since then fails here until it is run again."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
from execute import sources_sha256  # noqa: E402


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_notebook_is_stored_with_fresh_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{path.name}: run `make notebooks`"
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, f"{path.name}: most cells show no output"
    assert not [o for c in code for o in c.outputs if o.get("output_type") == "error"]
    stamp = nb.metadata.get("workbench", {}).get("sources_sha256")
    assert stamp == sources_sha256(nb), f"{path.name} changed since its outputs were made: run `make notebooks`"
