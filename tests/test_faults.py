"""The fault battery of the commands: shipped files checked where they are used, refusals before anything
is written, one process per arm, arguments that are not values, and messages that name the right thing.
(Regeneration's own faults: tests/test_regenerate.py.)"""

from __future__ import annotations

import gzip
import json
import re
import shutil

import pytest
import torch

from eagle3lib import cli, files
from eagle3lib.data.conversations import ConversationError, read_conversations
from eagle3lib.devices import resolve_device
from eagle3lib.drafter.checkpoint import CheckpointError, load_drafter
from eagle3lib.reports import publish
from eagle3lib.runs import RunExistsError
from eagle3lib.training import train
from eagle3lib.training.loss import step_weights, summarize
from tests.test_train import data_folder, tiny_params  # noqa: F401 (data_folder: a fixture)

DATASET = files.REPO_ROOT / "datasets" / "stdlib-functions-smollm2.jsonl.gz"
DRAFTER = files.REPO_ROOT / publish.DEMO_SOURCE_DRAFTER


def eagle3(capsys, *argv) -> tuple[int, str]:
    """`eagle3 ARGV...` in this process: (exit status, what it printed on stderr)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse refuses an argument
        code = exit_.code
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- 6. shipped files, checked where used


def edited_copy(tmp_path):
    """The shipped code dataset and its manifest, copied, with one reply changed."""
    copy = tmp_path / DATASET.name
    shutil.copy(DATASET, copy)
    shutil.copy(DATASET.with_name("stdlib-functions-smollm2.manifest.json"), tmp_path)
    lines = gzip.decompress(copy.read_bytes()).decode().split("\n")
    record = json.loads(lines[0])
    record["conversations"][-1]["content"] += " (edited)"
    lines[0] = json.dumps(record)
    copy.write_bytes(gzip.compress("\n".join(lines).encode()))
    return copy


def test_an_edited_dataset_is_refused_where_it_is_read_and_accepted_only_on_purpose(tmp_path, capsys):
    copy = edited_copy(tmp_path)
    recorded = r"SHA-256 [0-9a-f]{64} is not the [0-9a-f]{64} recorded in .*manifest\.json.*accept-edit"
    with pytest.raises(ConversationError, match=recorded):
        next(read_conversations(copy))
    code, err = eagle3(capsys, "dataset", str(copy), "--target", "zoo:tiny-llama", "--limit", "1")
    assert code == 2 and "SHA-256" in err and str(copy) in err
    assert eagle3(capsys, "accept-edit", str(copy))[0] == 0
    manifest = json.loads(copy.with_name("stdlib-functions-smollm2.manifest.json").read_text())
    assert manifest["sha256"] == files.file_sha256(copy) and len(manifest["edits_accepted"]) == 1
    assert next(read_conversations(copy)).messages[-1]["content"].endswith("(edited)")


def test_an_edited_published_drafter_is_refused_by_every_load(tmp_path, capsys):
    copy = tmp_path / "drafter"
    shutil.copytree(DRAFTER, copy)
    weights = copy / "model.safetensors"
    stored = bytearray(weights.read_bytes())
    data_start = 8 + int.from_bytes(stored[:8], "little")
    stored[data_start + 2 * ((len(stored) - data_start) // 4)] ^= 1  # one weight's lowest mantissa bit
    weights.write_bytes(bytes(stored))
    with pytest.raises(CheckpointError, match="SHA-256 .* recorded in .*provenance.json"):
        load_drafter(copy)
    code, err = eagle3(capsys, "inspect", str(copy))
    assert code == 2 and "SHA-256" in err
    assert eagle3(capsys, "accept-edit", str(copy))[0] == 0
    assert load_drafter(copy)[1].ok


def test_shipped_manifests_name_a_corpus_and_its_hash_not_a_machines_folder():
    for manifest in (files.REPO_ROOT / "datasets").rglob("*.manifest.json"):
        source = json.loads(manifest.read_text())["source"]
        assert not any(isinstance(v, str) and "/" in v for v in source.values()), manifest
        assert source["corpus"] and (len(source.get("sha256", "")) == 64 or "python" in source), manifest


# ---------------------------------------------------------------- 7. a refused train command writes nothing


@pytest.mark.parametrize("override", ["train.data=/nonexistent/data", "train.steps=-5", "train.batch_size=3",
                                      "train.ttt_steps=0", "train.lr=-0.1", "train.checkpoint_every=-1"])
def test_a_refused_train_leaves_nothing_and_the_corrected_command_runs(tmp_path, capsys, override):
    out = tmp_path / "run" / "04_finetune"
    code, err = eagle3(capsys, "train", "params/smoke.yaml", "-p", override, "-o", str(out))
    assert code == 2 and "error" in err
    assert not (tmp_path / "run").exists(), "nothing written: not params.yaml, not metrics.json"


def test_another_runs_params_name_the_overwrite_flag_that_exists(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "params.yaml").write_text("run: {name: other}\n")
    code, err = eagle3(capsys, "train", "params/smoke.yaml", "-o", str(run / "04_finetune"),
                       "-p", "train.data=tests/fixtures")
    assert code == 2 and "--overwrite" in err and "overwrite=True in a notebook" in err


# ---------------------------------------------------------------- 8. one process trains an arm


def test_a_second_process_training_the_same_arm_is_refused(data_folder, tmp_path):  # noqa: F811
    params = tiny_params(data_folder, steps=2)
    out = tmp_path / "04_finetune"
    with files.held(out / ".scratch.lock", lambda holder: RuntimeError(holder)):  # another process's lock
        with pytest.raises(RunExistsError, match="being trained by another process"):
            train.train_arms(params, out, resume=True)
    assert not (out / "scratch").exists()


# ---------------------------------------------------------------- 9. arguments that are not values


@pytest.mark.parametrize("argv, option", [
    (["dataset", "sharegpt", "--target", "zoo:tiny-llama", "--seq-len", "-5"], "--seq-len"),
    (["dataset", "sharegpt", "--target", "zoo:tiny-llama", "--seq-len", "0"], "--seq-len"),
    (["dataset", "sharegpt", "--target", "t", "--heldout-fraction", "1.5"], "--heldout-fraction"),
    (["dataset", "sharegpt", "--target", "zoo:tiny-llama", "--limit", "-1"], "--limit"),
    (["probe", "d", "--target", "t", "--corpus", "sharegpt", "--num-prompts", "-1"], "--num-prompts"),
    (["regenerate", "sharegpt", "-o", "x.jsonl", "--target", "t", "--limit", "-1"], "--limit"),
    (["regenerate", "sharegpt", "-o", "x.jsonl", "--target", "t", "--chunk", "-3"], "--chunk"),
    (["regenerate", "sharegpt", "-o", "x.jsonl", "--target", "t", "--skip", "-1"], "--skip"),
])
def test_arguments_that_are_not_values_are_refused_naming_the_option(capsys, argv, option):
    code, err = eagle3(capsys, *argv)
    assert code == 2 and f"argument {option}" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_is_a_sentence_not_a_traceback(capsys):
    with pytest.raises(ValueError, match="'cuda' asked for, but this machine runs"):
        resolve_device("cuda")
    code, err = eagle3(capsys, "probe", str(DRAFTER), "--target", "zoo:tiny-llama", "--corpus", "humaneval",
                       "--num-prompts", "1", "--device", "cuda")
    assert code == 2 and "asked for, but this machine runs" in err and "Traceback" not in err


# ---------------------------------------------------------------- 10. messages that name the right thing


def test_a_file_given_as_a_checkpoint_is_named_and_torch_advice_is_never_passed_on(tmp_path, capsys):
    code, err = eagle3(capsys, "inspect", str(DRAFTER / "config.json"))
    assert code == 2 and "config.json is a file, not a drafter checkpoint" in err
    fake = tmp_path / "c"
    shutil.copytree(DRAFTER, fake)
    (fake / "model.safetensors").unlink()
    (fake / "provenance.json").unlink()
    (fake / "pytorch_model.bin").write_text(json.dumps({"not": "weights"}))
    code, err = eagle3(capsys, "inspect", str(fake))
    assert code == 2 and "pytorch_model.bin: not a torch.save file" in err and "it is not loaded" in err
    assert "weights_only" not in err and "False" not in err


def test_a_dangling_link_on_the_output_path_is_named(tmp_path, capsys):
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    code, err = eagle3(capsys, "train", "params/smoke.yaml", "-o", str(tmp_path / "out" / "04_finetune"))
    assert code == 2 and "is a symbolic link to" in err and "which does not exist" in err


@pytest.mark.parametrize("content, message", [
    (b"not json\n{\"turns\": [\"hi\"]}\n", r"q\.jsonl:1: not JSON"),
    (b"\xff\xfe{\"prompt\": \"x\"}\n", r"q\.jsonl: not UTF-8 text"),
])
def test_prompt_files_that_cannot_be_read_are_named(tmp_path, capsys, content, message):
    prompts = tmp_path / "q.jsonl"
    prompts.write_bytes(content)
    code, err = eagle3(capsys, "probe", str(DRAFTER), "--target", "zoo:tiny-llama", "--corpus", str(prompts),
                       "--num-prompts", "1")
    assert code == 2 and re.search(message, err), err


def test_a_gz_that_is_not_gzip_is_named(tmp_path, capsys):
    prompts = tmp_path / "q.jsonl.gz"
    prompts.write_text("plain text")
    code, err = eagle3(capsys, "probe", str(DRAFTER), "--target", "zoo:tiny-llama", "--corpus", str(prompts),
                       "--num-prompts", "1")
    assert code == 2 and "q.jsonl.gz: not a readable gzip file" in err


# ---------------------------------------------------------------- 11. a window without loss tokens


def test_a_window_without_loss_tokens_logs_no_loss_not_a_perfect_one():
    sums = torch.zeros(5, 3, dtype=torch.float64)
    sums[2] = 10  # rows counted, none in the cross-entropy (no target in the draft vocab), none right
    logged = summarize(sums, step_weights(3, 0.8))
    assert logged["loss"] is None and logged["loss_0"] is None and "no loss tokens" in logged["note"]
    assert logged["acc_0"] == 0.0
