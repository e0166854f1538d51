"""Target: aux states equal HF's hidden states at the documented indices; verifier logits; ids; identity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3lib import devices
from eagle3lib.decoding.speculate import decode_target_only
from eagle3lib.target.model import PackedLinear, Target, TargetError, fast_argmax, pack_linears, resolve_dtype
from eagle3lib.training.trainer import autocast_dtype

N_LAYERS = 8


@pytest.fixture(scope="module")
def target() -> Target:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=N_LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=97,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norms, so that "before" and "after" the final norm differ
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return Target(model.float(), tokenizer=None, name="tiny-test-llama")


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    attention_mask[1, 7:] = False  # right padding
    return input_ids, attention_mask


def hf_forward(target: Target, input_ids, attention_mask):
    with torch.no_grad():
        return target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)


def real(tensor: torch.Tensor, batch) -> torch.Tensor:
    """The real positions of a [B, T, ...] tensor (a capture's padded ones hold garbage)."""
    return tensor[batch[1]]


@pytest.mark.parametrize("ids", [[1, 3, 4], [0, 6], [5, 2]])
def test_aux_states_are_hf_hidden_states_at_id_plus_one(target, batch, ids):
    captured = target.capture(*batch, aux_layer_ids=ids)
    reference = hf_forward(target, *batch)
    expected = torch.cat([reference.hidden_states[i + 1] for i in ids], dim=-1)
    assert captured.aux_hidden_states.shape == (3, 11, len(ids) * 32)
    assert torch.equal(real(captured.aux_hidden_states, batch), real(expected, batch))


def test_last_hidden_state_is_after_the_final_norm_and_argmax_is_over_the_full_vocab(target, batch):
    captured = target.capture(*batch, return_logits=True)
    reference = hf_forward(target, *batch)
    assert torch.equal(real(captured.last_hidden_state, batch), real(reference.hidden_states[-1], batch))
    assert torch.equal(real(captured.logits, batch), real(reference.logits, batch))
    assert torch.equal(captured.target_argmax, captured.logits.argmax(-1))
    assert torch.equal(target.capture(*batch).target_argmax, captured.target_argmax)  # chunked path


def test_a_capture_takes_right_padding_only(target, batch):
    """A right-padded row's real positions are what the sequence alone gives; a mask that is not right
    padding (left padding, holes) is refused, as causal attention without the mask would read its gaps."""
    input_ids, attention_mask = batch
    alone = target.capture(input_ids[1:2, :7], aux_layer_ids=[2])
    padded = target.capture(input_ids, attention_mask, aux_layer_ids=[2])
    # products over 7 and 11 positions block their sums differently: float rounding only
    torch.testing.assert_close(padded.aux_hidden_states[1, :7], alone.aux_hidden_states[0], rtol=1e-6,
                               atol=1e-6)
    for bad in (attention_mask.flip(1), torch.ones(3, 11).index_fill_(1, torch.tensor([4]), 0)):
        with pytest.raises(TargetError, match=r"right padding only: attention_mask \(3, 11\)"):
            target.capture(input_ids, bad)


def test_last_layer_id_is_the_state_before_the_final_norm(target, batch):
    # HF ties hidden_states[N] to the normed state; id N-1 must still be decoder layer N-1's own output.
    captured = target.capture(*batch, aux_layer_ids=[N_LAYERS - 1])
    with torch.no_grad():
        assert torch.equal(target.norm(captured.aux_hidden_states), captured.last_hidden_state)
    assert not torch.equal(captured.aux_hidden_states, captured.last_hidden_state)


def test_restricted_verifier_logits_equal_the_full_logits_columns(target, batch):
    captured = target.capture(*batch, return_logits=True)
    draft_ids = torch.tensor([0, 3, 5, 17, 42, 96])
    restricted = target.verifier_logits(captured.last_hidden_state, draft_ids)
    assert restricted.shape == (3, 11, 6)
    # a matmul over 6 rows may block its sums differently from one over 97: float rounding only
    torch.testing.assert_close(restricted, captured.logits[..., draft_ids], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        target.verifier_logits(captured.last_hidden_state), captured.logits, rtol=1e-6, atol=1e-6
    )


def test_default_ids_and_shape_facts(target):
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (N_LAYERS, 32, 97)
    assert target.default_aux_layer_ids == [1, 3, 4]
    assert target.embed_tokens is target.model.model.embed_tokens


@pytest.mark.parametrize("ids", [[1, N_LAYERS], [-1, 2], []])
def test_layer_ids_outside_the_target_are_refused(target, batch, ids):
    with pytest.raises(TargetError, match="tiny-test-llama"):
        target.capture(*batch, aux_layer_ids=ids)


def test_head_weights_are_separate_copies(target):
    head = target.head_weights()
    assert set(head) == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    assert torch.equal(head["lm_head.weight"], target.lm_head.weight)
    assert head["lm_head.weight"].data_ptr() != target.lm_head.weight.data_ptr()


def test_fingerprint_ignores_load_dtype_but_not_weights(target):
    bf16 = Target(LlamaForCausalLM(target.config), None, "copy")
    bf16.model.load_state_dict(target.model.state_dict())
    bf16.model.to(torch.bfloat16)
    assert bf16.fingerprint == target.fingerprint
    changed = Target(LlamaForCausalLM(target.config), None, "changed")
    changed.model.load_state_dict(target.model.state_dict())
    with torch.no_grad():
        changed.model.model.layers[3].mlp.up_proj.weight.mul_(1.01)
    assert changed.fingerprint != target.fingerprint


@pytest.mark.parametrize("flags, inference, training", [
    ("fpu sse avx2 avx512f", torch.float32, None),  # an AMD EPYC without bf16 units
    ("fpu avx512f avx512_bf16", torch.bfloat16, torch.bfloat16),  # an AMD EPYC with bf16 dot products
    ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", torch.bfloat16, torch.bfloat16),  # an Intel Xeon with AMX
])
def test_auto_dtype_follows_the_cpus_bf16_units(monkeypatch, flags, inference, training):
    monkeypatch.setattr(devices, "_cpuinfo", lambda: f"model name\t: Some CPU\nflags\t\t: {flags}\n")
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == inference
    assert autocast_dtype("auto", cpu) == training
    assert resolve_dtype("float32", cpu) == torch.float32 and autocast_dtype("fp32", cpu) is None
    assert devices.cpu_model() == "Some CPU"


def test_dtype_choice(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", cuda) == torch.bfloat16 and autocast_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float32", cuda) == torch.float32
    with pytest.raises(TargetError, match="int8"):
        resolve_dtype("int8", cpu)


def test_loading_a_missing_folder_names_it(tmp_path):
    with pytest.raises(TargetError, match="no-such-model"):
        Target.load(tmp_path / "no-such-model", device="cpu")


def test_shared_kv_attention_is_hf_sdpa_bit_for_bit(target):
    """The attention `Target.load` installs computes exactly what HF's SDPA does, with a 4D mask (the batched
    engine's), a 2D padding mask (HF's `generate` on a left-padded batch) and none, while not copying the KV
    heads."""
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(2))
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()[None].repeat(3, 1, 1)
    allowed[1, :, :4] = False  # left padding of row 1 ...
    allowed[1, torch.arange(4), torch.arange(4)] = True  # ... whose rows attend to themselves only
    mask = torch.zeros(3, 1, 9, 9).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    padding = torch.ones(3, 9, dtype=torch.long)
    padding[1, :4] = 0
    model = target.model

    def forwards() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(ids).logits, model(ids, attention_mask=mask).logits,
                    model(ids, attention_mask=padding).logits[padding.bool()]]

    plain = forwards()
    model.set_attn_implementation("sdpa_shared_kv")
    try:
        shared = forwards()
    finally:
        model.set_attn_implementation("sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    for a, b in zip(plain, shared, strict=True):
        assert torch.equal(a, b)


def test_loading_installs_shared_kv_attention():
    assert Target.load("zoo:tiny-llama", device="cpu").model.config._attn_implementation == "sdpa_shared_kv"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_what_the_model_computed_and_keep_its_weights(dtype):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 96, (3, 11))
    with torch.no_grad():
        before = model(ids).logits
    prompts = [[5, 9, 2], [7] * 6, [1]]
    greedy = [g.tokens for g in decode_target_only(model, prompts, 12).generations]
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert pack_linears(model) == 0  # oneDNN would refuse the reorder: the linears stay as they were
        assert sum(type(m) is torch.nn.Linear for m in model.modules()) == linears
        return
    assert pack_linears(model) == linears == 2 * 7 + 1
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        after = model(ids).logits
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(after, before, **tolerance)  # the same products, blocked differently
    assert [g.tokens for g in decode_target_only(model, prompts, 12).generations] == greedy
    assert not any(type(m) is torch.nn.Linear for m in model.modules())


def test_fast_argmax_picks_the_first_maximum_as_argmax_does():
    torch.manual_seed(0)
    logits = torch.randn(64, 49152).mul(3).to(torch.bfloat16)
    logits[:, torch.randint(0, 49152, (5,))] = logits.max()  # ties at the top, common in bf16
    coarse = torch.randint(0, 4, (64, 1000)).to(torch.bfloat16)  # ties everywhere
    for x in (logits, coarse, logits.float()):
        assert torch.equal(fast_argmax(x), x.argmax(-1))


HUGE_PAGES_IN_USE = """
import re, sys
if sys.argv[1] == "eagle3lib":
    import eagle3lib  # noqa: F401
import torch
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MB, every page touched
print(sum(int(kb) for kb in re.findall(r"AnonHugePages:\\s+(\\d+)", open("/proc/self/smaps").read())))
"""


def test_importing_eagle3lib_gives_large_tensors_huge_pages():
    """torch's CPU allocator frees every large tensor back to the kernel; each new one is faulted in page by
    page unless it asks for transparent huge pages, which eagle3lib has it do (THP_MEM_ALLOC_ENABLE)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}

    def huge_kb(first: str) -> int:
        run = subprocess.run([sys.executable, "-c", HUGE_PAGES_IN_USE, first], env=env, capture_output=True,
                             text=True, check=True)
        return int(run.stdout)

    assert huge_kb("eagle3lib") >= 32 << 10
    if "[madvise]" in mode.read_text():  # huge pages only where asked for: torch alone asks for none
        assert huge_kb("torch") == 0
