"""`eagle3 check`: every fault that silently breaks a move to a new target, planted in a tiny drafter, is
reported as FAIL or WARN with both values and the fix; the clean pair passes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3lib import cli, files
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.training import audit

DRAFTER = files.REPO_ROOT / "tests" / "fixtures" / "speculate" / "tiny_llama_drafter"
SHIPPED = files.REPO_ROOT / "drafters" / "smollm2-135m-chat"


@pytest.fixture(scope="module")
def tiny_target() -> audit.TargetConfig:
    return audit.TargetConfig.read("zoo:tiny-llama")  # 8 layers, H 64, Vt 49152


def planted(tmp_path, config_change=None, tensors_change=None):
    folder = tmp_path / "drafter"
    shutil.copytree(DRAFTER, folder)
    if config_change:
        raw = json.loads((folder / "config.json").read_text())
        config_change(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    if tensors_change:
        tensors = load_file(folder / "model.safetensors")
        tensors_change(tensors)
        save_file(tensors, folder / "model.safetensors")
    return folder


def row(rows, check: str) -> audit.Row:
    return next(r for r in rows if r.check.startswith(check))


def test_the_clean_pairs_pass(tiny_target, tmp_path):
    rows = audit.audit(planted(tmp_path), tiny_target)
    assert audit.rows_of(rows)["FAIL"] == 0, audit.report(rows)
    shipped = audit.audit(SHIPPED, audit.TargetConfig.read("zoo:smollm2-135m-instruct"))
    assert audit.rows_of(shipped) == {"PASS": len(shipped), "WARN": 0, "FAIL": 0}, audit.report(shipped)


@pytest.mark.parametrize("change, check, status, values, fix", [
    (lambda c: c.update(hidden_size=96), "hidden size", "FAIL", "drafter 96 ≠ target 64", "train one"),
    (lambda c: c.update(target_hidden_size=80), "target hidden size", "FAIL", "drafter 80 ≠ target 64",
     "train one"),
    (lambda c: c.update(vocab_size=32000, draft_vocab_size=256), "target vocab size", "FAIL",
     "drafter 32000 ≠ target 49152", "train one"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 9]), "aux layers within",
     "FAIL", "the target has 8 layers", "do not exist"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]), "aux layer numbering",
     "WARN", "default [1, 3, 4] shifted by +1", "output of layer i"),
    (lambda c: c.update(rope_theta=10000.0), "RoPE θ", "FAIL", "drafter 10000.0 ≠ target 100000.0",
     "rope_theta"),
    (lambda c: c.update(partial_rotary_factor=0.5), "partial rotary", "FAIL", "drafter 0.5", "retrain"),
    (lambda c: c.update(max_position_embeddings=2048), "max positions", "WARN", "2048, target 8192",
     "max_position_embeddings 8192"),
    (lambda c: c.update(norm_before_residual=True), "norms and flags as SGLang", "FAIL",
     "norm_before_residual True", "eagle3 inspect"),
])
def test_each_planted_config_fault_is_reported_with_both_values_and_the_fix(tiny_target, tmp_path, change,
                                                                            check, status, values, fix):
    rows = audit.audit(planted(tmp_path, change), tiny_target)
    found = row(rows, check)
    assert found.status == status and values in found.compared and fix in found.fix, found


def test_vllm_numbering_of_an_sglang_layout_config_is_flagged_for_vllm(tiny_target, tmp_path):
    folder = planted(tmp_path, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 3, 5]))
    found = row(audit.audit(folder, tiny_target, engine="vllm"), "aux layers as vLLM reads them")
    assert found.status == "WARN" and "--to speculators" in found.fix


def test_an_identity_map_stored_as_arange_is_named(tiny_target, tmp_path):
    folder = planted(tmp_path, tensors_change=lambda t: t.update(d2t=torch.arange(256)))
    found = row(audit.audit(folder, tiny_target), "vocab map valid")
    assert found.status == "FAIL" and "the identity map is zeros" in found.compared


def test_a_map_other_than_the_new_datas_and_its_coverage_are_reported(tiny_target, tmp_path):
    folder = planted(tmp_path)
    own = VocabMap.load(folder)
    counts = torch.zeros(49152, dtype=torch.long)
    counts[1000:1256] = 10  # the new data's tokens: none of them in the drafter's map
    counts[own.draft_ids[:10]] = 1
    new = VocabMap.from_counts(counts, 256, 49152)
    rows = audit.audit(folder, tiny_target, data_map=new, counts=counts)
    agreement, coverage = row(rows, "vocab map against"), row(rows, "coverage")
    assert agreement.status == "WARN" and "eagle3 remap" in agreement.fix and "of 256 draft positions" in \
        agreement.compared
    share = float(counts[own.draft_ids].sum() / counts.sum())
    assert share < 0.05 and coverage.status == "WARN"
    assert f"{share:.1%} of the new data's {int(counts.sum()):,} target tokens" in coverage.compared
    same = audit.audit(folder, tiny_target, data_map=own)
    assert row(same, "vocab map against").status == "PASS"


def test_a_drafter_trained_without_thinking_served_with_it_fails(tiny_target, tmp_path):
    folder = planted(tmp_path)
    (folder / "provenance.json").write_text(json.dumps({"recipe": {"data": {"chat_template_kwargs": {}}}}))
    found = row(audit.audit(folder, tiny_target, serve_template_kwargs={"enable_thinking": True}),
                "chat template and thinking mode")
    assert found.status == "FAIL" and "trained with chat_template_kwargs {}" in found.compared
    assert "served with {'enable_thinking': True}" in found.compared
    unknown = row(audit.audit(planted(tmp_path / "b"), tiny_target), "chat template and thinking mode")
    assert unknown.status == "WARN" and "unknown" in unknown.compared


def test_the_command_exits_non_zero_on_a_fail_and_gives_json(tmp_path, capsys):
    clean = planted(tmp_path / "clean")
    assert cli.main(["check", str(clean), "--target", "zoo:tiny-llama", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["status"] for r in rows} <= {"PASS", "WARN"} and all({"check", "compared", "fix"} <= set(r)
                                                                   for r in rows)
    broken = planted(tmp_path / "broken", lambda c: c.update(rope_theta=10000.0))
    assert cli.main(["check", str(broken), "--target", "zoo:tiny-llama"]) == 1
    assert "FAIL  RoPE θ" in capsys.readouterr().out


def test_04_refuses_a_warm_start_that_fails_its_audit_before_any_step(tmp_path):
    from eagle3lib.training import train
    from eagle3lib.training.trainer import TrainingError
    from tests.test_online import recipe

    broken = planted(tmp_path, lambda c: c.update(rope_theta=10000.0))
    params = recipe("online", drafter=str(broken), arms=["drafter"])
    out = tmp_path / "04_finetune"
    with pytest.raises(TrainingError, match="the warm start fails its audit: FAIL  RoPE θ: drafter 10000.0"):
        train.train_arms(params, out)
    assert json.loads((out / train.AUDIT_FILE).read_text()) and not (out / "drafter").exists()
