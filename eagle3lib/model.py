"""The EAGLE-3 drafter: one Llama decoder layer on top of the target's hidden states (FORMATS.md §1).

Module and parameter names are the SGLang checkpoint keys (`fc.weight`, `midlayer.self_attn.q_proj.weight`,
`norm.weight`, `lm_head.weight`, buffers `d2t`, `t2d`), so `state_dict()` is the checkpoint.

One draft step, for token ids `x` and hidden states `h` (the target's aux states on step 0, the drafter's
own pre-norm output afterwards):
    h   = fc(h)                                  only when h has the aux width A*Ht
                                                 (fc_norm, EAGLE-3.1: each Ht-wide aux state RMS-normed first)
    a   = cat[input_layernorm(E[x]), hidden_norm(h)]          width 2H
    r   = hidden_norm(h) if norm_before_residual else h
    h1  = r + o_proj(attention(q_proj(a), k_proj(a), v_proj(a)))     causal, RoPE
    out = h1 + mlp(post_attention_layernorm(h1))                     fed to the next step
    logits = lm_head(norm(out))                                      over the Vd draft tokens
With `feed_normed_hidden` (EAGLE-3.1) norm(out) is the state fed to the next step; with
`norm_before_lm_head` false (a SpecForge option) logits are lm_head(out).
Draft token j is target token j + d2t[j].

Alignment (as vLLM and speculators): row t gets the aux state of position t with the embedding of token
t+1, at position id t+1, and predicts token t+2.

It runs past 600 lines: the TTT attention's autograd function and its per-device kernels (CPU fused,
CUDA flash / memory-efficient, blocked reference) live beside the drafter layer that calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3lib.config import DrafterConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, as the drafter's norms and a target's final norm compute it, in float32."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin of the rotary embedding at given positions.

    The inverse frequencies are computed on first use per device (not kept as a buffer), so a drafter built
    on the meta device by the loader needs nothing re-initialised. Scaled variants (llama3, linear, yarn) use
    transformers' own functions.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self._inv_freq: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def inv_freq(self, device: torch.device) -> tuple[torch.Tensor, float]:
        if device not in self._inv_freq:
            config = self.config
            rope_type = config.rope_parameters["rope_type"]
            if rope_type == "default":
                exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device)
                inv_freq, scaling = 1.0 / (config.rope_theta ** (exponents / config.head_dim)), 1.0
            else:
                from transformers import LlamaConfig
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                hf_config = LlamaConfig(
                    hidden_size=config.hidden_size,
                    num_attention_heads=config.num_attention_heads,
                    head_dim=config.head_dim,
                    max_position_embeddings=config.max_position_embeddings,
                    rope_parameters=config.rope_parameters,
                )
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device)
            self._inv_freq[device] = (inv_freq.float(), float(scaling))
        return self._inv_freq[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self.inv_freq(position_ids.device)
        freqs = position_ids.float()[..., None] * inv_freq  # [B, T, head_dim/2]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim]; cos/sin [B, T, head_dim]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DraftCache:
    """Keys and values of the drafter's one layer during speculation.

    Positions are kept in the order they were added; `crop(n)` drops everything after the first n (rejected
    drafts). `attend` appends the new keys/values, then attends with the given mask.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [B, kv_heads, n, head_dim]
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, n: int) -> None:
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot crop a draft cache of {len(self)} positions to {n}")
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        cached, new = len(self), q.shape[2]
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        if attention_mask is None:
            if cached == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            # default: every cached position, plus the new ones causally
            attention_mask = torch.ones(new, cached + new, dtype=torch.bool, device=q.device).tril(cached)
            attention_mask = attention_mask[None]
        expected = (q.shape[0], new, cached + new)
        if (
            attention_mask.dtype != torch.bool
            or attention_mask.shape[1:] != expected[1:]
            or (attention_mask.shape[0] not in (1, expected[0]))
        ):
            raise ValueError(
                f"attention_mask must be bool [B, t, cached+t] = {list(expected)}, got "
                f"{attention_mask.dtype} {list(attention_mask.shape)}"
            )
        return F.scaled_dot_product_attention(
            q, self.keys, self.values, attn_mask=attention_mask[:, None], enable_gqa=True
        )


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """Softmax statistics and sums are kept in float32 (float64 inputs stay float64)."""
    return torch.promote_types(x.dtype, torch.float32)


# ----------------------------------------------------------------------------- TTT prefix attention kernels


@dataclass(frozen=True)
class PrefixAttentionKernel:
    """One implementation of the causal attention `PrefixAndDiagonalsAttention` runs over the step-0 prefix.

    `forward(q, k, v)`: q [B, Hq, T, D], k and v [B, Hkv, T, D] (grouped query: query head h reads key head
    h // (Hq / Hkv)) -> (out [B, Hq, T, D] in q's dtype, log-sum-exp [B, Hq, T] of the scaled scores, at least
    float32). `backward(grad_out, q, k, v, out, lse)` -> (grad_q, grad_k, grad_v), given the output and
    log-sum-exp of a softmax that this attention is a slice of: its share of that softmax's gradients.
    `supports(q, k, v)`: whether this implementation runs these inputs.
    """

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    supports: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool]


def kv_groups(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.shape[1] // k.shape[1]


def expand_kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D]: head h holds key head h // groups (copied if groups > 1)."""
    if groups == 1:
        return x
    return x[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2)


def sum_kv_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `expand_kv_heads`: each key head's copies summed, in at least float32."""
    if groups == 1:
        return grad
    return grad.unflatten(1, (-1, groups)).sum(2, dtype=accumulation_dtype(grad)).to(grad.dtype)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The fused CUDA kernels read rows of D contiguous elements; any other layout is theirs to handle."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _cpu_flash_forward(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)


def _cpu_flash_backward(grad_out, q, k, v, out, lse):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, True
    )


class CudaAttentionOps:
    """PyTorch's fused CUDA attention ops that return their log-sum-exp, and their backward ops (ATen's own
    `scaled_dot_product_attention` and its autograd formula call them). Class attributes, so that tests on a
    machine without CUDA can put stand-ins with the same signatures in their place."""

    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    efficient_backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


def _cuda_inputs(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Key heads are expanded to the query heads: the two ops' own grouped-query support differs between
    # kernels and torch versions, and the copy is exact (none when Hq == Hkv, as in Kimi-K2.5's drafter).
    groups = kv_groups(q, k)
    return tuple(last_dim_contiguous(x) for x in (q, expand_kv_heads(k, groups), expand_kv_heads(v, groups)))


def _unused_rng_state(q: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The dropout RNG state a backward op takes; without dropout (p = 0 here) it is never read."""
    return torch.zeros(shape, dtype=dtype, device=q.device)


def _cuda_flash_forward(q, k, v):
    out, lse, *_ = CudaAttentionOps.flash(
        *_cuda_inputs(q, k, v), dropout_p=0.0, is_causal=True, return_debug_mask=False
    )
    return out, lse


def _cuda_flash_backward(grad_out, q, k, v, out, lse):
    T, groups = q.shape[2], kv_groups(q, k)
    grad_q, grad_k, grad_v = CudaAttentionOps.flash_backward(
        last_dim_contiguous(grad_out), *_cuda_inputs(q, k, v), last_dim_contiguous(out), lse.contiguous(),
        None, None, T, T,  # dense batch: no cumulative sequence lengths; max lengths T
        0.0, True,  # dropout_p, is_causal
        _unused_rng_state(q, torch.uint64, (2,)), _unused_rng_state(q, torch.uint64, ()),
    )
    return grad_q, sum_kv_heads(grad_k, groups), sum_kv_heads(grad_v, groups)


def efficient_lse_length(T: int) -> int:
    """Rows of the log-sum-exp the memory-efficient kernel writes and its backward reads: T rounded up to a
    multiple of 32 on CUDA (its backward loads rows in blocks of 32), T itself on ROCm."""
    return T if torch.version.hip else -(-T // 32) * 32


def _cuda_efficient_forward(q, k, v):
    out, lse, *_ = CudaAttentionOps.efficient(
        *_cuda_inputs(q, k, v), None, True, dropout_p=0.0, is_causal=True  # no bias; compute the lse
    )
    return out, lse[..., : q.shape[2]]


def _cuda_efficient_backward(grad_out, q, k, v, out, lse):
    T, groups = q.shape[2], kv_groups(q, k)
    # padded as the forward pads it: +inf gives rows past T zero weight, whatever the kernel does with them
    padded = F.pad(lse, (0, efficient_lse_length(T) - T), value=float("inf")).contiguous()
    grad_q, grad_k, grad_v, _ = CudaAttentionOps.efficient_backward(
        last_dim_contiguous(grad_out), *_cuda_inputs(q, k, v), None, last_dim_contiguous(out), padded,
        _unused_rng_state(q, torch.int64, ()), _unused_rng_state(q, torch.int64, ()),
        0.0, [True, True, True, False], True,  # dropout_p, gradients of (q, k, v, no bias), is_causal
    )
    return grad_q, sum_kv_heads(grad_k, groups), sum_kv_heads(grad_v, groups)


def _cuda_supports(can_use_name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool]:
    """`supports` of a CUDA kernel: what torch's own SDPA dispatcher asks (dtype, head size, architecture),
    for inputs shaped as the kernel gets them (key heads expanded; a view here, nothing copied)."""

    def supports(q, k, v) -> bool:
        k, v = (x[:, :1].expand_as(q) if kv_groups(q, k) > 1 else x for x in (k, v))
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False)
        return bool(getattr(torch.backends.cuda, can_use_name)(params))

    return supports


CPU_FLASH_KERNEL = PrefixAttentionKernel(
    "cpu-flash", _cpu_flash_forward, _cpu_flash_backward, supports=lambda q, k, v: q.device.type == "cpu"
)
CUDA_FLASH_KERNEL = PrefixAttentionKernel(
    "cuda-flash", _cuda_flash_forward, _cuda_flash_backward, _cuda_supports("can_use_flash_attention")
)
CUDA_EFFICIENT_KERNEL = PrefixAttentionKernel(
    "cuda-efficient", _cuda_efficient_forward, _cuda_efficient_backward,
    _cuda_supports("can_use_efficient_attention"),
)
# fused kernels by device type, the first that supports the inputs wins; otherwise BLOCKED_KERNEL
FUSED_PREFIX_KERNELS: dict[str, tuple[PrefixAttentionKernel, ...]] = {
    "cpu": (CPU_FLASH_KERNEL,),
    "cuda": (CUDA_FLASH_KERNEL, CUDA_EFFICIENT_KERNEL),
}
_forced_prefix_kernel: PrefixAttentionKernel | None = None


@contextmanager
def forced_prefix_kernel(kernel: PrefixAttentionKernel) -> Iterator[None]:
    """Run every TTT prefix attention, forward and backward, on `kernel` while active, whatever the device
    (benchmarks comparing kernels, tests). Put the backward inside too. A module global, not a context
    variable: the autograd engine runs a CUDA backward on threads of its own."""
    global _forced_prefix_kernel
    previous, _forced_prefix_kernel = _forced_prefix_kernel, kernel
    try:
        yield
    finally:
        _forced_prefix_kernel = previous


def prefix_attention_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> PrefixAttentionKernel:
    """The kernel the prefix attention of these inputs runs on: the forced one, else the first fused kernel
    of q's device that supports them, else `BLOCKED_KERNEL`."""
    if _forced_prefix_kernel is not None:
        return _forced_prefix_kernel
    for kernel in FUSED_PREFIX_KERNELS.get(q.device.type, ()):
        if kernel.supports(q, k, v):
            return kernel
    return BLOCKED_KERNEL


def causal_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [B, Hq, T, D] over k, v [B, Hkv, T, D] (grouped query) and its log-sum-exp
    [B, Hq, T] in float32, which is what lets more keys be merged in afterwards exactly."""
    return prefix_attention_kernel(q, k, v).forward(q, k, v)


def causal_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k, v) of causal attention, given the output and log-sum-exp of the softmax it is part of:
    with a merged output and log-sum-exp, these are the prefix's share of the merged attention's gradients.
    Any kernel's backward pairs with any kernel's forward: all of them mean the same log-sum-exp."""
    return prefix_attention_kernel(q, k, v).backward(grad_out, q, k, v, out, lse)


class BlockedCausalAttention:
    """`causal_attention_with_lse` and its backward in plain torch, in blocks of query rows: a block of
    scores holds at most `score_elements` (and at least one row), never [B, Hq, T, T]. The fallback where no
    fused kernel takes the inputs (float64 on CUDA, other devices), and the reference the fused ones are
    tested against."""

    score_elements = 2**26  # 256 MiB of float32 scores per block

    @classmethod
    def blocks(cls, q: torch.Tensor) -> Iterator[tuple[int, int]]:
        B, heads, T, _ = q.shape
        rows = max(1, cls.score_elements // (B * heads * T))
        for start in range(0, T, rows):
            yield start, min(start + rows, T)

    @staticmethod
    def scores(q: torch.Tensor, k: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Scores [B, Hkv, G, end-start, end] of queries start..end-1 over keys 0..end-1, causal, at least
        float32."""
        scale, wide = q.shape[-1] ** -0.5, accumulation_dtype(q)
        rows = q[:, :, start:end].unflatten(1, (k.shape[1], -1)).to(wide)
        scores = rows @ k[:, :, None, :end].to(wide).transpose(-1, -2) * scale
        causal = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
        return scores.masked_fill(~causal, float("-inf"))

    @classmethod
    def forward(cls, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        wide = accumulation_dtype(q)
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=wide)
        for start, end in cls.blocks(q):
            scores = cls.scores(q, k, start, end)
            chunk_lse = scores.logsumexp(-1)
            weights = (scores - chunk_lse[..., None]).exp()
            out[:, :, start:end] = (weights @ v[:, :, None, :end].to(wide)).flatten(1, 2).to(q.dtype)
            lse[:, :, start:end] = chunk_lse.flatten(1, 2)
        return out, lse

    @classmethod
    def backward(cls, grad_out, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale, wide, groups = q.shape[-1] ** -0.5, accumulation_dtype(q), (k.shape[1], -1)
        grad_q = torch.empty_like(q)
        grad_k, grad_v = torch.zeros_like(k, dtype=wide), torch.zeros_like(v, dtype=wide)
        delta = (grad_out.to(wide) * out.to(wide)).sum(-1)  # [B, Hq, T]
        for start, end in cls.blocks(q):
            rows = slice(start, end)
            weights = (cls.scores(q, k, start, end) - lse[:, :, rows].unflatten(1, groups)[..., None]).exp()
            grad_rows = grad_out[:, :, rows].unflatten(1, groups).to(wide)
            grad_v[:, :, :end] += (weights.transpose(-1, -2) @ grad_rows).sum(2)
            grad_weights = grad_rows @ v[:, :, None, :end].to(wide).transpose(-1, -2)
            grad_scores = weights * (grad_weights - delta[:, :, rows].unflatten(1, groups)[..., None]) * scale
            grad_q[:, :, rows] = (grad_scores @ k[:, :, None, :end].to(wide)).flatten(1, 2).to(q.dtype)
            query_rows = q[:, :, rows].unflatten(1, groups).to(wide)
            grad_k[:, :, :end] += (grad_scores.transpose(-1, -2) @ query_rows).sum(2)
        return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype)


BLOCKED_KERNEL = PrefixAttentionKernel(
    "blocked", BlockedCausalAttention.forward, BlockedCausalAttention.backward, supports=lambda q, k, v: True
)

def diagonal_scores(rows: torch.Tensor, keys: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Scores [n, B, Hkv, G, T] of query row j (rows [B, Hkv, G, T, D]) with row j of each key."""
    scale = rows.shape[-1] ** -0.5
    return torch.stack([(rows * key[:, :, None].to(rows.dtype)).sum(-1) * scale for key in keys])


class PrefixAndDiagonalsAttention(torch.autograd.Function):
    """TTT step n >= 1: row j attends to the step-0 keys 0..j (causal) and to row j of steps 1..n.

    Exact, with O(T) memory per head: the fused causal attention over the step-0 prefix returns its
    log-sum-exp L_p, and the n diagonal scores s_i = q_j . k_ij / sqrt(D) merge into it:
        L = log(e^L_p + sum_i e^s_i),   out = e^(L_p - L) out_p + sum_i e^(s_i - L) v_ij.
    The prefix's gradients are the fused kernel's backward run with the merged out and L (its softmax is a
    slice of the merged one); the diagonals' are elementwise. Nothing [T, T]-sized is kept for backward.
    """

    @staticmethod
    def forward(ctx, q, prefix_keys, prefix_values, *diagonals):
        keys, values = diagonals[: len(diagonals) // 2], diagonals[len(diagonals) // 2 :]
        wide = accumulation_dtype(q)
        with torch.autocast(q.device.type, enabled=False):
            prefix_out, prefix_lse = causal_attention_with_lse(q, prefix_keys, prefix_values)
            groups = (prefix_keys.shape[1], -1)
            rows = q.unflatten(1, groups).to(wide)  # [B, Hkv, G, T, D]
            scores = diagonal_scores(rows, keys)  # [n, B, Hkv, G, T]
            lse = torch.logaddexp(prefix_lse.unflatten(1, groups), scores.logsumexp(0))
            out = (prefix_lse.unflatten(1, groups) - lse).exp()[..., None] * prefix_out.unflatten(1, groups)
            for score, value in zip((scores - lse).exp(), values, strict=True):
                out = out + score[..., None] * value[:, :, None].to(wide)
            out, lse = out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)
        ctx.save_for_backward(q, prefix_keys, prefix_values, out, lse, *diagonals)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, prefix_keys, prefix_values, out, lse, *diagonals = ctx.saved_tensors
        keys, values = diagonals[: len(diagonals) // 2], diagonals[len(diagonals) // 2 :]
        wide = accumulation_dtype(q)
        with torch.autocast(q.device.type, enabled=False):
            grad_q, grad_prefix_keys, grad_prefix_values = causal_attention_backward(
                grad_out.contiguous(), q, prefix_keys, prefix_values, out, lse
            )
            groups = (prefix_keys.shape[1], -1)
            scale = q.shape[-1] ** -0.5
            rows, grad_rows = q.unflatten(1, groups).to(wide), grad_out.unflatten(1, groups).to(wide)
            delta = (grad_rows * out.unflatten(1, groups).to(wide)).sum(-1)  # [B, Hkv, G, T]
            weights = (diagonal_scores(rows, keys) - lse.unflatten(1, groups)).exp()
            grad_rows_q = grad_q.unflatten(1, groups).to(wide)
            grad_keys, grad_values = [], []
            for weight, key, value in zip(weights, keys, values, strict=True):
                grad_values.append((weight[..., None] * grad_rows).sum(2).to(value.dtype))
                grad_score = weight * ((grad_rows * value[:, :, None].to(wide)).sum(-1) - delta) * scale
                grad_rows_q = grad_rows_q + grad_score[..., None] * key[:, :, None].to(wide)
                grad_keys.append((grad_score[..., None] * rows).sum(2).to(key.dtype))
        grad_q = grad_rows_q.flatten(1, 2).to(q.dtype)
        return grad_q, grad_prefix_keys, grad_prefix_values, *grad_keys, *grad_values


class TTTCache:
    """Keys and values of a train-time-test unroll (teacher-forced, as speculators and SpecForge train).

    Step 0 attends causally over its own rows. At step n >= 1, row j sees the step-0 rows 0..j plus row j of
    every step 1..n (one diagonal per step): `PrefixAndDiagonalsAttention`, which never forms the
    [T, (n+1)T] mask nor [T, T] scores.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("a train-time-test unroll has its own attention pattern; it takes no mask")
        device = q.device.type
        if torch.is_autocast_enabled(device):  # in the autocast dtype, as autocast runs SDPA
            q, k, v = (x.to(torch.get_autocast_dtype(device)) for x in (q, k, v))
        self.keys.append(k)
        self.values.append(v)
        if len(self.keys) == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return PrefixAndDiagonalsAttention.apply(
            q, self.keys[0], self.values[0], *self.keys[1:], *self.values[1:]
        )


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v projections read the 2H-wide [embedding, hidden] input."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftCache | TTTCache,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = cache.attend(q, k, v, attention_mask)  # [B, heads, T, head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """`midlayer`: the decoder layer that reads [input_layernorm(embedding), hidden_norm(hidden)]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftCache | TTTCache,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        hidden = residual + self.self_attn(x, cos, sin, cache, attention_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 drafter. `embed_tokens=True` gives it its own embedding (a checkpoint that carries one);
    otherwise attach the target's with `attach_embedding`, which is frozen and never saved."""

    def __init__(self, config: DrafterConfig, *, embed_tokens: bool = False):
        super().__init__()
        config.check()
        self.config = config
        if embed_tokens:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.embed_tokens.requires_grad_(False)  # a copy of the target's; both trainers freeze it
        if config.fc_norm:  # one norm per aux state, as SpecForge and speculators key them: fc_norm.{i}
            self.fc_norm = nn.ModuleList(
                RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(config.num_aux_layers)
            )
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # The vocab map (identity on the first Vd ids until a real one is loaded).
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.rotary_emb = RotaryEmbedding(config)
        self.apply(self.init_module)

    @staticmethod
    def init_module(module: nn.Module, std: float = 0.02) -> None:
        """Initialise one module as Hugging Face Llama does (SpecForge trains from this init)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    # ---------------------------------------------------------------- embedding and vocab map

    @property
    def owns_embedding(self) -> bool:
        """True when the drafter carries its own `embed_tokens` (saved with it)."""
        return "embed_tokens" in self._modules

    def attach_embedding(self, embedding: nn.Embedding | torch.Tensor) -> None:
        """Use the target's input embedding [Vt, H] (frozen, a non-persistent buffer: never saved).

        Replaces an embedding the checkpoint carried, as SGLang and vLLM take the target's."""
        weight = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"embedding of shape {list(weight.shape)} does not fit this drafter: expected "
                f"{list(expected)}"
            )
        if self.owns_embedding:
            del self.embed_tokens
        self.register_buffer("target_embedding", weight.detach(), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.owns_embedding:
            return self.embed_tokens(input_ids)
        if getattr(self, "target_embedding", None) is None:
            raise RuntimeError(
                "this drafter has no token embedding: attach the target's with drafter.attach_embedding(...)"
            )
        return F.embedding(input_ids, self.target_embedding)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocab ids → target vocab ids (id + d2t[id])."""
        return draft_ids + self.d2t[draft_ids]

    # ---------------------------------------------------------------- one draft step

    def project_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """`fc` on the target's aux states (width A*Ht); the drafter's own states (width H) pass as is."""
        hidden = hidden.to(self.fc.weight.dtype)
        width = hidden.shape[-1]
        if width == self.fc.in_features and width != self.config.hidden_size:
            if self.config.fc_norm:
                chunks = hidden.split(self.config.target_hidden_size, dim=-1)
                normed = [norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)]
                hidden = torch.cat(normed, dim=-1)
            return self.fc(hidden)
        if width == self.config.hidden_size:
            return hidden
        c = self.config
        raise ValueError(
            f"hidden states of width {width}: expected the target's aux states ({c.num_aux_layers} x "
            f"{c.target_hidden_size} = {self.fc.in_features}) or the drafter's own ({c.hidden_size})"
        )

    def layer(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | TTTCache,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The state [B, T, H] one draft step feeds to the next: its output, normed when
        `feed_normed_hidden` (EAGLE-3.1); `compute_logits` takes it as it is."""
        if (
            input_ids.dim() != 2
            or hidden.shape[:2] != input_ids.shape
            or position_ids.shape != input_ids.shape
        ):
            raise ValueError(
                f"input_ids {list(input_ids.shape)}, hidden {list(hidden.shape)} and position_ids "
                f"{list(position_ids.shape)} must share [B, T]"
            )
        hidden = self.project_hidden(hidden)
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        embeds = self.embed(input_ids).to(hidden.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, cache, attention_mask)
        return self.norm(out) if self.config.feed_normed_hidden else out

    def compute_logits(self, layer_out: torch.Tensor) -> torch.Tensor:
        """Logits of a state from `layer`: already normed when it feeds norm(out) forward."""
        if self.config.feed_normed_hidden or not self.config.norm_before_lm_head:
            return self.lm_head(layer_out)
        return self.lm_head(self.norm(layer_out))

    @staticmethod
    def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
        """1..T per row: the embedded token t+1 sits at position t+1 (as speculators numbers them)."""
        T = input_ids.shape[1]
        return torch.arange(1, T + 1, device=input_ids.device).expand_as(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Step-0 logits [B, T, Vd]: row t pairs aux state t with token t+1 and predicts token t+2."""
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids)
        return self.compute_logits(self.layer(input_ids, aux_hidden_states, position_ids, DraftCache()))

    # ---------------------------------------------------------------- train-time test

    def unroll_steps(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield the state [B, T, H] each TTT step 0..steps-1 feeds forward (see `layer`), teacher-forced.

        Step k embeds the ground truth shifted by k more (0 past the end), at positions advanced by k, with
        the previous step's pre-norm output as the hidden state. One step at a time, and without logits: a
        trainer applies `compute_logits` to the rows it grades (at step k, the last k rows have no target)
        and takes each step's loss without holding every step's logits.
        """
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids)
        cache = TTTCache()
        hidden = aux_hidden_states
        for k in range(steps):
            tokens = F.pad(input_ids[:, k:], (0, min(k, input_ids.shape[1])), value=0)
            hidden = self.layer(tokens, hidden, position_ids + k, cache)
            yield hidden

    def unroll(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        steps: int,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Train-time test: (logits [K, B, T, Vd], layer_outs [K, B, T, H]) for K = `steps`."""
        layer_outs = list(self.unroll_steps(input_ids, aux_hidden_states, steps, position_ids))
        return torch.stack([self.compute_logits(out) for out in layer_outs]), torch.stack(layer_outs)

    # ---------------------------------------------------------------- incremental decoding

    @staticmethod
    def new_cache() -> DraftCache:
        return DraftCache()

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add t positions to `cache` and return (logits [B, t, Vd], layer_out [B, t, H]).

        `hidden` is [B, t, A*Ht] (target aux states, `fc` applied) or [B, t, H] (the drafter's own output).
        `attention_mask` is bool [B, t, len(cache)+t], True where a new position may attend (trees); the
        default is every cached position plus the new ones causally.
        """
        layer_out = self.layer(input_ids, hidden, position_ids, cache, attention_mask)
        return self.compute_logits(layer_out), layer_out
