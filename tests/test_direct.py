"""The direct decoder (`target.direct`) computes what Hugging Face's layers do, in every Llama-like family."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle3lib.decoding.batches import TargetBatch
from eagle3lib.decoding.speculate import decode_target_only
from eagle3lib.target import direct
from eagle3lib.target.model import pack_linears
from tests.tiny import count_compiled_steps

SHAPE = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128}
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),  # biased q, k and v projections
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE)),  # each head normed before the rotation
}
AUX = [0, 2]


def tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family]().float().eval()
    with torch.no_grad():  # norms and biases away from their initial 1 and 0, so that a missed one shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
    return model


def two_forwards(batch: TargetBatch, route_direct: bool) -> list[torch.Tensor]:
    """A prefill of 3 rows, one left-padded, then a step of 2 new tokens: the states and aux of both."""
    saved = batch._direct
    batch._direct = saved if route_direct else None
    cache = DynamicCache(config=batch.model.config)
    ids = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()[None].repeat(3, 1, 1)
    allowed[1, :, :3] = False  # row 1 is left-padded by 3, its padding sees itself
    allowed[1, torch.arange(3), torch.arange(3)] = True
    positions = torch.arange(7).repeat(3, 1)
    positions[1] = (positions[1] - 3).clamp(min=0)
    try:
        out = list(batch._forward(ids, allowed, positions, cache=cache, states=True))
        step = torch.cat([allowed[:, -1:].expand(3, 2, 7), torch.ones(2, 2, dtype=torch.bool).tril()[None]
                          .expand(3, 2, 2)], dim=2)
        out += batch._forward(ids[:, :2], step, positions[:, -1:] + torch.tensor([[1, 2]]), cache=cache)
    finally:
        batch._direct = saved
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_direct_decoder_is_hf_bit_for_bit_where_nothing_is_fused(family):
    """Unpacked float32 weights: every kernel but the rotation's and the norm's is HF's own, and those two are
    exact rewrites, so states, aux states and logits are equal bit for bit, prefill and step."""
    model = tiny(family)
    batch = TargetBatch(model, AUX)
    assert batch._direct is not None
    for ours, theirs in zip(two_forwards(batch, True), two_forwards(batch, False), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_direct_decoder_with_fused_products_matches_hf_and_decodes_the_same_tokens(family, monkeypatch):
    """Packed (oneDNN) weights fuse the SiLU, the gate's product and the residual additions into the products:
    float32 results agree to rounding, and greedy batches of 1, 3 and 8 prompts of different lengths,
    finishing at an end token mid-batch, decode token for token as through HF's layers."""
    model = tiny(family)
    if not pack_linears(model):
        pytest.skip("this torch has no oneDNN")
    batch = TargetBatch(model, AUX)
    for ours, theirs in zip(two_forwards(batch, True), two_forwards(batch, False), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    prompts = [[5, 9, 2], [7] * 6, [1], [3, 4], [8] * 11, [2, 2, 9, 1], [6], [40, 41, 42, 43, 44]]

    def greedy() -> list[list[list[int]]]:
        return [[g.tokens for g in decode_target_only(model, prompts[:n], 16, eos_token_id=[29, 37])
                 .generations] for n in (1, 3, 8)]

    ours = greedy()
    assert any(len(tokens) < 16 for tokens in ours[-1])  # some finish mid-batch
    monkeypatch.setattr(direct, "supports", lambda model: False)
    assert greedy() == ours


def test_only_llama_like_decoders_with_full_attention_are_run_directly():
    assert direct.supports(tiny("llama"))
    windowed = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=16))
    gemma = Gemma2ForCausalLM(Gemma2Config(**SHAPE))
    gelu = LlamaForCausalLM(LlamaConfig(**SHAPE, hidden_act="gelu"))
    for model in (windowed, gemma, gelu):
        assert not direct.supports(model)
        assert TargetBatch(model, AUX)._direct is None
    with pytest.raises(ValueError, match="gemma2"):
        direct.DirectDecoder(gemma)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compiled_decoding_gives_the_eager_tokens_and_states(family, monkeypatch):
    """The compiled graph over preallocated buffers (`DirectDecoder.into_buffers`, Inductor freezing the
    weights, each row attending from its own first column) computes the eager decoder's states and aux
    states to float32 rounding, and greedy batches of 1, 3 and 8 prompts of different lengths, finishing at an
    end token mid-batch and so changing the batch's shape, decode token for token as eagerly, every step
    compiled."""
    model = tiny(family)
    model.set_attn_implementation("sdpa_shared_kv")  # as `Target.load` sets it: runs of rows skip padding
    pack_linears(model)
    compiled_steps = count_compiled_steps(monkeypatch)
    eager, compiled = TargetBatch(model, AUX), TargetBatch(model, AUX, compiled=True)
    assert compiled._direct.compiled is not None and eager._direct.compiled is None
    prompts = [[5, 9, 2], [7] * 6, [1], [3, 4], [8] * 11, [2, 2, 9, 1], [6], [40, 41, 42, 43, 44]]
    for batch in (eager, compiled):
        batch.prefill(prompts[:3])
    step = torch.tensor([[3, 1], [4, 1], [5, 9]]), torch.ones(3, 2, 2, dtype=torch.bool).tril(), torch.zeros(
        3, 2, dtype=torch.long) + torch.tensor([0, 1])
    for ours, theirs in zip(compiled.verify(*step), eager.verify(*step), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert compiled_steps == [(3, 2)]  # the prefill is eager, the tree's step compiled
    assert compiled.cache.layers[0].keys.shape == eager.cache.layers[0].keys.shape

    rounds = []

    def greedy(compile_: bool) -> list[list[list[int]]]:
        outputs = [decode_target_only(model, prompts[:n], 16, eos_token_id=[29, 37], compiled=compile_)
                   for n in (1, 3, 8)]
        rounds.append(sum(output.rounds for output in outputs))
        return [[g.tokens for g in output.generations] for output in outputs]

    reference = greedy(False)
    assert any(len(tokens) < 16 for tokens in reference[-1])  # some finish mid-batch
    compiled_steps.clear()
    assert greedy(True) == reference
    assert len(compiled_steps) == rounds[-1] == rounds[0]  # every decoding step compiled


def test_only_a_direct_decoder_is_compiled():
    with pytest.raises(ValueError, match="gemma2.*compiled"):
        TargetBatch(Gemma2ForCausalLM(Gemma2Config(**SHAPE)), AUX, compiled=True)
