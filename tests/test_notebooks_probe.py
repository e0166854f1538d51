"""Notebooks 01 (probe a drafter) and 05 (drafters side by side) run headless under params/smoke.yaml:
zoo:tiny-llama and the random fixture drafters sized for it (tests/fixtures/speculate)."""

from __future__ import annotations

import json

import pytest

from eagle3lib.params import load_params
from tests.notebook_harness import run_notebook

pytestmark = pytest.mark.usefixtures("one_thread_kernels")


def test_01_then_05_under_smoke_params(tmp_path):
    params = load_params("params/smoke.yaml")
    steps = params["probe"]["steps"]

    probed = run_notebook("01_probe_drafter", tmp_path)
    assert probed["backend"] == "builtin" and probed["steps"] == steps
    assert probed["matches_target"] == 1.0  # greedy speculation reproduced the target's own decoding
    assert len(probed["acceptance_per_position"]) == steps
    assert probed["tau"] == pytest.approx(1 + sum(probed["acceptance_per_position"]))
    assert probed["tokens"] == params["probe"]["num_prompts"] * params["probe"]["max_new_tokens"]
    for key in ("tokens_per_s", "target_tokens_per_s", "speedup", "ideal_speedup", "efficiency"):
        assert probed[key] > 0, key
    step = tmp_path / "01_probe_drafter"
    for figure in ("acceptance_by_position.png", "speculation_costs.png"):
        assert (step / figure).stat().st_size > 0, figure
    generations = json.loads((step / "generations.json").read_text())
    assert generations["outputs"] == generations["target_outputs"]

    evaluated = run_notebook("05_evaluate", tmp_path)
    names = [entry["name"] for entry in params["evaluate"]["drafters"]]
    assert list(evaluated["benchmarks"]) == [params["probe"]["corpus"]]  # no benchmarks: probe's prompts
    found = evaluated["benchmarks"][params["probe"]["corpus"]]
    assert list(found) == names
    for name in names:
        assert found[name]["replayed"] and "speedup" not in found[name]  # greedy: replayed, untimed
        assert len(found[name]["acceptance_per_position"]) == steps
    # fixture A is 01's drafter on 01's prompts: its replay accepts what 01's verifications accepted
    assert found[names[0]]["tau"] == probed["tau"]
    assert found[names[0]]["acceptance_per_position"] == probed["acceptance_per_position"]
    step = tmp_path / "05_evaluate"
    for name in ("acceptance_by_position.png", "tau_and_speedup.png", "table.md"):
        assert (step / name).stat().st_size > 0, name
    table = (step / "table.md").read_text().splitlines()
    assert [line.split(" | ")[0].removeprefix("| ") for line in table[2:]] == names
    probe = params["probe"]
    assert table[0] == f"| drafter | {probe['corpus']} ({probe['num_prompts']}) | mean τ |"
