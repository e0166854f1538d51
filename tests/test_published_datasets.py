"""The datasets shipped under datasets/: each file as its manifest recorded it, complete, and readable."""

from __future__ import annotations

import gzip
import json

import pytest

from eagle3lib.data.conversations import ReadStats, read_conversations
from eagle3lib.generation.capture import training_text
from eagle3lib.generation.regenerate import FORMAT, TargetFacts, file_sha256
from eagle3lib.params import load_params
from eagle3lib.runs import REPO_ROOT

MANIFESTS = sorted((REPO_ROOT / "datasets").glob("**/*.manifest.json"))


def test_the_chat_drafters_data_is_shipped():
    assert REPO_ROOT / "datasets" / "sharegpt-smollm2" / "vllm-cpu.manifest.json" in MANIFESTS


@pytest.mark.parametrize("manifest_path", MANIFESTS, ids=lambda p: str(p.relative_to(REPO_ROOT / "datasets")))
def test_shipped_dataset_matches_its_manifest(manifest_path):
    manifest = json.loads(manifest_path.read_text())
    stem = manifest_path.name.removesuffix(".manifest.json")
    data = manifest_path.with_name(f"{stem}.jsonl.gz")
    assert manifest["format"] == FORMAT and manifest["complete"]
    assert file_sha256(data) == manifest["sha256"] and data.stat().st_size == manifest["bytes"]
    assert data.stat().st_size < 50 * 2**20
    assert (
        manifest["target"]["name"] == "zoo:smollm2-135m-instruct"
        and manifest["command"]
        and manifest["commit"]
    )
    stats = ReadStats()
    found = list(read_conversations(data, stats))
    lines = gzip.decompress(data.read_bytes()).decode().removesuffix("\n").split("\n")
    assert len(found) == len(lines) == manifest["counts"]["conversations"] and stats.skipped == {}
    assert all(c.messages[-1]["role"] == "assistant" for c in found)


RECIPES_ON_SHIPPED_DATA = [
    recipe for recipe in sorted((REPO_ROOT / "params").glob("*.yaml"))
    if load_params(recipe)["data"]["corpus"].startswith("datasets/")
]


def test_the_demo_and_the_chat_drafter_train_on_shipped_data():
    assert {p.stem for p in RECIPES_ON_SHIPPED_DATA} >= {"demo", "chat-drafter"}


@pytest.mark.parametrize("recipe", RECIPES_ON_SHIPPED_DATA, ids=lambda p: p.name)
def test_a_recipe_asks_no_more_tokens_than_its_shipped_data_holds(recipe, tmp_path):
    params = load_params(recipe)
    data = params["data"]
    target = TargetFacts.read(params["target"]["spec"])
    samples, _ = training_text(target, data, seed=0, work_dir=tmp_path)
    held = sum(len(sample.input_ids) for sample in samples)
    assert data["num_tokens"] <= held, f"{recipe.name}: data.num_tokens {data['num_tokens']} > {held} held"
