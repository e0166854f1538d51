"""Notebook 04 headless: three arms on the learnable synthetic task of test_train, warm-started from a
drafter trained there under one vocab map and moved to another."""

from __future__ import annotations

import math

from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.training import train
from tests.notebook_harness import run_notebook
from tests.test_train import VD, _other_map, _trained_drafter, data_folder, synthetic_data  # noqa: F401

ARMS = ["drafter", "drafter-no-remap", "scratch"]


def test_three_arms_same_budget(tmp_path, data_folder, monkeypatch):  # noqa: F811
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel's torch: tiny models on 2 shared cores
    source = _trained_drafter(tmp_path, data_folder)
    moved = _other_map(synthetic_data(data_folder).vocab_map).save(tmp_path / "moved_map.safetensors")
    recipe = {
        "arms": ARMS, "data": data_folder["data"], "vocab_map": str(moved), "drafter": source,
        "allow_no_remap": True, "steps": 30, "batch_size": 4, "micro_batch_size": 2, "seq_len": 16,
        "ttt_steps": 4, "lr": 3e-3, "warmup_steps": 5, "log_every": 5, "checkpoint_every": 0,
        "check_batches": 2,
    }
    metrics = run_notebook("04_finetune", tmp_path / "run", overrides={"train": recipe})

    arms = metrics["arms"]
    assert list(arms) == ARMS
    assert arms["drafter"]["check_passed"] and not arms["drafter-no-remap"]["check_passed"]
    assert arms["drafter"]["initial_loss"] < 0.5 * math.log(VD)
    assert arms["drafter-no-remap"]["initial_loss"] >= math.log(VD)
    # same budget: the remapped warm start ends best, and every arm learned
    others = (arms["drafter-no-remap"]["final_loss"], arms["scratch"]["final_loss"])
    assert arms["drafter"]["final_loss"] < min(others)
    assert arms["drafter"]["predicted_tau"] > arms["scratch"]["predicted_tau"]
    for numbers in arms.values():
        assert numbers["final_loss"] < numbers["initial_loss"]
        load_drafter(numbers["drafter"], strict=True)
    found = metrics["found"]
    assert "drafter: loss_0" in found and "step-0 check passed" in found
    assert "drafter-no-remap: loss_0" in found and "failed as the scrambled-labels bug predicts" in found
    step = tmp_path / "run" / "04_finetune"
    for figure in metrics["figures"]:
        assert (tmp_path / "run" / figure).stat().st_size > 10_000
    assert (step / "drafter-no-remap" / "check.json").is_file()
    assert train.ArmResult.read(step / "scratch").steps == 30
