"""The attention of train-time test: an unrolled step attends to the step-0 prefix and to one diagonal per
step, in O(T) memory, on the fastest kernel the device has (docs/formats.md §5).

Step 0 of a TTT unroll attends causally over its own rows. At step n >= 1, row j sees the step-0 rows 0..j
plus row j of every step 1..n. `PrefixAndDiagonalsAttention` computes that exactly without ever forming the
[T, (n+1)T] mask or [T, T] scores: a fused causal attention over the prefix returns its log-sum-exp, and the
n diagonal scores merge into it. The prefix kernel is chosen per device (`prefix_attention_kernel`): CPU
flash, CUDA flash or memory-efficient, else the blocked plain-torch reference (`BLOCKED_KERNEL`), which the
fused ones are tested against. `TTTCache` is the cache the drafter's attention uses during an unroll.

A packed row holds several documents (`Segments`: runs of rows): the step-0 prefix then attends within each
document alone, one causal attention per run, so that no block across documents is ever computed; the
diagonals stay within a row, hence within its document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Per batch row, the (start, end) runs of rows that form one document each, covering the row.
Segments = tuple[tuple[tuple[int, int], ...], ...]


def segments_of(documents: torch.Tensor) -> Segments | None:
    """The runs of equal document numbers in each row of `documents` [B, R]; None when every row is one run
    (nothing to keep apart)."""
    runs = []
    for row in documents.tolist():
        starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
        runs.append(tuple(zip(starts, [*starts[1:], len(row)], strict=True)))
    return None if all(len(row) == 1 for row in runs) else tuple(runs)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments | None
) -> torch.Tensor:
    """Causal attention (SDPA, grouped query) of each segment alone; of each whole row without segments."""
    if segments is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return torch.cat([
        torch.cat([F.scaled_dot_product_attention(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e],
                                                  v[b : b + 1, :, s:e], is_causal=True, enable_gqa=True)
                   for s, e in row], dim=2)
        for b, row in enumerate(segments)
    ])


class TTTCache:
    """Keys and values of a train-time-test unroll (teacher-forced, as speculators and SpecForge train).

    Step 0 attends causally over its own rows. At step n >= 1, row j sees the step-0 rows 0..j plus row j of
    every step 1..n (one diagonal per step): `PrefixAndDiagonalsAttention`, which never forms the
    [T, (n+1)T] mask nor [T, T] scores. With `segments` (a packed batch) the step-0 rows a row sees are
    those of its own document only.
    """

    def __init__(self, segments: Segments | None = None) -> None:
        self.segments = segments
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
            return causal_attention(q, k, v, self.segments)
        return PrefixAndDiagonalsAttention.apply(
            q, self.keys[0], self.values[0], self.segments, *self.keys[1:], *self.values[1:]
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
    def forward(ctx, q, prefix_keys, prefix_values, segments, *diagonals):
        keys, values = diagonals[: len(diagonals) // 2], diagonals[len(diagonals) // 2 :]
        wide = accumulation_dtype(q)
        ctx.segments = segments
        with torch.autocast(q.device.type, enabled=False):
            prefix_out, prefix_lse = causal_attention_with_lse(q, prefix_keys, prefix_values, segments)
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
                grad_out.contiguous(), q, prefix_keys, prefix_values, out, lse, ctx.segments
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
        return grad_q, grad_prefix_keys, grad_prefix_values, None, *grad_keys, *grad_values


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [B, Hq, T, D] over k, v [B, Hkv, T, D] (grouped query) and its log-sum-exp
    [B, Hq, T] in float32, which is what lets more keys be merged in afterwards exactly. With `segments`,
    each segment of a row attends within itself alone (one kernel call each)."""
    kernel = prefix_attention_kernel(q, k, v)
    if segments is None:
        return kernel.forward(q, k, v)
    out, lse = torch.empty_like(q), None
    for b, s, e in _pieces(segments):
        piece_out, piece_lse = kernel.forward(*(x[b : b + 1, :, s:e] for x in (q, k, v)))
        if lse is None:
            lse = q.new_empty(q.shape[:3], dtype=piece_lse.dtype)
        out[b : b + 1, :, s:e], lse[b : b + 1, :, s:e] = piece_out, piece_lse
    return out, lse


def causal_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    segments: Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k, v) of causal attention, given the output and log-sum-exp of the softmax it is part of:
    with a merged output and log-sum-exp, these are the prefix's share of the merged attention's gradients.
    Any kernel's backward pairs with any kernel's forward: all of them mean the same log-sum-exp."""
    kernel = prefix_attention_kernel(q, k, v)
    if segments is None:
        return kernel.backward(grad_out, q, k, v, out, lse)
    grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b, s, e in _pieces(segments):
        pieces = (x[b : b + 1, :, s:e].contiguous() for x in (grad_out, q, k, v, out, lse))
        for grad, piece in zip(grads, kernel.backward(*pieces), strict=True):
            grad[b : b + 1, :, s:e] = piece
    return grads


def _pieces(segments: Segments) -> Iterator[tuple[int, int, int]]:
    return ((b, s, e) for b, row in enumerate(segments) for s, e in row)


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
