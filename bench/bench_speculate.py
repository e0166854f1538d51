"""Speculative decoding on SmolLM2-135M-Instruct with chain drafting: τ, tokens/s, speedups, efficiency.

    .venv/bin/python bench/bench_speculate.py --drafter drafters/smollm2-135m-chat --corpus sharegpt
    .venv/bin/python bench/bench_speculate.py --steps 1,3 --batch-sizes 1,4,8,16 --prompts 16   # batching
    .venv/bin/python bench/bench_speculate.py --topk 4 --num-draft-tokens 8    # trees instead of chains
    .venv/bin/python bench/bench_speculate.py --compiled --batch-sizes 1   # the target's compiled steps

For each batch size (prompts decoded together; the target-only baseline decodes the same batches) and each
draft depth K: τ, the acceptance at each draft position, tokens/s with and without the drafter on
the same held-out prompts, the measured speedup (end to end, and in decoding alone), the ideal speedup
that τ and the measured draft/verify costs allow, and efficiency = measured / ideal (what prefill and
bookkeeping leave). Greedy decoding must
give the target's own output (`same`: prompts whose speculative output equals the target-only output; in
bfloat16 a near tie can flip between a one-token and a K+1-token forward pass). Without --drafter the
shipped source drafter (drafters/smollm2-135m-chat) is used. Numbers, never asserts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eagle3lib.decoding import batches, engines, probe, speculate
from eagle3lib.reports import publish
from eagle3lib.target.model import Target

TARGET = "zoo:smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=str(publish.DEMO_SOURCE_DRAFTER),
                        help="drafter checkpoint folder (default: the shipped source drafter)")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--steps", default="1,3,5", help="comma-separated draft depths K")
    parser.add_argument("--topk", type=int, default=1, help="1: chain drafting; > 1: tree drafting")
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="tree budget (default: full tree)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-sizes", default="1,16", help="prompts decoded together, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--corpus", default="sharegpt", help="prompts, as probe.corpus")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compiled", action="store_true",
                        help="verifications and the target's steps alone through the compiled graph")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    target = Target.load(args.target, dtype=args.dtype, device="cpu")
    drafter_path = Path(args.drafter)
    prompts = engines.probe_prompts(target.tokenizer, args.corpus, args.prompts, 600, args.chat)
    steps = "compiled" if args.compiled else "eager"
    print(f"{target.name} ({target.dtype}, {args.threads} threads, {steps} target steps), "
          f"drafter {drafter_path}")
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} held-out {args.corpus} prompts of {min(lengths)}-{max(lengths)} tokens, "
          f"{args.max_new_tokens} new tokens each, greedy {'chain' if args.topk == 1 else 'tree'} drafting "
          f"(loaded in {time.perf_counter() - start:.1f} s)\n")
    header = (f"{'batch':>5} {'K':>2} {'τ':>5}  {'accept by position':<26} {'tok/s':>6} {'target':>7} "
              f"{'speedup':>8} {'decoding':>8} {'ideal':>6} {'effic.':>6} {'draft ms':>9} {'verify ms':>9} "
              f"{'target ms':>9} {'same':>5} {'vs batch 1':>10}")
    print(header)
    print("-" * len(header))
    drafter, _ = engines.decoding_drafter(drafter_path, target)
    single: dict[int, float] = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        reuse = batches.PrefillCache()  # every K of this batching shares its prefill and its baseline
        baseline = None
        for steps in (int(k) for k in args.steps.split(",")):
            settings = speculate.DraftSettings(steps, topk=args.topk, num_draft_tokens=args.num_draft_tokens)
            result = probe.probe(target.model, drafter, prompts, settings, args.max_new_tokens,
                                     batch_size=batch, baseline=baseline, reuse=reuse, compiled=args.compiled)
            m, baseline = result.metrics, result.baseline
            if batch == 1:
                single[steps] = m["tokens_per_s"]
            versus = f"{m['tokens_per_s'] / single[steps]:9.2f}x" if steps in single else f"{'–':>10}"
            per_position = " ".join(f"{r:.2f}" for r in m["acceptance_per_position"])
            print(f"{batch:>5} {steps:>2} {m['tau']:5.2f}  {per_position:<26} {m['tokens_per_s']:6.1f} "
                  f"{m['target_tokens_per_s']:7.1f} {m['speedup']:7.2f}x "
                  f"{m['decode_speedup']:7.2f}x {m['ideal_speedup']:5.2f}x "
                  f"{m['efficiency']:6.0%} {m['draft_ms_per_round']:9.1f} {m['verify_ms_per_round']:9.1f} "
                  f"{m['target_ms_per_step']:9.1f} {m['matches_target']:5.0%} {versus}", flush=True)


if __name__ == "__main__":
    main()
