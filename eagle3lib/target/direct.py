"""A Llama-like target's decoder layers called directly, for the batched engine's forwards.

Hugging Face's layers run a decoding step of a small model as many small kernels around the products: the
rotary embedding's ten, a SiLU, a product and two residual additions that oneDNN can apply inside the matrix
products, plus hooks for the aux states. Here the same math runs with fewer: the rotary embedding as one
rotation of the head halves against a signed sine (bit-identical), `F.rms_norm` for HF's RMSNorm
(bit-identical; on a CPU it runs the same kernels), and on a CPU the SiLU, the gate's product and the residual
additions fused into the products of `PackedLinear` weights. In float32 the fusions change nothing but the
SiLU's last bits; in bf16 they round once where HF rounds twice. The products and attention, which stream the
weights and the cache, stay the bulk of a step (bench/RESULTS.md §10).

Run eagerly, a step is still some 300 small kernels at several microseconds each: at batch 32 on the 2-core
Xeon about a fifth of it. `DirectDecoder(compiled=True)` therefore also has the same layers as one graph for
`torch.compile` (`into_buffers`): the cache as preallocated buffers written in place, the weights frozen into
the graph so that Inductor packs the products itself and fuses everything between them. On a CPU its
attention is `decode_attention`, which reads each row's columns from its first valid one (no left padding)
and each KV head once for the query heads that share it. It compiles once a process (about a minute for
SmolLM2-135M on 2 cores, again for a batch of one row; the attention kernel is built once a machine), and
reads the weights as they were when it compiled.

Used where the architecture is Llama's (`supports`): Llama, Mistral, Qwen2 and Qwen3 with full attention in
every layer and a SiLU MLP. Others (sliding windows, Gemma's norms, MLA) run through Hugging Face.
"""

from __future__ import annotations

from collections.abc import Callable
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._inductor import config as inductor_config
from transformers.cache_utils import Cache

from eagle3lib.target.decode_attention import decode_attention
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


def _linear(module: nn.Module, x: Tensor, activation: str = "none", fused: bool = True) -> Tensor:
    if fused and isinstance(module, PackedLinear):
        return torch.ops.mkldnn._linear_pointwise(x, module.packed, module.bias, activation, [], "")
    y = F.linear(x, module.weight, module.bias)
    return F.silu(y) if activation == "swish" else y


def _linear_then(module: nn.Module, x: Tensor, other: Tensor, op: str, fused: bool = True) -> Tensor:
    """`module(x)` then `op` ("add" or "mul") with `other`, fused into the product on a CPU."""
    if fused and isinstance(module, PackedLinear):
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


# attend(layer index, attention module, query [B, heads, n, D], key and value [B, kv heads, n, D]): writes the
# new key and value to the cache and gives the attention output [B, n, heads, D]
Attend = Callable[[int, nn.Module, Tensor, Tensor, Tensor], Tensor]


def _embed(decoder: nn.Module, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The embedded tokens [B, n, H] and their rotary cosine and signed sine [B, 1, n, D]."""
    hidden = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(hidden, positions)
    half = sin.shape[-1] // 2
    return hidden, cos[:, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, None]


def _layers(decoder: nn.Module, hidden: Tensor, cos: Tensor, signed_sin: Tensor, attend: Attend,
            aux_layer_ids: list[int], fused: bool) -> tuple[Tensor, list[Tensor]]:
    """The decoder layers over embedded tokens: the final-normed states and the aux layers' outputs. `fused`:
    packed products with their pointwise neighbours fused in (eager); unfused, a compiler fuses them."""
    batch, columns = hidden.shape[:2]
    wanted = set(aux_layer_ids)
    kept: dict[int, Tensor] = {}
    for i, layer in enumerate(decoder.layers):
        attention = layer.self_attn
        normed = _norm(layer.input_layernorm, hidden)
        shape = (batch, columns, -1, attention.head_dim)
        query = _linear(attention.q_proj, normed, fused=fused).view(shape)
        key = _linear(attention.k_proj, normed, fused=fused).view(shape)
        value = _linear(attention.v_proj, normed, fused=fused).view(shape).transpose(1, 2)
        if hasattr(attention, "q_norm"):  # Qwen3 normalises each head before the rotation
            query, key = attention.q_norm(query), attention.k_norm(key)
        query = _rotate(query.transpose(1, 2), cos, signed_sin)
        key = _rotate(key.transpose(1, 2), cos, signed_sin)
        out = attend(i, attention, query, key, value)
        hidden = _linear_then(attention.o_proj, out.reshape(batch, columns, -1), hidden, "add", fused)
        mlp = layer.mlp
        normed = _norm(layer.post_attention_layernorm, hidden)
        gate = _linear(mlp.gate_proj, normed, "swish", fused)
        gated = _linear_then(mlp.up_proj, normed, gate, "mul", fused)
        hidden = _linear_then(mlp.down_proj, gated, hidden, "add", fused)
        if i in wanted:
            kept[i] = hidden
    return _norm(decoder.norm, hidden), [kept[i] for i in aux_layer_ids]


class _BufferedLayers(nn.Module):
    """`_layers` over a KV cache held as preallocated buffers, in one graph for `torch.compile`: the new keys
    and values written to columns [filled, filled + n) of each layer's buffers, attention over the first
    filled + n columns with an additive mask [B, 1, n, filled + n], row b reading from column first[b] on
    (`decode_attention`: a short prompt's left padding is not read)."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, hidden: Tensor, cos: Tensor, signed_sin: Tensor, mask: Tensor, keys: list[Tensor],
                values: list[Tensor], filled: int, first: Tensor, aux_layer_ids: list[int]
                ) -> tuple[Tensor, list[Tensor]]:
        end = filled + hidden.shape[1]

        def attend(i: int, attention: nn.Module, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            keys[i][:, :, filled:end] = key
            values[i][:, :, filled:end] = value
            key, value = keys[i][:, :, :end], values[i][:, :, :end]
            if query.device.type == "cpu":
                return decode_attention(query, key, value, mask, first, attention.scaling)
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attention.scaling,
                                                 enable_gqa=True)  # every column read, the padding masked
            return out.transpose(1, 2)

        return _layers(self.decoder, hidden, cos, signed_sin, attend, aux_layer_ids, fused=False)


# one compiled graph per model for the life of the process: the compiler keys its work on the module
_COMPILED: WeakKeyDictionary[nn.Module, Callable] = WeakKeyDictionary()


class DirectDecoder:
    """`model`'s decoder as one function of the batched engine's inputs (see `__call__`), or with `compiled`,
    also one compiled graph over preallocated cache buffers (`into_buffers`)."""

    def __init__(self, model: nn.Module, compiled: bool = False):
        if not supports(model):
            raise ValueError(f"{model.config.model_type}: not a Llama-like decoder with full attention, "
                             "which direct (and compiled) decoding needs")
        self.decoder = model.get_decoder()
        self.compiled = None
        if compiled:
            if model not in _COMPILED:
                _COMPILED[model] = torch.compile(_BufferedLayers(self.decoder), dynamic=True)
            self.compiled = _COMPILED[model]

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: Cache,
                 aux_layer_ids: list[int], runs: list | None = None, spans: list | None = None,
                 prefix: Cache | None = None) -> tuple[Tensor, list[Tensor]]:
        """The final-normed states [B, n, H] of n new tokens (input_ids, positions [B, n]; mask [B, 1, n, C]
        additive over the cache's C columns after the new ones are written) and the outputs of the decoder
        layers `aux_layer_ids`, in their order. The new keys and values are written to `cache`.

        `spans` (a prefill's packed rows, into an empty cache): each row's prompts as [(first column,
        tokens)], each attending causally within itself, the mask unread; a column in no span gets zeros.
        Attention is then computed prompt by prompt, not over whole rows (256 ShareGPT first turns in rows
        of 373 tokens: most of a row's mask is other prompts; 6.2-7.4 -> 6.2-6.8 s on the 2-core Xeon).
        `prefix` (with `spans`): the keys and values [1, Hkv, p, D] of the p tokens every prompt begins with,
        which each prompt's tokens (at positions p on) also attend to."""
        if spans is not None and cache.get_seq_length():
            raise ValueError(f"prompt spans index the new columns, but the cache holds "
                             f"{cache.get_seq_length()} already")
        hidden, cos, signed_sin = _embed(self.decoder, input_ids, positions)
        shared = 0 if prefix is None else prefix.get_seq_length()
        # a prompt's token j sees the shared columns and its own up to j
        masks = {n: torch.ones(n, shared + n, dtype=torch.bool, device=hidden.device).tril(shared)
                 for row in spans or [] for _, n in row} if shared else {}

        def attend(i: int, attention: nn.Module, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            key, value = cache.update(key, value, i)
            if spans is None:
                return sdpa_shared_kv_attention(attention, query, key, value, mask, scaling=attention.scaling,
                                                key_runs=runs)[0]
            out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
            for r, row in enumerate(spans):
                for first, tokens in row:
                    span = slice(first, first + tokens)
                    keys, values = key[r:r + 1, :, span], value[r:r + 1, :, span]
                    if shared:
                        keys = torch.cat([prefix.layers[i].keys, keys], dim=2)
                        values = torch.cat([prefix.layers[i].values, values], dim=2)
                    out[r, span] = F.scaled_dot_product_attention(  # 4-D: 3-D takes a slower kernel
                        query[r:r + 1, :, span], keys, values, attn_mask=masks.get(tokens),
                        is_causal=not shared, scale=attention.scaling, enable_gqa=True)[0].transpose(0, 1)
            return out

        return _layers(self.decoder, hidden, cos, signed_sin, attend, aux_layer_ids, fused=True)

    @torch.no_grad()
    def into_buffers(self, input_ids: Tensor, mask: Tensor, positions: Tensor, keys: list[Tensor],
                     values: list[Tensor], filled: int, first: Tensor, aux_layer_ids: list[int]
                     ) -> tuple[Tensor, list[Tensor]]:
        """`__call__` through the compiled graph, the cache as each layer's key and value buffers [B, Hkv,
        columns, D] whose first `filled` columns are written and which have room for the n new ones; row b's
        attention reads from column first[b] on (int64 [B]; the columns before it are masked)."""
        hidden, cos, signed_sin = _embed(self.decoder, input_ids, positions)
        # freezing: the weights become the graph's constants, so that Inductor packs the products for oneDNN
        # and fuses the norms, rotations and residuals around them (as a compile option it is not applied)
        with inductor_config.patch(freezing=True):
            return self.compiled(hidden, cos, signed_sin, mask, keys, values, filled, first, aux_layer_ids)
