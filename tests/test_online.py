"""Online training (`train.data_mode: online`): the target in the loop gives what capture-then-train gives on
the same text, resumes exactly without recomputing skipped batches, and runs data-parallel."""

from __future__ import annotations

import pytest
import torch

from eagle3lib.data.layout import DataError
from eagle3lib.data.readers import open_reader
from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.generation import online
from eagle3lib.generation.capture import prepare_for_run
from eagle3lib.generation.online import OnlineReader
from eagle3lib.params import load_params
from eagle3lib.target.model import Target
from eagle3lib.training import train
from eagle3lib.training.trainer import TrainingError
from tests.test_train import train_interrupted

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6


def recipe(mode: str, **train_overrides) -> dict:
    """zoo:tiny-llama (float32) on raw stdlib code: 2,000 tokens in shards of 300, so that the shuffled
    reading order spans several shards and windows cut samples of 96 tokens. The draft vocab is the whole
    vocabulary: the random target's predictions are tokens the text rarely holds. Training in float32, whose
    products MKL's reproducibility mode makes bit-exact (bf16 autocast, `auto` on AMX CPUs, is not)."""
    settings = {
        "run": {"device": "cpu"},
        "target": {"spec": "zoo:tiny-llama", "dtype": "float32"},
        "data": {"corpus": "stdlib-code", "num_tokens": 2000, "text": "raw", "seq_len": 96, "batch_size": 4,
                 "dtype": "float32", "shard_tokens": 300, "draft_vocab_size": 49152},
        "train": {"data_mode": mode, "dtype": "fp32", "steps": STEPS, "batch_size": 4, "micro_batch_size": 2,
                  "seq_len": 64, "ttt_steps": 3, "lr": 3e-3, "warmup_steps": 2, "log_every": 1,
                  "checkpoint_every": 0, "check_batches": 2,
                  "scratch": {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                              "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                              "max_position_embeddings": 256}},
    }
    settings["train"].update(train_overrides)
    return load_params(None, settings)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """Capture, then train: the reference an online run must reproduce."""
    run_dir = tmp_path_factory.mktemp("offline")
    params = recipe("offline")
    target = Target.load("zoo:tiny-llama", dtype="float32", device="cpu")
    prepare_for_run(target, params, "main", run_dir)
    return run_dir, train.train_arms(params, run_dir / "04_finetune", run_dir)["scratch"]


@pytest.fixture(scope="module")
def online_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("online") / "04_finetune"
    return out, train.train_arms(recipe("online"), out)["scratch"]


def assert_same_curve(a: list[dict], b: list[dict]) -> None:
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "loss_0", "loss_2", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-4 * abs(x[key]) + 1e-6, (x["step"], key, x[key], y[key])
        for key in ("rows", "acc_0", "full_acc_2"):
            assert x[key] == y[key], (x["step"], key)


def test_online_gives_the_offline_loss_curve_on_the_same_text(offline_run, online_run):
    run_dir, offline = offline_run
    out, result = online_run
    folder = out / online.FOLDER
    # the same text and the same vocab map, with no hidden state on disk
    captured = VocabMap.load(run_dir / "00_prepare_data" / "vocab_map.safetensors")
    assert torch.equal(VocabMap.load(folder / "vocab_map.safetensors").d2t, captured.d2t)
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json", "text.safetensors", "token_counts.safetensors", "vocab_map.safetensors"]
    text_bytes = (folder / "text.safetensors").stat().st_size
    assert text_bytes < 9 * 2100 + 1000  # int64 ids and a bool mask per token
    captured_bytes = sum(p.stat().st_size for p in (run_dir / "00_prepare_data").glob("shard_*"))
    assert captured_bytes > 50 * text_bytes
    assert_same_curve(offline.metrics, result.metrics)
    assert result.metrics[-1]["loss"] < result.metrics[0]["loss"]
    assert result.check["loss_0"] == pytest.approx(offline.check["loss_0"], rel=1e-4)
    assert result.check["acc_0"] == offline.check["acc_0"]
    # the drafter names the target that ran in the loop
    assert load_drafter(result.drafter, strict=True)[0].config.verifier == "zoo:tiny-llama"


def test_resume_online_continues_exactly_without_recomputing_skipped_batches(tmp_path, online_run,
                                                                             monkeypatch):
    params = recipe("online", checkpoint_every=3, keep_checkpoints=1)
    train_interrupted(params, tmp_path / "cut", monkeypatch, steps_done=4)  # checkpoint of step 3 on disk
    calls = {"batches": 0}
    forward = OnlineReader._forward

    def counted(self, *args, **kwargs):
        calls["batches"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(OnlineReader, "_forward", counted)
    resumed = train.train_arms(params, tmp_path / "cut", resume=True)["scratch"]
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in online_run[1].metrics]
    # the step-0 check's 2 batches, then steps 4-6: the target computes each batch once, none for steps 1-3
    assert calls["batches"] == 2 + STEPS - 3


def test_a_run_says_how_many_passes_over_the_data_its_steps_make(offline_run, online_run):
    run_dir, offline = offline_run
    out, result = online_run
    stored = open_reader(run_dir / "00_prepare_data")
    streamed = online.online_training_data(recipe("online"), out, torch.device("cpu")).reader
    # counted from the lengths alone: the batches an epoch of that seed yields, packed or one sample a row
    for reader in (stored, streamed):
        for seed, packing in ((0, True), (1, True), (0, False)):
            yielded = reader.batches(4, 64, shuffle=True, seed=seed, drop_last=True, packing=packing)
            assert reader.batches_per_epoch(4, 64, seed, packing) == sum(1 for _ in yielded)
    per_pass = stored.batches_per_epoch(4, 64, 0, True)
    assert per_pass == streamed.batches_per_epoch(4, 64, 0, True) > 0
    assert offline.passes == result.passes == STEPS / per_pass
    log = (out / "scratch" / "log.txt").read_text()
    assert f"one pass over the data is {per_pass:,} batches" in log
    assert f"done after {STEPS / per_pass:.2f} passes over the data" in log


def test_two_processes_online_match_one(tmp_path, online_run):
    params = recipe("online", micro_batch_size=1, nproc=2)
    double = train.train_arms(params, tmp_path / "ddp")["scratch"]
    assert_same_curve(online_run[1].metrics, double.metrics)


def test_a_changed_recipe_does_not_reuse_the_text(tmp_path, online_run):
    out = tmp_path / "04_finetune"
    out.mkdir()
    (out / online.FOLDER).symlink_to(online_run[0] / online.FOLDER)
    with pytest.raises(DataError, match=r"online_data: this online text was made with other settings "
                                        r"\(data.num_tokens 2000 -> 1500\)"):
        train.train_arms(load_params(None, {**recipe("online"), "data": {**recipe("online")["data"],
                                                                             "num_tokens": 1500}}), out)


@pytest.mark.parametrize("overrides, message", [
    ({"data_mode": "streaming"}, "train.data_mode must be offline or online, got 'streaming'"),
    ({"data": "somewhere"}, "train.data and train.target_head name offline data"),
])
def test_bad_online_settings_are_refused(tmp_path, overrides, message):
    with pytest.raises(TrainingError, match=message):
        train.train_arms(recipe("online", **overrides), tmp_path)
