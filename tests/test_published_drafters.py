"""The drafters shipped under drafters/: weights as recorded, loaded strictly, fit for their target."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from eagle3lib import files
from eagle3lib.decoding.speculate import check_compatible
from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.drafter.config import default_aux_layer_ids
from eagle3lib.params import load_params
from eagle3lib.reports import publish
from eagle3lib.target import zoo

DRAFTERS = sorted(publish.DEMO_SOURCE_DRAFTER.parent.glob("*/provenance.json"))
SMOLLM2 = LlamaConfig(num_hidden_layers=30, hidden_size=576, vocab_size=49152)  # SmolLM2-135M-Instruct


def test_the_demo_source_drafter_is_shipped():
    assert publish.DEMO_SOURCE_DRAFTER / publish.PROVENANCE in DRAFTERS


@pytest.mark.parametrize("provenance", DRAFTERS, ids=lambda p: p.parent.name)
def test_published_drafter_matches_its_record_and_loads_strictly(provenance):
    folder = provenance.parent
    record = publish.verify(folder)  # the SHA-256 of the weights
    assert (folder / publish.WEIGHTS).stat().st_size <= 20 * 2**20
    drafter, report = load_drafter(folder, strict=True)
    assert report.ok and report.summary() == record["load_report"]
    assert record["recipe"]["target"]["spec"] == f"{zoo.ZOO_PREFIX}{zoo.SMOLLM2}"
    check_compatible(drafter.config, target_vocab_size=SMOLLM2.vocab_size,
                     target_hidden_size=SMOLLM2.hidden_size, target_num_layers=SMOLLM2.num_hidden_layers)
    assert (drafter.config.aux_layer_ids or default_aux_layer_ids(30)) == [1, 14, 26]
    # what was measured when it was made travels with it
    measured = publish.measured_metrics(record)
    assert measured and all(m["tau_low"] <= m["tau"] <= m["tau_high"] for m in measured.values())
    assert record["commit"] and record["command"] and record["training_curve"]


def test_the_chat_drafter_shows_its_learning_curve():
    """What more data buys: held-out ShareGPT τ of the run along training (one pass: every point fresh data),
    from its first measurement to its last step, against the tokens it had trained on."""
    record = publish.verify(publish.DEMO_SOURCE_DRAFTER)
    points = record["validation_curve"]["points"]
    tokens = [point["tokens"] for point in points]
    assert len(points) >= 3 and tokens == sorted(set(tokens)) and points[-1]["step"] == record["steps"]
    for point in points:
        m = point["benchmarks"]["sharegpt"]
        assert m["tau_low"] <= m["tau"] <= m["tau_high"]
    assert (publish.DEMO_SOURCE_DRAFTER / publish.VALIDATION_FIGURE).is_file()


def test_the_demo_recipe_fits_its_source_drafter():
    """The demo's no-remap arm keeps the source drafter's rows under the new map: the draft vocab sizes must
    be equal, and the drafter must be the shipped one."""
    demo = load_params("params/demo.yaml")
    drafter, _ = load_drafter(publish.DEMO_SOURCE_DRAFTER, strict=True)
    assert files.resolve_path(demo["train"]["drafter"]) == publish.DEMO_SOURCE_DRAFTER
    assert demo["data"]["draft_vocab_size"] == drafter.config.draft_vocab_size


TABLES = [table for p in DRAFTERS for table in sorted(p.parent.glob("*_table.json"))]  # tau_, one_user_


@pytest.mark.parametrize("path", TABLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_published_tau_table_measured_these_weights(path):
    """`eagle3 table -o`: every benchmark at every setting, with intervals, of exactly the shipped weights."""
    table = json.loads(path.read_text())
    assert table["weights_sha256"] == publish.verify(path.parent)["sha256"][publish.WEIGHTS]
    assert table["machine"] and table["command"].startswith("eagle3 table") and table["commit"]
    settings = {row["setting"] for row in table["rows"]}
    benchmarks = {row["benchmark"] for row in table["rows"]}
    assert len(table["rows"]) == len(settings) * len(benchmarks) >= 3
    for row in table["rows"]:
        assert row["tau_low"] <= row["tau"] <= row["tau_high"] and row["prompts"] >= 32
