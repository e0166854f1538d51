"""The package's house rules: imports run one way, floor by floor, so no module imports one that imports it
back, and the ground floor imports nothing of the package."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eagle3lib"

# The floors, bottom first: a module imports only from its own floor and the ones below (README, "Layout").
FLOORS = (
    ("ground", {"files", "progress", "devices", "intervals", "loss", "ttt_attention"}),
    ("parameters and runs", {"params", "runs"}),
    ("the drafter", {"config", "vocab", "model", "checkpoint"}),
    ("the target", {"zoo", "target"}),
    ("data", {"data", "conversations", "sources", "benchmarks", "readers"}),
    ("decoding", {"speculate", "probe", "engines", "evaluate"}),
    ("making drafters", {"remap", "regenerate", "capture", "online", "trainer", "train"}),
    ("reports", {"plots", "report", "publish"}),
    ("the command", {"cli"}),
)


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


def package_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    return {m: imports_of(PACKAGE / f"{m}.py", modules) for m in modules}


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
    floor_of = {module: i for i, (_, modules) in enumerate(FLOORS) for module in modules}
    assert set(floor_of) == set(graph), f"modules on no floor: {sorted(set(graph) - set(floor_of))}"
    upward = [
        f"{module} ({FLOORS[floor_of[module]][0]}) imports {dep} ({FLOORS[floor_of[dep]][0]})"
        for module, deps in sorted(graph.items()) for dep in sorted(deps) if floor_of[dep] > floor_of[module]
    ]
    assert not upward, "imports that run up: " + "; ".join(upward)
    ground = FLOORS[0][1]
    assert not any(graph[module] for module in ground), "the ground floor imports nothing of the package"
