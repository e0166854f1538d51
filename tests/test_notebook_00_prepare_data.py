"""Notebook 00 under params/smoke.yaml: both corpora captured from zoo:tiny-llama, maps and figures."""

from __future__ import annotations

import torch

from eagle3lib.data import layout as data
from eagle3lib.data import readers
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.params import load_params
from tests.notebook_harness import run_notebook


def test_prepare_data_notebook(tmp_path, monkeypatch):
    # a fresh cache: a stand-in source drafter cached by an earlier run would skip the source capture
    monkeypatch.setenv("EAGLE3LIB_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    metrics = run_notebook("00_prepare_data", run_dir)
    params = load_params("params/smoke.yaml")
    step = run_dir / "00_prepare_data"
    assert metrics["target"] == "zoo:tiny-llama" and metrics["aux_layer_ids"] == [1, 3, 4]
    for which, corpus in (("main", "stdlib-code"), ("source", "pydoc-prose")):
        folder = data.prepared_dir(run_dir, which)
        found = metrics[which]
        assert found["corpus"] == corpus and found["folder"] == str(folder)
        assert found["tokens"] >= params["data"]["num_tokens"]
        reader = readers.open_reader(folder)
        assert reader.manifest["num_tokens"] == found["tokens"]
        assert reader.manifest["provenance"]["corpus"] == corpus
        vocab_map = VocabMap.load(folder / "vocab_map.safetensors", vt=49152)
        counts = reader.token_counts()
        assert torch.equal(vocab_map.draft_ids, VocabMap.from_counts(counts, 512, 49152).draft_ids)
        assert 0 < found["input_coverage"] <= 1 and found["distinct_tokens"] == int((counts > 0).sum())
    # the main data is the step folder itself: the map and counts other notebooks look for are at its top
    assert (step / "vocab_map.safetensors").is_file() and (step / "token_counts.safetensors").is_file()
    assert (step / "token_frequency.png").is_file() and (step / "top_tokens_coverage.png").is_file()
    assert (run_dir / "00_prepare_data.ipynb").is_file()
    assert metrics["stand_in"]["steps"] == params["stand_in"]["steps"]
    assert (step / "source_drafter" / "model.safetensors").is_file()
