"""A Llama-like target's decoder layers called directly, for the batched engine's forwards.

Hugging Face's layers run a decoding step of a small model as many small kernels around the products: the
rotary embedding's ten, a SiLU, a product and two residual additions that oneDNN can apply inside the matrix
products, plus hooks for the aux states. Here the same math runs with fewer: the rotary embedding as one
rotation of the head halves against a signed sine (bit-identical), `F.rms_norm` for HF's RMSNorm
(bit-identical; on a CPU it runs the same kernels), and on a CPU the SiLU, the gate's product and the residual
additions fused into the products of `PackedLinear` weights. In float32 the fusions change nothing but the
SiLU's last bits; in bf16 they round once where HF rounds twice. The products and attention, which stream the
weights and the cache, stay the bulk of a step (bench/RESULTS.md §10).

Used where the architecture is Llama's (`supports`): Llama, Mistral, Qwen2 and Qwen3 with full attention in
every layer and a SiLU MLP. Others (sliding windows, Gemma's norms, MLA) run through Hugging Face.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache

from eagle3lib.target.model import PackedLinear, sdpa_shared_kv_attention

DIRECT_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def supports(model: nn.Module) -> bool:
    """The model is one `DirectDecoder` computes exactly: Llama-like, full attention in every layer."""
    config = model.config.get_text_config()
    kinds = getattr(config, "layer_types", None) or ["full_attention"]
    window = getattr(config, "sliding_window", None)
    windowed = window is not None and getattr(config, "use_sliding_window", True)
    full = all(kind == "full_attention" for kind in kinds) and not windowed
    return (config.model_type in DIRECT_MODELS and full and config.hidden_act == "silu"
            and config._attn_implementation in ("sdpa", "sdpa_shared_kv"))


def _linear(module: nn.Module, x: Tensor, activation: str = "none") -> Tensor:
    if isinstance(module, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise(x, module.packed, module.bias, activation, [], "")
    y = F.linear(x, module.weight, module.bias)
    return F.silu(y) if activation == "swish" else y


def _linear_then(module: nn.Module, x: Tensor, other: Tensor, op: str) -> Tensor:
    """`module(x)` then `op` ("add" or "mul") with `other`, fused into the product on a CPU."""
    if isinstance(module, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, module.packed, module.bias, op)
    y = F.linear(x, module.weight, module.bias)
    return y + other if op == "add" else y * other


def _norm(norm: nn.Module, x: Tensor) -> Tensor:
    """HF's Llama RMSNorm (`norm`) of x, bit for bit: normalised in float32, rounded to x's dtype, times the
    weight."""
    return norm.weight * F.rms_norm(x, (x.shape[-1],), eps=norm.variance_epsilon)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """HF's `x * cos + rotate_half(x) * sin` in four kernels: rotate_half(x) * sin is the halves of x swapped,
    times the sine with its first half negated (the two halves of a rotary sine are equal)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * signed_sin


class DirectDecoder:
    """`model`'s decoder as one function of the batched engine's inputs (see `__call__`)."""

    def __init__(self, model: nn.Module):
        if not supports(model):
            raise ValueError(f"{model.config.model_type}: not a Llama-like decoder with full attention")
        self.decoder = model.get_decoder()

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: Cache,
                 aux_layer_ids: list[int], runs: list | None = None) -> tuple[Tensor, list[Tensor]]:
        """The final-normed states [B, n, H] of n new tokens (input_ids, positions [B, n]; mask [B, 1, n, C]
        additive over the cache's C columns after the new ones are written) and the outputs of the decoder
        layers `aux_layer_ids`, in their order. The new keys and values are written to `cache`."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(hidden, positions)
        half = sin.shape[-1] // 2
        cos, signed_sin = cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]
        batch, columns = input_ids.shape
        wanted = set(aux_layer_ids)
        kept: dict[int, Tensor] = {}
        for i, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            normed = _norm(layer.input_layernorm, hidden)
            shape = (batch, columns, -1, attention.head_dim)
            query = _linear(attention.q_proj, normed).view(shape)
            key = _linear(attention.k_proj, normed).view(shape)
            value = _linear(attention.v_proj, normed).view(shape).transpose(1, 2)
            if hasattr(attention, "q_norm"):  # Qwen3 normalises each head before the rotation
                query, key = attention.q_norm(query), attention.k_norm(key)
            query = _rotate(query.transpose(1, 2), cos, signed_sin)
            key = _rotate(key.transpose(1, 2), cos, signed_sin)
            key, value = cache.update(key, value, i)
            out, _ = sdpa_shared_kv_attention(attention, query, key, value, mask, scaling=attention.scaling,
                                              key_runs=runs)
            hidden = _linear_then(attention.o_proj, out.reshape(batch, columns, -1), hidden, "add")
            mlp = layer.mlp
            normed = _norm(layer.post_attention_layernorm, hidden)
            gated = _linear_then(mlp.up_proj, normed, _linear(mlp.gate_proj, normed, "swish"), "mul")
            hidden = _linear_then(mlp.down_proj, gated, hidden, "add")
            if i in wanted:
                kept[i] = hidden
        return decoder.norm(hidden), [kept[i] for i in aux_layer_ids]
