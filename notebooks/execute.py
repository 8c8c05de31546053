"""Run every tutorial notebook top to bottom and store it with its outputs (`make notebooks`).

Owns: executing `notebooks/[0-9][0-9]_*.ipynb` in place with nbclient (a real kernel, the notebook's
own folder as the working directory) and stamping each with the hash of its code cells
(`metadata.workbench.sources_sha256`), so tests/notebook/test_notebook_outputs.py can tell that the stored
outputs come from the code as it is now. Widgets keep only their text fallback: their state holds
whole traces (tens of MB) and is not stored. Usage: python notebooks/execute.py [NAME ...]
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sources_sha256(nb) -> str:
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    return hashlib.sha256("\n\x00\n".join(code).encode()).hexdigest()


def execute(path: Path) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", store_widget_state=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nb.metadata["workbench"] = {"sources_sha256": sources_sha256(nb)}
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(names: list[str]) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    paths = sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    if names:
        paths = [p for p in paths if p.stem in names or p.name in names]
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path.name} ...", flush=True)
        print(f"[{i}/{len(paths)}] {path.name}: {execute(path):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
