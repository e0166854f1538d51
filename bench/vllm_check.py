"""Export check: a drafter saved by the project, served by vLLM, gets the τ the built-in engine measures.

    make vllm-check
    make vllm-check VLLM_CHECK_ARGS="--drafter outputs/<run>/04_finetune/scratch/drafter --steps 3"

Both engines decode the same held-out prompts (token ids) with greedy chain drafting of K steps, EOS
ignored, in the same dtype. vLLM's τ comes from its own `vllm:spec_decode_*` counters; the built-in engine
counts the same way (1 + accepted / verifications). Prints both τ, the acceptance at each draft position,
how many outputs agree token for token, and exits 1 when the two τ differ by more than --tolerance.

An SGLang-layout drafter with explicit aux ids is served to vLLM as a speculators-layout copy
(`engines.vllm_ready_drafter`: vLLM reads SGLang-layout ids one layer early); `--as-saved` serves the
folder untouched, to see what that numbering difference costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from eagle3lib.decoding import engines, probe, speculate
from eagle3lib.reports import publish
from eagle3lib.target.model import Target


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="zoo:smollm2-135m-instruct")
    parser.add_argument("--drafter", default=str(publish.DEMO_SOURCE_DRAFTER),
                        help="checkpoint folder (default: the shipped source drafter)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--corpus", default="sharegpt", help="prompts, as probe.corpus")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="prompts in the target's chat template (--no-chat: raw document openings)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 | float32 (both engines)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest allowed relative τ difference")
    parser.add_argument("--as-saved", action="store_true", help="serve an SGLang-layout folder unconverted")
    parser.add_argument("--work-dir", default=None, help="where vLLM's request, result and log go")
    args = parser.parse_args()

    target = Target.load(args.target, dtype=args.dtype, device="cpu")
    drafter = Path(args.drafter)
    prompts = engines.probe_prompts(target.tokenizer, args.corpus, args.prompts, 600, chat=args.chat)
    settings = speculate.DraftSettings(steps=args.steps)
    print(f"target {args.target} ({args.dtype}), drafter {drafter}, {len(prompts)} {args.corpus} prompts, "
          f"{args.max_new_tokens} tokens each, greedy chain K={args.steps}", flush=True)

    start = time.perf_counter()
    model, report = engines.decoding_drafter(drafter, target)
    builtin = probe.probe(
        target.model, model, prompts, settings, args.max_new_tokens, compare_target=False
    )
    print(f"builtin: τ {builtin.metrics['tau']:.3f} in {time.perf_counter() - start:.0f} s", flush=True)
    del target

    start = time.perf_counter()
    work = Path(args.work_dir) if args.work_dir else None
    if args.as_saved:
        config, layout = engines.check_checkpoints(args.target, drafter)
        print(f"serving the {layout}-layout folder as saved (aux ids {config.aux_layer_ids}, eagle3lib "
              "numbering)")
    vllm = engines.vllm_probe(
        args.target, drafter, prompts, steps=args.steps, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
        work_dir=work, convert_sglang=not args.as_saved,
    )
    seconds = time.perf_counter() - start
    print(f"vllm: τ {vllm.metrics['tau']:.3f} in {seconds:.0f} s; " + "; ".join(vllm.notes))

    ours, theirs = builtin.metrics, vllm.metrics
    builtin_outputs = [g.tokens for g in builtin.spec]
    pairs = list(zip(builtin_outputs, vllm.outputs, strict=True))
    same = sum(a == b for a, b in pairs)
    prefix = sum(common_prefix(a, b) for a, b in pairs) / len(pairs)
    difference = abs(theirs["tau"] - ours["tau"]) / ours["tau"]
    print()
    print(f"{'':8} {'τ':>6} {'drafts':>7} {'accepted':>9}  accept by position")
    for name, m in (("builtin", ours), ("vllm", theirs)):
        rates = " ".join(f"{r:.3f}" for r in m["acceptance_per_position"])
        print(f"{name:8} {m['tau']:6.3f} {m['num_drafts']:7d} {m['num_accepted_tokens']:9d}  {rates}")
    print(f"\nτ differs by {difference:.1%} (tolerance {args.tolerance:.0%}); outputs identical for {same} "
          f"of {len(prompts)} prompts, common prefix {prefix:.1f} of {args.max_new_tokens} tokens on average "
          f"({args.dtype} kernels differ between the engines, so near ties can flip)")
    if difference > args.tolerance:
        print("FAIL: vLLM's τ is outside the tolerance of the built-in engine's", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
