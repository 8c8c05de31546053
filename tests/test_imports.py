"""Import contracts between the packages, each checked in a fresh interpreter.

What a user would notice when one breaks: `import workbench` or opening a trace in the TUI or a
notebook pulls in torch, the engine, or the web and widget stacks (seconds of start-up, and tools
that fail without those installed); and, inside the engine, a part that reaches for the whole
`Engine` instead of the collaborators it is given.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def loaded_after(statement: str) -> set[str]:
    """The top-level names of the modules loaded after running `statement` in a new interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_trace_package_imports_no_torch() -> None:
    mods = loaded_after("import workbench.trace, workbench.trace.reader, workbench.trace.live, "
                        "workbench.trace.store, workbench.trace.diff, workbench.trace.export")
    assert "torch" not in mods
    assert not [m for m in mods if m.startswith("workbench.engine")]


@pytest.mark.parametrize("package", ["tui", "tui.app", "workbench.notebook"])
def test_the_viewers_import_no_engine(package: str) -> None:
    mods = loaded_after(f"import {package}")
    assert not [m for m in mods if m.startswith("workbench.engine")], package
    assert "torch" not in mods, package


def test_importing_workbench_stays_light() -> None:
    mods = {m.split(".")[0] for m in loaded_after("import workbench")}
    assert not mods & {"textual", "plotly", "ipywidgets", "fastapi", "torch", "transformers"}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """Every `from X import a, b` and `import X` in a file, including those under TYPE_CHECKING or
    inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def test_no_engine_part_imports_the_engine() -> None:
    """Only engine.py knows the Engine class: every other module under workbench/engine/ is handed
    the collaborators it needs (even a type annotation of Engine would hide a service locator)."""
    offenders = []
    for path in sorted((ROOT / "workbench" / "engine").rglob("*.py")):
        if path.name == "engine.py" and path.parent.name == "engine":
            continue
        for module, names in _imports(path):
            if module == "workbench.engine.engine" or (module == "workbench.engine" and "engine" in names):
                offenders.append(f"{path.relative_to(ROOT)} imports {module} {names}")
    assert offenders == []


def test_the_engine_parts_form_no_import_circle() -> None:
    """The modules under workbench/engine/ import each other without a cycle (TYPE_CHECKING and
    in-function imports count), so the pipeline reads in one direction."""
    base = ROOT / "workbench" / "engine"
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in base.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        deps = set()
        for module, items in _imports(path):
            deps |= {m for m in [module, *(f"{module}.{i}" for i in items)] if m in names and m != name}
        graph[name] = {d for d in deps if not d.endswith("__init__")}
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        seen[node] = 1
        for dep in sorted(graph.get(node, ())):
            if seen.get(dep) == 1:
                return stack + [node, dep]
            if dep not in seen and (cycle := visit(dep, stack + [node])):
                return cycle
        seen[node] = 2
        return None

    cycles = [c for n in sorted(graph) if n not in seen and (c := visit(n, []))]
    assert cycles == []
