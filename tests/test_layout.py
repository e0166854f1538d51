"""The package's house rules: the folders show the flow, imports run one way, floor by floor, so no module
imports one that imports it back, and the ground floor's own helpers import nothing of the package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eagle3lib"

# The floors, bottom first: a module imports only from its own floor and the ones below (README, "Layout").
# A floor is a subpackage (a folder), except the ground floor's modules at the top of the package and the
# command, which stands above everything.
FLOORS = (
    ("ground", {"files", "progress", "devices", "params", "runs"}),
    ("drafter", {"drafter"}),
    ("target", {"target"}),
    ("data", {"data"}),
    ("decoding", {"decoding"}),
    ("generation", {"generation"}),
    ("training", {"training"}),
    ("reports", {"reports"}),
    ("the command", {"cli"}),
)
# Helpers that everything may use: they import nothing of the package.
SELF_CONTAINED = {"files", "progress", "devices"}


def module_name(path: Path) -> str:
    """`drafter.model` for eagle3lib/drafter/model.py, `files` for eagle3lib/files.py."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def room(module: str) -> str:
    """The floor's member a module belongs to: its folder, or itself at the top of the package."""
    return module.split(".")[0]


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules a module imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3lib"):
            base = node.module.removeprefix("eagle3lib").removeprefix(".")
            for alias in node.names:
                child = f"{base}.{alias.name}" if base else alias.name
                found.add(child if child in modules else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("eagle3lib.") for a in node.names if a.name.startswith("eagle3lib")}
    return found - {module_name(path), ""}


def package_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def test_every_subpackage_says_what_it_holds_and_may_import():
    for folder in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder} is no package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "Imports" in doc, f"{init}: a docstring saying what it holds and what it may import"
        held = {p.stem for p in folder.glob("*.py")} - {"__init__"}
        unnamed = {m for m in held if m not in doc}
        assert not unnamed, f"{init}'s docstring does not name {sorted(unnamed)}"


def test_no_import_circle():
    graph = package_graph()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            assert state.get(dep) != "open", "import circle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_imports_run_down_the_floors():
    graph = package_graph()
    floor_of = {member: i for i, (_, members) in enumerate(FLOORS) for member in members}
    rooms = {room(module) for module in graph}
    assert rooms == set(floor_of), f"on no floor: {rooms - set(floor_of)}; gone: {set(floor_of) - rooms}"
    upward = [
        f"{module} ({FLOORS[floor_of[room(module)]][0]}) imports {dep} ({FLOORS[floor_of[room(dep)]][0]})"
        for module, deps in sorted(graph.items()) for dep in sorted(deps)
        if floor_of[room(dep)] > floor_of[room(module)]
    ]
    assert not upward, "imports that run up: " + "; ".join(upward)
    assert not any(graph[module] for module in SELF_CONTAINED), "files, progress and devices import nothing"
