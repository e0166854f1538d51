"""Time the matrix products of a (K+1)-token verification against a one-token step, weights from memory.

    .venv/bin/python bench/bench_small_products.py [--rows 1,2,4,8,16]

Speculation pays only if verifying K+1 tokens per sequence costs about what one token costs. On a CPU that
holds for the matrix products when they are bound by reading the weights, not by arithmetic. For one
SmolLM2-135M MLP shape (1536 x 576, float32) and its vocabulary head (49152 x 576), cycled through enough
different weights that each comes from memory as in a forward pass, prints ms per product with M rows for
`F.linear` (MKL here), oneDNN with the weight reordered once (`torch.ops.mkldnn._linear_pointwise`, where this
torch build has it) and M one-row products, plus the bandwidth a one-row product reaches.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"MLP up (1536 x 576)": (1536, 576), "vocabulary head (49152 x 576)": (49152, 576)}
CACHE_BYTES = 256 * 2**20  # cycle through more weight bytes than any last-level cache holds


def ms_per_product(product, weights: list[torch.Tensor], x: torch.Tensor, repeats: int = 5) -> float:
    for weight in weights:  # warm-up: first-call allocations and kernel selection
        product(x, weight)
    start = time.perf_counter()
    for _ in range(repeats):
        for weight in weights:
            product(x, weight)
    return (time.perf_counter() - start) / repeats / len(weights) * 1e3


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def one_row_at_a_time(x: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    return [torch.mv(weight, row) for row in x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated rows M (tokens in one product)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    packed_available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    print(f"torch {torch.__version__}, {args.threads} threads, float32, ms per product")
    for name, (out_features, in_features) in SHAPES.items():
        count = max(2, CACHE_BYTES // (out_features * in_features * 4))
        weights = [torch.randn(out_features, in_features) for _ in range(count)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights] if packed_available else []
        print(f"\n{name}, {count} weights in turn")
        print(f"{'M':>3} {'F.linear':>9} {'oneDNN packed':>14} {'M one-row':>10}")
        for m in rows:
            x = torch.randn(m, in_features)
            plain = ms_per_product(F.linear, weights, x)
            oned = ms_per_product(packed_linear, packed, x) if packed else float("nan")
            one_rows = ms_per_product(one_row_at_a_time, weights, x)
            print(f"{m:>3} {plain:>9.3f} {oned:>14.3f} {one_rows:>10.3f}")
            if m == 1:
                best = min(plain, oned) if packed else plain
                gbps = out_features * in_features * 4 / (best * 1e-3) / 1e9
                print(f"    one row streams the weight at {gbps:.1f} GB/s (the faster kernel)")


if __name__ == "__main__":
    main()
