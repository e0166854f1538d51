"""τ measured two ways on SmolLM2-135M-Instruct: real speculation (the target verifies every round) and replay
against the target's recorded greedy decoding (`batches.RecordedTarget`), with the seconds each takes.

    .venv/bin/python bench/bench_replay.py --dtype float32 --prompts 16 --drafters 2
    .venv/bin/python bench/bench_replay.py --drafter drafters/smollm2-135m-chat --batch-size 24

What 05 does with D drafters on one benchmark: real, every drafter speculates with the target verifying
(plus one target-only baseline); replayed, the target decodes the prompts once (recording its aux states)
and each drafter is replayed. Prints τ both ways, how many prompts accepted the same drafts round by round,
and the seconds. Numbers, never asserts.
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3lib.decoding import engines, probe
from eagle3lib.decoding.speculate import DraftSettings
from eagle3lib.reports import publish
from eagle3lib.target.model import Target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=str(publish.DEMO_SOURCE_DRAFTER))
    parser.add_argument("--target", default="zoo:smollm2-135m-instruct")
    parser.add_argument("--drafters", type=int, default=2, help="times the drafter is measured (05's D)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--corpus", default="sharegpt")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = Target.load(args.target, dtype=args.dtype, device="cpu")
    prompts = engines.probe_prompts(target.tokenizer, args.corpus, args.prompts, 600, True)
    drafter, _ = engines.decoding_drafter(args.drafter, target)
    eos = target.tokenizer.eos_token_id
    print(f"{target.name} ({target.dtype}, {args.threads} threads), drafter {args.drafter} x "
          f"{args.drafters}, {len(prompts)} {args.corpus} prompts x {args.max_new_tokens}, batch "
          f"{args.batch_size}\n")
    print(f"{'setting':<12} {'τ real':>8} {'τ replay':>9} {'same':>6} {'real s':>8} {'replay s':>9} "
          f"{'ratio':>6}")
    for name, settings in (("chain 3/1/4", DraftSettings(steps=3)),
                           ("tree 3/2/6", DraftSettings(steps=3, topk=2, num_draft_tokens=6))):
        common = dict(eos_token_id=eos, batch_size=args.batch_size)
        start, baseline = time.perf_counter(), None
        for _ in range(args.drafters):
            real = probe.probe(target.model, drafter, prompts, settings, args.max_new_tokens,
                               baseline=baseline, **common)
            baseline = real.baseline
        real_seconds = time.perf_counter() - start
        start, baseline = time.perf_counter(), None
        for _ in range(args.drafters):
            replayed = probe.probe(target.model, drafter, prompts, settings, args.max_new_tokens,
                                   baseline=baseline, replay=True, **common)
            baseline = replayed.baseline
        replay_seconds = time.perf_counter() - start
        same = sum(a == b for a, b in zip(real.metrics["accepted_per_prompt"],
                                          replayed.metrics["accepted_per_prompt"], strict=True))
        print(f"{name:<12} {real.metrics['tau']:>8.4f} {replayed.metrics['tau']:>9.4f} "
              f"{same:>3}/{len(prompts):<2} {real_seconds:>8.1f} {replay_seconds:>9.1f} "
              f"{real_seconds / replay_seconds:>5.1f}x")


if __name__ == "__main__":
    main()
