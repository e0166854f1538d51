"""Training throughput and peak memory of the TTT trainer for a SmolLM2-sized drafter.

    .venv/bin/python bench/bench_train.py [--steps 6] [--seq-len 512] [--ttt-steps 7] [--device cpu]
    .venv/bin/python bench/bench_train.py --compile    # also torch.compile of the TTT objective vs eager

Drafter: H 576, 9 heads / 3 KV heads x 64, intermediate 1536, Vt 49,152, Vd 4,096 (the demo's sizes), fed
random batches of the data format (batch 1, fp32 on CPU). Prints optimizer steps' tokens/s as the trainer
logs them (forward + backward + AdamW; the first window, with its one-off costs, is not counted), the time
of each TTT step's forward (steps k >= 1 attend to the step-0 prefix plus a diagonal, so each costs about
what step 0 costs), and peak memory: resident set on CPU, allocated memory on CUDA.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from eagle3lib.data.readers import TrainingData
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.params import load_params
from eagle3lib.training import arms
from eagle3lib.training.loss import Targets, drafter_rows, ttt_sums
from eagle3lib.training.trainer import Processes, Trainer

HIDDEN, VT, VD, AUX = 576, 49_152, 4_096, 3
SIZES = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
         "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192}


class RandomBatches:
    """A `readers.BatchReader` stand-in: a few random batches of the data folder's format, made once, repeated
    (making them costs a full-vocab matmul each, which is not what this measures)."""

    def __init__(self, vocab_map: VocabMap, head: torch.Tensor, distinct: int = 2):
        self.vocab_map, self.head, self.distinct = vocab_map, head, distinct
        self.made: dict[tuple, list[dict]] = {}

    def _make(self, batch_size: int, seq_len: int, generator: torch.Generator) -> dict:
        ids = self.vocab_map.draft_ids[torch.randint(0, VD, (batch_size, seq_len), generator=generator)]
        last = torch.randn(batch_size, seq_len, HIDDEN, generator=generator)
        return {
            "input_ids": ids,
            "aux_hidden_states": torch.randn(batch_size, seq_len, AUX * HIDDEN, generator=generator),
            "last_hidden_state": last,
            "target_argmax": (last @ self.head.T).argmax(-1),
            "loss_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
            "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        }

    def batches(self, batch_size: int, seq_len: int, shuffle: bool, seed: int, **reading):
        """Endless (the trainer's `skip` and `rows` do not apply: one process, no resume)."""
        key = (batch_size, seq_len, seed)
        if key not in self.made:
            generator = torch.Generator().manual_seed(seed)
            self.made[key] = [self._make(batch_size, seq_len, generator) for _ in range(self.distinct)]
        while True:
            yield from self.made[key]


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated on {device}"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident (process peak)"


def fit(drafter, data: TrainingData, params: dict, procs: Processes, compiled: bool) -> tuple[Trainer, list]:
    """Train `2 x --steps` steps; the metrics logged every `--steps` steps (the first window has the
    one-off costs: compilation, allocator warm-up)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(drafter, data, params["train"], 0, Path(out), procs, log=lambda message: None)
        if compiled:
            trainer.model = torch.compile(trainer.objective)
        trainer.fit()
        return trainer, [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps (after as many untimed)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "auto"])
    parser.add_argument("--compile", action="store_true",
                        help="also train with torch.compile of the TTT objective (same seed and batches) and "
                             "compare tokens/s and losses with eager")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    head = {
        "embed_tokens.weight": torch.randn(VT, HIDDEN, generator=generator) * 0.02,
        "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VT, HIDDEN, generator=generator) * 0.02,
    }
    counts = torch.randint(0, 1000, (VT,), generator=generator)
    vocab_map = VocabMap.from_counts(counts, VD, VT)
    data = TrainingData(RandomBatches(vocab_map, head["lm_head.weight"]), vocab_map, head, HIDDEN, VT,
                              [1, 14, 26], "random SmolLM2-sized data")
    params = load_params(None, {
        "run": {"device": args.device},
        "train": {"steps": 2 * args.steps, "log_every": args.steps, "batch_size": args.batch_size,
                  "micro_batch_size": args.batch_size, "seq_len": args.seq_len, "ttt_steps": args.ttt_steps,
                  "dtype": args.dtype, "checkpoint_every": 0, "warmup_steps": 1, "scratch": SIZES},
    })
    procs = Processes.start(args.device)
    drafter, _ = arms.init_drafter("scratch", params["train"], data, seed=0)
    parameters = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    print(f"drafter: {parameters / 1e6:.1f} M trainable parameters; batch {args.batch_size} x T "
          f"{args.seq_len}, {args.ttt_steps} TTT steps, {args.dtype} on {procs.device}, "
          f"{torch.get_num_threads()} threads")

    trainer, logged = fit(drafter, data, params, procs, compiled=False)
    print(f"training: {logged[-1]['tokens_per_s']:.0f} tokens/s over {args.steps} optimizer steps "
          f"({args.batch_size * args.seq_len} tokens each); peak memory {peak_memory(procs.device)}")
    if args.compile:
        fresh, _ = arms.init_drafter("scratch", params["train"], data, seed=0)
        start = time.perf_counter()
        _, compiled = fit(fresh, data, params, procs, compiled=True)
        gap = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(logged, compiled, strict=True))
        print(f"torch.compile: {compiled[-1]['tokens_per_s']:.0f} tokens/s over the last {args.steps} steps "
              f"({compiled[-1]['tokens_per_s'] / logged[-1]['tokens_per_s']:.2f}x eager; "
              f"{time.perf_counter() - start:.0f} s in all with compilation); logged losses differ from "
              f"eager by at most {gap:.2e} (relative)")

    # one forward, step by step, to see what each TTT step costs
    batch = trainer.to_device(next(data.reader.batches(args.batch_size, args.seq_len, shuffle=False, seed=1)))
    targets = Targets.from_batch(batch, trainer.draft_head, trainer.t2d)
    input_ids, aux = drafter_rows(batch["input_ids"], batch["aux_hidden_states"])
    times, start = [], time.perf_counter()
    with torch.no_grad(), trainer.autocast():
        for layer_out in trainer.drafter.unroll_steps(input_ids, aux, args.ttt_steps):
            logits = trainer.drafter.compute_logits(layer_out)
            ttt_sums([logits], targets, trainer.objective.draft_ids)  # step 0's alignment: only cost counts
            if procs.device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - start)
            start = now
    print("forward per TTT step (ms): " + ", ".join(f"{1000 * t:.1f}" for t in times))


if __name__ == "__main__":
    main()
