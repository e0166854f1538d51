"""Capture throughput against the target's plain forward on the same batch (prints, never asserts).

    .venv/bin/python bench/bench_capture.py [--target zoo:smollm2-135m-instruct] [--batch 4] [--seq 256]

"plain" is `model(input_ids).logits` (what any user of the model runs); "capture" is
`Target.capture` (aux states by hooks, normed last state, argmax over the full vocabulary).
Each is timed as the median of --repeats runs, alternating, after one warm-up, so that load from
other processes on a shared machine hits both alike. Besides wall time it prints CPU time per thread
(process CPU seconds / torch threads): on a machine other jobs share, that is closer to what an idle
machine gives.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagle3lib.target.model import Target


def median_seconds(fns: list, repeats: int) -> list[tuple[float, float]]:
    """(median wall seconds, median CPU seconds per thread) of each function."""
    times: list[list[tuple[float, float]]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for _ in range(repeats):
        for fn, slot in zip(fns, times, strict=True):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            slot.append((time.perf_counter() - wall, (time.process_time() - cpu) / torch.get_num_threads()))
    return [(statistics.median(w for w, _ in slot), statistics.median(c for _, c in slot)) for slot in times]


def bench_one(spec: str, dtype: str, device: str, batch: int, seq: int, repeats: int) -> None:
    target = Target.load(spec, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, target.vocab_size, (batch, seq), generator=generator).to(target.device)

    def synchronize() -> None:
        if target.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def plain() -> None:
        target.model(input_ids=input_ids, use_cache=False)
        synchronize()

    def capture() -> None:
        target.capture(input_ids)
        synchronize()

    (plain_wall, plain_cpu), (capture_wall, capture_cpu) = median_seconds([plain, capture], repeats)
    tokens = input_ids.numel()
    for clock, plain_s, capture_s in (("wall", plain_wall, capture_wall), ("cpu", plain_cpu, capture_cpu)):
        if clock == "cpu" and target.device.type != "cpu":
            continue
        print(
            f"{target.name} {dtype:>8} {target.device} {clock:>4} time: plain {tokens / plain_s:7.0f} tok/s, "
            f"capture {tokens / capture_s:7.0f} tok/s, capture costs {100 * (capture_s / plain_s - 1):+.1f} %"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch} x {args.seq}")
    for dtype in args.dtypes.split(","):
        bench_one(args.target, dtype, args.device, args.batch, args.seq, args.repeats)


if __name__ == "__main__":
    main()
