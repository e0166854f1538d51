"""A long run carried across machines (`eagle3 relay`, `eagle3 restore`): the relay holds what resuming needs
and little else, each file checked by its hash; the relayed run continues the same data, schedule, step count
and curve, with AdamW afresh and the learning rate rewarmed; what cannot continue correctly is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3lib import files, runs
from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.generation import online
from eagle3lib.training import relay, train
from eagle3lib.training.trainer import STATE_FILE, load_state
from tests.test_curves import BENCHMARKS
from tests.test_online import recipe
from tests.test_train import train_interrupted

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 8


def relay_recipe() -> dict:
    """8 steps, a checkpoint every 3, τ measured at steps 0, 2, 4 and 8; a warmup of 4 steps, so that the
    rewarm after step 6 shows in the learning rates logged at steps 7 and 8."""
    params = recipe("online", steps=STEPS, checkpoint_every=3, keep_checkpoints=1, warmup_steps=4,
                    validation_prompts=2, validation_new_tokens=8, curve_points=3)
    params["evaluate"]["benchmarks"] = BENCHMARKS[:1]
    params["probe"].update(batch_size=2, steps=2, num_draft_tokens=3)
    return params


def trained(run_dir, monkeypatch=None, steps_done: int | None = None):
    """The recipe trained in the run folder `run_dir` (to the end, or stopped after `steps_done` steps)."""
    params = relay_recipe()
    runs.Run.open(run_dir, params)
    if steps_done is None:
        return train.train_arms(params, run_dir / runs.FINETUNE)["scratch"]
    train_interrupted(params, run_dir / runs.FINETUNE, monkeypatch, steps_done=steps_done)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return trained(tmp_path_factory.mktemp("whole") / "run")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped after step 7, its checkpoint of step 6 on disk, and its relay."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        trained(run_dir, monkeypatch, steps_done=7)
    record = relay.save(run_dir, run_dir.parent / "relay", command="eagle3 train params/relay.yaml")
    return run_dir, run_dir.parent / "relay", record


def without_speed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics]


def test_the_relay_holds_the_latest_checkpoint_in_bf16_without_the_moments_or_the_text(stopped):
    run_dir, relay_dir, record = stopped
    carried_arm = record["arms"]["scratch"]
    assert (carried_arm["step"], carried_arm["steps"]) == (6, STEPS)
    arm = relay_dir / runs.FINETUNE / "scratch"
    assert sorted(p.name for p in (arm / "checkpoints").iterdir()) == ["step_000006"]
    state = load_state(arm / "checkpoints" / "step_000006" / STATE_FILE)
    full = load_state(run_dir / runs.FINETUNE / "scratch" / "checkpoints" / "step_000006" / STATE_FILE)
    assert "optimizer" not in state and "optimizer" in full
    assert state["step"] == 6 and state["data"] == full["data"] and state["tokens"] == full["tokens"]
    for folder in [arm / "checkpoints" / "step_000006" / "drafter", *(arm / "points").iterdir()]:
        header = files.read_safetensors_header(folder / "model.safetensors")
        dtypes = {dtype for key, (_, dtype) in header.tensors.items() if key not in ("d2t", "t2d")}
        assert dtypes == {"BF16"}, folder
    # the curve and metrics cut at the checkpoint (the run had logged step 7), the chosen point alone kept
    assert [m["step"] for m in files.read_json_lines(arm / "metrics.jsonl")] == list(range(1, 7))
    points = files.read_json_lines(arm / "curve.jsonl")
    assert [p["step"] for p in points] == [0, 2, 4]
    assert [p.name for p in (arm / "points").iterdir()] == [f"step_{carried_arm['chosen']['step']:06d}"]
    carried = {rel for rel in record["sha256"]}
    assert f"{runs.FINETUNE}/{online.FOLDER}/{online.TEXT_FILE}" not in carried
    assert "params.yaml" in carried and not any(".lock" in rel for rel in carried)
    checkpoints = run_dir / runs.FINETUNE / "scratch" / "checkpoints"
    full_bytes = sum(p.stat().st_size for p in checkpoints.rglob("*") if p.is_file())
    checkpoint_bytes = sum(p.stat().st_size for p in (arm / "checkpoints").rglob("*") if p.is_file())
    assert checkpoint_bytes < full_bytes / 4  # bf16 weights, no moments: a sixth of fp32 weights and moments


def test_a_restored_relay_continues_the_data_schedule_and_curve(tmp_path, whole, stopped):
    _, relay_dir, _ = stopped
    run_dir, record = relay.restore(relay_dir, tmp_path / "restored")
    assert record == relay.read_record(relay_dir)
    folder = run_dir / runs.FINETUNE / online.FOLDER
    assert (folder / online.TEXT_FILE).is_file()  # rebuilt from the corpus, its hash the relay's
    resumed = train.train_arms(relay_recipe(), run_dir / runs.FINETUNE, resume=True)["scratch"]
    assert [m["step"] for m in resumed.metrics] == list(range(1, STEPS + 1))
    assert without_speed(resumed.metrics[:6]) == without_speed(whole.metrics[:6])
    for after, uninterrupted in zip(resumed.metrics[6:], whole.metrics[6:], strict=True):
        # the same batches: the data continues where the relay stopped
        for key in ("tokens", "rows", "real_fraction"):
            assert after[key] == uninterrupted[key], (after["step"], key)
    # the lr logged after steps 7 and 8 is the schedule's for steps 8 and 9, rewarmed from step 6 over 4 steps
    assert resumed.metrics[6]["lr"] == pytest.approx(whole.metrics[6]["lr"] * 2 / 4, rel=1e-12)
    assert resumed.metrics[7]["lr"] == pytest.approx(whole.metrics[7]["lr"] * 3 / 4, rel=1e-12)
    log = (run_dir / runs.FINETUNE / "scratch" / "log.txt").read_text()
    assert "a relay's checkpoint" in log and "AdamW starts afresh" in log
    steps = [p["step"] for p in files.read_json_lines(run_dir / runs.FINETUNE / "scratch" / "curve.jsonl")]
    assert steps == [0, 2, 4, 8]
    assert load_drafter(resumed.drafter, strict=True)[0] is not None


def test_a_changed_or_incomplete_relay_is_refused(tmp_path, stopped):
    _, relay_dir, _ = stopped
    copy = tmp_path / "relay"
    shutil.copytree(relay_dir, copy)
    with pytest.raises(runs.RunExistsError, match="already exists"):
        relay.restore(copy, relay_dir)
    metrics = copy / runs.FINETUNE / "scratch" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + "\n")
    with pytest.raises(relay.RelayError, match="metrics.jsonl: SHA-256 .* changed since the relay was saved"):
        relay.read_record(copy)
    metrics.unlink()
    (copy / "notes.txt").write_text("stray")
    with pytest.raises(relay.RelayError, match=r"files not in relay.json: \['notes.txt'\]; listed but "
                                               r"missing: \['04_finetune/scratch/metrics.jsonl'\]"):
        relay.read_record(copy)


def test_a_relay_whose_text_this_machine_rebuilds_otherwise_is_refused(tmp_path, stopped):
    _, relay_dir, _ = stopped
    shutil.copytree(relay_dir, tmp_path / "relay")
    record = json.loads((tmp_path / "relay" / relay.RELAY_FILE).read_text())
    record["text_sha256"][online.TEXT_FILE] = "0" * 64  # as if another tokenizer had made the relay's text
    (tmp_path / "relay" / relay.RELAY_FILE).write_text(json.dumps(record))
    with pytest.raises(relay.RelayError, match="text.safetensors .* another data order"):
        relay.restore(tmp_path / "relay", tmp_path / "restored")
    assert not (tmp_path / "restored").exists()  # nothing half-made


def test_relaying_a_finished_arm_or_an_older_checkpoint_is_refused(tmp_path, monkeypatch, whole, stopped):
    _, relay_dir, _ = stopped
    finished = Path(whole.folder).parent.parent
    with pytest.raises(relay.RelayError, match=r"finished .*\(eagle3 publish\)"):
        relay.save(finished, tmp_path / "relay", command="x")
    older = tmp_path / "run"
    trained(older, monkeypatch, steps_done=4)  # its latest checkpoint: step 3
    with pytest.raises(relay.RelayError, match="relayed at step 6; .* step 3, older"):
        relay.save(older, relay_dir, command="x")


COMMITTED = sorted(p.parent for p in (runs.REPO_ROOT / "relay").glob("*/relay.json"))


@pytest.mark.parametrize("relay_dir", COMMITTED, ids=lambda p: p.name)
def test_a_committed_relay_holds_exactly_its_files_with_their_hashes(relay_dir):
    record = relay.read_record(relay_dir)
    assert record["run"] == relay_dir.name
    assert (runs.REPO_ROOT / "params" / f"{record['run']}.yaml").is_file()  # the recipe that continues it
    for arm, carried in record["arms"].items():
        checkpoint = relay_dir / runs.FINETUNE / arm / "checkpoints" / f"step_{carried['step']:06d}"
        assert "optimizer" not in load_state(checkpoint / STATE_FILE)
        assert load_drafter(checkpoint / "drafter", strict=True)[0] is not None
