"""A decoding step's attention over a batch's KV cache that reads each row's own columns only
(`decode_attention.cpp`), for the compiled decoding steps (`target.direct`).

Built on first use with the machine's C++ compiler (as `torch.compile` builds its own kernels there), for
this machine's instruction set, into torch's extension cache; registered as the operator
`eagle3lib::decode_attention` so that a compiled graph calls it as one node.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import torch
from torch import Tensor
from torch.utils import cpp_extension

SOURCE = Path(__file__).with_suffix(".cpp")

_built = None


def _machine() -> str:
    """This CPU's model and instruction sets: code built with -march=native runs only on such a CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _module():
    global _built
    if _built is None:
        tag = hashlib.sha256(_machine().encode()).hexdigest()[:10]
        try:
            _built = cpp_extension.load(
                name=f"eagle3lib_decode_attention_{tag}", sources=[str(SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
        except Exception as error:  # a compiler's failure comes as several exception types
            raise RuntimeError(f"compiled decoding builds its attention kernel {SOURCE} with this machine's "
                               f"C++ compiler (as torch.compile does), which failed: {error}") from error
    return _built


@torch.library.custom_op("eagle3lib::decode_attention", mutates_args=(), device_types="cpu")
def decode_attention(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, first: Tensor,
                     scale: float) -> Tensor:
    """Attention [B, n, H, D] of query [B, H, n, D] over keys and values [B, Hkv, C, D] (grouped-query heads
    sharing theirs) with the additive mask [B, 1, n, C], row b reading only columns first[b] (int64) on."""
    return _module().decode_attention(query, keys, values, mask, first, scale)


@decode_attention.register_fake
def _(query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, first: Tensor, scale: float) -> Tensor:
    batch, heads, news, dim = query.shape
    return query.new_empty(batch, news, heads, dim)
