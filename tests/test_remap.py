"""lm_head remap between vocab maps: rows land where the new map says, and the built-in proof is exact."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3lib import cli
from eagle3lib.drafter.checkpoint import detect_layout, load_drafter
from eagle3lib.drafter.config import DrafterConfig
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.drafter.vocab import VocabMap, VocabMapError
from eagle3lib.training.remap import (
    RemapError,
    prove_logits_preserved,
    remap_checkpoint,
    remap_drafter,
    remap_rows,
    source_positions,
)

VT, VD = 512, 96
FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "speculators-0.9.0"
NEW_MAP = FIXTURES / "vocab" / "new_map.safetensors"


def random_map(vd: int, seed: int, vt: int = VT) -> VocabMap:
    generator = torch.Generator().manual_seed(seed)
    return VocabMap.from_ids(torch.randperm(vt, generator=generator)[:vd].sort().values, vt, f"map{seed}")


def random_drafter(seed: int, vd: int = VD, dtype=torch.float32, embed_tokens: bool = False) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=128, vocab_size=VT, draft_vocab_size=vd)
    drafter = Eagle3Drafter(config, embed_tokens=embed_tokens).to(dtype)
    # larger than the HF init so logits differ visibly between tokens
    drafter.lm_head.weight.data.normal_(0, 1.0)
    vocab = random_map(vd, seed + 100)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    return drafter.eval()


def with_some_overlap(old: VocabMap, vd: int, seed: int) -> VocabMap:
    """A new map sharing about half of `old`'s tokens, as maps from different data do."""
    generator = torch.Generator().manual_seed(seed)
    keep = old.draft_ids[torch.randperm(old.vd, generator=generator)[: min(vd, old.vd) // 2]]
    others = (~old.t2d).nonzero().flatten()
    extra = others[torch.randperm(others.numel(), generator=generator)[: vd - keep.numel()]]
    return VocabMap.from_ids(torch.cat([keep, extra]).sort().values, old.vt, f"new{seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed, new_vd", [(0, 96), (1, 130), (2, 40)])
def test_proof_holds_exactly_on_random_drafters_and_map_pairs(seed, new_vd, dtype):
    drafter = random_drafter(seed, dtype=dtype)
    old = VocabMap.from_pair(drafter.d2t, drafter.t2d)
    new = with_some_overlap(old, new_vd, seed)
    remapped, report = remap_drafter(drafter, new, missing="random", seed=seed)
    proof = report.proof
    assert proof.passed and proof.max_abs_diff == 0.0 and proof.body_identical
    assert proof.tokens_checked == report.shared == int((old.t2d & new.t2d).sum()) > 0
    assert proof.forward_max_abs_diff < 1e-2  # the sliced full-forward columns, reported for information
    # every shared token's row is bit-for-bit its old row, at its new position
    shared = (old.t2d & new.t2d).nonzero().flatten()
    assert torch.equal(remapped.lm_head.weight[new.target_to_draft[shared]],
                       drafter.lm_head.weight[old.target_to_draft[shared]])
    assert VocabMap.from_pair(remapped.d2t, remapped.t2d) == new
    assert remapped.config.draft_vocab_size == new_vd and remapped.lm_head.weight.shape == (new_vd, 64)
    assert remapped.lm_head.weight.dtype == dtype


def test_a_deliberately_wrong_permutation_is_caught():
    drafter = random_drafter(3)
    new = with_some_overlap(VocabMap.from_pair(drafter.d2t, drafter.t2d), VD, 3)
    remapped, report = remap_drafter(drafter, new)
    assert report.proof.passed
    shared_rows = new.target_to_draft[(new.t2d & drafter.t2d).nonzero().flatten()]
    weight = remapped.lm_head.weight.data
    weight[shared_rows] = weight[shared_rows.roll(1)]  # every shared row one slot off
    wrong = prove_logits_preserved(drafter, remapped)
    assert not wrong.passed and wrong.max_abs_diff > 0.1 and wrong.body_identical
    assert "proof FAILED" in wrong.summary()


def test_a_changed_body_or_a_broken_head_is_caught():
    drafter = random_drafter(4)
    new = with_some_overlap(VocabMap.from_pair(drafter.d2t, drafter.t2d), VD, 4)
    remapped, _ = remap_drafter(drafter, new, prove=False)
    remapped.fc.weight = torch.nn.Parameter(remapped.fc.weight.detach() * (1 + 1e-6))  # not shared any more
    changed = prove_logits_preserved(drafter, remapped)
    assert not changed.passed and not changed.body_identical
    remapped, _ = remap_drafter(drafter, new, prove=False)
    remapped.lm_head.weight = torch.nn.Parameter(torch.full_like(remapped.lm_head.weight, float("nan")))
    broken = prove_logits_preserved(drafter, remapped)
    assert not broken.passed and broken.max_abs_diff != broken.max_abs_diff  # nan


def test_report_counts_on_a_hand_made_pair():
    old = VocabMap.from_ids(torch.tensor([1, 3, 5, 7]), 10)
    new = VocabMap.from_ids(torch.tensor([1, 2, 5, 7, 8]), 10)
    assert source_positions(old, new).tolist() == [0, -1, 2, 3, -1]
    weight = torch.arange(8.0).view(4, 2)
    moved = remap_rows(weight, old, new, missing="zeros")
    assert moved.tolist() == [[0, 1], [0, 0], [4, 5], [6, 7], [0, 0]]
    drafter = random_drafter(5, vd=4)
    drafter.d2t.copy_(VocabMap.from_ids(torch.tensor([1, 3, 5, 7]), VT).d2t)
    drafter.t2d.copy_(VocabMap.from_ids(torch.tensor([1, 3, 5, 7]), VT).t2d)
    _, report = remap_drafter(drafter, VocabMap.from_ids(torch.tensor([1, 2, 5, 7, 8]), VT), missing="zeros")
    assert (report.shared, report.in_place, report.moved, report.filled, report.dropped) == (3, 3, 0, 2, 1)
    assert "3 in place, 2 newly filled (zeros), 1 dropped" in report.summary()
    _, report = remap_drafter(drafter, VocabMap.from_ids(torch.tensor([0, 1, 3, 5]), VT))  # one new id first
    assert (report.in_place, report.moved, report.filled, report.dropped) == (0, 3, 1, 1)


def test_missing_row_policies():
    old = VocabMap.from_ids(torch.tensor([1, 3, 5, 7]), 10)
    new = VocabMap.from_ids(torch.tensor([0, 3, 4, 9]), 10)
    weight = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    filled = torch.tensor([0, 2, 3])  # new positions of tokens 0, 4, 9
    target_head = torch.randn(10, 6)
    verifier = remap_rows(weight, old, new, "verifier", target_head=target_head)
    assert torch.equal(verifier[filled], target_head[[0, 4, 9]]) and torch.equal(verifier[1], weight[1])
    mean = remap_rows(weight, old, new, "mean")
    torch.testing.assert_close(mean[filled], weight.double().mean(0).float().expand(3, 6), rtol=0, atol=1e-6)
    assert torch.equal(remap_rows(weight, old, new, "zeros")[filled], torch.zeros(3, 6))
    first = remap_rows(weight, old, new, "random", seed=7)
    assert torch.equal(first, remap_rows(weight, old, new, "random", seed=7))
    assert not torch.equal(first, remap_rows(weight, old, new, "random", seed=8))
    big = torch.randn(400, 64) * 3
    wide_old = VocabMap.from_ids(torch.arange(400), 1000)
    wide_new = VocabMap.from_ids(torch.arange(200, 1000), 1000)
    random_rows = remap_rows(big, wide_old, wide_new, "random")[200:]
    assert abs(float(random_rows.std()) - float(big.std())) < 0.1


def test_bad_requests_are_refused():
    old = VocabMap.from_ids(torch.tensor([1, 3, 5, 7]), 10, "old.safetensors")
    new = VocabMap.from_ids(torch.tensor([0, 3, 4, 9]), 10, "new.safetensors")
    weight = torch.randn(4, 6)
    with pytest.raises(RemapError, match="missing='verifier' needs the target's lm_head weight for 3 token"):
        remap_rows(weight, old, new, "verifier")
    with pytest.raises(RemapError, match=r"the target's lm_head has shape \[10, 5\]; rows of width H=6"):
        remap_rows(weight, old, new, "verifier", target_head=torch.zeros(10, 5))
    with pytest.raises(RemapError, match="unknown missing-row policy 'copy'; choose one of verifier, mean"):
        remap_rows(weight, old, new, "copy")
    with pytest.raises(RemapError, match=r"lm_head.weight has shape \[5, 6\]; the old map needs \[4, H\]"):
        remap_rows(torch.randn(5, 6), old, new)
    # nothing to fill: no target needed even for 'verifier'
    assert torch.equal(remap_rows(weight, old, old, "verifier"), weight)
    with pytest.raises(VocabMapError, match="new.safetensors: the map is for Vt 10 but the drafter has Vt"):
        remap_drafter(random_drafter(6), new)


def test_the_source_drafter_is_left_as_it_was_and_the_body_is_shared():
    drafter = random_drafter(7)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    new = with_some_overlap(VocabMap.from_pair(drafter.d2t, drafter.t2d), 120, 7)
    remapped, report = remap_drafter(drafter, new)
    assert report.proof.embedding.startswith("random")
    assert not hasattr(drafter, "target_embedding") and not hasattr(remapped, "target_embedding")  # proof's
    assert all(torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    assert remapped.fc.weight.data_ptr() == drafter.fc.weight.data_ptr()
    assert set(remapped.state_dict()) == set(drafter.state_dict())


def test_a_carried_embedding_stays_indexed_by_target_id():
    drafter = random_drafter(8, embed_tokens=True)
    new = with_some_overlap(VocabMap.from_pair(drafter.d2t, drafter.t2d), 80, 8)
    remapped, report = remap_drafter(drafter, new, missing="mean")
    assert torch.equal(remapped.embed_tokens.weight, drafter.embed_tokens.weight)
    assert not remapped.embed_tokens.weight.requires_grad
    assert report.embed_tokens.startswith("carried, kept as is")
    assert report.proof.embedding == "the drafter's own"
    assert report.proof.passed
    target_embedding = torch.randn(VT, 64)
    bare = random_drafter(9)
    bare.attach_embedding(target_embedding)
    remapped, report = remap_drafter(bare, new)
    assert torch.equal(remapped.target_embedding, target_embedding)
    assert report.proof.embedding == "the attached target embedding" and report.proof.passed


# ---------------------------------------------------------------- real checkpoints and `eagle3 remap`


def test_remapped_fixture_drafter_matches_speculators_own_logits_on_shared_tokens():
    """The tiny SGLang-layout drafter, moved onto another map, still gives speculators' reference logits
    (computed by speculators 0.9.0 under the old map) for every token the maps share."""
    drafter, _ = load_drafter(TINY / "sglang_tiny")
    drafter.attach_embedding(load_file(TINY / "sglang_tiny_embed.safetensors")["embed_tokens.weight"])
    reference = load_file(TINY / "sglang_tiny_reference.safetensors")
    new = VocabMap.load(NEW_MAP)
    remapped, report = remap_drafter(drafter, new, missing="zeros")
    assert report.proof.passed and report.proof.embedding == "the attached target embedding"
    old = VocabMap.from_pair(reference["d2t"], reference["t2d"])
    shared = (old.t2d & new.t2d).nonzero().flatten()
    with torch.no_grad():
        logits = remapped(reference["input_ids"], reference["hidden_states"], reference["position_ids"])
    expected = reference["logits_step0"][..., old.target_to_draft[shared]]
    torch.testing.assert_close(logits[..., new.target_to_draft[shared]], expected, rtol=1e-5, atol=1e-5)


def test_cli_remap_writes_each_layout_and_the_report(tmp_path, capsys):
    for name in ("sglang_tiny", "speculators_tiny"):
        out = tmp_path / name
        assert cli.main(["remap", str(TINY / name), "--to-map", str(NEW_MAP), "-o", str(out)]) == 0
        assert "proof PASSED" in capsys.readouterr().out
        assert detect_layout(out) == detect_layout(TINY / name)
        source, _ = load_drafter(TINY / name)
        remapped, load_report = load_drafter(out)  # strict: every key present, nothing unexpected
        new, old = VocabMap.load(NEW_MAP), VocabMap.load(TINY / name)
        assert VocabMap.load(out) == new
        shared = (old.t2d & new.t2d).nonzero().flatten()
        assert torch.equal(remapped.lm_head.weight[new.target_to_draft[shared]],
                           source.lm_head.weight[old.target_to_draft[shared]])
        assert torch.equal(remapped.fc.weight, source.fc.weight)
        if name == "speculators_tiny":
            assert torch.equal(remapped.embed_tokens.weight, source.embed_tokens.weight)
        report = json.loads((out / "remap_report.json").read_text())
        assert report["proof"]["passed"] and report["proof"]["max_abs_diff"] == 0.0
        assert report["shared"] == shared.numel() == {"sglang_tiny": 79, "speculators_tiny": 18}[name]
        assert report["filled"] == report["dropped"] == 96 - shared.numel()
    again = ["remap", str(TINY / "sglang_tiny"), "--to-map", str(NEW_MAP), "-o", str(tmp_path / name)]
    assert cli.main(again) == 2
    assert "exists; a remapped drafter never overwrites" in capsys.readouterr().err


def test_cli_remap_verifier_rows_come_from_the_target_head(tmp_path, capsys):
    head = {"lm_head.weight": torch.randn(VT, 64), "embed_tokens.weight": torch.randn(VT, 64)}
    save_file(head, tmp_path / "target_head.safetensors")
    out = tmp_path / "remapped"
    args = ["remap", str(TINY / "sglang_tiny"), "--to-map", str(NEW_MAP), "--missing", "verifier",
            "--target", str(tmp_path), "-o", str(out)]
    assert cli.main(args) == 0
    report = json.loads((out / "remap_report.json").read_text())
    assert report["proof"]["embedding"] == "the attached target embedding" and report["missing"] == "verifier"
    new, old = VocabMap.load(NEW_MAP), VocabMap.load(TINY / "sglang_tiny")
    only_new = (new.t2d & ~old.t2d).nonzero().flatten()
    remapped, _ = load_drafter(out)
    filled_rows = remapped.lm_head.weight[new.target_to_draft[only_new]]
    assert torch.equal(filled_rows, head["lm_head.weight"][only_new])
    capsys.readouterr()
    save_file({"lm_head.weight": torch.randn(VT, 32), "embed_tokens.weight": torch.randn(VT, 32)},
              tmp_path / "narrow.safetensors")
    args[args.index("--target") + 1] = str(tmp_path / "narrow.safetensors")
    args[-1] = str(tmp_path / "other")
    assert cli.main(args) == 2
    assert "lm_head.weight has shape [512, 32], the drafter needs [Vt 512, H 64]" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_cli_remap_refuses_a_bad_map_naming_the_file(tmp_path, capsys):
    torch.save({"d2t": torch.zeros(96, dtype=torch.int64), "t2d": torch.ones(VT, dtype=torch.bool)},
               tmp_path / "bad.pt")
    args = ["remap", str(TINY / "sglang_tiny"), "--to-map", str(tmp_path / "bad.pt"),
            "-o", str(tmp_path / "x")]
    assert cli.main(args) == 2
    assert "bad.pt: d2t has 96 entries but t2d marks 512 tokens" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- faults (issue 28)


def test_remap_killed_at_its_rename_leaves_a_whole_folder_or_none(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    replace = os.replace

    def killed(before_rename: bool):
        def rename_then_die(source, destination):
            if Path(destination) == out and before_rename:
                raise KeyboardInterrupt
            replace(source, destination)
            if Path(destination) == out:
                raise KeyboardInterrupt
        return rename_then_die

    monkeypatch.setattr(os, "replace", killed(before_rename=True))
    with pytest.raises(KeyboardInterrupt):
        remap_checkpoint(TINY / "sglang_tiny", NEW_MAP, out)
    assert list(tmp_path.iterdir()) == []  # nothing half-written blocks a rerun
    monkeypatch.setattr(os, "replace", killed(before_rename=False))
    with pytest.raises(KeyboardInterrupt):
        remap_checkpoint(TINY / "sglang_tiny", NEW_MAP, out)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "remap_report.json"]
    assert json.loads((out / "remap_report.json").read_text())["proof"]["passed"]


def test_remap_names_a_full_disk(tmp_path, full_disk, capsys):
    out = tmp_path / "out"
    assert cli.main(["remap", str(TINY / "sglang_tiny"), "--to-map", str(NEW_MAP), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"eagle3 remap: error: writing {re.escape(str(tmp_path))}/\.out\.[\w.]+\.tmp/"
                        r"model\.safetensors: No space left on device\n", err), err
    assert list(tmp_path.iterdir()) == []
