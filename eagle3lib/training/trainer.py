"""The trainer: train-time-test steps of one drafter over a stream of batches, in-process or as one rank of
a torchrun job; optimizer, schedule, accumulation, checkpoints and bit-for-bit resume.

`training.train` builds drafters and runs the experiment around this (arms, warm starts with the remap,
the step-0 check, the torchrun launcher).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eagle3lib import files
from eagle3lib.data.readers import TrainingData
from eagle3lib.devices import fast_bf16, machine_description, resolve_device, trim_heap
from eagle3lib.drafter.checkpoint import load_drafter, save_drafter
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.drafter.ttt_attention import Segments, segments_of
from eagle3lib.params import RESUME_FREE
from eagle3lib.progress import progress as progress_bar
from eagle3lib.training.loss import (
    StepSums,
    Targets,
    ce_row_counts,
    documents,
    drafter_rows,
    position_masks,
    step_weights,
    summarize,
    ttt_sums,
    weighted_loss,
)

STATE_FILE = "training_state.pt"


class TrainingError(ValueError):
    """Training cannot start or continue as asked; the message says what to check."""


class TrainingDiverged(TrainingError):
    pass


# ----------------------------------------------------------------------------- processes


@dataclass
class Processes:
    """This process's place in a torchrun job (rank 0 of 1 when run plainly)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def start(cls, device: str) -> Processes:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls(device=resolve_device(device))
        local_rank = int(os.environ["LOCAL_RANK"])
        wanted = resolve_device(device)
        if wanted.type == "cuda":
            torch.cuda.set_device(local_rank)
            wanted = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if wanted.type == "cuda" else "gloo")
            # no rank leaves before every rank is connected: a rank that fails fast (bad data) and exits
            # would otherwise break a slower rank's connect, whose own error would then go unreported
            dist.barrier()
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=wanted)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(tensor, src=0)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


# ----------------------------------------------------------------------------- data


class BatchStream:
    """Global batches in a seeded order, epoch after epoch, of which this process gets its rows; `state`
    (epoch, batch index) is what a checkpoint keeps, so a resumed run sees exactly the batches an
    uninterrupted one would.

    Every rank walks the same order and takes its own slice of each global batch (only that slice is read,
    or computed by the target online), so the result does not depend on the number of processes. A short
    last batch of an epoch is left out.
    """

    def __init__(self, reader, batch_size: int, seq_len: int, seed: int, procs: Processes, packing: bool):
        self.reader, self.batch_size, self.seq_len, self.seed = reader, batch_size, seq_len, seed
        self.packing = packing
        share = batch_size // procs.world_size
        self.rows = slice(procs.rank * share, (procs.rank + 1) * share)
        self.epoch, self.index = 0, 0
        self._batches: Iterator[dict] | None = None

    @property
    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict) -> None:
        self.epoch, self.index, self._batches = state["epoch"], state["index"], None

    def batches_per_epoch(self) -> int | None:
        """The global batches of one pass over the data (epoch 0's plan; later epochs' orders pack within a
        few batches of it); None where the reader cannot count them without reading every sample."""
        return self.reader.batches_per_epoch(self.batch_size, self.seq_len, self.seed, self.packing)

    def _open_epoch(self) -> Iterator[dict]:
        return self.reader.batches(self.batch_size, self.seq_len, shuffle=True, seed=self.seed + self.epoch,
                                   drop_last=True, skip=self.index, rows=self.rows, packing=self.packing)

    def next(self) -> dict:
        """This process's rows of the next global batch."""
        for _ in range(2):
            if self._batches is None:
                self._batches = self._open_epoch()
            for batch in self._batches:
                self.index += 1
                return batch
            if self.index == 0:
                break
            self.epoch, self.index, self._batches = self.epoch + 1, 0, None
        raise TrainingError(
            f"the data holds fewer than batch_size={self.batch_size} rows of up to seq_len={self.seq_len} "
            f"tokens{' (packed)' if self.packing else ''}; lower train.batch_size or prepare more data"
        )


def split_batch(batch: dict, parts: int, part: int) -> dict:
    """Rows [part*n, (part+1)*n) of every tensor, n = rows / parts."""
    rows = len(batch["input_ids"]) // parts
    return {key: value[part * rows : (part + 1) * rows] for key, value in batch.items()}


# ----------------------------------------------------------------------------- the objective


class TTTObjective(nn.Module):
    """The drafter's unrolled forward and its per-step sums, as one module: DDP wraps `forward` only."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, draft_ids: torch.Tensor):
        super().__init__()
        self.drafter, self.steps = drafter, steps
        self.register_buffer("draft_ids", draft_ids, persistent=False)

    def forward(self, batch: dict, targets: Targets, segments: Segments | None = None) -> StepSums:
        """`segments`: the documents of packed rows, as runs of the drafter's rows (`row_segments`)."""
        input_ids, aux = drafter_rows(batch["input_ids"], batch["aux_hidden_states"])
        rows = input_ids.shape[1]
        # row t embeds token t+1: its position in its document (1..R for a row of one sample)
        positions = batch["position_ids"][:, 1:] if "position_ids" in batch else None
        unrolled = self.drafter.unroll_steps(input_ids, aux, self.steps, positions, segments)
        step_logits = (  # row t of step k has a target only for t < rows - k
            self.drafter.compute_logits(layer_out[:, : rows - k]) for k, layer_out in enumerate(unrolled)
        )
        return ttt_sums(step_logits, targets, self.draft_ids)


def row_segments(batch: dict) -> Segments | None:
    """The documents of a batch's packed rows as runs of the drafter's rows (row t is position t's), read
    on the host before the batch moves to its device; None when each row holds one sample."""
    found = documents(batch)
    return None if found is None else segments_of(found[:, :-1])


def micro_batches_per_rank(train: dict, world_size: int) -> int:
    """Gradient-accumulation steps: batch_size = micro_batch_size x world_size x this."""
    per_rank, rest = divmod(train["batch_size"], world_size * train["micro_batch_size"])
    if rest or per_rank == 0:
        raise TrainingError(
            f"train.batch_size={train['batch_size']} must be a multiple of train.micro_batch_size="
            f"{train['micro_batch_size']} x {world_size} processes"
        )
    return per_rank


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_lr_ratio at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _rng_state() -> dict:
    """Every generator's state in what a weights-only load reads: tensors, tuples, lists and numbers (numpy's
    own form holds an ndarray, so its key goes in as a list)."""
    kind, key, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, key.tolist(), int(position), int(has_gauss), float(cached_gaussian)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, key, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.array(key, dtype=np.uint32), position, has_gauss, cached_gaussian))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """Trains one drafter with TTT; `fit()` runs to `train.steps`, from the last checkpoint when resuming."""

    def __init__(self, drafter: Eagle3Drafter, data: TrainingData, train: dict, seed: int, out: Path,
                 procs: Processes, log=print):
        self.train, self.seed, self.out, self.procs, self.log = train, seed, out, procs, log
        self.data = data
        self.micro_batches = micro_batches_per_rank(train, procs.world_size)
        device = procs.device
        self.drafter = drafter.to(device)
        self.drafter.lm_head.weight.requires_grad_(train["train_lm_head"])
        draft_ids = data.vocab_map.draft_ids.to(device)
        self.draft_head = data.head["lm_head.weight"][data.vocab_map.draft_ids].float().to(device)
        self.t2d = data.vocab_map.t2d.to(device)
        self.objective = TTTObjective(self.drafter, train["ttt_steps"], draft_ids)
        self.model = self.objective
        if procs.world_size > 1:
            self.model = DistributedDataParallel(
                self.objective, device_ids=[device.index] if device.type == "cuda" else None,
                forward_sync_buffers=False,  # d2t/t2d/the embedding are the same everywhere and constant
            )
        self.weights = step_weights(train["ttt_steps"], train["step_decay"])
        self.parameters = [p for p in self.drafter.parameters() if p.requires_grad]
        # L2-SP: the weights trained from (a warm start after its remap), what the penalty pulls towards
        self.l2sp = train["l2sp"]
        self.anchors = [p.detach().clone() for p in self.parameters] if self.l2sp else []
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=train["lr"], betas=tuple(train["betas"]), weight_decay=train["weight_decay"]
        )
        self.rewarm_from: int | None = None  # the step a relayed resume started AdamW afresh at (`relay`)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)
        self.stream = BatchStream(data.reader, train["batch_size"], train["seq_len"], seed, procs,
                                  train["packing"])
        self.step = 0
        self.pass_batches: int | None = None  # the batches of one pass over the data, counted by fit()
        # the sums and tokens of the steps since the last metrics.jsonl entry: checkpointed, so that a resumed
        # run logs what an uninterrupted one logs
        self.window = torch.zeros(5, train["ttt_steps"], dtype=torch.float64)
        self.window_tokens = self.window_positions = 0
        self.tokens = 0  # real tokens trained on so far, all ranks: the x axis of τ along training
        self.autocast_dtype = autocast_dtype(train["dtype"], device)

    def lr_factor(self, step: int) -> float:
        """The schedule's factor at `step`; after a relayed resume the warmup again, from where it started,
        so that AdamW's fresh moments form before the full rate."""
        t = self.train
        factor = lr_factor(step, t["warmup_steps"], t["steps"], t["min_lr_ratio"])
        if self.rewarm_from is not None and step - self.rewarm_from < t["warmup_steps"]:
            factor *= (step - self.rewarm_from + 1) / t["warmup_steps"]
        return factor

    def to_device(self, batch: dict) -> dict:
        return {key: value.to(self.procs.device, non_blocking=True) for key, value in batch.items()}

    def autocast(self):
        """bf16 autocast when `train.dtype` asks for it (and `auto` finds a GPU that does it well)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.procs.device.type, dtype=self.autocast_dtype)

    def _targets(self, batch: dict) -> Targets:
        return Targets.from_batch(batch, self.draft_head, self.t2d)

    # ------------------------------------------------------------------ step-0 check and evaluation

    @torch.no_grad()
    def evaluate(self, batches: list[dict]) -> tuple[dict, float]:
        """Metrics of the current drafter on `batches`, and the most-frequent-token accuracy baseline."""
        sums = torch.zeros(5, self.train["ttt_steps"], dtype=torch.float64)
        counts = torch.zeros(self.data.vocab_size, dtype=torch.float64)
        for batch in batches:
            segments, batch = row_segments(batch), self.to_device(batch)
            targets = self._targets(batch)
            with self.autocast():
                sums += self.objective(batch, targets, segments).detached().cpu()
            counted = targets.argmax[:, 1:][targets.counted[:, 1:]].cpu()
            counts += torch.bincount(counted, minlength=self.data.vocab_size).double()
        baseline = float(counts.max() / counts.sum().clamp(min=1))
        sums = self.procs.broadcast(sums.to(self.procs.device)).cpu()
        return summarize(sums, self.weights), baseline

    def check_batches(self) -> list[dict]:
        """The first `check_batches` batches of the data, unshuffled: the same for every arm and rank."""
        t = self.train
        batches = self.data.reader.batches(t["micro_batch_size"], t["seq_len"], shuffle=False, seed=0,
                                           packing=t["packing"])
        return [batch for _, batch in zip(range(t["check_batches"]), batches, strict=False)]

    # ------------------------------------------------------------------ one optimizer step

    def _optimizer_step(self, mine: dict) -> tuple[torch.Tensor, float, int, int]:
        """Forward/backward over this rank's micro-batches of one global batch, then one AdamW step.

        Returns the step's sums [5, K] (all ranks), the gradient norm, and the real tokens and the positions
        computed by all ranks.
        """
        procs, n_micro = self.procs, self.micro_batches
        parts = [split_batch(mine, n_micro, i) for i in range(n_micro)]
        segments = [row_segments(part) for part in parts]
        micro = [self.to_device(part) for part in parts]
        masks = [position_masks(m, self.t2d) for m in micro]
        # the loss is a mean over the global batch's rows: count them before any backward
        steps = self.train["ttt_steps"]
        ce_rows = sum(ce_row_counts(m["in_draft"], m["counted"], steps, m["documents"]) for m in masks)
        ce_rows = procs.all_reduce(ce_rows.double())
        sums = torch.zeros(5, self.train["ttt_steps"], dtype=torch.float64, device=procs.device)
        for i, (m, rows) in enumerate(zip(micro, segments, strict=True)):
            sync = i == n_micro - 1 or procs.world_size == 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                targets = self._targets(m)
                with self.autocast():
                    step_sums = self.model(m, targets, rows)
                # DDP averages gradients over ranks; the global mean needs their sum
                loss = weighted_loss(step_sums.ce, ce_rows, self.weights) * procs.world_size
                loss.backward()
            sums += step_sums.detached()
        procs.all_reduce(sums)
        self.add_l2sp_gradient()
        max_norm = self.train["max_grad_norm"] or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, max_norm))
        counts = torch.stack([sum(m["attention_mask"].sum() for m in micro),
                              torch.tensor(sum(m["attention_mask"].numel() for m in micro))]).double()
        tokens, positions = procs.all_reduce(counts.to(procs.device)).tolist()
        return sums, grad_norm, int(tokens), int(positions)

    def add_l2sp_gradient(self) -> None:
        """The gradient of l2sp/2 x Σ ||θ - θ0||², λ(θ - θ0), added to each trained weight's (once per
        optimizer step: the penalty is not a mean over rows). Nothing at all when l2sp is 0."""
        if not self.l2sp:
            return
        with torch.no_grad():
            for weight, anchor in zip(self.parameters, self.anchors, strict=True):
                pull = (weight - anchor) * self.l2sp
                weight.grad = pull if weight.grad is None else weight.grad.add_(pull)

    def l2sp_penalty(self) -> float:
        """l2sp/2 x Σ ||θ - θ0||² now."""
        with torch.no_grad():
            return 0.5 * self.l2sp * sum(float((w - a).double().pow(2).sum())
                                         for w, a in zip(self.parameters, self.anchors, strict=True))

    # ------------------------------------------------------------------ the loop

    def fit(self, resume: bool = False, curve=None) -> dict:
        """Train to `train.steps` (from the latest checkpoint when resuming). `curve` measures the drafter
        along the way: `curve.restore(step)` on resuming, then `curve.measure(step, tokens)` at each of
        `curve.steps` reached (0 included), which returns True to stop early."""
        t, procs = self.train, self.procs
        metrics_path = self.out / "metrics.jsonl"
        if resume:
            self._restore_latest(metrics_path)
        # `auto` decides by the machine, so legs of one run on two machines may train in two precisions
        precision = "float32" if self.autocast_dtype is None else "bf16 autocast"
        self.log(f"{self.out.name}: steps {self.step + 1}..{t['steps']} in {precision} (train.dtype "
                 f"{t['dtype']}; {machine_description()})")
        self.pass_batches = self.stream.batches_per_epoch()
        if self.pass_batches:
            self.log(f"{self.out.name}: one pass over the data is {self.pass_batches:,} batches (epoch 0's "
                     f"plan): train.steps {t['steps']:,} is {t['steps'] / self.pass_batches:.2f} passes")
        if curve is not None:
            curve.restore(self.step)
            if self.step == 0 and 0 in curve.steps:
                curve.measure(0, 0)
        window_start, last = time.perf_counter(), {}
        progress = progress_bar(total=t["steps"], initial=self.step, desc=self.out.name,
                                disable=not procs.main)
        while self.step < t["steps"]:
            data_state = dict(self.stream.state)
            batch = self.stream.next()
            sums, grad_norm, tokens, positions = self._optimizer_step(batch)
            if not (math.isfinite(float(sums[0].sum())) and math.isfinite(grad_norm)):
                self.optimizer.zero_grad(set_to_none=True)
                path = self.save_checkpoint(data_state)
                raise TrainingDiverged(
                    f"{self.out.name}: loss or gradient is not finite at step {self.step + 1} (loss "
                    f"{float(sums[0].sum()):.4g}, grad norm {grad_norm:.4g}); training stopped, the last "
                    f"good state (after step {self.step}) is saved at {path}. Lower train.lr or "
                    "train.max_grad_norm, or check the data for non-finite hidden states"
                )
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if procs.device.type == "cpu":
                trim_heap()  # tensors of many sizes every step: keep the resident set flat
            self.step += 1
            self.window += sums.cpu()
            self.window_tokens += tokens
            self.window_positions += positions
            self.tokens += tokens
            if self.step % t["log_every"] == 0 or self.step == t["steps"]:
                elapsed = time.perf_counter() - window_start
                last = {
                    "step": self.step,
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm,
                    "tokens_per_s": self.window_tokens / elapsed,  # real tokens, padding not counted
                    "real_fraction": self.window_tokens / max(self.window_positions, 1),
                    "tokens": self.tokens,
                    **summarize(self.window, self.weights),
                }
                if self.l2sp:
                    last["l2sp_penalty"] = self.l2sp_penalty()
                if procs.main:
                    files.append_line(metrics_path, json.dumps(last))
                loss_text = "no loss tokens" if last["loss"] is None else f"{last['loss']:.3f}"
                progress.set_postfix(loss=loss_text, acc_0=f"{100 * last['acc_0']:.1f} %",
                                     tau=f"{last['tau']:.2f}")
                self.window.zero_()
                self.window_tokens, self.window_positions, window_start = 0, 0, time.perf_counter()
            progress.update(1)
            if t["checkpoint_every"] and self.step % t["checkpoint_every"] == 0 and self.step < t["steps"]:
                self.save_checkpoint(self.stream.state)
            if curve is not None and self.step in curve.steps and curve.measure(self.step, self.tokens):
                self.log(f"{self.out.name}: stopped early at step {self.step}: train.early_stop measurements "
                         "without a better validation τ")
                break
        progress.close()
        return last

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self, data_state: dict) -> Path:
        """`checkpoints/step_NNNNNN/`: the drafter (SGLang layout) and the training state, written to a
        temporary folder and renamed into place; older ones beyond `keep_checkpoints` are removed."""
        path = self.checkpoint_dir / f"step_{self.step:06d}"
        if self.procs.main:
            with files.staged_folder(path, replace=True) as staging:
                save_drafter(self.drafter, staging / "drafter", layout="sglang")
                save_state(
                    {
                        "step": self.step,
                        "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(),
                        "rewarm_from": self.rewarm_from,
                        "data": data_state,
                        "rng": _rng_state(),
                        "window": self.window.clone(),
                        "window_tokens": self.window_tokens,
                        "window_positions": self.window_positions,
                        "tokens": self.tokens,
                        "train": self.train,
                        "seed": self.seed,
                        "world_size": self.procs.world_size,
                    },
                    staging / STATE_FILE,
                )
            for old in self.checkpoints()[: -self.train["keep_checkpoints"] or None]:
                shutil.rmtree(old)
        self.procs.barrier()
        return path

    def checkpoints(self) -> list[Path]:
        if not self.checkpoint_dir.is_dir():
            return []
        return sorted(p for p in self.checkpoint_dir.glob("step_*") if (p / STATE_FILE).is_file())

    def _restore_latest(self, metrics_path: Path) -> None:
        found = self.checkpoints()
        if not found:
            afresh = ""
            if self.procs.main and metrics_path.exists():  # its entries came from steps trained again now
                metrics_path.unlink()
                afresh = f", {metrics_path} afresh"
            self.log(f"resume: no checkpoint under {self.checkpoint_dir}; starting at step 0{afresh}")
            return
        path = found[-1]
        state = load_state(path / STATE_FILE)
        changed = sorted(
            key for key, value in self.train.items()
            if key not in RESUME_FREE and state["train"].get(key) != value
        )
        if changed or state["seed"] != self.seed:
            raise TrainingError(
                f"resume from {path}: the run's params differ from the checkpoint's in "
                f"{', '.join(changed) or 'run.seed'}; resume with the same params"
            )
        saved = load_drafter(path / "drafter", strict=True, dtype=torch.float32)[0].state_dict()
        with torch.no_grad():
            for name, tensor in self.drafter.state_dict().items():
                tensor.copy_(saved[name])
        self.scheduler.load_state_dict(state["scheduler"])
        self.rewarm_from = state.get("rewarm_from")
        relayed = "optimizer" not in state  # `relay`: carried without AdamW's moments
        if relayed:
            self.rewarm_from = state["step"]
            for group in self.optimizer.param_groups:
                group["lr"] = self.train["lr"] * self.lr_factor(state["step"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.stream.restore(state["data"])
        _set_rng_state(state["rng"])
        self.window, self.window_tokens = state["window"], state["window_tokens"]
        self.window_positions, self.tokens = state["window_positions"], state["tokens"]
        self.step = state["step"]
        if self.procs.main and metrics_path.exists():  # drop entries logged after that checkpoint
            whole, _, torn = metrics_path.read_text().rpartition("\n")
            if torn:  # the last append was cut short (a full disk, a kill): its entry is after the checkpoint
                self.log(f"resume: dropped the torn last line of {metrics_path} ({len(torn)} characters "
                         "without their newline)")
            lines = whole.splitlines()
            kept = [line for number, line in enumerate(lines, 1)
                    if files.json_line(line, metrics_path, number)["step"] <= self.step]
            files.atomic_write_text(metrics_path, "".join(line + "\n" for line in kept))
        if relayed:
            self.log(f"resumed from {path} at step {self.step}, a relay's checkpoint (saved on "
                     f"{state['relayed']['machine']}; without {state['relayed']['dropped']}): AdamW starts "
                     f"afresh and the learning rate rewarms over {self.train['warmup_steps']} steps")
        else:
            self.log(f"resumed from {path} at step {self.step}")


def save_state(state: dict, file: Path) -> None:
    """torch.save into a file object of ours, so that a failed write says why (torch's own file writer
    reports only "enforce fail at inline_container.cc")."""
    try:
        with open(file, "wb") as handle:
            torch.save(state, handle)
    except Exception as err:
        raise files.write_failure(file, err) from err


def load_state(file: Path) -> dict:
    """A training state, read by a weights-only load: tensors, containers, numbers and strings, never the
    code a pickle can carry. A file that needs more was not written by this trainer and is refused."""
    return files.load_weights_only(file, TrainingError)


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast when asked for, or with `auto` where the device computes bf16 natively
    (`devices.fast_bf16`: CUDA, CPUs with AMX or AVX512-BF16), else plain float32."""
    if dtype == "fp32":
        return None
    if dtype == "bf16" or fast_bf16(device):
        return torch.bfloat16
    return None
