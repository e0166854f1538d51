"""The records under records/: their files as their provenance records them, the recipe that made them as it
stands in params/, and every recipe's `evaluate.record` one of them."""

from __future__ import annotations

import pytest
import yaml

from eagle3lib import files
from eagle3lib.params import load_params, override_dict
from eagle3lib.reports import publish

FOLDER = files.REPO_ROOT / "records"
RECORDS = sorted(p.parent / publish.PROVENANCE for p in FOLDER.glob(f"*/{publish.CURVES}"))
COMPARISONS = sorted(FOLDER.glob(f"*/{publish.COMPARISON}"))
COVERAGES = sorted(FOLDER.glob(f"*/{publish.COVERAGE}"))


def test_every_record_is_a_curves_record_a_cost_comparison_or_a_coverage():
    folders = sorted(FOLDER.glob(f"*/{publish.PROVENANCE}"))
    assert folders == sorted(RECORDS + [p.parent / publish.PROVENANCE for p in COMPARISONS + COVERAGES])


def test_the_warm_start_curve_is_committed():
    assert files.REPO_ROOT / "records" / "warm-start-curve" / publish.PROVENANCE in RECORDS


@pytest.mark.parametrize("provenance", RECORDS, ids=lambda p: p.parent.name)
def test_a_record_matches_its_hashes_and_the_recipe_that_made_it(provenance):
    record = publish.read_record(provenance.parent)  # the SHA-256 of curves.json and the figure
    assert record["commit"] and record["machine"] and record["arms"]
    assert record["findings"] or list(record["arms"]) == ["scratch"]  # findings are about warm starts
    for points in record["arms"].values():
        assert [p["tokens"] for p in points] == sorted(p["tokens"] for p in points)
        measured = [m for p in points for m in p["benchmarks"].values()]
        assert all(m["tau_low"] <= m["tau"] <= m["tau_high"] for m in measured)
    # the command names a recipe of params/, and every setting that recipe writes, with the command's own
    # overrides (-p KEY=VALUE, --name), is the one the record used
    words = record["command"].split()
    recipe = next(word for word in words if word.startswith("params/"))
    written = yaml.safe_load((files.REPO_ROOT / recipe).read_text())
    overrides = [value for flag, value in zip(words, words[1:], strict=False) if flag in ("-p", "--param")]

    def merge(into: dict, settings: dict) -> None:  # as `eagle3 run -p` overrides: key by key, nested too
        for key, value in settings.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    merge(written, override_dict(overrides))
    names = [value for flag, value in zip(words, words[1:], strict=False) if flag == "--name"]
    if names:  # eagle3 run --name: the run's folder and name
        written["run"]["name"] = names[-1]
    for section, settings in written.items():
        for key, value in settings.items():
            assert record["recipe"][section][key] == value, f"{recipe}: {section}.{key} is not the record's"


@pytest.mark.parametrize("recipe", sorted((files.REPO_ROOT / "params").glob("*.yaml")), ids=lambda p: p.name)
def test_a_recipe_shows_a_committed_record_or_none(recipe):
    shown = load_params(recipe)["evaluate"]["record"]
    if shown:
        publish.read_record(shown)


@pytest.mark.parametrize("comparison", COMPARISONS, ids=lambda p: p.parent.name)
def test_a_cost_comparison_matches_its_hashes_and_the_records_it_compares(comparison):
    publish.check_published(comparison.parent)
    compared = yaml.safe_load(comparison.read_text())  # JSON is YAML
    for arm in compared["arms"].values():
        record = publish.read_record(files.REPO_ROOT / arm["record"])
        points = record["arms"][arm["arm"]]
        assert [{k: v for k, v in p.items() if k != "core_hours"} for p in arm["points"]] == points
        assert [p["core_hours"] for p in arm["points"]] == sorted(p["core_hours"] for p in arm["points"])
    assert compared["paired"] == publish.paired_at_equal_steps(compared["arms"])


@pytest.mark.parametrize("coverage", COVERAGES, ids=lambda p: p.parent.name)
def test_a_coverage_record_matches_its_hashes_and_holds_more_at_every_larger_size(coverage):
    publish.check_published(coverage.parent)
    record = yaml.safe_load(coverage.read_text())  # JSON is YAML
    assert record["command"].startswith("eagle3 coverage ") and record["commit"] and record["machine"]
    for label, points in record["curves"].items():
        shares = [share for _, share in points]
        assert shares == sorted(shares) and 0 < shares[0] and shares[-1] == 1.0, label
        at = dict(points)
        assert all(row["coverage"][label] == at[row["vd"]] for row in record["rows"]), label
