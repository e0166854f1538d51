"""The package's house rules: imports run one way, so no module imports one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eagle3lib"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package modules a module imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3lib"):
            parts = node.module.split(".")
            found |= {alias.name for alias in node.names} & modules if len(parts) == 1 else {parts[1]}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("eagle3lib.")}
    return found - {path.stem}


def test_no_import_circle():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    graph = {m: imports_of(PACKAGE / f"{m}.py", modules) for m in modules}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            assert state.get(dep) != "open", "import circle: " + " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = "done"

    for module in sorted(modules):
        if module not in state:
            visit(module, [])
    # the bottom of the house
    assert not graph["files"] and not graph["progress"] and not graph["devices"]
    assert graph["params"] <= {"files"}
    assert graph["runs"] <= {"files", "params", "progress", "devices"}
