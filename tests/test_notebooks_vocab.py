"""Notebooks 02 (diff two vocab maps) and 03 (remap lm_head) run headless under params/smoke.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3lib import files
from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.params import ParamsError, load_params
from eagle3lib.training.remap import notebook_inputs
from tests.notebook_harness import run_notebook

FIXTURES = Path(__file__).parent / "fixtures"


def test_the_smoke_maps_follow_their_recipe():
    """tests/fixtures/vocab/README.md: the drafter's counts, each scaled by a seeded factor in [0.5, 2)."""
    vocab_freq = load_file(FIXTURES / "speculators-0.9.0" / "sglang_tiny_reference.safetensors")["vocab_freq"]
    generator = torch.Generator().manual_seed(0)
    factors = torch.empty(512, dtype=torch.float64).uniform_(0.5, 2.0, generator=generator)
    counts = (vocab_freq.double() * factors).round().long()
    assert torch.equal(load_file(FIXTURES / "vocab" / "token_counts.safetensors")["counts"], counts)
    assert VocabMap.load(FIXTURES / "vocab" / "new_map.safetensors") == VocabMap.from_counts(counts, 96)


def test_inputs_default_to_the_runs_earlier_steps(tmp_path):
    params = load_params("params/smoke.yaml", {"vocab": {"map_b": "", "counts": ""}})
    with pytest.raises(FileNotFoundError, match=r"00_prepare_data/vocab_map.safetensors does not exist"):
        notebook_inputs(params, tmp_path, ("map_a", "map_b"))
    prepared = tmp_path / "00_prepare_data"
    VocabMap.load(FIXTURES / "vocab" / "new_map.safetensors").save(prepared / "vocab_map.safetensors")
    found = notebook_inputs(params, tmp_path, ("map_a", "map_b"))
    assert found["map_b"] == prepared / "vocab_map.safetensors"
    assert found["map_a"] == files.resolve_path(params["remap"]["source_drafter"])  # map_a "" = the drafter's
    params["remap"]["source_drafter"] = ""
    with pytest.raises(ParamsError, match="set remap.source_drafter"):
        notebook_inputs(params, tmp_path, ("source_drafter",))


def test_02_then_03_under_smoke_params(tmp_path):
    diffed = run_notebook("02_diff_vocab_maps", tmp_path)
    assert (diffed["positions_equal"], diffed["first_divergence"]) == (24, 1)
    assert (diffed["intersection"], diffed["only_in_a"], diffed["only_in_b"]) == (79, 17, 17)
    assert diffed["coverage_b"] > diffed["coverage_a"]  # B was built from these counts
    step = tmp_path / "02_diff_vocab_maps"
    for figure in ("agreement_by_position.png", "coverage.png"):
        assert (step / figure).stat().st_size > 10_000
    assert (step / "diff.json").is_file()

    remapped = run_notebook("03_remap_lm_head", tmp_path)
    assert remapped["proof"]["passed"] and remapped["proof"]["max_abs_diff"] == 0.0
    assert remapped["proof"]["body_identical"] and remapped["reloaded_ok"]
    assert (remapped["shared"], remapped["filled"], remapped["dropped"]) == (79, 17, 17)
    assert remapped["rows_right_without_remap"] == 24 and remapped["layout"] == "sglang"
    drafter, _ = load_drafter(tmp_path / "03_remap_lm_head" / "drafter")
    new_map = VocabMap.load(FIXTURES / "vocab" / "new_map.safetensors")
    assert VocabMap.from_pair(drafter.d2t, drafter.t2d) == new_map
    assert (tmp_path / "03_remap_lm_head" / "row_moves.png").stat().st_size > 10_000
