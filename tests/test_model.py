"""Eagle3Drafter against speculators 0.9.0's outputs, a plain reference forward, and its own cache paths."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3lib.drafter.config import ConfigError
from eagle3lib.drafter.model import Eagle3Drafter
from tests.tiny import tiny_drafter_config

FIXTURES = Path(__file__).parent / "fixtures" / "speculators-0.9.0"
SGLANG_KEYS = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
}


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: make gpu-check runs it")
CUDA = pytest.param("cuda", marks=NO_CUDA)
DEVICES = ["cpu", CUDA]


def tiny_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(tiny_drafter_config(**overrides))
    with torch.no_grad():  # norms away from 1 so that every weight matters
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    drafter.attach_embedding(torch.randn(64, 32))
    return drafter.eval()


def fixture_drafter(name: str) -> tuple[Eagle3Drafter, dict]:
    """Fixture weights loaded by hand (the checkpoint loader has its own tests)."""
    from eagle3lib.drafter.config import read_config

    config, _, _ = read_config(FIXTURES / name)
    tensors = {
        k.replace("layers.0.", "midlayer."): v
        for k, v in load_file(FIXTURES / name / "model.safetensors").items()
    }
    drafter = Eagle3Drafter(config, embed_tokens="embed_tokens.weight" in tensors)
    drafter.load_state_dict(tensors, strict=True)
    if "embed_tokens.weight" not in tensors:
        drafter.attach_embedding(load_file(FIXTURES / f"{name}_embed.safetensors")["embed_tokens.weight"])
    return drafter.eval(), load_file(FIXTURES / f"{name}_reference.safetensors")


# ------------------------------------------------------------------ plain reference (docs/formats.md §1)


def reference_forward(drafter: Eagle3Drafter, input_ids, aux, position_ids) -> torch.Tensor:
    """Step-0 logits written out from the formulas, in float64, one head at a time."""
    c = drafter.config
    w = {k: v.double() for k, v in drafter.state_dict().items() if v.is_floating_point()}
    embedding = drafter.target_embedding.double()

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rope(x, positions):  # x [T, d]: pairs (i, i + d/2) rotated by angle p * theta^(-2i/d)
        d = x.shape[-1]
        i = torch.arange(d // 2, dtype=torch.float64)
        angle = positions.double()[:, None] * c.rope_theta ** (-2 * i / d)
        a, b = x[:, : d // 2], x[:, d // 2 :]
        return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)

    logits = []
    for row_ids, row_aux, row_pos in zip(input_ids, aux, position_ids, strict=True):
        h = row_aux.double() @ w["fc.weight"].T
        e = embedding[row_ids]
        normed_h = rms(h, w["midlayer.hidden_norm.weight"])
        x = torch.cat([rms(e, w["midlayer.input_layernorm.weight"]), normed_h], -1)
        q = x @ w["midlayer.self_attn.q_proj.weight"].T
        k = x @ w["midlayer.self_attn.k_proj.weight"].T
        v = x @ w["midlayer.self_attn.v_proj.weight"].T
        T, d = len(row_ids), c.head_dim
        heads = []
        for head in range(c.num_attention_heads):
            kv = head // (c.num_attention_heads // c.num_key_value_heads)
            qh = rope(q[:, head * d : (head + 1) * d], row_pos)
            kh = rope(k[:, kv * d : (kv + 1) * d], row_pos)
            vh = v[:, kv * d : (kv + 1) * d]
            scores = qh @ kh.T / d**0.5
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            heads.append(scores.softmax(-1) @ vh)
        attn = torch.cat(heads, -1) @ w["midlayer.self_attn.o_proj.weight"].T
        residual = normed_h if c.norm_before_residual else h
        h1 = residual + attn
        m = rms(h1, w["midlayer.post_attention_layernorm.weight"])
        gate = m @ w["midlayer.mlp.gate_proj.weight"].T
        mlp = (gate * torch.sigmoid(gate) * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
            "midlayer.mlp.down_proj.weight"
        ].T
        out = h1 + mlp
        logits.append(rms(out, w["norm.weight"]) @ w["lm_head.weight"].T)
    return torch.stack(logits)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_forward_matches_plain_reference(norm_before_residual):
    drafter = tiny_drafter(norm_before_residual=norm_before_residual)
    torch.manual_seed(1)
    input_ids = torch.randint(0, 64, (2, 7))
    aux = torch.randn(2, 7, 3 * 40)
    positions = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        logits = drafter(input_ids, aux, positions)
    expected = reference_forward(drafter, input_ids, aux, positions)
    assert logits.shape == (2, 7, 24)
    torch.testing.assert_close(logits.double(), expected, atol=1e-5, rtol=1e-5)


def test_norm_before_residual_changes_the_output():
    a, b = tiny_drafter(norm_before_residual=False), tiny_drafter(norm_before_residual=True)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    input_ids, aux = torch.randint(0, 64, (1, 5)), torch.randn(1, 5, 120)
    with torch.no_grad():
        assert (a(input_ids, aux) - b(input_ids, aux)).abs().max() > 1e-2


# ----------------------------------------------------------------------------- speculators 0.9.0 fixtures


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["speculators_tiny", "sglang_tiny"])
def test_step0_and_ttt_match_speculators(name, device):
    drafter, ref = fixture_drafter(name)
    drafter, ref = drafter.to(device), {key: value.to(device) for key, value in ref.items()}
    with torch.no_grad():
        torch.testing.assert_close(drafter.fc(ref["hidden_states"]), ref["fc_out"], atol=1e-6, rtol=1e-6)
        logits = drafter(ref["input_ids"], ref["hidden_states"])  # default positions 1..T
        torch.testing.assert_close(logits, ref["logits_step0"], atol=1e-5, rtol=1e-5)
        all_logits, layer_outs = drafter.unroll(ref["input_ids"], ref["hidden_states"], steps=3)
    torch.testing.assert_close(all_logits, ref["logits_all_steps"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer_outs, ref["layer_out_all_steps"], atol=1e-5, rtol=1e-5)
    assert torch.equal(all_logits.argmax(-1), ref["draft_token_ids"])
    assert torch.equal(drafter.draft_to_target(all_logits.argmax(-1)), ref["draft_token_ids_target"])


def test_unroll_steps_yields_the_same_as_unroll():
    drafter = tiny_drafter()
    input_ids, aux = torch.randint(0, 64, (2, 6)), torch.randn(2, 6, 120)
    with torch.no_grad():
        logits, outs = drafter.unroll(input_ids, aux, steps=4)
        for k, step_out in enumerate(drafter.unroll_steps(input_ids, aux, steps=4)):
            assert torch.equal(step_out, outs[k])
            assert torch.equal(drafter.compute_logits(step_out), logits[k])
        assert torch.equal(logits[0], drafter(input_ids, aux))


# ----------------------------------------------------------------------------- incremental decoding


def test_step_with_cache_equals_full_forward():
    drafter = tiny_drafter()
    input_ids, aux = torch.randint(0, 64, (2, 9)), torch.randn(2, 9, 120)
    positions = drafter.default_position_ids(input_ids)
    with torch.no_grad():
        full = drafter(input_ids, aux)
        cache = drafter.new_cache()
        prefix_logits, _ = drafter.step(input_ids[:, :4], aux[:, :4], positions[:, :4], cache)
        pieces = [prefix_logits]
        for t in range(4, 9):  # one position at a time, target states through fc
            logits, _ = drafter.step(
                input_ids[:, t : t + 1], aux[:, t : t + 1], positions[:, t : t + 1], cache
            )
            pieces.append(logits)
    assert len(cache) == 9
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


def test_diagonal_mask_on_cache_reproduces_ttt_step_1():
    """Step 1 of the unroll, recomputed with the incremental path and an explicit [T, 2T] mask."""
    drafter = tiny_drafter()
    T = 6
    input_ids, aux = torch.randint(0, 64, (1, T)), torch.randn(1, T, 120)
    positions = drafter.default_position_ids(input_ids)
    with torch.no_grad():
        logits, outs = drafter.unroll(input_ids, aux, steps=2)
        cache = drafter.new_cache()
        drafter.step(input_ids, aux, positions, cache)
        mask = torch.cat([torch.ones(T, T).tril(), torch.eye(T)], dim=1).bool()[None]
        shifted = torch.cat([input_ids[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
        step1_logits, step1_out = drafter.step(shifted, outs[0], positions + 1, cache, attention_mask=mask)
    torch.testing.assert_close(step1_logits, logits[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step1_out, outs[1], atol=1e-5, rtol=1e-5)


def test_tree_mask_keeps_branches_apart_and_crop_rolls_back():
    drafter = tiny_drafter()
    n = 5
    prefix_ids, prefix_aux = torch.randint(0, 64, (1, n)), torch.randn(1, n, 120)
    prefix_pos = drafter.default_position_ids(prefix_ids)
    with torch.no_grad():
        cache = drafter.new_cache()
        _, prefix_out = drafter.step(prefix_ids, prefix_aux, prefix_pos, cache)
        root_hidden = prefix_out[:, -1:]
        # tree: a and b are siblings after the prefix, c is a's child
        tree_ids = torch.tensor([[7, 11, 13]])
        tree_hidden = torch.cat([root_hidden, root_hidden, torch.randn(1, 1, 32)], 1)
        tree_pos = torch.tensor([[n + 1, n + 1, n + 2]])
        tree = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.bool)
        mask = torch.cat([torch.ones(3, n, dtype=torch.bool), tree], 1)[None]
        tree_logits, _ = drafter.step(tree_ids, tree_hidden, tree_pos, cache, attention_mask=mask)
        assert len(cache) == n + 3

        cache.crop(n)
        assert len(cache) == n
        chain_a, _ = drafter.step(tree_ids[:, :1], tree_hidden[:, :1], tree_pos[:, :1], cache)
        chain_c, _ = drafter.step(tree_ids[:, 2:], tree_hidden[:, 2:], tree_pos[:, 2:], cache)
        cache.crop(n)
        chain_b, _ = drafter.step(tree_ids[:, 1:2], tree_hidden[:, 1:2], tree_pos[:, 1:2], cache)
    chain = torch.cat([chain_a, chain_b, chain_c], 1)
    torch.testing.assert_close(tree_logits, chain, atol=1e-5, rtol=1e-5)
    # without the mask, b would see a: the tree mask is doing something
    with torch.no_grad():
        cache.crop(n)
        causal_logits, _ = drafter.step(tree_ids, tree_hidden, tree_pos, cache)
    assert (causal_logits[:, 1] - chain_b[:, 0]).abs().max() > 1e-4


def test_cache_and_mask_errors():
    drafter = tiny_drafter()
    cache = drafter.new_cache()
    ids, pos = torch.randint(0, 64, (1, 3)), torch.arange(1, 4)[None]
    with torch.no_grad():
        drafter.step(ids, torch.randn(1, 3, 120), pos, cache)
        with pytest.raises(ValueError, match="attention_mask must be bool"):
            drafter.step(
                ids[:, :1], torch.randn(1, 1, 32), pos[:, :1], cache, torch.ones(1, 1, 3, dtype=torch.bool)
            )
        with pytest.raises(ValueError, match="cannot crop"):
            cache.crop(10)
        with pytest.raises(ValueError, match="hidden states of width 50"):
            drafter(ids, torch.randn(1, 3, 50))


# ----------------------------------------------------------------------------- module surface


def test_parameter_names_are_the_sglang_checkpoint_keys():
    drafter = Eagle3Drafter(tiny_drafter_config())
    assert set(drafter.state_dict()) == SGLANG_KEYS | {"d2t", "t2d"}
    drafter.attach_embedding(torch.randn(64, 32))
    assert set(drafter.state_dict()) == SGLANG_KEYS | {"d2t", "t2d"}  # the target's embedding is never saved
    assert not any(name.startswith("target_embedding") for name, _ in drafter.named_parameters())
    owned = Eagle3Drafter(tiny_drafter_config(), embed_tokens=True)
    assert set(owned.state_dict()) == SGLANG_KEYS | {"d2t", "t2d", "embed_tokens.weight"}
    assert not owned.embed_tokens.weight.requires_grad
    assert drafter.lm_head.weight.shape == (24, 32) and drafter.fc.weight.shape == (32, 120)
    assert drafter.d2t.dtype == torch.int64 and drafter.t2d.dtype == torch.bool and drafter.t2d.sum() == 24


def test_embedding_is_required_and_checked():
    drafter = Eagle3Drafter(tiny_drafter_config())
    with pytest.raises(RuntimeError, match="attach_embedding"):
        drafter(torch.zeros(1, 2, dtype=torch.long), torch.randn(1, 2, 120))
    with pytest.raises(ValueError, match=r"expected \[64, 32\]"):
        drafter.attach_embedding(torch.randn(63, 32))
    owned = Eagle3Drafter(tiny_drafter_config(), embed_tokens=True)
    target = torch.randn(64, 32)
    owned.attach_embedding(target)  # the target's replaces the carried one, as the engines do
    assert "embed_tokens.weight" not in owned.state_dict()
    assert torch.equal(owned.embed(torch.tensor([3])), target[3:4])


def test_draft_to_target_uses_d2t_offsets():
    drafter = Eagle3Drafter(tiny_drafter_config())
    drafter.d2t.copy_(torch.arange(24) * 2 % 40)
    ids = torch.tensor([[0, 5, 23]])
    assert torch.equal(drafter.draft_to_target(ids), ids + (ids * 2 % 40))


@pytest.mark.parametrize(
    "option", [{"norm_before_fc": True}, {"num_hidden_layers": 2}, {"feed_normed_hidden": True,
                                                                    "norm_before_lm_head": False}]
)
def test_refused_options_name_themselves(option):
    name = next(iter(option)) if len(option) == 1 else "feeds norm"
    with pytest.raises(ConfigError, match=name):
        Eagle3Drafter(tiny_drafter_config(**option))


def test_scaled_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    drafter = Eagle3Drafter(
        tiny_drafter_config(rope_scaling=scaling, rope_theta=500000.0, max_position_embeddings=512)
    )
    positions = torch.arange(0, 300, 7)[None]
    cos, sin = drafter.rotary_emb(positions, torch.float32)
    hf = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=32,
            num_attention_heads=4,
            head_dim=8,
            max_position_embeddings=512,
            rope_parameters={**scaling, "rope_theta": 500000.0},
        )
    )
    hf_cos, hf_sin = hf(torch.zeros(1, 1, 8), positions)
    torch.testing.assert_close(cos, hf_cos)
    torch.testing.assert_close(sin, hf_sin)
    plain = Eagle3Drafter(tiny_drafter_config(rope_theta=500000.0)).rotary_emb(positions, torch.float32)[0]
    assert (plain - cos).abs().max() > 1e-3


# ----------------------------------------------------------------------------- TTT attention


def masked_reference_attention(q, prefix_keys, prefix_values, keys, values):
    """The TTT step-n attention the plain way: every key of steps 0..n, a causal + diagonal mask, softmax."""
    groups = q.shape[1] // prefix_keys.shape[1]
    T = q.shape[2]
    all_keys = torch.cat([prefix_keys, *keys], 2).repeat_interleave(groups, 1)
    all_values = torch.cat([prefix_values, *values], 2).repeat_interleave(groups, 1)
    mask = torch.cat([torch.ones(T, T).tril(), *[torch.eye(T)] * len(keys)], 1).bool().to(q.device)
    scores = (q @ all_keys.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ all_values


def ttt_attention_inputs(steps: int, T: int = 7, dtype=torch.float64):
    generator = torch.Generator().manual_seed(steps)
    q = torch.randn(2, 6, T, 4, generator=generator, dtype=dtype)
    kv = [torch.randn(2, 2, T, 4, generator=generator, dtype=dtype) for _ in range(2 * steps)]
    return [q, *kv[:steps], *kv[steps:]]  # q, keys of steps 0..n-1, values of steps 0..n-1


@pytest.mark.parametrize("steps", [2, 4])
def test_prefix_and_diagonals_attention_is_exact_with_exact_gradients(steps):
    from eagle3lib.drafter.ttt_attention import PrefixAndDiagonalsAttention

    q, *kv = [t.requires_grad_() for t in ttt_attention_inputs(steps)]
    keys, values = kv[:steps], kv[steps:]
    out = PrefixAndDiagonalsAttention.apply(q, keys[0], values[0], None, *keys[1:], *values[1:])
    reference = masked_reference_attention(q, keys[0], values[0], keys[1:], values[1:])
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=0)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, *kv], grad_out)
    reference_grads = torch.autograd.grad(reference, [q, *kv], grad_out)
    for i, (grad, expected) in enumerate(zip(grads, reference_grads, strict=True)):
        torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0, msg=f"gradient of input {i}")
    assert torch.autograd.gradcheck(
        lambda q, k0, v0, *rest: PrefixAndDiagonalsAttention.apply(q, k0, v0, None, *rest),
        [q, keys[0], values[0], *keys[1:], *values[1:]],
    )


@pytest.mark.parametrize("score_elements", [300, 2**26])  # blocks of 3 query rows, or all 8 at once
def test_blocked_causal_attention_matches_the_fused_kernel(score_elements, monkeypatch):
    """The off-CPU path (blocks of query rows in plain torch) against the CPU's fused kernel."""
    from eagle3lib.drafter.ttt_attention import (
        BlockedCausalAttention,
        causal_attention_backward,
        causal_attention_with_lse,
    )

    monkeypatch.setattr(BlockedCausalAttention, "score_elements", score_elements)
    q, k, v = ttt_attention_inputs(1, T=8)[:3]
    assert len(list(BlockedCausalAttention.blocks(q))) == (3 if score_elements == 300 else 1)
    out, lse = BlockedCausalAttention.forward(q, k, v)
    fused_out, fused_lse = causal_attention_with_lse(q, k, v)
    torch.testing.assert_close(out, fused_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, fused_lse.double(), atol=1e-12, rtol=0)
    grad_out = torch.randn_like(out)
    grads = BlockedCausalAttention.backward(grad_out, q, k, v, out, lse)
    fused_grads = causal_attention_backward(grad_out, q, k, v, fused_out, fused_lse)
    for grad, expected in zip(grads, fused_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_unroll_gradients_match_the_masked_reference_in_bfloat16_autocast(device):
    """The trainer's setting, bf16 autocast over float32 weights: gradients as with masked attention."""
    from eagle3lib.drafter import ttt_attention

    def masked_attend(cache, q, k, v, attention_mask):
        cache.keys.append(k)
        cache.values.append(v)
        return masked_reference_attention(q, cache.keys[0], cache.values[0], cache.keys[1:], cache.values[1:])

    drafter = tiny_drafter().to(device)
    input_ids, aux = torch.randint(0, 64, (2, 12), device=device), torch.randn(2, 12, 120, device=device)

    def gradients():
        drafter.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits, _ = drafter.unroll(input_ids, aux, steps=4)
        logits.float().logsumexp(-1).sum().backward()
        return {name: p.grad.clone() for name, p in drafter.named_parameters()}

    fused = gradients()
    original = ttt_attention.TTTCache.attend
    ttt_attention.TTTCache.attend = masked_attend
    try:
        reference = gradients()
    finally:
        ttt_attention.TTTCache.attend = original
    for name, grad in fused.items():
        scale = reference[name].abs().max()
        assert (grad - reference[name]).abs().max() <= 0.02 * scale, name


# ------------------------------------------------------------------------- TTT attention kernels by device


def masked_attention_on_cpu(q, kv, dtype=torch.float64):
    """`masked_reference_attention` of TTT inputs (q, keys of steps 0..n, values of steps 0..n) on the CPU in
    `dtype`, and its leaves in that order."""
    leaves = [x.detach().cpu().to(dtype).requires_grad_() for x in (q, *kv)]
    steps = len(kv) // 2
    keys, values = leaves[1 : 1 + steps], leaves[1 + steps :]
    return masked_reference_attention(leaves[0], keys[0], values[0], keys[1:], values[1:]), leaves


def test_prefix_kernel_is_chosen_by_device_and_support(monkeypatch):
    """Device type picks the list of fused kernels; on CUDA torch's SDPA checks decide between flash, the
    memory-efficient kernel and the blocked path, asked about the inputs as the kernel will get them."""
    from eagle3lib.drafter import ttt_attention

    cuda_kernels = (ttt_attention.CUDA_FLASH_KERNEL, ttt_attention.CUDA_EFFICIENT_KERNEL)
    assert ttt_attention.FUSED_PREFIX_KERNELS["cuda"] == cuda_kernels
    q, k, v = ttt_attention_inputs(1, T=5)[:3]  # 6 query heads over 2 key heads
    assert ttt_attention.prefix_attention_kernel(q, k, v) is ttt_attention.CPU_FLASH_KERNEL
    meta = [x.to("meta") for x in (q, k, v)]
    # no fused kernel on this device
    assert ttt_attention.prefix_attention_kernel(*meta) is ttt_attention.BLOCKED_KERNEL

    usable, asked = {}, []

    def answer(kind):
        def can_use(params):
            asked.append((kind, params.key.shape, params.value.shape, params.is_causal))
            return usable[kind]

        return can_use

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", answer("flash"))
    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", answer("efficient"))
    cuda_kernels = ttt_attention.FUSED_PREFIX_KERNELS["cuda"]
    monkeypatch.setitem(ttt_attention.FUSED_PREFIX_KERNELS, "cpu", cuda_kernels)  # CPU tensors
    for flash, efficient, expected in [
        (True, True, ttt_attention.CUDA_FLASH_KERNEL),
        (False, True, ttt_attention.CUDA_EFFICIENT_KERNEL),
        (False, False, ttt_attention.BLOCKED_KERNEL),
    ]:
        usable.update(flash=flash, efficient=efficient)
        asked.clear()
        assert ttt_attention.prefix_attention_kernel(q, k, v) is expected
        assert asked[0] == ("flash", q.shape, q.shape, True)  # key heads expanded to the query heads
    with ttt_attention.forced_prefix_kernel(ttt_attention.BLOCKED_KERNEL):
        assert ttt_attention.prefix_attention_kernel(q, k, v) is ttt_attention.BLOCKED_KERNEL
    usable.update(flash=True)
    # the forced kernel is undone
    assert ttt_attention.prefix_attention_kernel(q, k, v) is ttt_attention.CUDA_FLASH_KERNEL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel_name", ["CUDA_FLASH_KERNEL", "CUDA_EFFICIENT_KERNEL"])
def test_cuda_kernels_call_the_real_ops_as_their_schemas_say(kernel_name, dtype):
    """The real CUDA ops on meta tensors: torch binds every argument against the op's schema and its meta
    function gives the shapes the CUDA kernel would (the efficient kernel's log-sum-exp padded to 64 rows)."""
    from eagle3lib.drafter import ttt_attention

    kernel = getattr(ttt_attention, kernel_name)
    q = torch.empty(2, 6, 40, 16, device="meta", dtype=dtype)
    k, v = (torch.empty(2, 2, 40, 16, device="meta", dtype=dtype) for _ in range(2))
    out, lse = kernel.forward(q, k, v)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (2, 6, 40), torch.float32)
    grads = kernel.backward(torch.empty_like(out), q, k, v, out, lse)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype), (k.shape, dtype), (v.shape, dtype)]


CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class StandInCudaOps:
    """The CUDA ops' signatures (checked against their schemas) and output conventions, computed by the CPU's
    fused kernel: the CUDA kernels' own code (head expansion, argument order, log-sum-exp padding, gradient
    sums) runs on the CPU, exactly in float64."""

    calls: list[str] = []

    @staticmethod
    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        assert key.shape == query.shape and dropout_p == 0.0 and is_causal and not return_debug_mask
        StandInCudaOps.calls.append("flash")
        out, lse = CPU_FLASH(query, key, value, is_causal=True)
        T, empty = query.shape[2], torch.empty(0)
        return out, lse, None, None, T, T, torch.zeros(2, dtype=torch.uint64), torch.zeros(()), empty

    @staticmethod
    def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                       dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
        T = query.shape[2]
        assert (cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal) == (None, None, T, T, 0.0, True)
        assert logsumexp.shape == query.shape[:3] and logsumexp.is_contiguous()
        StandInCudaOps.calls.append("flash_backward")
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, 0.0, True
        )

    @staticmethod
    def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                  scale=None):
        assert key.shape == query.shape and attn_bias is None and compute_log_sumexp and is_causal
        from eagle3lib.drafter.ttt_attention import efficient_lse_length

        StandInCudaOps.calls.append("efficient")
        out, lse = CPU_FLASH(query, key, value, is_causal=True)
        padding = efficient_lse_length(query.shape[2]) - query.shape[2]
        lse = torch.nn.functional.pad(lse, (0, padding), value=float("nan"))  # the kernel's own padding
        return out, lse, torch.zeros(()), torch.zeros(())

    @staticmethod
    def efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed,
                           philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        from eagle3lib.drafter.ttt_attention import efficient_lse_length

        T = query.shape[2]
        assert attn_bias is None and dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
        assert logsumexp.shape == (*query.shape[:2], efficient_lse_length(T)) and is_causal
        assert torch.isinf(logsumexp[..., T:]).all()  # padded rows weigh nothing
        StandInCudaOps.calls.append("efficient_backward")
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out_, query, key, value, out, logsumexp[..., :T].contiguous(), 0.0, True
        )
        return *grads, None


@pytest.mark.parametrize("op", ["flash", "flash_backward", "efficient", "efficient_backward"])
def test_stand_in_cuda_ops_have_the_real_signatures(op):
    import inspect

    from eagle3lib.drafter.ttt_attention import CudaAttentionOps

    schema = getattr(CudaAttentionOps, op)._schema
    parameters = inspect.signature(getattr(StandInCudaOps, op)).parameters.values()
    assert [(p.name, p.kind == p.KEYWORD_ONLY) for p in parameters] == [
        (a.name, a.kwarg_only) for a in schema.arguments
    ]


@pytest.mark.parametrize("kernel_name", ["CUDA_FLASH_KERNEL", "CUDA_EFFICIENT_KERNEL"])
def test_cuda_kernel_code_with_stand_in_ops_is_exact(kernel_name, monkeypatch):
    """PrefixAndDiagonalsAttention on a CUDA kernel's code, its ops stood in for by the CPU's: output and
    gradients as the masked softmax's, to float64 rounding."""
    from eagle3lib.drafter import ttt_attention

    for op in ("flash", "flash_backward", "efficient", "efficient_backward"):
        monkeypatch.setattr(ttt_attention.CudaAttentionOps, op, getattr(StandInCudaOps, op))
    StandInCudaOps.calls.clear()
    steps = 3
    q, *kv = [t.requires_grad_() for t in ttt_attention_inputs(steps, T=37)]  # lse padding: 37 -> 64 rows
    keys, values = kv[:steps], kv[steps:]
    with ttt_attention.forced_prefix_kernel(getattr(ttt_attention, kernel_name)):
        out = ttt_attention.PrefixAndDiagonalsAttention.apply(
            q, keys[0], values[0], None, *keys[1:], *values[1:]
        )
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, [q, *kv], grad_out)
    op = "flash" if kernel_name == "CUDA_FLASH_KERNEL" else "efficient"
    assert StandInCudaOps.calls == [op, f"{op}_backward"]
    reference = masked_reference_attention(q, keys[0], values[0], keys[1:], values[1:])
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=0)
    reference_grads = torch.autograd.grad(reference, [q, *kv], grad_out)
    for i, (grad, expected) in enumerate(zip(grads, reference_grads, strict=True)):
        torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0, msg=f"gradient of input {i}")


# max |error| / max |reference| of the TTT attention against a float64 masked softmax
ATTENTION_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_fused_blocked_and_masked_attention_agree_on(device, dtype):
    """The TTT attention of step 3 on the device's fused kernel and on the blocked path, forward and backward,
    against the masked softmax in float64 (of the same rounded inputs)."""
    from eagle3lib.drafter import ttt_attention

    steps = 4
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 70, 16, generator=generator).to(device, dtype)  # 8 query heads over 2 key heads
    kv = [torch.randn(2, 2, 70, 16, generator=generator).to(device, dtype) for _ in range(2 * steps)]
    keys, values = kv[:steps], kv[steps:]
    fused = ttt_attention.prefix_attention_kernel(q, keys[0], values[0])
    assert fused in ttt_attention.FUSED_PREFIX_KERNELS[device]
    reference, leaves = masked_attention_on_cpu(q, kv)
    grad_out = torch.randn(reference.shape, generator=generator, dtype=torch.float64)
    expected = [reference, *torch.autograd.grad(reference, leaves, grad_out)]
    names = ["out", "q", *(f"k{i}" for i in range(steps)), *(f"v{i}" for i in range(steps))]
    for kernel in (fused, ttt_attention.BLOCKED_KERNEL):
        inputs = [x.clone().requires_grad_() for x in (q, *kv)]
        q_, keys_, values_ = inputs[0], inputs[1 : 1 + steps], inputs[1 + steps :]
        with ttt_attention.forced_prefix_kernel(kernel):
            out = ttt_attention.PrefixAndDiagonalsAttention.apply(
                q_, keys_[0], values_[0], None, *keys_[1:], *values_[1:]
            )
            grads = torch.autograd.grad(out, inputs, grad_out.to(device, dtype))
        for name, got, want in zip(names, [out, *grads], expected, strict=True):
            assert got.dtype == dtype and got.device.type == device
            error = float((got.double().cpu() - want).abs().max() / want.abs().max())
            assert error <= ATTENTION_TOLERANCE[dtype], f"{kernel.name} {dtype}: {name} off by {error:.1e}"


@pytest.mark.parametrize("device", [CUDA])
def test_greedy_speculation_is_lossless_in_float32_on(device):
    """Chain and tree drafting on the device: exactly the target's own greedy tokens (test_speculate's
    random pair; its CPU tests are there)."""
    from eagle3lib.decoding import speculate
    from tests.test_speculate import SETTINGS, random_pair

    target, drafter = random_pair(vocab=64, draft_vocab=24)
    target, drafter = target.to(device), drafter.to(device)
    for name in ("chain-3", "tree-4x3-8"):
        decoder = speculate.SpeculativeDecoder(target, drafter, SETTINGS[name])
        for prompt in ([1, 2, 3], [60, 7, 7, 41, 9, 0]):
            expected = speculate.generate_target_only(target, prompt, 40).tokens
            assert decoder.generate(prompt, 40).tokens == expected, f"{name}, prompt {prompt}"


def test_gpu_check_runs_its_training_step_code_on_the_cpu(monkeypatch, capsys):
    """bench/gpu_check.py's own code where a CPU can run it: the trainer and batch it builds, its fused vs
    blocked comparison and the memory plan's predictions at a tiny shape; with no CUDA device it checks
    nothing and exits 0."""
    import argparse
    import sys

    from eagle3lib.drafter.ttt_attention import BLOCKED_KERNEL

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "bench"))
    import gpu_check

    shape = argparse.Namespace(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, vt=96, vd=24,
                               seq_len=12, ttt_steps=3, micro_batch=1, dtype="bf16", data_dtype="bfloat16",
                               train_lm_head=False)
    trainer, _, batch, _ = gpu_check.build_on_device(shape, torch.device("cpu"))
    assert batch["aux_hidden_states"].shape == (1, 12, 3 * 32) and trainer.t2d[batch["target_argmax"]].all()
    checks = gpu_check.Checks()
    gpu_check.compare_paths(trainer, batch, checks)
    assert checks.failed == []
    fused, blocked = gpu_check.predicted_peak(shape, None), gpu_check.predicted_peak(shape, BLOCKED_KERNEL)
    assert 0 < fused and 0 < blocked
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert gpu_check.main() == 0
    assert "no CUDA device here" in capsys.readouterr().out
