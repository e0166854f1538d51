"""The repository's own discipline: layout, dependency lists in step, notebooks stripped."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
import yaml

from eagle3lib.files import REPO_ROOT
from tests import check_notebooks


def test_top_level_layout():
    for name in ["notebooks", "eagle3lib", "params", "outputs", "tests", "environment.yml", "README.md",
                 "pyproject.toml", "Makefile", ".ci/run", ".gitattributes", ".gitignore"]:
        assert (REPO_ROOT / name).exists(), f"{name} is missing from the repository root"
    assert "filter=nbstripout" in (REPO_ROOT / ".gitattributes").read_text()


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((REPO_ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {r for r in pip_section if not r.startswith("-e")}
    assert listed == set(project["dependencies"]), "environment.yml and pyproject.toml disagree"
    editable = next(r for r in pip_section if r.startswith("-e"))
    extras = set(re.search(r"\[(.*)\]", editable).group(1).split(","))
    assert extras == set(project["optional-dependencies"]) - {"vllm"}, "environment.yml misses an extra"
    assert "torch==2.13.0" in project["dependencies"], "torch must stay pinned"


def test_committed_notebooks_are_stripped_and_parameterised():
    names = check_notebooks.tracked_notebooks()
    found = [p for name in names for p in check_notebooks.problems(name, check_notebooks.staged_text(name))]
    assert not found, "\n".join(found)


def _notebook(outputs=None, count=None, params_source='params_file = "params/smoke.yaml"', cell_id="0"):
    text = json.dumps({
        "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4, "nbformat_minor": 5,
        "cells": [{"cell_type": "code", "id": cell_id, "metadata": {"tags": ["parameters"]},
                   "source": params_source, "outputs": outputs or [], "execution_count": count}],
    })
    return text if outputs or count or cell_id != "0" else check_notebooks.stripped(text)


def test_check_catches_outputs_and_names_the_file():
    executed = _notebook(outputs=[{"output_type": "stream"}], count=3)
    found = check_notebooks.problems("notebooks/07_x.ipynb", executed)
    assert any("notebooks/07_x.ipynb: cell 0 has outputs" in p for p in found)
    assert any("execution_count 3" in p for p in found)
    assert check_notebooks.problems("n.ipynb", _notebook()) == []


def test_check_wants_nbstripouts_own_form():
    # random cell ids (as JupyterLab writes them) are rewritten by the filter: git would show the file changed
    found = check_notebooks.problems("notebooks/02_x.ipynb", _notebook(cell_id="2b5d14e5"))
    assert found == ["notebooks/02_x.ipynb: not in nbstripout's form (cell ids, metadata or layout differ); "
                     "run `make setup`, then `git add` the notebook again"]


@pytest.mark.parametrize("source", ["import os", "x = os.getcwd()", "x = [i for i in range(3)]"])
def test_parameters_cell_must_hold_plain_literals(source):
    assert check_notebooks.problems("n.ipynb", _notebook(params_source=source))
