"""Speculative decoding on SmolLM2-135M-Instruct with chain drafting: τ, tokens/s, speedup, efficiency.

    .venv/bin/python bench/bench_speculate.py --drafter outputs/<run>/04_finetune/scratch/drafter
    .venv/bin/python bench/bench_speculate.py --steps 1,3,5 --prompts 8 --max-new-tokens 64 --dtype float32
    .venv/bin/python bench/bench_speculate.py --topk 4 --num-draft-tokens 8    # trees instead of chains

For each draft depth K: τ, the acceptance at each draft position, tokens/s with and without the drafter on
the same held-out prompts, the measured speedup, the ideal speedup that τ and the measured draft/verify
costs allow, and efficiency = measured / ideal (what prefill and bookkeeping leave). Greedy decoding must
give the target's own output (`same`: prompts whose speculative output equals the target-only output; in
bfloat16 a near tie can flip between a one-token and a K+1-token forward pass). Without --drafter the
newest `outputs/*/04_finetune/*/drafter` made for this target is used. Numbers, never asserts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from eagle3lib import engines, speculate
from eagle3lib.checkpoint import load_drafter
from eagle3lib.config import read_config
from eagle3lib.runs import REPO_ROOT
from eagle3lib.target import Target

TARGET = "zoo:smollm2-135m-instruct"


def newest_drafter(vocab_size: int) -> Path:
    """The most recent drafter trained in a run folder whose config fits a target of `vocab_size`."""
    found = REPO_ROOT.glob("outputs/*/04_finetune/*/drafter/config.json")
    found = sorted(found, key=lambda p: p.stat().st_mtime)
    fitting = [p.parent for p in found if read_config(p.parent)[0].vocab_size == vocab_size]
    if not fitting:
        sys.exit(f"no drafter for a Vt {vocab_size} target under outputs/*/04_finetune/; give --drafter PATH "
                 "(e.g. train one with `eagle3 run params/demo.yaml --only 00,04`)")
    return fitting[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", help="drafter checkpoint folder (default: the newest trained one)")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--steps", default="1,3,5", help="comma-separated draft depths K")
    parser.add_argument("--topk", type=int, default=1, help="1: chain drafting; > 1: tree drafting")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="tree budget (default: full tree)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--corpus", default="stdlib-code", help="held-out prompts: stdlib-code | pydoc-prose")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    target = Target.load(args.target, dtype=args.dtype, device="cpu")
    drafter_path = Path(args.drafter) if args.drafter else newest_drafter(target.vocab_size)
    prompts = engines.probe_prompts(target.tokenizer, args.corpus, args.prompts, 600, args.chat)
    print(f"{target.name} ({target.dtype}, {args.threads} threads), drafter {drafter_path}")
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} held-out {args.corpus} prompts of {min(lengths)}-{max(lengths)} tokens, "
          f"{args.max_new_tokens} new tokens each, greedy {'chain' if args.topk == 1 else 'tree'} drafting "
          f"(loaded in {time.perf_counter() - start:.1f} s)\n")
    header = (f"{'K':>2} {'τ':>5}  {'accept by position':<26} {'tok/s':>6} {'target':>7} {'speedup':>8} "
              f"{'ideal':>6} {'effic.':>6} {'draft ms':>9} {'verify ms':>9} {'target ms':>9} {'same':>5}")
    print(header)
    print("-" * len(header))
    for steps in (int(k) for k in args.steps.split(",")):
        drafter, _ = load_drafter(drafter_path, dtype=target.dtype)
        settings = speculate.DraftSettings(steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
        m = speculate.probe(target.model, drafter, prompts, settings, args.max_new_tokens).metrics
        per_position = " ".join(f"{r:.2f}" for r in m["acceptance_per_position"])
        print(f"{steps:>2} {m['tau']:5.2f}  {per_position:<26} {m['tokens_per_s']:6.1f} "
              f"{m['target_tokens_per_s']:7.1f} {m['speedup']:7.2f}x {m['ideal_speedup']:5.2f}x "
              f"{m['efficiency']:6.0%} {m['draft_ms_per_round']:9.1f} {m['verify_ms_per_round']:9.1f} "
              f"{m['target_ms_per_step']:9.1f} {m['matches_target']:5.0%}", flush=True)


if __name__ == "__main__":
    main()
