"""Fail, naming each file, when a tracked notebook is not committed stripped and well-formed.

Rules: committed exactly as nbstripout writes it (so a fresh clone with the filter installed shows no
change, and a run records a clean commit), kernelspec `python3`, exactly one cell tagged `parameters` whose
statements assign plain literals only.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def tracked_notebooks() -> list[str]:
    return _git("ls-files", "*.ipynb").split()


def staged_text(name: str) -> str:
    """The notebook as git stores it (the index): what a commit holds, after any clean filter."""
    return _git("show", f":{name}")


def stripped(text: str) -> str:
    """The notebook as nbstripout's clean filter writes it (what `git add` stores once `make setup` ran)."""
    done = subprocess.run([sys.executable, "-m", "nbstripout"], input=text, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nbstripout failed: {done.stderr.strip()}")
    return done.stdout


def problems(name: str, text: str) -> list[str]:
    """Everything wrong with one notebook's JSON text, as messages naming the file and cell."""
    try:
        nb = json.loads(text)
    except json.JSONDecodeError as err:
        return [f"{name}: not a readable notebook: {err}"]
    found = []
    kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
    if kernel != "python3":
        found.append(f"{name}: kernelspec is {kernel!r}, expected 'python3'")
    parameter_cells = []
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            found.append(f"{name}: cell {index} has outputs (run `make setup` to install nbstripout)")
        if cell.get("execution_count") is not None:
            found.append(f"{name}: cell {index} has execution_count {cell['execution_count']}")
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            parameter_cells.append((index, "".join(cell["source"])))
    if not found and stripped(text) != text:
        found.append(f"{name}: not in nbstripout's form (cell ids, metadata or layout differ); "
                     "run `make setup`, then `git add` the notebook again")
    if len(parameter_cells) != 1:
        found.append(f"{name}: expected one cell tagged 'parameters', found {len(parameter_cells)}")
    for index, source in parameter_cells:
        found += [f"{name}: parameters cell {index}: {p}" for p in literal_only_problems(source)]
    return found


def literal_only_problems(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        return [f"not valid Python: {err}"]
    found = []
    for statement in tree.body:
        plain = isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets)
        if not plain:
            found.append(f"line {statement.lineno}: only `name = literal` assignments are allowed")
            continue
        try:
            ast.literal_eval(statement.value)
        except ValueError:
            found.append(f"line {statement.lineno}: value is not a plain literal")
    return found


def main() -> int:
    names = tracked_notebooks()
    found = [p for name in names for p in problems(name, staged_text(name))]
    for problem in found:
        print(problem, file=sys.stderr)
    if found:
        print(f"{len(found)} notebook problem(s); notebooks must be committed stripped", file=sys.stderr)
        return 1
    print(f"notebooks ok: {len(names)} checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
