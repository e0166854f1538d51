"""eagle3lib against EAGLE-3.1 drafters written by the reference projects themselves (issue 15).

The fixtures under tests/fixtures/reference/ were made by tests/fixtures/reference/make_fixtures.py with
SpecForge 0.2.0 and speculators 0.9.0 (see provenance.json): a SpecForge training checkpoint
(`training_state.pt`, weights under `draft_state_dict`, the run's draft config beside it), SpecForge's own
SGLang export of it, and a speculators `save_pretrained` folder, each with the logits the reference library
computed on a fixed input. Neither library is needed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3lib.cli import main as cli_main
from eagle3lib.drafter.checkpoint import CheckpointError, convert, load_drafter, read_tensors
from eagle3lib.drafter.config import EngineMismatchError
from eagle3lib.drafter.inspection import inspect_checkpoint

REFERENCE = Path(__file__).parent / "fixtures" / "reference"
PROVENANCE = json.loads((REFERENCE / "provenance.json").read_text())
RUN = REFERENCE / "specforge-run"
STEP = RUN / "tiny31-step4"
DRAFT_CONFIG = RUN / "draft_config.json"
TOLERANCE = 1e-5
# weights: fc, 3 fc_norm, 10 in the decoder layer, norm, lm_head; + embed_tokens in speculators' folder
FIXTURES = {
    "specforge-export": dict(path=REFERENCE / "specforge-export", config=None, layout="sglang", feed=False,
                             summary="16 loaded, 2 skipped (d2t, t2d), 0 missing, 0 unexpected"),
    "specforge-run": dict(path=STEP, config=DRAFT_CONFIG, layout="sglang", feed=False,
                          summary="16 loaded, 2 skipped (d2t, t2d), 0 missing, 0 unexpected"),
    "speculators": dict(path=REFERENCE / "speculators", config=None, layout="speculators", feed=True,
                        summary="17 loaded (10 renamed), 2 skipped (d2t, t2d), 0 missing, 0 unexpected"),
}


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    return load_file(REFERENCE / "inputs.safetensors")


def reference_logits(name: str) -> tuple[torch.Tensor, int]:
    file = REFERENCE / "logits" / f"{name}.safetensors"
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor("logits"), int(handle.metadata()["first_position"])


def eagle3lib_logits(drafter, inputs: dict, first_position: int, steps: int) -> torch.Tensor:
    ids = inputs["input_ids"]
    positions = torch.arange(first_position, first_position + ids.shape[1])[None]
    with torch.no_grad():
        logits, _ = drafter.unroll(ids, inputs["hidden_states"], steps, positions)
    return logits[:, 0]


def load(name: str, inputs: dict, path: Path | None = None):
    """The fixture loaded strictly in float32 (SpecForge exports bfloat16), with the target embedding."""
    spec = FIXTURES[name]
    drafter, report = load_drafter(path or spec["path"], strict=True, config=spec["config"],
                                   dtype=torch.float32)
    if not drafter.owns_embedding:
        drafter.attach_embedding(inputs["embedding"])
    return drafter, report


def test_fixtures_are_small_and_recorded():
    files = [p for p in REFERENCE.rglob("*") if p.is_file() and not p.is_symlink()]
    assert sum(p.stat().st_size for p in files) < 1_000_000
    assert PROVENANCE["versions"]["specforge"] == "0.2.0"
    assert PROVENANCE["versions"]["speculators"] == "0.9.0"
    assert PROVENANCE["source_sha256"]["specforge"] and PROVENANCE["source_sha256"]["speculators"]
    # SpecForge's CheckpointManager layout: the step folder, its rank file and the run's latest link
    assert (STEP / "training_state.pt").is_file() and (STEP / "training_state_rank0.pt").is_file()
    assert not (STEP / "config.json").exists() and not (STEP / "model.safetensors").exists()


@pytest.mark.parametrize("name", FIXTURES)
def test_strict_load_matches_reference_logits(name, inputs, one_torch_thread):
    spec = FIXTURES[name]
    drafter, report = load(name, inputs)
    assert report.summary() == spec["summary"]
    assert report.ok and report.layout == spec["layout"]
    config = drafter.config
    assert config.fc_norm and config.norm_before_lm_head  # EAGLE-3.1 as each project writes it
    assert config.feed_normed_hidden is spec["feed"]
    assert not config.norm_before_residual
    expected, first_position = reference_logits(name)
    ours = eagle3lib_logits(drafter, inputs, first_position, expected.shape[0])
    assert ours.shape == expected.shape
    assert (ours - expected).abs().max().item() <= TOLERANCE


def test_specforge_checkpoint_report_and_export_agree(inputs):
    """The training state's notes, and SpecForge's export is its checkpoint in bfloat16, tensor for tensor."""
    _, report = load("specforge-run", inputs)
    assert report.files == ["training_state.pt"]
    assert f"config from {DRAFT_CONFIG}" in report.notes
    assert any(n.startswith("training_state.pt: epoch 1, global_step 4") for n in report.notes)
    state, export = stored_tensors("specforge-run"), stored_tensors("specforge-export")
    assert sorted(state) == sorted(export)
    for key, tensor in state.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(export[key], expected), key


def test_specforge_checkpoint_without_config_names_the_way_out(tmp_path):
    """A SpecForge 0.2 step folder carries no config.json; without one beside the run the error says so."""
    step = tmp_path / "run" / STEP.name
    step.mkdir(parents=True)
    (step / "training_state.pt").write_bytes((STEP / "training_state.pt").read_bytes())
    with pytest.raises(CheckpointError, match=r"no config\.json.*--config PATH"):
        load_drafter(step)
    # the run's draft config as the run folder's config.json is found without being named
    (tmp_path / "run" / "config.json").write_text(DRAFT_CONFIG.read_text())
    _, report = load_drafter(step)
    assert report.summary() == FIXTURES["specforge-run"]["summary"]


def stored_tensors(name: str) -> dict[str, torch.Tensor]:
    """The tensors as the reference library wrote them (SpecForge's `draft_state_dict` for its checkpoint)."""
    if name == "specforge-run":
        return read_tensors(STEP / "training_state.pt")[0]
    return read_tensors(FIXTURES[name]["path"] / "model.safetensors")[0]


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_tensors(first: dict, second: dict) -> None:
    assert sorted(first) == sorted(second)
    for key in first:
        assert first[key].dtype == second[key].dtype, key
        assert torch.equal(first[key], second[key]), key


@pytest.mark.parametrize("name", ["specforge-export", "specforge-run"])
def test_specforge_drafters_round_trip_through_speculators(name, inputs, tmp_path, one_torch_thread):
    spec = FIXTURES[name]
    there, back = tmp_path / "speculators", tmp_path / "sglang"
    convert(spec["path"], there, "speculators", config=spec["config"], target_embedding=inputs["embedding"],
            verifier="tiny-llama-verifier")
    convert(there, back, "sglang")
    original = stored_tensors(name)
    speculators_copy, round_trip = tensors_of(there), tensors_of(back)
    assert torch.equal(speculators_copy.pop("embed_tokens.weight"), inputs["embedding"].to(
        speculators_copy["fc.weight"].dtype))
    renamed = {key.replace("layers.0.", "midlayer."): t for key, t in speculators_copy.items()}
    assert_same_tensors(renamed, original)
    # the speculators copy carried the target's embedding, and a drafter that owns one keeps it
    embedding = inputs["embedding"].to(round_trip["fc.weight"].dtype)
    assert torch.equal(round_trip.pop("embed_tokens.weight"), embedding)
    assert_same_tensors(round_trip, original)
    # the same function in every copy; the speculators copy carries the target embedding in the checkpoint's
    # dtype (bfloat16 for SpecForge's export, checked above), the reference ran with the float32 one
    expected, first_position = reference_logits(name)
    for folder in (there, back):
        drafter, report = load_drafter(folder, strict=True, dtype=torch.float32)
        assert report.ok
        if drafter.owns_embedding:
            with torch.no_grad():
                drafter.embed_tokens.weight.copy_(inputs["embedding"])
        else:
            drafter.attach_embedding(inputs["embedding"])
        assert drafter.config.fc_norm and drafter.config.norm_before_lm_head
        assert not drafter.config.feed_normed_hidden
        ours = eagle3lib_logits(drafter, inputs, first_position, expected.shape[0])
        assert (ours - expected).abs().max().item() <= TOLERANCE


def test_speculators_drafter_round_trips_through_sglang(inputs, tmp_path, one_torch_thread):
    """speculators' EAGLE-3.1 drafter feeds norm(out) forward, which SpecForge cannot: an SGLang-layout export
    is refused naming it, written for SGLang and vLLM, and comes back to the same tensors and config."""
    source = FIXTURES["speculators"]["path"]
    with pytest.raises(EngineMismatchError, match="SpecForge always feeds the pre-norm state"):
        convert(source, tmp_path / "refused", "sglang")
    assert not (tmp_path / "refused").exists()
    there, back = tmp_path / "sglang", tmp_path / "speculators"
    convert(source, there, "sglang", engines=("SGLang", "vLLM"))
    convert(there, back, "speculators", engines=("vLLM", "speculators"))
    original = tensors_of(source)
    renamed = {key.replace("layers.0.", "midlayer."): t for key, t in original.items()}
    assert_same_tensors(tensors_of(there), renamed)  # the drafter's own embedding stays with it
    assert_same_tensors(tensors_of(back), original)
    raw = json.loads((back / "config.json").read_text())
    reference = json.loads((source / "config.json").read_text())
    for key in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc", "draft_vocab_size",
                "eagle_aux_hidden_state_layer_ids"):
        assert raw[key] == reference[key], key
    assert raw["speculators_config"]["verifier"] == reference["speculators_config"]["verifier"]
    expected, first_position = reference_logits("speculators")
    drafter, _ = load_drafter(there, strict=True)
    if not drafter.owns_embedding:
        drafter.attach_embedding(inputs["embedding"])
    assert drafter.config.feed_normed_hidden
    ours = eagle3lib_logits(drafter, inputs, first_position, expected.shape[0])
    assert (ours - expected).abs().max().item() <= TOLERANCE


def test_cli_inspect_and_convert_a_specforge_checkpoint(inputs, tmp_path, capsys, one_torch_thread):
    assert cli_main(["inspect", str(STEP), "--config", str(DRAFT_CONFIG)]) == 0
    shown = capsys.readouterr().out
    assert f"{STEP}: sglang layout" in shown
    assert "fc_norm True, norm_before_lm_head True, feed_normed_hidden False" in shown
    assert "SpecForge: faithful" in shown
    assert FIXTURES["specforge-run"]["summary"] in shown
    assert "training_state.pt: epoch 1, global_step 4" in shown

    out = tmp_path / "served"
    arguments = ["convert", str(STEP), "--config", str(DRAFT_CONFIG), "--to", "sglang", "-o", str(out)]
    assert cli_main(arguments) == 0
    assert FIXTURES["specforge-run"]["summary"] in capsys.readouterr().out
    assert_same_tensors(tensors_of(out), stored_tensors("specforge-run"))
    info = inspect_checkpoint(out)
    assert info["report"]["ok"] and info["layout"] == "sglang"
    drafter, _ = load_drafter(out, strict=True)
    drafter.attach_embedding(inputs["embedding"])
    expected, first_position = reference_logits("specforge-run")
    ours = eagle3lib_logits(drafter, inputs, first_position, expected.shape[0])
    assert (ours - expected).abs().max().item() <= TOLERANCE
