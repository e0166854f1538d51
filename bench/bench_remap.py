"""Time an lm_head remap at the size of a real drafter (Kimi-K2: Vd 32,000 x H 7,168) and print peak memory.

    .venv/bin/python bench/bench_remap.py [--dtype bfloat16] [--missing mean]

Two maps built from different random Zipf token counts (as two data sets give) over Vt 163,840 share most
tokens at shifted positions. Prints seconds for the remap alone and the process's peak resident memory, in
units of one lm_head matrix: the source matrix plus the remapped one is 2.0.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from eagle3lib.drafter.vocab import VocabMap, diff
from eagle3lib.training.remap import remap_rows


def zipf_counts(vt: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(vt, generator=generator).double() + 1
    return (1e9 / ranks).round().long() + torch.randint(0, 1000, (vt,), generator=generator)


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vd", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=7_168)
    parser.add_argument("--vt", type=int, default=163_840)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--missing", default="mean", choices=["mean", "zeros", "random", "verifier"])
    args = parser.parse_args()

    # two count tables that agree on the commonest tokens and differ in the tail
    base = zipf_counts(args.vt, 0)
    old = VocabMap.from_counts(base + zipf_counts(args.vt, 1) // 50, args.vd)
    new = VocabMap.from_counts(base + zipf_counts(args.vt, 2) // 50, args.vd)
    print(diff(old, new, label_a="old", label_b="new").summary())

    dtype = getattr(torch, args.dtype)
    baseline = rss_bytes()
    weight = torch.empty(args.vd, args.hidden, dtype=dtype).normal_()
    matrix = weight.numel() * weight.element_size()
    target_head = None
    if args.missing == "verifier":  # only the rows to fill are read; a full [Vt, H] head would dwarf the rest
        target_head = torch.empty(args.vt, args.hidden, dtype=dtype).normal_()

    start = time.perf_counter()
    remapped = remap_rows(weight, old, new, args.missing, target_head=target_head)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"remap {args.vd:,} x {args.hidden:,} {args.dtype} lm_head (missing={args.missing}): "
        f"{seconds:.2f} s; one matrix = {matrix / 2**30:.2f} GiB; peak RSS {peak / 2**30:.2f} GiB, "
        f"{(peak - baseline) / matrix:.2f} matrices above the {baseline / 2**30:.2f} GiB before the matrix "
        "existed" + (" (this includes the [Vt, H] target head)" if target_head is not None else "")
    )
    assert remapped.shape == (new.vd, args.hidden)


if __name__ == "__main__":
    main()
