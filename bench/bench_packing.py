"""Packed vs padded training rows on the shipped ShareGPT conversations, and the resident set of a long run.

    .venv/bin/python bench/bench_packing.py [--batch-sizes 4 16] [--rounds 3] [--modes online offline]
    .venv/bin/python bench/bench_packing.py --memory-steps 300 [--memory-every 50] [--memory-packing true]
                                            [--allocator trim-each-step|glibc|large-blocks] [--memory-trim]

Speed: SmolLM2-135M-Instruct as the target, a drafter of the chat drafter's size (H 576, Vd 8,192), seq_len
2,048, 4 TTT steps, one row a forward (micro-batches of 1: on a CPU a larger forward is slower per position,
its [rows, T, Vd] logits out of every cache), the recipe's dtype (`auto`), the conversations of
datasets/sharegpt-smollm2/ rendered as 00 renders them. Two trainers share the data, one packing its rows and
one padding one conversation a row to the batch's longest, and take turns step by step in one process, so that
both see the same machine. Prints, per mode and batch size, the real (non-padding) tokens per second of each,
the share of computed positions that are real, and the ratio.

Memory: one online run of `--memory-steps` steps (batch 4, seq_len 1,024) printing the resident set every
`--memory-every` steps, its growth after the first print, the tensors Python still holds and the seconds a
step; `--memory-trim` also gives the C heap's free pages back each time and prints what stays (allocator
retention against a leak). `--allocator`: the trainer's own (the heap trimmed after every step,
`devices.trim_heap`), glibc's default, or every block of 1 MiB or more in a mapping of its own (glibc's
M_MMAP_THRESHOLD fixed: freed at once, but each large tensor faults its pages in anew).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import tempfile
import time
from pathlib import Path

import torch

from eagle3lib.data.readers import offline_training_data
from eagle3lib.devices import machine_description, trim_heap
from eagle3lib.generation.capture import prepare_for_run
from eagle3lib.generation.online import online_training_data
from eagle3lib.params import load_params
from eagle3lib.target.model import Target
from eagle3lib.training import arms
from eagle3lib.training.trainer import Processes, Trainer

DATA = "datasets/sharegpt-smollm2"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
CHAT_DRAFTER = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192}


def recipe(mode: str, batch_size: int, seq_len: int, packing: bool, num_tokens: int, micro: int = 1) -> dict:
    return load_params(None, {
        "run": {"device": "cpu"},
        "target": {"spec": "zoo:smollm2-135m-instruct"},
        "data": {"corpus": DATA, "text": "conversation", "num_tokens": num_tokens, "seq_len": seq_len,
                 "batch_size": 8, "dtype": "bfloat16", "draft_vocab_size": 8192},
        "train": {"data_mode": mode, "steps": 10**6, "batch_size": batch_size, "micro_batch_size": micro,
                  "seq_len": seq_len, "ttt_steps": 4, "checkpoint_every": 0, "check_batches": 1,
                  "packing": packing, "lr": 1e-3, "warmup_steps": 10, "scratch": CHAT_DRAFTER},
    })


def make_trainer(params: dict, data, out: Path) -> Trainer:
    drafter, _ = arms.init_drafter("scratch", params["train"], data, params["run"]["seed"])
    seed = params["run"]["seed"]
    return Trainer(drafter, data, params["train"], seed, out, Processes(), log=lambda *_: None)


def step(trainer: Trainer) -> tuple[float, int, int]:
    """One optimizer step as `Trainer.fit` takes it: (seconds, real tokens, computed positions)."""
    start = time.perf_counter()
    _, _, tokens, positions = trainer._optimizer_step(trainer.stream.next())
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, tokens, positions


def resident_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


def training_data(mode: str, params: dict, work: Path):
    if mode == "online":
        return online_training_data(params, work / "online", torch.device("cpu"))
    run_dir = work / "offline"
    if not (run_dir / "00_prepare_data").exists():
        target = Target.from_params(params["target"], "cpu")
        prepare_for_run(target, params, "main", run_dir)
        del target
    return offline_training_data(params["train"], run_dir)


def compare(mode: str, batch_size: int, rounds: int, work: Path) -> None:
    # enough conversations for every step of both trainers, and the first one of each left out (warm-up)
    num_tokens = (rounds + 2) * batch_size * 2048
    made = {}
    for packing in (True, False):
        params = recipe(mode, batch_size, 2048, packing, num_tokens)
        data = training_data(mode, params, work / f"{mode}-{batch_size}")
        made[packing] = make_trainer(params, data, work / f"{mode}-{batch_size}-{packing}")
    totals = {packing: [0.0, 0, 0] for packing in made}
    for round_ in range(rounds + 1):
        for packing, trainer in made.items():
            seconds, tokens, positions = step(trainer)
            if round_:  # the first step of each pays one-off costs
                for i, value in enumerate((seconds, tokens, positions)):
                    totals[packing][i] += value
    speed = {packing: tokens / seconds for packing, (seconds, tokens, _) in totals.items()}
    for packing, (seconds, tokens, positions) in totals.items():
        print(f"  {mode:7s} batch {batch_size:2d} {'packed' if packing else 'padded'}: "
              f"{speed[packing]:7.0f} real tokens/s, real fraction {tokens / positions:.2f} "
              f"({tokens:,} tokens in {seconds:.1f} s over {rounds} steps)")
    print(f"  {mode:7s} batch {batch_size:2d} packed / padded: {speed[True] / speed[False]:.2f}x")


def live_tensor_gb() -> float:
    """What the Python side holds: the bytes of every tensor storage still referenced (each counted once)."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**30


def memory(steps: int, every: int, packing: bool, allocator: str, trim: bool, work: Path) -> None:
    if allocator == "large-blocks":
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    params = recipe("online", 4, 1024, packing, 4 * 1024 * (steps + 2))
    trainer = make_trainer(params, training_data("online", params, work / "memory"), work / "memory-run")
    print(f"  online run, batch 4 x seq_len 1,024, packing {packing}, allocator {allocator}: resident set "
          f"every {every} steps" + (", then again after malloc_trim" if trim else ""))
    first, seconds = None, 0.0
    for n in range(1, steps + 1):
        seconds += step(trainer)[0]
        if allocator == "trim-each-step":
            start = time.perf_counter()
            trim_heap()
            seconds += time.perf_counter() - start
        if n % every == 0:
            gc.collect()
            now = resident_gb()
            first = first or now
            line = (f"    step {n:4d}: {now:.2f} GB ({100 * (now / first - 1):+.1f} % since step {every}), "
                    f"live tensors {live_tensor_gb():.2f} GB, {seconds / every:.2f} s a step")
            seconds = 0.0
            if trim:
                trim_heap()
                line += f", {resident_gb():.2f} GB after malloc_trim"
            print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--modes", nargs="+", default=["online", "offline"], choices=["online", "offline"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=0, help="> 0: the resident-set run instead")
    parser.add_argument("--memory-every", type=int, default=50)
    parser.add_argument("--memory-packing", default="true", choices=["true", "false"])
    parser.add_argument("--allocator", default="trim-each-step",
                        choices=["trim-each-step", "glibc", "large-blocks"])
    parser.add_argument("--memory-trim", action="store_true",
                        help="also give free heap pages back at each print (glibc malloc_trim): resident "
                        "memory that falls then was the allocator's, not a leak")
    args = parser.parse_args()
    print(f"machine: {machine_description()}; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as work:
        if args.memory_steps:
            memory(args.memory_steps, args.memory_every, args.memory_packing == "true", args.allocator,
                   args.memory_trim, Path(work))
            return
        for mode in args.modes:
            for batch_size in args.batch_sizes:
                compare(mode, batch_size, args.rounds, Path(work))


if __name__ == "__main__":
    main()
