"""TTT loss and the trainer, on a tiny learnable synthetic task built here.

The task: token x_{t+1} = succ(x_t) for a fixed random successor map over 80 of 128 tokens; the aux
states encode x_t, the verifier's last hidden state at p is its lm_head row of x_{p+1} (so its argmax
is the next token). A drafter can learn succ from the embedded token alone.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re

import pytest
import torch

from eagle3lib import devices, runs
from eagle3lib.data import readers
from eagle3lib.data.readers import TrainingData
from eagle3lib.drafter.checkpoint import load_drafter, save_drafter
from eagle3lib.drafter.config import EngineMismatchError
from eagle3lib.drafter.vocab import VocabMap, load_counts
from eagle3lib.generation.capture import DataWriter
from eagle3lib.params import DEFAULTS, load_params
from eagle3lib.reports import publish
from eagle3lib.training import arms, loss, train, trainer
from eagle3lib.training.trainer import (
    STATE_FILE,
    BatchStream,
    Processes,
    Trainer,
    TrainingDiverged,
    TrainingError,
)

VT, VD, H, A, T = 128, 64, 32, 3, 16
SCRATCH = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def synthetic_samples(seed: int = 0, n: int = 32, used: int = 80) -> tuple[dict, dict]:
    """Unshifted samples [n, T, ...] of the task, and the target head they were made with."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(VT, generator=g)[:used]
    succ = torch.arange(VT)
    succ[tokens] = tokens[torch.randperm(used, generator=g)]
    head = {"embed_tokens.weight": torch.randn(VT, H, generator=g), "norm.weight": torch.ones(H),
            "lm_head.weight": torch.randn(VT, H, generator=g)}
    projections = torch.randn(A, VT, H, generator=g)
    x = torch.empty(n, T + 1, dtype=torch.long)
    x[:, 0] = tokens[torch.randint(0, used, (n,), generator=g)]
    for t in range(T):
        x[:, t + 1] = succ[x[:, t]]
    ids = x[:, :T]
    aux = torch.cat([projections[a][ids] for a in range(A)], -1) + 0.1 * torch.randn(n, T, A * H, generator=g)
    last = head["lm_head.weight"][x[:, 1:]] / 2
    loss_mask = torch.ones(n, T, dtype=torch.bool)
    loss_mask[:, :2] = False  # a two-token "prompt"
    samples = {"input_ids": ids, "loss_mask": loss_mask, "aux_hidden_states": aux, "last_hidden_state": last,
               "target_argmax": (last @ head["lm_head.weight"].T).argmax(-1)}
    return samples, head


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory) -> dict:
    """A real data folder (DataWriter's format, float32) of the task, and its vocab map file."""
    samples, head = synthetic_samples()
    folder = tmp_path_factory.mktemp("data") / "synthetic"
    target = {"name": "synthetic", "fingerprint": "0" * 16, "hidden_size": H, "vocab_size": VT,
              "rms_norm_eps": 1e-6}
    with DataWriter(folder, target=target, aux_layer_ids=[0, 1, 2], head=head, dtype=torch.float32) as writer:
        for i in range(len(samples["input_ids"])):
            writer.add(**{key: value[i] for key, value in samples.items()})
        writer.close()
    counts = load_counts(folder / "token_counts.safetensors")
    map_path = VocabMap.from_counts(counts, VD, VT).save(folder.parent / "map.safetensors")
    return {"data": str(folder), "vocab_map": str(map_path)}


def synthetic_data(folders: dict) -> TrainingData:
    settings = {**DEFAULTS["train"], "data": folders["data"], "vocab_map": folders["vocab_map"]}
    return readers.offline_training_data(settings, None)


def tiny_params(folders: dict, **train_overrides) -> dict:
    recipe = {**folders, "steps": 40, "batch_size": 4, "micro_batch_size": 2, "seq_len": T, "lr": 3e-3,
              "warmup_steps": 5, "log_every": 5, "checkpoint_every": 0, "check_batches": 2, "ttt_steps": 4,
              "scratch": SCRATCH}
    recipe.update(train_overrides)
    return load_params(None, {"train": recipe, "run": {"device": "cpu"}})


# ----------------------------------------------------------------------------- loss


def reference_sums(logits: torch.Tensor, batch: dict, head: torch.Tensor, vocab_map: VocabMap):
    """The TTT sums written out row by row from the alignment in docs/formats.md §1 and §5."""
    K, B, R, _ = logits.shape
    verifier = batch["last_hidden_state"] @ head[vocab_map.draft_ids].T
    sums = torch.zeros(5, K, dtype=torch.float64)
    for b in range(B):
        for t in range(R):
            alive = True
            for k in range(K):
                p = t + 1 + k  # verifier position of the token row t predicts at step k: x_{t+2+k}
                if p + 1 > T - 1:  # that token lies past the end
                    break
                target = int(batch["target_argmax"][b, p])
                hit = int(vocab_map.draft_ids[logits[k, b, t].argmax()]) == target
                alive = alive and hit
                if not batch["loss_mask"][b, p + 1]:
                    continue
                sums[2, k] += 1
                sums[3, k] += hit
                sums[4, k] += alive
                if vocab_map.t2d[target]:
                    probs = torch.softmax(verifier[b, p].double(), -1)
                    sums[0, k] += -(probs * torch.log_softmax(logits[k, b, t].double(), -1)).sum()
                    sums[1, k] += 1
    return sums


def test_ttt_sums_match_a_row_by_row_reference(data_folder):
    training = synthetic_data(data_folder)
    batch = next(training.reader.batches(3, T, shuffle=True, seed=1))
    batch["loss_mask"][1, 9] = False  # a hole in the loss mask
    vocab_map, head = training.vocab_map, training.head["lm_head.weight"]
    logits = torch.randn(4, 3, T - 1, VD, generator=torch.Generator().manual_seed(0))
    # make some predictions right, so that hits and chains of hits occur
    right = vocab_map.target_to_draft[batch["target_argmax"]].clamp(min=0)
    for k in range(2):
        logits[k, :, : T - 1 - k] += 8 * torch.nn.functional.one_hot(right[:, 1 + k :], VD)
    targets = loss.Targets.from_batch(batch, head[vocab_map.draft_ids], vocab_map.t2d)
    sums = loss.ttt_sums(logits, targets, vocab_map.draft_ids).detached()
    expected = reference_sums(logits, batch, head, vocab_map)
    torch.testing.assert_close(sums[0], expected[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(sums[1:], expected[1:])
    assert sums[3, 0] > 0 and sums[4, 1] > 0 and sums[3, 3] < sums[2, 3]
    # only the graded rows of each step (what the trainer computes logits for): the same sums, exactly
    graded = [logits[k, :, : T - 1 - k] for k in range(4)]
    assert torch.equal(loss.ttt_sums(graded, targets, vocab_map.draft_ids).detached(), sums)
    with pytest.raises(ValueError, match=r"step 1 logits .* graded rows \[B, 14, Vd\]"):
        loss.ttt_sums([graded[0], graded[0][:, :-3]], targets, vocab_map.draft_ids)


def test_uniform_drafter_scores_ln_vd_and_the_oracle_scores_the_entropy(data_folder):
    training = synthetic_data(data_folder)
    batch = next(training.reader.batches(4, T, shuffle=False, seed=0))
    vocab_map = training.vocab_map
    draft_head = training.head["lm_head.weight"][vocab_map.draft_ids]
    targets = loss.Targets.from_batch(batch, draft_head, vocab_map.t2d)
    weights = loss.step_weights(3, 0.8)
    uniform = loss.ttt_sums(torch.zeros(3, 4, T - 1, VD), targets, vocab_map.draft_ids).detached()
    for k in range(3):
        assert loss.summarize(uniform, weights)[f"loss_{k}"] == pytest.approx(math.log(VD), abs=1e-6)
    # the oracle: row t at step k outputs the verifier's own logits at position t+1+k
    verifier = loss.verifier_draft_logits(batch["last_hidden_state"], draft_head)
    oracle = torch.stack([torch.nn.functional.pad(verifier[:, 1 + k :], (0, 0, 0, k)) for k in range(3)])
    metrics = loss.summarize(loss.ttt_sums(oracle, targets, vocab_map.draft_ids).detached(), weights)
    in_ce = (targets.counted & targets.in_draft)[:, 1:]
    entropy = -(targets.probs * targets.probs.log()).sum(-1)[:, 1:][in_ce]
    assert metrics["loss_0"] == pytest.approx(float(entropy.mean()), rel=1e-5)
    in_draft_share = float(targets.in_draft[:, 1:][targets.counted[:, 1:]].float().mean())
    assert 0.5 < in_draft_share < 1.0
    assert metrics["acc_0"] == pytest.approx(in_draft_share)  # right wherever the draft vocab has the token
    assert metrics["tau"] == pytest.approx(1 + sum(metrics[f"full_acc_{k}"] for k in range(3)))
    assert weights.tolist() == pytest.approx([1.0, 0.8, 0.64])


def test_target_ids_outside_the_maps_vocab_are_refused(data_folder):
    training = synthetic_data(data_folder)
    batch = next(training.reader.batches(2, T, shuffle=False, seed=0))
    batch["target_argmax"][0, 3] = VT + 5
    with pytest.raises(ValueError, match="another target vocabulary"):
        loss.position_masks(batch, training.vocab_map.t2d)


# ----------------------------------------------------------------------------- training


def test_loss_falls_on_a_learnable_task(tmp_path, data_folder):
    results = train.train_arms(tiny_params(data_folder, save_speculators=True), tmp_path)
    result = results["scratch"]
    curve = result.metrics
    assert [m["step"] for m in curve] == list(range(5, 41, 5))
    assert curve[-1]["loss"] < 0.3 * curve[0]["loss"]
    assert result.final_check["acc_0"] > 0.5 > result.check["acc_0"]
    assert result.final_check["metrics"]["tau"] > result.check["metrics"]["tau"]
    assert json.loads((tmp_path / "scratch" / "check.json").read_text())["passed"]
    # the final drafter loads strictly (SGLang layout) and predicts as the trained one did
    drafter, report = load_drafter(result.drafter, strict=True)
    assert report.summary() == "13 loaded, 2 skipped (d2t, t2d), 0 missing, 0 unexpected"
    assert torch.equal(drafter.d2t, synthetic_data(data_folder).vocab_map.d2t)
    same, report = load_drafter(tmp_path / "scratch" / "drafter-speculators", strict=True)
    assert report.layout == "speculators" and torch.equal(same.lm_head.weight, drafter.lm_head.weight)


def test_speculators_copy_names_the_datas_target_and_refuses_what_speculators_cannot_compute(
    tmp_path, data_folder
):
    result = train.train_arms(tiny_params(data_folder, steps=2, save_speculators=True), tmp_path / "ok")
    copy = tmp_path / "ok" / "scratch" / "drafter-speculators"
    raw = json.loads((copy / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "synthetic"  # the manifest's target
    assert load_drafter(result["scratch"].drafter, strict=True)[0].config.verifier == "synthetic"

    # a warm start without the final norm before lm_head: speculators and vLLM always apply it, so the
    # export is refused by name before any step; the internal drafter/ checkpoint alone would be written
    training = synthetic_data(data_folder)
    fresh, _ = arms.init_drafter("scratch", tiny_params(data_folder)["train"], training, seed=0)
    fresh.config.norm_before_lm_head = False
    save_drafter(fresh, tmp_path / "no_final_norm")
    params = tiny_params(data_folder, arms=["drafter"], drafter=str(tmp_path / "no_final_norm"), steps=2,
                         save_speculators=True)
    with pytest.raises(EngineMismatchError, match=r"train\.save_speculators.*vLLM always applies the final "
                       r"norm before lm_head.*speculators always applies"):
        train.train_arms(params, tmp_path / "refused")
    assert not (tmp_path / "refused" / "drafter" / "metrics.jsonl").exists()


def test_frozen_lm_head_stays_the_targets_rows(tmp_path, data_folder):
    result = train.train_arms(tiny_params(data_folder, steps=3, train_lm_head=False), tmp_path)["scratch"]
    drafter, _ = load_drafter(result.drafter, strict=True)
    training = synthetic_data(data_folder)
    assert torch.equal(drafter.lm_head.weight, training.head["lm_head.weight"][training.vocab_map.draft_ids])
    fresh, _ = arms.init_drafter("scratch", tiny_params(data_folder)["train"], training, seed=0)  # untrained
    assert not torch.equal(drafter.fc.weight, fresh.fc.weight)


def test_a_cpu_run_trims_the_heap_after_every_step(tmp_path, data_folder, monkeypatch):
    trims = []
    monkeypatch.setattr(trainer, "trim_heap", lambda: trims.append(1) or True)
    train.train_arms(tiny_params(data_folder, steps=3), tmp_path)
    assert len(trims) == 3


def _trained_drafter(tmp_path, data_folder) -> str:
    return train.train_arms(tiny_params(data_folder), tmp_path / "source")["scratch"].drafter


def _other_map(vocab_map: VocabMap) -> VocabMap:
    """A map built from other counts: mostly the same tokens, at shifted draft positions."""
    counts = torch.zeros(VT, dtype=torch.long)
    counts[vocab_map.draft_ids[4:]] = 10  # drop the 4 lowest ids, add the 4 highest unused
    counts[(~vocab_map.t2d).nonzero().flatten()[-4:]] = 5
    return VocabMap.from_counts(counts, VD, VT)


def test_step0_check_catches_a_shuffled_map_and_passes_after_remap(tmp_path, data_folder):
    source = _trained_drafter(tmp_path, data_folder)
    training = synthetic_data(data_folder)
    moved = TrainingData(**{**training.__dict__, "vocab_map": _other_map(training.vocab_map)})
    assert int((moved.vocab_map.draft_ids == training.vocab_map.draft_ids).sum()) < 10
    params = tiny_params(data_folder, drafter=source, allow_no_remap=True)
    checks = {}
    for arm in ("drafter", "drafter-no-remap"):
        drafter, report = arms.init_drafter(arm, params["train"], moved, seed=0)
        trainer = Trainer(drafter, moved, params["train"], 0, tmp_path / arm, Processes())
        metrics, baseline = trainer.evaluate(trainer.check_batches())
        checks[arm] = arms.diagnose(metrics, baseline, VD, warm_start=True)
        assert ("proof PASSED" in report) == (arm == "drafter")
    assert checks["drafter"].passed, checks["drafter"].message
    assert checks["drafter"].loss_0 < 0.5 * math.log(VD)
    assert not checks["drafter-no-remap"].passed
    assert checks["drafter-no-remap"].loss_0 >= math.log(VD)
    assert "vocab maps" in checks["drafter-no-remap"].message

    # a checkpoint whose lm_head rows do not fit its own map is stopped before any step
    broken, _ = load_drafter(source, strict=True)
    with torch.no_grad():
        broken.lm_head.weight.copy_(broken.lm_head.weight.roll(7, dims=0))
    save_drafter(broken, tmp_path / "broken")
    params = tiny_params(data_folder, arms=["drafter"], drafter=str(tmp_path / "broken"))
    with pytest.raises(arms.StepZeroCheckFailed, match="aux layer ids"):
        train.train_arms(params, tmp_path / "out")
    assert not (tmp_path / "out" / "drafter" / "metrics.jsonl").exists()


def test_no_remap_arm_needs_the_explicit_flag(data_folder):
    with pytest.raises(TrainingError, match="allow_no_remap"):
        arms.init_drafter("drafter-no-remap", tiny_params(data_folder, drafter="x")["train"],
                           synthetic_data(data_folder), seed=0)


def test_drafter_for_another_target_is_refused(tmp_path, data_folder):
    source, _ = load_drafter(_trained_drafter(tmp_path, data_folder), strict=True)
    source.config.aux_layer_ids = [2, 5, 7]
    save_drafter(source, tmp_path / "other_aux")
    params = tiny_params(data_folder, drafter=str(tmp_path / "other_aux"))
    with pytest.raises(TrainingError, match=r"aux layers \[2, 5, 7\].*\[0, 1, 2\]"):
        arms.init_drafter("drafter", params["train"], synthetic_data(data_folder), seed=0)


def train_interrupted(params: dict, out, monkeypatch, steps_done: int) -> None:
    """Train `params` into `out` and stop it (KeyboardInterrupt) after `steps_done` optimizer steps."""
    calls = {"n": 0}
    original = BatchStream.next

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == steps_done + 1:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(BatchStream, "next", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.train_arms(params, out)
    monkeypatch.setattr(BatchStream, "next", original)


def test_resume_continues_bit_for_bit(tmp_path, data_folder, monkeypatch):
    params = tiny_params(data_folder, steps=8, log_every=1, checkpoint_every=3, keep_checkpoints=1)
    whole = train.train_arms(params, tmp_path / "whole")["scratch"]

    train_interrupted(params, tmp_path / "cut", monkeypatch, steps_done=5)  # checkpoint of step 3 on disk
    folder = tmp_path / "cut" / "scratch"
    assert [p.name for p in (folder / "checkpoints").iterdir()] == ["step_000003"]
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 5
    with pytest.raises(runs.RunExistsError, match="--resume"):
        train.train_arms(params, tmp_path / "cut")
    resumed = train.train_arms(params, tmp_path / "cut", resume=True)["scratch"]

    assert [m["step"] for m in resumed.metrics] == list(range(1, 9))
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in whole.metrics]
    a, _ = load_drafter(whole.drafter)
    b, _ = load_drafter(resumed.drafter)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    changed = tiny_params(data_folder, steps=8, log_every=2, checkpoint_every=3, lr=1e-3)
    (folder / "summary.json").unlink()
    with pytest.raises(TrainingError, match="differ from the checkpoint's in lr"):
        train.train_arms(changed, tmp_path / "cut", resume=True)


class PoisonedReader:
    """A data reader whose third shuffled batch has NaN aux states."""

    def __init__(self, reader):
        self.reader = reader

    def __getattr__(self, name):  # all else is the wrapped reader's
        return getattr(self.reader, name)

    def batches(self, batch_size, seq_len, shuffle, seed, **reading):
        for i, batch in enumerate(self.reader.batches(batch_size, seq_len, shuffle, seed, **reading)):
            if shuffle and i == 2:
                batch = {**batch, "aux_hidden_states": batch["aux_hidden_states"] * float("nan")}
            yield batch


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_folder):
    training = synthetic_data(data_folder)
    training = TrainingData(**{**training.__dict__, "reader": PoisonedReader(training.reader)})
    with pytest.raises(TrainingDiverged, match=r"step 3 .*after step 2.*step_000002"):
        train.train_arm("scratch", tiny_params(data_folder, steps=10), tmp_path, training,
                        Processes())
    last_good = tmp_path / "scratch" / "checkpoints" / "step_000002"
    assert [p.name for p in last_good.parent.iterdir()] == ["step_000002"]
    saved, report = load_drafter(last_good / "drafter", strict=True)
    assert report.ok
    assert all(torch.isfinite(t).all() for t in saved.state_dict().values() if t.is_floating_point())


def test_bad_settings_are_refused(tmp_path, data_folder):
    with pytest.raises(TrainingError, match="multiple of train.micro_batch_size"):
        train.train_arms(tiny_params(data_folder, batch_size=3), tmp_path / "a")
    with pytest.raises(TrainingError, match="fewer than batch_size=64"):
        train.train_arms(tiny_params(data_folder, batch_size=64, micro_batch_size=64), tmp_path / "b")
    with pytest.raises(TrainingError, match="each must be one of"):
        train.train_arms(tiny_params(data_folder, arms=["warm"]), tmp_path / "c")
    with pytest.raises(TrainingError, match=r"train.micro_batch_size must be an integer >= 1, got 0"):
        train.train_arms(tiny_params(data_folder, micro_batch_size=0), tmp_path / "c")
    with pytest.raises(TrainingError, match="train.dtype must be auto, fp32 or bf16"):
        train.train_arms(tiny_params(data_folder, dtype="fp16"), tmp_path / "c")
    assert not (tmp_path / "c").exists()
    other_vt = VocabMap.from_ids(torch.arange(VD), VT + 1).save(tmp_path / "other_vt.safetensors")
    with pytest.raises(ValueError, match=str(VT + 1)):
        train.train_arms(tiny_params(data_folder, vocab_map=str(other_vt)), tmp_path / "d")


def test_eagle3_train_command_trains_the_recipes_arms_and_refuses_to_overwrite(tmp_path, data_folder, capsys):
    """`eagle3 train`: a recipe file with a run-relative ('@') vocab map, -p overrides, output per arm."""
    import shutil

    import yaml

    from eagle3lib import cli

    run_dir = tmp_path / "run"
    (run_dir / "02_diff_vocab_maps").mkdir(parents=True)
    shutil.copy(data_folder["vocab_map"], run_dir / "02_diff_vocab_maps" / "map.safetensors")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "run": {"device": "cpu"},
        "train": {"data": data_folder["data"], "vocab_map": "@02_diff_vocab_maps/map.safetensors",
                  "steps": 4, "batch_size": 2, "micro_batch_size": 2, "seq_len": T, "warmup_steps": 1,
                  "log_every": 2, "checkpoint_every": 0, "check_batches": 1, "ttt_steps": 2,
                  "scratch": SCRATCH},
    }))
    out = run_dir / "04_finetune"
    arguments = ["train", str(recipe), "-o", str(out), "-p", "train.arms=[scratch]"]
    assert cli.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "eagle3 train: After 4 optimizer steps on the same data: scratch: loss_0" in printed
    drafter, report = load_drafter(out / "scratch" / "drafter", strict=True)
    assert report.summary() == "13 loaded, 2 skipped (d2t, t2d), 0 missing, 0 unexpected"
    assert torch.equal(drafter.d2t, VocabMap.load(data_folder["vocab_map"]).d2t)
    assert cli.main(arguments) == 2  # the finished arm is kept, not trained over
    assert "already holds a finished arm" in capsys.readouterr().err


# ----------------------------------------------------------------------------- faults (issue 28)


class PlantedCode:
    """What a pickle can carry: rebuilding it by an unsafe unpickler runs code (here, it writes `marker`)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_resume_reads_the_training_state_weights_only_and_refuses_planted_code(tmp_path, data_folder,
                                                                               monkeypatch):
    params = tiny_params(data_folder, steps=6, log_every=1, checkpoint_every=2, keep_checkpoints=1)
    train_interrupted(params, tmp_path, monkeypatch, steps_done=3)  # the checkpoint of step 2 on disk
    state_file = tmp_path / "scratch" / "checkpoints" / "step_000002" / STATE_FILE
    state = torch.load(state_file, weights_only=True)  # what the trainer writes needs no code to read
    assert state["step"] == 2 and isinstance(state["rng"]["numpy"][1], list)
    marker = tmp_path / "ran"
    torch.save({**state, "rng": PlantedCode(marker)}, state_file)
    with pytest.raises(TrainingError, match=rf"^{re.escape(str(state_file))}: refused, it needs exec, which "
                       "only an unsafe unpickler rebuilds"):
        train.train_arms(params, tmp_path, resume=True)
    assert not marker.exists()


def without_speed(entries: list[dict]) -> list[dict]:
    """metrics.jsonl entries without tokens_per_s, the one wall-clock number in them."""
    return [{key: value for key, value in entry.items() if key != "tokens_per_s"} for entry in entries]


def test_resume_logs_exactly_what_the_uninterrupted_run_logs(tmp_path, data_folder, monkeypatch):
    """The entry of step 4 spans the checkpoint of step 3: its sums come from both runs. A kill before the
    first checkpoint restarts at step 0 with metrics.jsonl afresh, not with steps logged twice."""
    params = tiny_params(data_folder, steps=8, log_every=2, checkpoint_every=3, keep_checkpoints=1)
    whole = train.train_arms(params, tmp_path / "whole")["scratch"].metrics
    assert [m["step"] for m in whole] == [2, 4, 6, 8]
    for cut, steps_done in (("after_checkpoint", 5), ("before_checkpoint", 2)):
        train_interrupted(params, tmp_path / cut, monkeypatch, steps_done=steps_done)
        resumed = train.train_arms(params, tmp_path / cut, resume=True)["scratch"].metrics
        assert without_speed(resumed) == without_speed(whole), cut
    metrics = tmp_path / "before_checkpoint" / "scratch" / "metrics.jsonl"
    log = metrics.with_name("log.txt").read_text()
    assert f"starting at step 0, {metrics} afresh" in log
    # each leg names its precision: `auto` follows the machine, which may change between legs
    precision = "float32" if trainer.autocast_dtype("auto", torch.device("cpu")) is None else "bf16 autocast"
    assert f"scratch: steps 1..8 in {precision} (train.dtype auto; {devices.machine_description()})" in log
    resumed_log = (tmp_path / "after_checkpoint" / "scratch" / "log.txt").read_text()
    assert f"scratch: steps 4..8 in {precision}" in resumed_log
    # a leg resumed from a checkpoint does not initialise and check again: the first leg's report stands
    first_check = json.loads((tmp_path / "whole" / "scratch" / "check.json").read_text())
    assert resumed_log.count("[scratch] initialisation:") == 1
    assert resumed_log.count(first_check["message"]) == 2
    assert "[scratch] resuming: initialised and checked when the run began" in resumed_log
    summary = json.loads((tmp_path / "after_checkpoint" / "scratch" / "summary.json").read_text())
    assert summary["check"] == first_check
    assert log.count("[scratch] initialisation:") == 2  # no checkpoint: the run began again at step 0


def test_a_torn_metrics_line_is_dropped_on_resume_and_a_broken_one_is_named(tmp_path, data_folder,
                                                                           monkeypatch, capsys):
    params = tiny_params(data_folder, steps=8, log_every=1, checkpoint_every=3, keep_checkpoints=1)
    whole = train.train_arms(params, tmp_path / "whole")["scratch"].metrics
    run, out = tmp_path / "run", tmp_path / "run" / "04_finetune"
    train_interrupted(params, out, monkeypatch, steps_done=5)
    metrics = out / "scratch" / "metrics.jsonl"
    with metrics.open("a") as handle:  # the disk filled up during this append
        handle.write('{"step": 6, "lr": 0.002, "grad_norm": 0.')
    capsys.readouterr()
    resumed = train.train_arms(params, out, resume=True)["scratch"]
    assert (f"resume: dropped the torn last line of {metrics} (40 characters without their newline)"
            in capsys.readouterr().out)
    assert without_speed(resumed.metrics) == without_speed(whole)
    # a line broken elsewhere is refused naming the file and the line: by notebook 04, publish and resume
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], lines[1][:50], *lines[2:]]) + "\n")
    named = rf"^{re.escape(str(metrics))}, line 2: not valid JSON \("
    with pytest.raises(ValueError, match=named):
        _ = resumed.metrics
    (run / "metrics.json").write_text("{}")
    with pytest.raises(ValueError, match=named):
        publish.publish(run, "scratch", tmp_path / "published", command="test")
    (metrics.parent / "summary.json").unlink()
    with pytest.raises(ValueError, match=named):
        train.train_arms(params, out, resume=True)


def test_resume_after_the_final_drafter_was_saved_finishes_the_arm(tmp_path, data_folder, monkeypatch):
    params = tiny_params(data_folder, steps=6, log_every=2, checkpoint_every=2, save_speculators=True)
    whole = train.train_arms(params, tmp_path / "whole")["scratch"]
    saved = train.save_drafter

    def killed_after_the_rename(drafter, path, *args, **kwargs):
        saved(drafter, path, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "save_drafter", killed_after_the_rename)
    with pytest.raises(KeyboardInterrupt):
        train.train_arms(params, tmp_path / "cut")
    monkeypatch.setattr(train, "save_drafter", saved)
    folder = tmp_path / "cut" / "scratch"
    assert (folder / "drafter").is_dir() and not (folder / "summary.json").exists()
    resumed = train.train_arms(params, tmp_path / "cut", resume=True)["scratch"]
    assert without_speed(resumed.metrics) == without_speed(whole.metrics)
    for name in ("drafter", "drafter-speculators"):
        a, b = load_drafter(tmp_path / "whole" / "scratch" / name)[0], load_drafter(folder / name)[0]
        for (key, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(x, y), (name, key)
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


class FullDisk(io.BytesIO):
    """A file on a full disk: every write fails as the system's write does."""

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_names_the_file_being_written(tmp_path, data_folder, monkeypatch, full_disk):
    """safetensors reports a full disk as a SafetensorError, torch.save as "enforce fail at
    inline_container.cc"; the user reads which file and why, and no staging is left behind."""
    params = tiny_params(data_folder, steps=4, checkpoint_every=2)
    file = r"checkpoints/\.step_000002\.[\w.]+\.tmp/\.drafter\.[\w.]+\.tmp/model\.safetensors"
    with pytest.raises(OSError, match=rf"^writing \S+/{file}: No space left on device$"):
        train.train_arms(params, tmp_path / "a")
    monkeypatch.undo()
    monkeypatch.setattr(trainer, "open", lambda file, mode: FullDisk(), raising=False)
    with pytest.raises(OSError, match=rf"^writing \S+/{STATE_FILE}: No space left on device$"):
        train.train_arms(params, tmp_path / "b")
    for out in (tmp_path / "a", tmp_path / "b"):
        assert list((out / "scratch" / "checkpoints").iterdir()) == []


def test_resume_appends_to_no_symlinked_log(tmp_path, data_folder, monkeypatch):
    params = tiny_params(data_folder, steps=6, checkpoint_every=2)
    train_interrupted(params, tmp_path / "run", monkeypatch, steps_done=3)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    log = tmp_path / "run" / "scratch" / "log.txt"
    log.unlink()
    log.symlink_to(outside)
    with pytest.raises(OSError, match=rf"^{re.escape(str(log))} is a symbolic link; a run appends only"):
        train.train_arms(params, tmp_path / "run", resume=True)
    assert outside.read_text() == "not the run's\n"


def test_a_dangling_symlink_as_output_is_named(tmp_path, data_folder, capsys):
    out = tmp_path / "link"
    out.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match=rf"^{re.escape(str(out))} is a symbolic link to "
                       rf"{re.escape(str(tmp_path / 'nowhere'))}, which does not exist, not a folder"):
        train.train_arms(tiny_params(data_folder, steps=2), out)


# ----------------------------------------------------------------------------- L2-SP


def test_l2sp_adds_the_penalty_gradient_lambda_times_the_distance_from_the_warm_start(data_folder, tmp_path):
    training = synthetic_data(data_folder)
    params = tiny_params(data_folder, l2sp=0.25)
    drafter, _ = arms.init_drafter("scratch", params["train"], training, seed=0)
    fitted = trainer.Trainer(drafter, training, params["train"], 0, tmp_path, trainer.Processes(), log=print)
    with torch.no_grad():  # moved away from where it started
        for weight in fitted.parameters:
            weight.add_(torch.randn_like(weight) * 0.1)
    penalty = sum(0.5 * 0.25 * (w - a).pow(2).sum() for w, a in zip(fitted.parameters, fitted.anchors,
                                                                    strict=True))
    expected = torch.autograd.grad(penalty, fitted.parameters)
    for weight in fitted.parameters:
        weight.grad = torch.zeros_like(weight)
    fitted.add_l2sp_gradient()
    for weight, want, anchor in zip(fitted.parameters, expected, fitted.anchors, strict=True):
        torch.testing.assert_close(weight.grad, want)
        torch.testing.assert_close(weight.grad, 0.25 * (weight.detach() - anchor))
    assert fitted.l2sp_penalty() == pytest.approx(float(penalty), rel=1e-6)


def test_l2sp_zero_trains_bit_for_bit_as_without_it_and_a_penalty_changes_the_weights(data_folder, tmp_path):
    def trained(**overrides):
        params = tiny_params(data_folder, steps=6, dtype="fp32", **overrides)
        training = synthetic_data(data_folder)
        drafter, _ = arms.init_drafter("scratch", params["train"], training, seed=0)
        out = tmp_path / f"l2sp-{overrides.get('l2sp', 'absent')}"
        out.mkdir()
        fitted = trainer.Trainer(drafter, training, params["train"], 0, out, trainer.Processes(), log=print)
        fitted.fit()
        return fitted.drafter.state_dict()

    plain, zero, pulled = trained(), trained(l2sp=0.0), trained(l2sp=10.0)
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
    assert not all(torch.equal(plain[k], pulled[k]) for k in plain)
