"""Online vs offline training on SmolLM2-135M-Instruct: tokens/s and the disk each mode uses.

    .venv/bin/python bench/bench_online.py [--tokens 12000] [--steps 12] [--target-dtype auto]

The same recipe both ways: raw stdlib-code text, a SmolLM2-sized scratch drafter (Vd 4,096), batch 4 x 512,
7 TTT steps, fp32 training. Offline captures the text first (hidden states in bf16, as the demo stores
them), then trains; online keeps the text's tokens and runs the target on each batch inside the loop.
Prints the preparation's wall time and disk, and the training steps' tokens/s as the trainer logs them
(the first log window, with its one-off costs, left out).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from eagle3lib.generation.capture import prepare_for_run
from eagle3lib.generation.online import FOLDER
from eagle3lib.params import load_params
from eagle3lib.target.model import Target
from eagle3lib.training import train


def folder_megabytes(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def recipe(mode: str, args: argparse.Namespace) -> dict:
    return load_params(None, {
        "run": {"device": "cpu"},
        "target": {"spec": "zoo:smollm2-135m-instruct", "dtype": args.target_dtype},
        "data": {"corpus": "stdlib-code", "num_tokens": args.tokens, "text": "raw", "seq_len": 512,
                 "batch_size": 8, "dtype": "bfloat16", "draft_vocab_size": 4096},
        "train": {"data_mode": mode, "steps": args.steps, "batch_size": 4, "micro_batch_size": 1,
                  "seq_len": 512, "ttt_steps": 7, "log_every": 2, "checkpoint_every": 0, "check_batches": 1,
                  "dtype": "fp32",
                  "scratch": {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                              "intermediate_size": 1536, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                              "max_position_embeddings": 8192}},
    })


def training_tokens_per_s(arm_folder: Path) -> float:
    windows = [json.loads(line) for line in (arm_folder / "metrics.jsonl").read_text().splitlines()][1:]
    return sum(w["tokens_per_s"] for w in windows) / len(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=12000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--target-dtype", default="auto")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.tokens} tokens of raw stdlib code, "
          f"{args.steps} steps")
    with tempfile.TemporaryDirectory() as work:
        run_dir = Path(work) / "offline"
        params = recipe("offline", args)
        target = Target.load(params["target"]["spec"], dtype=params["target"]["dtype"], device="cpu")
        print(f"target {target}")
        start = time.perf_counter()
        prepare_for_run(target, params, "main", run_dir)
        capture_s = time.perf_counter() - start
        del target
        train.train_arms(params, run_dir / "04_finetune", run_dir)
        offline = {"prepare_s": capture_s, "disk_mb": folder_megabytes(run_dir / "00_prepare_data"),
                   "tokens_per_s": training_tokens_per_s(run_dir / "04_finetune" / "scratch")}

        out = Path(work) / "online" / "04_finetune"
        start = time.perf_counter()
        train.train_arms(recipe("online", args), out)
        total_s = time.perf_counter() - start
        online = {"total_s": total_s, "disk_mb": folder_megabytes(out / FOLDER),
                  "tokens_per_s": training_tokens_per_s(out / "scratch")}
    print(f"offline: capture {offline['prepare_s']:.0f} s ({args.tokens / offline['prepare_s']:.0f} tok/s), "
          f"{offline['disk_mb']:.1f} MB on disk; training {offline['tokens_per_s']:.0f} tok/s")
    print(f"online:  {online['disk_mb']:.2f} MB on disk (text, counts, map); training "
          f"{online['tokens_per_s']:.0f} tok/s with the target in the loop "
          f"({online['total_s']:.0f} s in all)")
    ratio = online["tokens_per_s"] / offline["tokens_per_s"]
    less = offline["disk_mb"] / online["disk_mb"]
    print(f"online / offline training throughput: {ratio:.2f}x; disk {less:.0f}x less online")


if __name__ == "__main__":
    main()
