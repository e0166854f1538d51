"""The datasets shipped under datasets/: each file as its manifest recorded it, complete, and readable."""

from __future__ import annotations

import gzip
import json

import pytest

from eagle3lib.conversations import ReadStats, read_conversations
from eagle3lib.regenerate import FORMAT, file_sha256
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
