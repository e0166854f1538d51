"""Drafter checkpoints: both layouts, every weight format, strict reports, refusals, atomic saves, CLI."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3lib import cli
from eagle3lib.drafter import checkpoint
from eagle3lib.drafter.checkpoint import CheckpointError, load_drafter, save_drafter
from eagle3lib.drafter.config import (
    ConfigError,
    DrafterConfig,
    aux_ids_from_vllm,
    aux_ids_to_vllm,
    default_aux_layer_ids,
    read_config,
    to_sglang_dict,
    to_speculators_dict,
)
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.drafter.vocab import VocabMap
from tests.tiny import tiny_drafter_config

FIXTURES = Path(__file__).parent / "fixtures" / "speculators-0.9.0"
CLEAN = "13 loaded, 2 skipped (d2t, t2d), 0 missing, 0 unexpected"


def project_drafter(dtype: torch.dtype = torch.float32, **overrides) -> Eagle3Drafter:
    config = tiny_drafter_config(
        **{"vocab_size": 80, "draft_vocab_size": 20, "target_hidden_size": 24, "norm_before_residual": True,
           **overrides}
    )
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    vocab = VocabMap.from_ids(torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values, 80)
    drafter.d2t.copy_(vocab.d2t)
    drafter.t2d.copy_(vocab.t2d)
    drafter = drafter.to(dtype)
    # the target's embedding, which a speculators-layout save writes as embed_tokens.weight
    drafter.attach_embedding(torch.randn(config.vocab_size, config.hidden_size).to(dtype))
    return drafter


def logits_of(drafter: Eagle3Drafter, embedding: torch.Tensor | None) -> torch.Tensor:
    if embedding is not None and not drafter.owns_embedding:
        drafter.attach_embedding(embedding)
    torch.manual_seed(3)
    c = drafter.config
    input_ids = torch.randint(0, c.vocab_size, (2, 6))
    aux = torch.randn(2, 6, c.fc_in_features).to(drafter.fc.weight.dtype)
    with torch.no_grad():
        return drafter(input_ids, aux)


def rewrite_tensors(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def rewrite_config(folder: Path, change) -> None:
    raw = json.loads((folder / "config.json").read_text())
    change(raw)
    (folder / "config.json").write_text(json.dumps(raw))


# ----------------------------------------------------------------------------- the fixtures


def test_loads_the_sglang_fixture_with_a_clean_report():
    drafter, report = load_drafter(FIXTURES / "sglang_tiny")
    assert report.layout == "sglang" and report.ok
    assert report.summary() == CLEAN
    assert [key for key, _ in report.skipped] == ["d2t", "t2d"] and not report.renamed
    assert any("norm_before_residual absent" in note for note in report.notes)
    assert drafter.config.norm_before_residual is False and drafter.config.aux_layer_ids == [1, 3, 4]
    ref = load_file(FIXTURES / "sglang_tiny_reference.safetensors")
    assert torch.equal(drafter.d2t, ref["d2t"]) and torch.equal(drafter.t2d, ref["t2d"])
    drafter.attach_embedding(load_file(FIXTURES / "sglang_tiny_embed.safetensors")["embed_tokens.weight"])
    with torch.no_grad():
        logits = drafter(ref["input_ids"], ref["hidden_states"])
    torch.testing.assert_close(logits, ref["logits_step0"], atol=1e-5, rtol=1e-5)


def test_loads_the_speculators_fixture_with_renames_reported():
    drafter, report = load_drafter(FIXTURES / "speculators_tiny")
    assert report.layout == checkpoint.detect_layout(FIXTURES / "speculators_tiny") == "speculators"
    # embed_tokens.weight is carried, so it counts as loaded: 13 + 1
    assert report.summary() == "14 loaded (10 renamed), 2 skipped (d2t, t2d), 0 missing, 0 unexpected"
    assert ("layers.0.hidden_norm.weight", "midlayer.hidden_norm.weight") in report.renamed
    assert "renamed     layers.0.self_attn.q_proj.weight → midlayer.self_attn.q_proj.weight" in str(report)
    assert drafter.owns_embedding and drafter.config.norm_before_residual is True
    assert drafter.config.aux_layer_ids == [1, 3, 4]  # [2, 4, 5] in the file, speculators numbering
    ref = load_file(FIXTURES / "speculators_tiny_reference.safetensors")
    with torch.no_grad():
        logits, _ = drafter.unroll(ref["input_ids"], ref["hidden_states"], steps=3)
    torch.testing.assert_close(logits, ref["logits_all_steps"], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fixture", ["sglang_tiny", "speculators_tiny"])
def test_round_trip_through_the_other_layout_is_identical(tmp_path, fixture):
    source = FIXTURES / fixture
    first = "speculators" if fixture == "sglang_tiny" else "sglang"
    second = "sglang" if first == "speculators" else "speculators"
    original, _ = load_drafter(source)
    embedding = torch.randn(512, 64)
    if fixture == "sglang_tiny":  # the speculators layout carries the target's embedding
        embedding = load_file(FIXTURES / "sglang_tiny_embed.safetensors")["embed_tokens.weight"]
        original.attach_embedding(embedding)
    save_drafter(original, tmp_path / "a", first)
    middle, middle_report = load_drafter(tmp_path / "a")
    assert middle_report.layout == first and middle_report.ok
    save_drafter(middle, tmp_path / "b", second)
    final, final_report = load_drafter(tmp_path / "b")
    assert final_report.layout == second and final_report.ok

    before, after = load_file(source / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    if fixture == "sglang_tiny":  # now carried, as the speculators copy had it
        assert torch.equal(after.pop("embed_tokens.weight"), embedding)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    assert final.config == original.config
    assert torch.equal(logits_of(original, embedding), logits_of(final, embedding))
    assert torch.equal(logits_of(original, embedding), logits_of(middle, embedding))


def test_project_checkpoint_round_trip_keeps_bf16_and_layout_keys(tmp_path):
    drafter = project_drafter(torch.bfloat16)
    save_drafter(drafter, tmp_path / "s", "sglang")
    save_drafter(drafter, tmp_path / "v", "speculators")
    sglang_keys = set(load_file(tmp_path / "s" / "model.safetensors"))
    speculators_keys = set(load_file(tmp_path / "v" / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in sglang_keys and "layers.0.hidden_norm.weight" in speculators_keys
    # the attached target embedding: written into the speculators layout only (SGLang takes the target's)
    renamed = {k.replace("layers.0.", "midlayer.") for k in speculators_keys}
    assert renamed == sglang_keys | {"embed_tokens.weight"}
    assert len(sglang_keys) == 15 and "embed_tokens.weight" not in sglang_keys
    loaded, report = load_drafter(tmp_path / "v")
    assert report.summary() == "14 loaded (10 renamed), 2 skipped (d2t, t2d), 0 missing, 0 unexpected"
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.embed_tokens.weight, drafter.target_embedding)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert torch.equal(logits_of(drafter, None), logits_of(loaded, None))


def test_written_configs_state_every_flag_and_convert_aux_ids(tmp_path):
    drafter = project_drafter()
    save_drafter(drafter, tmp_path / "s", "sglang")
    save_drafter(drafter, tmp_path / "v", "speculators")
    sglang = json.loads((tmp_path / "s" / "config.json").read_text())
    speculators = json.loads((tmp_path / "v" / "config.json").read_text())
    for raw in (sglang, speculators):
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
            assert flag in raw
        assert raw["norm_before_residual"] is True and raw["draft_vocab_size"] == 20
    # a standard drafter: SpecForge's default (true) and SGLang's/vLLM's (false) both mean the standard model
    assert "norm_output" not in sglang and speculators["norm_output"] is False
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"] and sglang["num_hidden_layers"] == 1
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert speculators["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert speculators["speculators_model_type"] == "eagle3"
    assert speculators["transformer_layer_config"]["vocab_size"] == 80


def test_written_rope_settings_parse_the_same_in_transformers():
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = project_drafter(rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=131072).config
    sglang = LlamaConfig.from_dict(to_sglang_dict(config))
    layer = LlamaConfig.from_dict(to_speculators_dict(config)["transformer_layer_config"])
    assert sglang.rope_parameters == layer.rope_parameters == {**scaling, "rope_theta": 500000.0}


def test_configs_read_back_equal(tmp_path):
    scaling = {"type": "linear", "factor": 2.0}  # legacy "type" key is normalised
    config = tiny_drafter_config(
        num_key_value_heads=4, vocab_size=80, draft_vocab_size=80, target_hidden_size=None,
        aux_layer_ids=None, rope_scaling=scaling, verifier="some/target",
    )
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    for layout, raw in (("sglang", to_sglang_dict(config)), ("speculators", to_speculators_dict(config))):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        read, read_layout, notes = read_config(tmp_path)
        assert read_layout == layout
        assert read == config  # the SGLang layout keeps the verifier under eagle3lib_speculation
        assert any("eagle_aux_hidden_state_layer_ids" in note for note in notes)
    assert "eagle_aux_hidden_state_layer_ids" not in to_sglang_dict(config)["eagle_config"]
    assert "speculators_config" not in to_sglang_dict(config)  # vLLM would read it as the other layout


def test_missing_norm_before_residual_follows_each_engine(tmp_path):
    raw = to_speculators_dict(project_drafter(norm_before_residual=False).config)
    del raw["norm_before_residual"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config, _, notes = read_config(tmp_path)
    assert config.norm_before_residual is True and any("as vLLM reads" in note for note in notes)


def test_aux_layer_id_conventions():
    assert default_aux_layer_ids(61) == [1, 29, 57]  # Kimi / DeepSeek
    assert default_aux_layer_ids(30) == [1, 14, 26]  # SmolLM2-135M
    assert aux_ids_to_vllm([1, 29, 57]) == [2, 30, 58] and aux_ids_from_vllm([2, 30, 58]) == [1, 29, 57]
    with pytest.raises(ConfigError, match="give aux_layer_ids explicitly"):
        default_aux_layer_ids(5)


def test_config_for_target_copies_the_target_shape():
    from transformers import LlamaConfig

    target = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_hidden_layers=8,
        vocab_size=512,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    )
    config = DrafterConfig.for_target(target, draft_vocab_size=96)
    assert config.aux_layer_ids == [1, 3, 4] and config.fc_in_features == 192
    assert (config.rope_theta, config.rope_scaling, config.rms_norm_eps) == (1e5, None, 1e-5)
    assert (config.vocab_size, config.draft_vocab_size, config.num_key_value_heads) == (512, 96, 2)


# ----------------------------------------------------------------------------- strict loading and reports


def test_renamed_key_fails_strict_and_is_reported_otherwise(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    rewrite_tensors(
        tmp_path / "c",
        lambda t: t.__setitem__(
            "midlayer.post_attn_norm.weight", t.pop("midlayer.post_attention_layernorm.weight")
        ),
    )
    with pytest.raises(CheckpointError) as failure:
        load_drafter(tmp_path / "c")
    message = str(failure.value)
    assert "missing midlayer.post_attention_layernorm.weight" in message
    assert "unexpected midlayer.post_attn_norm.weight" in message
    drafter, report = load_drafter(tmp_path / "c", strict=False)
    assert report.missing == ["midlayer.post_attention_layernorm.weight"]
    assert report.unexpected == ["midlayer.post_attn_norm.weight"]
    assert report.summary() == "12 loaded, 2 skipped (d2t, t2d), 1 missing, 1 unexpected" and not report.ok
    norm = drafter.midlayer.post_attention_layernorm.weight
    assert not norm.is_meta and torch.equal(norm, torch.ones(32))  # freshly initialised, as reported
    assert torch.isfinite(logits_of(drafter, torch.randn(80, 32))).all()


def test_stale_rope_buffers_are_skipped_and_duplicates_unexpected(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    rewrite_tensors(
        tmp_path / "c", lambda t: t.__setitem__("midlayer.self_attn.rotary_emb.inv_freq", torch.ones(4))
    )
    _, report = load_drafter(tmp_path / "c")
    assert report.summary() == "13 loaded, 3 skipped (d2t, midlayer.self_attn.rotary_emb.inv_freq, t2d), " + (
        "0 missing, 0 unexpected"
    )
    rewrite_tensors(tmp_path / "c", lambda t: t.__setitem__("layers.0.hidden_norm.weight", torch.ones(32)))
    with pytest.raises(CheckpointError, match="unexpected midlayer.hidden_norm.weight"):
        load_drafter(tmp_path / "c")


def test_config_contradicting_lm_head_names_the_field(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    rewrite_tensors(tmp_path / "c", lambda t: t.__setitem__("lm_head.weight", torch.randn(24, 32)))
    with pytest.raises(
        CheckpointError,
        match=r"lm_head.weight: expected \[20, 32\], found \[24, 32\] "
        r"\(rows = draft_vocab_size 20 in config.json\)",
    ):
        load_drafter(tmp_path / "c")
    _, report = load_drafter(tmp_path / "c", strict=False)
    assert report.mismatched == [("lm_head.weight", [20, 32], [24, 32])] and report.missing == []
    assert report.summary().endswith("1 shape-mismatched")


def test_vocab_map_contradictions_are_refused(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    rewrite_config(tmp_path / "c", lambda raw: raw.__setitem__("vocab_size", 70))
    with pytest.raises(CheckpointError, match=r"t2d has length 80 but config vocab_size \(Vt\) is 70"):
        load_drafter(tmp_path / "c", strict=False)

    save_drafter(project_drafter(), tmp_path / "d", "sglang")

    def break_d2t(tensors):
        tensors["d2t"][3] += 1

    rewrite_tensors(tmp_path / "d", break_d2t)
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        load_drafter(tmp_path / "d", strict=False)


def test_a_missing_vocab_map_is_missing(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    rewrite_tensors(tmp_path / "c", lambda t: (t.pop("d2t"), t.pop("t2d")))
    with pytest.raises(CheckpointError, match="missing d2t; missing t2d"):
        load_drafter(tmp_path / "c")
    save_drafter(project_drafter(), tmp_path / "d", "sglang")
    rewrite_tensors(tmp_path / "d", lambda t: t.pop("t2d"))
    drafter, report = load_drafter(tmp_path / "d")
    assert report.summary() == "13 loaded, 1 skipped (d2t), 0 missing, 0 unexpected"
    assert "t2d absent: derived from d2t" in report.notes
    assert torch.equal(drafter.t2d, project_drafter().t2d)


def test_nan_weights_name_the_tensor(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    rewrite_tensors(
        tmp_path / "c", lambda t: t["midlayer.mlp.up_proj.weight"].__setitem__((0, 1), float("nan"))
    )
    with pytest.raises(CheckpointError, match="midlayer.mlp.up_proj.weight holds 1 NaN and 0 Inf"):
        load_drafter(tmp_path / "c", strict=False)
    drafter = project_drafter()
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match="fc.weight holds 0 NaN and 1 Inf"):
        save_drafter(drafter, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_corrupt_files_are_named(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    (tmp_path / "c" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        load_drafter(tmp_path / "c")
    save_drafter(project_drafter(), tmp_path / "d", "sglang")
    (tmp_path / "d" / "model.safetensors").unlink()
    (tmp_path / "d" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(
        CheckpointError, match=r"pytorch_model.bin: not (readable as a weights-only torch|a torch.save) file"
    ):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text("{broken")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_drafter(tmp_path / "d")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, r"architectures=\['LlamaForCausalLM'\] is not an EAGLE-3"),
        ({"norm_before_fc": True}, "norm_before_fc=true is not supported"),
        ({"num_hidden_layers": 2}, "num_hidden_layers=2; eagle3lib supports one-layer"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
    ],
)
def test_refused_configs_name_the_option_and_file(tmp_path, change, message):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    rewrite_config(tmp_path / "c", lambda raw: raw.update(change))
    with pytest.raises(ConfigError, match=message) as failure:
        load_drafter(tmp_path / "c")
    assert str(tmp_path / "c" / "config.json") in str(failure.value)


def test_refused_speculators_options(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "speculators")
    rewrite_config(tmp_path / "c", lambda raw: raw.update(norm_before_fc=True))
    with pytest.raises(ConfigError, match="norm_before_fc=true"):
        load_drafter(tmp_path / "c")
    rewrite_config(tmp_path / "c", lambda raw: raw.update(norm_before_fc=False, speculators_model_type="mtp"))
    with pytest.raises(ConfigError, match="speculators_model_type='mtp'"):
        load_drafter(tmp_path / "c")


# ----------------------------------------------------------------------------- weight formats


def test_pytorch_bin_and_sharded_safetensors_load_the_same(tmp_path):
    drafter = project_drafter()
    save_drafter(drafter, tmp_path / "ref", "sglang")
    tensors = load_file(tmp_path / "ref" / "model.safetensors")
    config = (tmp_path / "ref" / "config.json").read_text()

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(config)
    torch.save(tensors, tmp_path / "bin" / "pytorch_model.bin")

    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "config.json").write_text(config)
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[:7], keys[7:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, tmp_path / "shards" / name)
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "shards" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    for folder in ("bin", "shards"):
        loaded, report = load_drafter(tmp_path / folder)
        assert report.summary() == CLEAN, folder
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(tensor, loaded.state_dict()[name]), (folder, name)
    assert load_drafter(tmp_path / "shards")[1].files[0] == "model.safetensors.index.json"

    (tmp_path / "shards" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is listed"):
        load_drafter(tmp_path / "shards")


def test_specforge_training_state(tmp_path):
    """SpecForge's epoch folder: model.safetensors + config.json + training_state.pt (optimizer state)."""
    drafter = project_drafter()
    save_drafter(drafter, tmp_path / "epoch_0_step_10", "sglang")
    folder = tmp_path / "epoch_0_step_10"
    params = [p.detach().clone().requires_grad_() for p in drafter.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    state = {
        "epoch": 0,
        "global_step": 10,
        "args": argparse.Namespace(learning_rate=1e-4, ttt_length=7, output_dir="out"),
        "optimizer_state_dict": optimizer.state_dict(),
        "scheduler_state_dict": {"last_epoch": 10},
    }
    torch.save(state, folder / "training_state.pt")
    loaded, report = load_drafter(folder)
    assert report.summary() == CLEAN
    assert (
        "training_state.pt: epoch 0, global_step 10, optimizer state for 13 tensors, lr 0.0001"
        in report.notes
    )

    with pytest.raises(CheckpointError, match="holds no model weights .*draft_state_dict"):
        load_drafter(folder / "training_state.pt")

    # a training state that does carry the weights (wrapped as SpecForge's training model names them)
    weights = {f"draft_model.{k}": v for k, v in load_file(folder / "model.safetensors").items()}
    torch.save({**state, "model_state_dict": weights}, folder / "training_state.pt")
    (folder / "model.safetensors").unlink()
    from_state, report = load_drafter(folder)
    assert report.files == ["training_state.pt"] and report.summary() == CLEAN
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, from_state.state_dict()[name]), name


def test_pickled_objects_are_not_executed(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    (tmp_path / "c" / "model.safetensors").unlink()
    torch.save({"weights": tensors, "callback": Path("x")}, tmp_path / "c" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only an unsafe unpickler rebuilds .* it is not loaded"):
        load_drafter(tmp_path / "c")


# ----------------------------------------------------------------------------- atomic saves


def test_saves_never_overwrite_or_leave_half_a_folder(tmp_path, monkeypatch):
    drafter = project_drafter()
    save_drafter(drafter, tmp_path / "c")
    before = (tmp_path / "c" / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        save_drafter(project_drafter(norm_before_residual=False), tmp_path / "c")
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == before

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_config", fail)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(drafter, tmp_path / "d")
    with pytest.raises(OSError, match="disk full"):
        save_drafter(drafter, tmp_path / "c", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no d, no temporary folders
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == before
    monkeypatch.undo()

    save_drafter(drafter, tmp_path / "c", "speculators", overwrite=True)
    assert checkpoint.detect_layout(tmp_path / "c") == "speculators"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# ----------------------------------------------------------------------------- CLI


def test_cli_inspect_reports_13_loaded_2_skipped(tmp_path, capsys):
    save_drafter(project_drafter(), tmp_path / "c", "sglang")
    assert cli.main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert CLEAN in out
    assert "aux layer ids [1, 3, 4] (eagle3lib/SGLang numbering) = [2, 4, 5] (speculators/vLLM)" in out
    assert "midlayer.self_attn.q_proj.weight" in out and "[32, 64]  float32" in out
    assert "vocab map: d2t and t2d present and consistent; Vd 20 of Vt 80" in out

    assert cli.main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["report"]["summary"] == CLEAN and len(info["tensors"]) == 15
    assert info["config"]["norm_before_residual"] is True and info["layout"] == "sglang"

    rewrite_tensors(tmp_path / "c", lambda t: t.pop("norm.weight"))
    assert cli.main(["inspect", str(tmp_path / "c")]) == 1
    assert "MISSING     norm.weight" in capsys.readouterr().out


def test_cli_convert(tmp_path, capsys):
    out_dir = tmp_path / "converted"
    source = str(FIXTURES / "sglang_tiny")
    # speculators needs the verifier (its from_pretrained reads the verifier's config) and the embedding,
    # which an SGLang-layout drafter does not carry
    assert cli.main(["convert", source, "--to", "speculators", "-o", str(out_dir)]) == 2
    assert "verifier.name_or_path is unknown" in capsys.readouterr().err and not out_dir.exists()
    drafter, _ = load_drafter(source)
    with pytest.raises(CheckpointError, match="needs the target's token embedding"):
        save_drafter(drafter, tmp_path / "no-embedding", "speculators")
    embedding = load_file(FIXTURES / "sglang_tiny_embed.safetensors")["embed_tokens.weight"]
    (tmp_path / "target").mkdir()
    head = {"embed_tokens.weight": embedding, "lm_head.weight": torch.zeros(512, 64)}
    save_file(head, tmp_path / "target" / "target_head.safetensors")
    target = ["--target", str(tmp_path / "target" / "target_head.safetensors")]
    # the embedding alone is not enough: speculators reads the verifier's config from name_or_path
    assert cli.main(["convert", source, "--to", "speculators", "-o", str(out_dir), *target]) == 2
    assert "verifier.name_or_path is unknown" in capsys.readouterr().err and not out_dir.exists()
    assert not (tmp_path / "no-embedding").exists()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    target = ["--target", str(tmp_path / "target")]
    assert cli.main(["convert", source, "--to", "speculators", "-o", str(out_dir), *target]) == 0
    assert "13 loaded, 2 skipped (d2t, t2d)" in capsys.readouterr().out
    assert checkpoint.detect_layout(out_dir) == "speculators"
    raw = json.loads((out_dir / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str((tmp_path / "target").resolve())
    assert torch.equal(load_file(out_dir / "model.safetensors")["embed_tokens.weight"], embedding)
    assert cli.main(["convert", str(FIXTURES / "sglang_tiny"), "--to", "sglang", "-o", str(out_dir)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "nowhere"), "--to", "sglang", "-o", str(tmp_path / "x")]) == 2


# ----------------------------------------------------------------------------- faults (issue 28)


def test_integer_weights_are_refused_by_name(tmp_path):
    save_drafter(project_drafter(), tmp_path / "c")
    rewrite_tensors(tmp_path / "c", lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.int32)}))
    for strict in (True, False):
        with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor fc\.weight is int32; the "
                           r"drafter's fc\.weight takes floating-point weights"):
            load_drafter(tmp_path / "c", strict=strict)


@pytest.mark.parametrize("change, message", [
    (lambda raw: raw.update(hidden_size="abc"), "config.json: hidden_size must be a whole number, got 'abc'"),
    (lambda raw: raw.update(hidden_size=64.5), "config.json: hidden_size must be a whole number, got 64.5"),
    (lambda raw: raw.update(rms_norm_eps=[1e-6]), "config.json: rms_norm_eps must be a number, got [1e-06]"),
    (lambda raw: raw["eagle_config"].update(eagle_aux_hidden_state_layer_ids=["one", 3, 4]),
     "config.json (eagle_config): eagle_aux_hidden_state_layer_ids must be a whole number, got 'one'"),
    (lambda raw: raw["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1.5, 3, 4]),
     "config.json (eagle_config): eagle_aux_hidden_state_layer_ids must be a whole number, got 1.5"),
    (lambda raw: raw["eagle3lib_speculation"]["proposal_methods"][0].update(speculative_tokens="x"),
     "config.json (eagle3lib_speculation): speculative_tokens must be a whole number, got 'x'"),
])
def test_non_numbers_in_a_config_name_the_file_and_key(tmp_path, change, message):
    save_drafter(project_drafter(), tmp_path / "c")
    rewrite_config(tmp_path / "c", change)
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_config(tmp_path / "c")


def test_convert_names_a_full_disk_and_a_dangling_output_link(tmp_path, capsys, monkeypatch, full_disk):
    source = str(FIXTURES / "sglang_tiny")
    assert cli.main(["convert", source, "--to", "sglang", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"eagle3 convert: error: writing {re.escape(str(tmp_path))}/\.out\.[\w.]+\.tmp/"
                        r"model\.safetensors: No space left on device\n", err), err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    assert cli.main(["convert", source, "--to", "sglang", "-o", str(link)]) == 2
    assert capsys.readouterr().err == (
        f"eagle3 convert: error: {link} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist; "
        "refusing to overwrite a checkpoint (pass overwrite=True)\n"
    )


def test_inspect_into_a_closed_pipe_ends_quietly():
    """`eagle3 inspect ... | head`: the reader leaves early; no BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        command = [sys.executable, "-m", "eagle3lib.cli", "inspect", str(FIXTURES / "sglang_tiny")]
        done = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")
