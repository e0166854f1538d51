"""Regeneration throughput: the target's replies to ShareGPT first turns through the built-in engine and vLLM.

    .venv/bin/python bench/bench_regenerate.py [--prompts 64] [--max-new-tokens 128] [--batch-sizes 8,32]
                                               [--dtypes bfloat16,float32]
                                               [--engines builtin,builtin-compiled,vllm] [--chunk N]
                                               [--temperature T]

The same prompts (the first user turns of ShareGPT's training split whose chat prompt fits
--max-prompt-tokens), greedy (or sampled at `--temperature`, prompt i with seed i), each engine as `eagle3
regenerate` drives it: the built-in engine decodes `--batch-sizes` replies together (prompts of similar
length), `builtin-compiled` through one compiled graph (`eagle3 regenerate --compiled`, its compilation timed
apart); vLLM (its venv, `make vllm-setup`) gets the prompts `--batch-sizes` at a time and schedules them
itself. `--chunk N` hands every engine N prompts a call
instead, as `eagle3 regenerate` does (its chunks are 4 x --batch-size conversations): the built-in engine
then decodes them in batches of similar length, vLLM all N at once. Prints reply tokens/s per engine, dtype
and batch, and the machine; vLLM's start-up (loading, warm-up) is timed apart.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from eagle3lib.data import corpora
from eagle3lib.data.conversations import ChatRenderer
from eagle3lib.devices import machine_description
from eagle3lib.generation import regenerate
from eagle3lib.target.model import Target

TARGET = "zoo:smollm2-135m-instruct"


def requests(renderer: ChatRenderer, count: int, max_prompt_tokens: int) -> list[regenerate.Request]:
    found = []
    for conversation in corpora.split_conversations("sharegpt", "train", 0.1):
        messages = [{"role": "user", "content": conversation.user_turns()[0]}]
        ids = renderer.prompt_ids(messages)
        if len(ids) <= max_prompt_tokens:
            found.append(regenerate.Request(messages, ids, seed=len(found)))
        if len(found) == count:
            return found
    raise ValueError(f"ShareGPT has fewer than {count} first turns of at most {max_prompt_tokens} tokens")


def timed(engine, batch: list[regenerate.Request], size: int) -> tuple[int, float]:
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(batch), size):
        tokens += sum(reply.tokens for reply in engine.replies(batch[first : first + size]))
    return tokens, time.perf_counter() - start


def measure(name: str, target: Target, renderer: ChatRenderer, batch: list[regenerate.Request], size: int,
            chunk: int, max_new_tokens: int, temperature: float = 0.0) -> tuple[int, float, float]:
    """(reply tokens, seconds, start-up seconds) of engine `name` (builtin, builtin-compiled or vllm) on the
    prompts, `chunk` a call, after a warm-up call on the first chunk (allocation, compilation, vLLM's
    start)."""
    settings = regenerate.RegenerationSettings(
        engine=name.removesuffix("-compiled"), compiled=name.endswith("-compiled"),
        max_new_tokens=max_new_tokens, batch_size=size, dtype=str(target.dtype).removeprefix("torch."),
        temperature=temperature)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work, \
            regenerate.make_engine(settings, target, renderer, Path(work)) as engine:
        timed(engine, batch[:chunk], chunk)
        ready = time.perf_counter() - started
        tokens, seconds = timed(engine, batch, chunk)
    return tokens, seconds, ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--engines", default="builtin,builtin-compiled,vllm")
    parser.add_argument("--chunk", type=int, help="prompts an engine gets a call (default: the batch size)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto (the built-in engine's device)")
    args = parser.parse_args()
    print(machine_description())
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    for dtype in args.dtypes.split(","):
        target = Target.load(TARGET, dtype=dtype, device=args.device)
        renderer = ChatRenderer(target.tokenizer, target.stop_token_ids)
        batch = requests(renderer, args.prompts, args.max_prompt_tokens)
        prompt_tokens = sum(len(r.prompt_ids) for r in batch)
        print(f"{dtype}: {len(batch)} ShareGPT first turns ({prompt_tokens:,} prompt tokens), "
              f"{args.max_new_tokens} new tokens at most, "
              f"{'greedy' if args.temperature == 0 else f'sampled at temperature {args.temperature}'}")
        for name in args.engines.split(","):
            for size in sizes:
                chunk = args.chunk or size
                tokens, seconds, ready = measure(name, target, renderer, batch, size, chunk,
                                                 args.max_new_tokens, args.temperature)
                start_note = f" (start-up {ready:.0f} s, not counted)" if name != "builtin" else ""
                calls = f", {chunk} prompts a call" if args.chunk else ""
                print(f"  {name:>7} {dtype:>8} batch {size:>3}{calls}: {tokens:6,} reply tokens in "
                      f"{seconds:6.1f} s = {tokens / seconds:6.1f} tok/s{start_note}", flush=True)

if __name__ == "__main__":
    main()
