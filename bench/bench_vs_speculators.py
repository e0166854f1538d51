"""One TTT training step: eagle3lib's trainer against speculators' Eagle3DraftModel, same drafter, same data.

    make bench-venv
    .venv-bench/bin/python bench/bench_vs_speculators.py [--threads 1] [--attn eager|sdpa] [--profile]

Runs in `.venv-bench` (speculators 0.9.0 is not a dependency of eagle3lib). eagle3lib's trainer builds a
random SmolLM2-sized drafter (scratch arm: H 576, 9/3 heads x 64, intermediate 1536, Vt 49,152, Vd 4,096);
its weights are copied key by key into speculators' model, and both train on the same random batch: fp32
on CPU, batch 1, T drafter rows (T+1 positions of data), the same TTT steps. Both train what speculators
trains (lm_head and embedding frozen), weight every step's loss by 1, clip gradients at 1 and step AdamW.
speculators runs with `draft_attn_impl` eager (or sdpa) and `loss_implementation` eager: its flex attention
and fused Triton loss need a GPU.

The same data means: the verifier's states are given pre-norm to speculators (it applies `verifier_norm`
and `verifier_lm_head` = the draft rows of the target head) and post-norm to eagle3lib; the verifier
argmax eagle3lib reads from the data is set inside the draft vocab, so that both count the same rows
(speculators has no out-of-draft-vocab mask). Before any timing, one step of each must give the same
gradients, or the script stops: otherwise the two would not be doing the same work.

Timing: full optimizer steps (forward, backward, clipping, AdamW), alternating ABBA between the two so
that load from other processes hits both alike; medians. tokens/s counts drafter rows (T per step).
Memory: two child processes, one per implementation, each holding only its own model, optimizer and
batch. Each reports the resident set before the timed steps and its peak during them (VmHWM, reset
first), with glibc told to map every allocation of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_) so
that freed tensors leave the resident set and the peak follows the tensors. `--profile` prints where each
implementation's step spends its time (torch.profiler, operators by self CPU time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3lib.data.readers import TrainingData
from eagle3lib.drafter.checkpoint import SGLANG_PREFIX, SPECULATORS_PREFIX, checkpoint_tensors
from eagle3lib.drafter.config import to_speculators_dict
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.params import load_params
from eagle3lib.training import arms
from eagle3lib.training.trainer import Processes, Trainer

HIDDEN, VT, VD, AUX_IDS = 576, 49_152, 4_096, [1, 14, 26]
SIZES = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
         "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192}
MAX_GRAD_NORM = 1.0  # speculators' trainer clips at 1.0
GRADIENT_TOLERANCE = 1e-3  # max |difference| / max |gradient|, per parameter


# ----------------------------------------------------------------------------- the shared setup


def random_target(rows: int, seed: int = 0) -> tuple[VocabMap, dict[str, torch.Tensor], dict, torch.Tensor]:
    """A random target's vocab map, head weights, one data batch of rows+1 positions (eagle3lib's data
    format) and the verifier's pre-norm last hidden states [1, rows+1, H]."""
    generator = torch.Generator().manual_seed(seed)
    vocab_map = VocabMap.from_counts(torch.randint(0, 1000, (VT,), generator=generator), VD, VT)
    head = {
        "embed_tokens.weight": torch.randn(VT, HIDDEN, generator=generator) * 0.02,
        "norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=generator),
        "lm_head.weight": torch.randn(VT, HIDDEN, generator=generator) * 0.02,
    }
    positions = rows + 1
    pre_norm = torch.randn(1, positions, HIDDEN, generator=generator)
    last = F.rms_norm(pre_norm, (HIDDEN,), head["norm.weight"], SIZES["rms_norm_eps"])
    draft_logits = last @ head["lm_head.weight"][vocab_map.draft_ids].T
    batch = {
        "input_ids": torch.randint(0, VT, (1, positions), generator=generator),
        "aux_hidden_states": torch.randn(1, positions, len(AUX_IDS) * HIDDEN, generator=generator),
        "last_hidden_state": last,
        "target_argmax": vocab_map.draft_ids[draft_logits.argmax(-1)],
        "loss_mask": torch.ones(1, positions, dtype=torch.long),
        "attention_mask": torch.ones(1, positions, dtype=torch.long),
    }
    return vocab_map, head, batch, pre_norm


def eagle3lib_trainer(rows: int, ttt_steps: int, vocab_map: VocabMap, head: dict) -> Trainer:
    """eagle3lib's Trainer on a fresh scratch drafter, configured as speculators trains."""
    data = TrainingData(None, vocab_map, head, HIDDEN, VT, AUX_IDS, "random SmolLM2-sized target")
    params = load_params(None, {
        "run": {"device": "cpu"},
        "train": {"ttt_steps": ttt_steps, "seq_len": rows + 1, "batch_size": 1, "micro_batch_size": 1,
                  "dtype": "fp32", "train_lm_head": False, "step_decay": 1.0, "max_grad_norm": MAX_GRAD_NORM,
                  "steps": 10**6, "warmup_steps": 1, "checkpoint_every": 0, "scratch": SIZES},
    })
    drafter, _ = arms.init_drafter("scratch", params["train"], data, seed=0)
    # the batch is handed to each step here; the trainer's own batch stream is never read
    return Trainer(drafter, data, params["train"], 0, None, Processes(), log=lambda message: None)


@dataclass
class SpeculatorsSide:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: dict
    ttt_steps: int
    loss_config: dict

    def step(self) -> float:
        """One training step as speculators' Trainer.train_epoch runs it; returns the gradient norm."""
        self.optimizer.zero_grad()
        _, loss, _ = self.model(**self.inputs, ttt_steps=self.ttt_steps, ttt_step_loss_decay=1.0,
                                loss_config=self.loss_config)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM))
        self.optimizer.step()
        return grad_norm


def speculators_side(trainer: Trainer, head: dict, batch: dict, pre_norm: torch.Tensor, attn: str,
                     ttt_steps: int) -> SpeculatorsSide:
    """speculators' Eagle3DraftModel with the drafter's weights, and the same batch in its own layout."""
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    drafter = trainer.drafter
    raw = to_speculators_dict(drafter.config)
    config = Eagle3SpeculatorConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "dtype")})
    config.transformer_layer_config._attn_implementation = attn
    model = Eagle3DraftModel(config)
    weights = checkpoint_tensors(drafter, "speculators")
    weights["embed_tokens.weight"] = head["embed_tokens.weight"]
    weights["verifier_norm.weight"] = head["norm.weight"]
    weights["verifier_lm_head.weight"] = trainer.draft_head
    model.load_state_dict(weights, strict=True)
    model.train()
    ours = {name.replace(SGLANG_PREFIX, SPECULATORS_PREFIX) for name, p in drafter.named_parameters()
            if p.requires_grad}
    theirs = {name for name, p in model.named_parameters() if p.requires_grad}
    if ours != theirs:
        raise SystemExit(f"trainable parameters differ: eagle3lib only {sorted(ours - theirs)}, "
                         f"speculators only {sorted(theirs - ours)}")
    # speculators' row j: token x_{j+1}, aux state g_j, verifier position j+1; the loss mask keeps the rows
    # whose next token is in eagle3lib's loss (none for the last row: its token is past the data)
    in_loss = (batch["loss_mask"] * batch["attention_mask"]).bool()
    inputs = {
        "hidden_states": batch["aux_hidden_states"][:, :-1],
        "input_ids": batch["input_ids"][:, 1:],
        "document_ids": torch.zeros_like(batch["input_ids"][:, 1:]),
        "loss_mask": torch.cat([in_loss[:, 2:], torch.zeros_like(in_loss[:, :1])], dim=1),
        "verifier_last_hidden_states": pre_norm[:, 1:],
    }
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-4)  # speculators' build_optimizers
    return SpeculatorsSide(model, optimizer, inputs, ttt_steps, resolve_loss_config("kl_div", "eager"))


def eagle3lib_step(trainer: Trainer, batch: dict) -> float:
    """One optimizer step as Trainer.fit runs it; returns the gradient norm."""
    _, grad_norm, *_ = trainer._optimizer_step(batch)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return grad_norm


# ----------------------------------------------------------------------------- checks and measurements


def check_same_gradients(trainer: Trainer, batch: dict, side: SpeculatorsSide) -> str:
    """One forward/backward of each (no optimizer step); the gradients must agree."""
    _, ours_norm, *_ = trainer._optimizer_step(batch)
    side.optimizer.zero_grad()
    _, loss, _ = side.model(**side.inputs, ttt_steps=side.ttt_steps, ttt_step_loss_decay=1.0,
                            loss_config=side.loss_config)
    loss.backward()
    theirs_norm = float(torch.nn.utils.clip_grad_norm_(side.model.parameters(), MAX_GRAD_NORM))
    theirs = dict(side.model.named_parameters())
    worst, worst_name = 0.0, ""
    for name, p in trainer.drafter.named_parameters():
        if p.requires_grad:
            other = theirs[name.replace(SGLANG_PREFIX, SPECULATORS_PREFIX)].grad
            error = float((p.grad - other).abs().max() / other.abs().max())
            worst, worst_name = max((worst, worst_name), (error, name))
    trainer.optimizer.zero_grad(set_to_none=True)
    side.optimizer.zero_grad()
    if worst > GRADIENT_TOLERANCE:
        raise SystemExit(f"the two implementations do not compute the same gradients ({worst_name}: max "
                         f"error {worst:.2e} of its largest entry): the comparison would be void")
    return (f"same gradients: max error {worst:.1e} of a parameter's largest entry ({worst_name}); gradient "
            f"norm before clipping {ours_norm:.5f} (eagle3lib) vs {theirs_norm:.5f} (speculators)")


def time_alternating(steps: dict[str, Callable[[], object]], warmup: int, repeats: int
                     ) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each timed step, the implementations taking turns ABBA."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for i in range(warmup + repeats):
        order = list(steps) if i % 2 == 0 else list(reversed(steps))
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name]()
            if i >= warmup:
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def kib_field(name: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{name}:\s+(\d+) kB", status.read(), re.M).group(1)) * 1024


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def measure_memory(which: str, rows: int, ttt_steps: int, attn: str, steps: int) -> dict:
    """In a child process: build only `which`, take one warm-up step, then the peak over `steps` steps."""
    vocab_map, head, batch, pre_norm = random_target(rows)
    trainer = eagle3lib_trainer(rows, ttt_steps, vocab_map, head)
    if which == "eagle3lib":
        step = lambda: eagle3lib_step(trainer, batch)  # noqa: E731
        held = [*trainer.drafter.parameters(), *trainer.drafter.buffers(), trainer.draft_head]
        optimizer = trainer.optimizer
    else:
        side = speculators_side(trainer, head, batch, pre_norm, attn, ttt_steps)
        del trainer, head, vocab_map, batch  # speculators holds its own copies of what it needs
        step = side.step
        held = [*side.model.parameters(), *side.model.buffers()]
        optimizer = side.optimizer
    gc.collect()
    step()  # the first step allocates the optimizer state
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident set
    before = kib_field("VmRSS")
    for _ in range(steps):
        step()
    return {"rss_before": before, "peak": kib_field("VmHWM"), "model_bytes": tensor_bytes(held),
            "optimizer_bytes": tensor_bytes(state)}


def memory_in_child(which: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    command = [sys.executable, __file__, "--memory-of", which, "--rows", str(args.rows), "--ttt-steps",
               str(args.ttt_steps), "--attn", args.attn, "--threads", str(args.threads),
               "--memory-steps", str(args.memory_steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"memory child for {which} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def profile(name: str, step: Callable[[], object]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"\n--- where one {name} step spends its time (self CPU) ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def compare_speed(args: argparse.Namespace) -> None:
    vocab_map, head, batch, pre_norm = random_target(args.rows)
    trainer = eagle3lib_trainer(args.rows, args.ttt_steps, vocab_map, head)
    side = speculators_side(trainer, head, batch, pre_norm, args.attn, args.ttt_steps)
    trainable = sum(p.numel() for p in trainer.drafter.parameters() if p.requires_grad)
    print(f"drafter: {trainable / 1e6:.2f} M trainable parameters (fc, midlayer, norm); lm_head and "
          "embedding frozen")
    print(check_same_gradients(trainer, batch, side))

    steps = {"eagle3lib": lambda: eagle3lib_step(trainer, batch), "speculators": side.step}
    load_before = os.getloadavg()[0]
    times = time_alternating(steps, args.warmup, args.repeats)
    print(f"load: 1-min load average {load_before:.2f} before and {os.getloadavg()[0]:.2f} after the timed "
          f"steps (other processes share the {os.cpu_count()} CPUs)")
    wall = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:>12}: {args.rows / wall[name]:7.1f} tokens/s (median step {wall[name]:.3f} s, range "
              f"{min(w for w, _ in t):.3f}-{max(w for w, _ in t):.3f} s over {len(t)} steps; median CPU "
              f"time {cpu[name]:.3f} s)")
    print(f"speed ratio eagle3lib / speculators: {wall['speculators'] / wall['eagle3lib']:.2f}x by median "
          f"wall time, {cpu['speculators'] / cpu['eagle3lib']:.2f}x by median CPU time")
    if args.profile:
        for name, step in steps.items():
            profile(name, step)


def compare_memory(args: argparse.Namespace) -> None:
    memory = {name: memory_in_child(name, args) for name in ("eagle3lib", "speculators")}
    growth = {name: m["peak"] - m["rss_before"] for name, m in memory.items()}
    for name, m in memory.items():
        print(f"{name:>12}: peak {m['peak'] / 2**20:7.1f} MiB resident, {growth[name] / 2**20:6.1f} MiB "
              f"above the {m['rss_before'] / 2**20:.1f} MiB before the steps (model tensors "
              f"{m['model_bytes'] / 2**20:.1f} MiB, AdamW state {m['optimizer_bytes'] / 2**20:.1f} MiB)")
    peak_ratio = memory["eagle3lib"]["peak"] / memory["speculators"]["peak"]
    print(f"memory ratio eagle3lib / speculators: peak {peak_ratio:.2f}, "
          f"step working set {growth['eagle3lib'] / growth['speculators']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="drafter rows per sequence (T)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="speculators' attention")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7, help="timed steps of each implementation")
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--profile", action="store_true", help="also profile one step of each")
    parser.add_argument("--memory-of", choices=["eagle3lib", "speculators"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_of:
        measured = measure_memory(args.memory_of, args.rows, args.ttt_steps, args.attn, args.memory_steps)
        print(json.dumps(measured))
        return
    from importlib.metadata import version

    print(f"torch {torch.__version__}, speculators {version('speculators')}, {torch.get_num_threads()} "
          f"threads, {os.cpu_count()} CPUs; fp32, batch 1, T {args.rows} rows, {args.ttt_steps} TTT steps; "
          f"speculators attention {args.attn}, loss eager")
    compare_speed(args)
    compare_memory(args)


if __name__ == "__main__":
    main()
