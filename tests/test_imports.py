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


def _module_graph(*folders: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, over the .py files under `folders` (package faces left out
    as targets: `from workbench.engine import x` names x's module, not the face)."""
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for f in folders for p in f.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        deps = set()
        for module, items in _imports(path):
            deps |= {m for m in [module, *(f"{module}.{i}" for i in items)] if m in names and m != name}
        graph[name] = {d for d in deps if not d.endswith("__init__")}
    return graph


def _first_cycle(graph: dict[str, set[str]]) -> list[str]:
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
    return cycles[0] if cycles else []


def test_the_engine_parts_form_no_import_circle() -> None:
    """The modules under workbench/engine/ import each other without a cycle (TYPE_CHECKING and
    in-function imports count), so the pipeline reads in one direction."""
    assert _first_cycle(_module_graph(ROOT / "workbench" / "engine")) == []


def test_no_module_of_the_project_is_in_an_import_circle() -> None:
    assert _first_cycle(_module_graph(ROOT / "workbench", ROOT / "tui")) == []


# The packages from the bottom up: a package may import only those below it. `tui` and `notebook` are
# viewers (they read traces; clients for live mode; the notebook names rerun's report type), `cli` is
# the top. Each layer is the folder list of the README's Layout section, read bottom to top.
LAYERS = ["trace", "models", "engine", "clients", "external", "rerun", "watch", "server", "notebook", "tui", "cli"]


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "tui":
        return "tui"
    return parts[1] if parts[0] == "workbench" and len(parts) >= 2 and parts[1] != "__init__" else None


def test_packages_import_only_the_layers_below_them() -> None:
    upward = []
    for path in sorted([*(ROOT / "workbench").rglob("*.py"), *(ROOT / "tui").rglob("*.py")]):
        here = _package(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here is None:
            continue
        assert here in LAYERS, f"{here}/ is a package the layer list does not place"
        for module, _ in _imports(path):
            there = _package(module)
            if there is not None and there != here and LAYERS.index(there) > LAYERS.index(here):
                upward.append(f"{path.relative_to(ROOT)} ({here}) imports {module} ({there})")
    assert upward == []


def test_no_loose_module_at_the_top_of_the_package() -> None:
    """workbench/ holds its face (__init__.py) and packages only: each module belongs to a family."""
    loose = sorted(p.name for p in (ROOT / "workbench").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    assert (ROOT / "workbench" / "cli" / "__main__.py").exists()  # `python -m workbench.cli`, the entry point


def test_no_test_module_imports_another() -> None:
    """Tests share fixtures through conftest.py and code through tests/helpers/, so moving or deleting a
    test module never breaks another."""
    borrowed = [f"{path.relative_to(ROOT)} imports {module}"
                for path in sorted((ROOT / "tests").rglob("test_*.py")) for module, names in _imports(path)
                if module.startswith("tests") and (module.rsplit(".", 1)[-1].startswith("test_")
                                                   or any(n.startswith("test_") for n in names))]
    assert borrowed == []


def _engine_api_members() -> set[str]:
    code = ("import json; from workbench.engine.api import EngineAPI; "
            "print(json.dumps(sorted(set(dir(EngineAPI)) | set(EngineAPI.__annotations__))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return {m for m in json.loads(out.stdout) if not m.startswith("__")}


OUTSIDE_THE_ENGINE = [ROOT / "workbench" / p for p in ("server", "external", "rerun", "notebook", "cli", "clients")]


def test_outside_the_engine_only_its_facade_is_imported() -> None:
    """server/, external/, rerun/, the viewers and the CLI import the engine's facade and the records
    that cross its boundary (api.PUBLIC_MODULES), never a part (the runner, the scheduler, a Req)."""
    sys.path.insert(0, str(ROOT))
    try:
        from workbench.engine.api import PUBLIC_MODULES
    finally:
        sys.path.pop(0)
    reaching = [f"{path.relative_to(ROOT)} imports {module}"
                for folder in [*OUTSIDE_THE_ENGINE, ROOT / "tui"] for path in sorted(folder.rglob("*.py"))
                for module, names in _imports(path)
                if module.startswith("workbench.engine") and module not in PUBLIC_MODULES
                and not (module == "workbench.engine" and not names)]
    assert reaching == []


def test_outside_the_engine_only_the_api_is_asked() -> None:
    """Every `engine.X` (and `state.engine.X`, `self.engine.X`) outside engine/ names a member of
    EngineAPI: the server and the re-runs ask facts and steps, never `engine.runner` or `engine.reqs`."""
    allowed = _engine_api_members()
    reaching = []
    for folder in [*OUTSIDE_THE_ENGINE, ROOT / "tui"]:
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Attribute):
                    continue
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
                if name == "engine" and node.attr not in allowed:
                    reaching.append(f"{path.relative_to(ROOT)}:{node.lineno} engine.{node.attr}")
    assert reaching == []
