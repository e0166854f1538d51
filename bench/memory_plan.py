"""Memory plan of one TTT training step at Kimi-K2.5 scale, traced through eagle3lib's own trainer code.

    .venv/bin/python bench/memory_plan.py [--seq-len 2048] [--ttt-steps 7] [--attention blocks|fused]

Nothing here is a formula. The trainer is built as it is for a real run (`train.init_drafter` for the
scratch arm, `Trainer` with the params' defaults), but from fake tensors (shapes and dtypes, no
memory): the target head the data folder supplies (embed_tokens and lm_head [Vt, Ht] in the target's
dtype), the drafter, its attached embedding, the trainer's draft head. One optimizer step then runs through
the trainer's own pieces: the verifier targets (`verifier_draft_logits`, softmax), `TTTObjective` (the
drafter's `unroll_steps` and `ttt_sums`) under the trainer's autocast, `weighted_loss`, backward, gradient
clipping, AdamW. A dispatch mode records every storage an operator creates and the moment it is freed,
so the peak and what is alive at the peak are the code's, shape by shape. Skipped: the data-dependent
validation of the batch masks (a few [B, T] booleans).

Defaults: the Kimi-K2.5 EAGLE-3 drafter shape (one Llama layer, H 7,168, 64 heads and 64 KV heads x 128,
intermediate 12,288, rope_theta 1e6, as public Kimi-K2.5 EAGLE-3 draft configs), Vt 163,840, Vd 32,000,
target head and captured states in bf16, micro-batch 1 x 2,048 tokens, 7 TTT steps, `train.dtype` bf16
(what `auto` picks on a GPU; fake tensors carry CPU autocast, which casts matmuls to bf16 as CUDA's does).
AdamW takes its foreach path, as it does for CUDA tensors. Device memory is what is reported: the CUDA
caching allocator rounds and fragments on top of it.
"""

from __future__ import annotations

import argparse
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from eagle3lib.data.readers import TrainingData
from eagle3lib.drafter import ttt_attention
from eagle3lib.drafter.config import default_aux_layer_ids
from eagle3lib.drafter.vocab import VocabMap
from eagle3lib.params import load_params
from eagle3lib.training import arms
from eagle3lib.training.loss import Targets, verifier_draft_logits, weighted_loss
from eagle3lib.training.trainer import Processes, Trainer

GIB = 2**30
FORWARD_CATEGORIES = ("draft logits", "attention scores", "MLP activations", "hidden-sized activations",
                      "bf16 weight copies (autocast)")
KNOBS = {
    "attention scores": "TTT steps k >= 1 keep O(T) per head (PrefixAndDiagonalsAttention: the step-0 prefix "
    "attention returns its log-sum-exp, the diagonals merge into it); off the CPU the prefix runs in blocks "
    "of query rows (BlockedCausalAttention.score_elements per block, transient)",
    "draft logits": "logit-sized [B, T, Vd] float32 tensors kept for backward at every TTT step: compute "
    "lm_head + log-softmax + loss in row chunks and recompute them in backward (a chunked/fused loss), or "
    "fewer train.ttt_steps",
    "verifier targets": "the verifier's [B, T, Vd] probabilities: compute them per row chunk inside the "
    "loss, or store top-k verifier probabilities in the data folder instead of the last hidden state",
    "MLP activations": "[B, T, intermediate] gate/up/SiLU outputs of every TTT step: activation "
    "checkpointing of the MLP per TTT step, or a smaller train.micro_batch_size / seq_len",
    "hidden-sized activations": "[B, T, H]-sized inputs, norms (computed in float32), q/k/v and RoPE outputs "
    "of every TTT step: activation checkpointing per TTT step (recompute the layer in backward), or a "
    "smaller train.micro_batch_size / seq_len",
    "bf16 weight copies (autocast)": "autocast keeps a bf16 copy of every weight for the whole forward: keep "
    "the frozen weights in bf16, or train with bf16 weights and fp32 optimizer state",
    "gradients and backward temporaries": "gradients of the trainable weights: freeze lm_head "
    "(train.train_lm_head=false, as speculators), or shard them (FSDP/ZeRO-2)",
    "AdamW state": "two float32 moments per trainable weight: shard across data-parallel ranks (ZeRO-1), or "
    "an 8-bit/bf16-state optimizer; train.train_lm_head=false removes lm_head's share",
    "trainable weights (fp32)": "fp32 master weights: shard them (FSDP) or freeze lm_head",
    "target embedding (frozen)": "the drafter's lookup table, the target's [Vt, H] embedding in the data's "
    "dtype: keep the data in bf16, or look the rows up on the host and send only the batch's rows",
}


class StorageTracker(TorchDispatchMode):
    """Live bytes of every storage created by an operator while active, by category, and their peak."""

    def __init__(self, classify):
        super().__init__()
        self.classify, self.phase = classify, "setup"
        self.live: dict[str, int] = defaultdict(int)
        self.peak, self.at_peak = 0, {}
        self.phase_peaks: dict[str, int] = {}
        self._seen = WeakIdKeyDictionary()

    @contextmanager
    def during(self, phase: str):
        self.phase = phase
        yield
        self.phase_peaks[phase] = self.phase_peaks.get(phase, self.total)

    @property
    def total(self) -> int:
        return sum(self.live.values())

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        size, category = storage.nbytes(), self.classify(self.phase, tensor)
        self._seen[storage] = weakref.ref(storage, lambda _: self._free(category, size))
        self.live[category] += size
        total = self.total
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), total)
        if total > self.peak:
            self.peak, self.at_peak = total, {**self.live, "(phase)": self.phase}

    def already_held(self, tensors) -> None:
        """Storages that existed before tracking: views of them are not new memory."""
        for tensor in tensors:
            self._seen[tensor.untyped_storage()] = None

    def restart(self) -> None:
        """Forget the peaks so far (what is alive stays alive)."""
        self.peak, self.at_peak, self.phase_peaks = 0, {}, {}

    def _free(self, category: str, size: int) -> None:
        self.live[category] -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        return out


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (meta and fake tensors too)."""
    storages = {tensor.untyped_storage()._cdata: tensor.untyped_storage().nbytes() for tensor in tensors}
    return sum(storages.values())


def build_trainer(args: argparse.Namespace, fake: FakeTensorMode) -> tuple[Trainer, dict, dict]:
    """The scratch arm's Trainer from the params' defaults, on fake CPU tensors; its data head and a batch."""
    sizes = {"num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
             "head_dim": args.head_dim, "intermediate_size": args.intermediate, "rms_norm_eps": 1e-6,
             "rope_theta": 1e6, "max_position_embeddings": 262_144}
    overrides = {"run": {"device": "cpu"}, "train": {
        "seq_len": args.seq_len, "ttt_steps": args.ttt_steps, "micro_batch_size": args.micro_batch,
        "batch_size": args.micro_batch, "dtype": args.dtype, "checkpoint_every": 0, "scratch": sizes}}
    if args.train_lm_head is not None:
        overrides["train"]["train_lm_head"] = args.train_lm_head
    t = load_params(None, overrides)["train"]
    B, T, H, data_dtype = t["micro_batch_size"], t["seq_len"], args.hidden, getattr(torch, args.data_dtype)
    # a real vocab map (its tensors are small): every (Vt // Vd)-th target id is a draft token
    vocab_map = VocabMap.from_ids(torch.arange(args.vd) * (args.vt // args.vd), args.vt)

    # init_drafter runs on the meta device (its weight copies do nothing there); the Trainer then moves the
    # drafter onto fake CPU tensors, which carry CPU autocast
    real_ids = vocab_map.draft_ids
    with torch.device("meta"):
        vocab_map.draft_ids = real_ids.to("meta")
        head = {"embed_tokens.weight": torch.empty(args.vt, H, dtype=data_dtype),
                "norm.weight": torch.empty(H, dtype=data_dtype),
                "lm_head.weight": torch.empty(args.vt, H, dtype=data_dtype)}
        data = TrainingData(None, vocab_map, head, H, args.vt, default_aux_layer_ids(61), "Kimi-K2.5")
        drafter, _ = arms.init_drafter("scratch", t, data, seed=0)
    vocab_map.draft_ids = real_ids

    with fake:
        trainer = Trainer(drafter, data, t, 0, None, Processes(), log=lambda message: None)
        for group in trainer.optimizer.param_groups:
            group["foreach"] = True  # what AdamW picks for CUDA tensors
        batch = {"input_ids": torch.zeros(B, T, dtype=torch.long),
                 "aux_hidden_states": torch.empty(B, T, len(data.aux_layer_ids) * H, dtype=data_dtype),
                 "last_hidden_state": torch.empty(B, T, H, dtype=data_dtype),
                 "target_argmax": torch.zeros(B, T, dtype=torch.long),
                 "loss_mask": torch.ones(B, T, dtype=torch.long),
                 "attention_mask": torch.ones(B, T, dtype=torch.long)}
    return trainer, head, batch


def trace_steps(trainer: Trainer, head: dict, batch: dict, args: argparse.Namespace
                ) -> tuple[StorageTracker, dict[str, int]]:
    """Two optimizer steps under the tracker: the first makes the AdamW state, the second is every later
    step (that state held). Returns the tracker (peaks of the second step) and what its forward saved."""
    t, drafter = trainer.train, trainer.drafter
    B, T = batch["input_ids"].shape
    rows = T - 1
    weight_shapes = {tuple(p.shape) for p in drafter.parameters()}

    def classify(phase: str, tensor: torch.Tensor) -> str:
        if phase in ("verifier targets", "optimizer"):
            return "AdamW state" if phase == "optimizer" else phase
        if phase == "backward":
            return "gradients and backward temporaries"
        shape = tuple(tensor.shape)
        if shape and shape[-1] == args.vd:
            return "draft logits"
        if tensor.dim() >= 4 and shape[-1] != args.head_dim:  # [.., queries, keys]; q/k/v end in head_dim
            return "attention scores"
        if shape in weight_shapes:
            return "bf16 weight copies (autocast)"
        if shape and shape[-1] == args.intermediate:
            return "MLP activations"
        return "hidden-sized activations"

    tracker = StorageTracker(classify)
    tracker.already_held([*drafter.parameters(), *drafter.buffers(), *head.values(), trainer.draft_head,
                          trainer.t2d, trainer.objective.draft_ids, *batch.values()])
    ce_rows = torch.full((t["ttt_steps"],), float(B * rows), dtype=torch.float64)
    argmax = batch["target_argmax"]

    def optimizer_step() -> dict[str, int]:
        """Trainer._optimizer_step and the rest of Trainer.fit's step; returns what the forward saved."""
        with tracker.during("verifier targets"):
            # Targets.from_batch without its data-dependent mask validation
            logits = verifier_draft_logits(batch["last_hidden_state"], trainer.draft_head)
            targets = Targets(probs=torch.softmax(logits, -1), argmax=argmax, in_draft=trainer.t2d[argmax],
                              counted=torch.ones(B, T, dtype=torch.bool))
            del logits
        with tracker.during("forward"), trainer.autocast():
            sums = trainer.model(batch, targets)
        saved = dict(tracker.live)
        with tracker.during("backward"):
            weighted_loss(sums.ce, ce_rows, trainer.weights).backward()
        with tracker.during("optimizer"):
            torch.nn.utils.clip_grad_norm_(trainer.parameters, t["max_grad_norm"] or float("inf"))
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        return saved

    with tracker:
        optimizer_step()
        tracker.restart()
        saved = optimizer_step()
    return tracker, saved


def report(trainer: Trainer, head: dict, batch: dict, tracker: StorageTracker, saved: dict,
           args: argparse.Namespace) -> None:
    t, drafter = trainer.train, trainer.drafter
    B, T = batch["input_ids"].shape
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    held = {
        "trainable weights (fp32)": unique_bytes(trainable),
        "frozen drafter weights": unique_bytes(p for p in drafter.parameters() if not p.requires_grad),
        "target embedding (frozen)": unique_bytes([drafter.target_embedding]),
        "trainer's draft head (fp32)": unique_bytes([trainer.draft_head]),
        "batch": unique_bytes(batch.values()),
    }
    persistent, probs_bytes = sum(held.values()), B * T * args.vd * 4
    adam = unique_bytes(s for state in trainer.optimizer.state.values() for s in state.values()
                        if torch.is_tensor(s) and s.dim() > 0)
    print(f"drafter: H {args.hidden}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, "
          f"intermediate {args.intermediate}, Vt {args.vt:,}, Vd {args.vd:,}; "
          f"{sum(p.numel() for p in trainable) / 1e9:.3f} B trainable parameters (train_lm_head="
          f"{t['train_lm_head']})")
    print(f"step: micro-batch {B} x T {T}, {t['ttt_steps']} TTT steps, train.dtype {t['dtype']}, data in "
          f"{args.data_dtype}\n")
    print("held for the whole run (before the step)")
    for name, size in held.items():
        print(f"  {name:<44} {size / GIB:8.2f} GiB")
    print(f"  {'total':<44} {persistent / GIB:8.2f} GiB")
    print(f"  (host RAM, not counted: the data's target head, {unique_bytes(head.values()) / GIB:.2f} GiB, "
          "stays on the host; the Trainer copies only the embedding and the draft rows to the device)\n")
    print("created by one optimizer step")
    print(f"  {'verifier logits (probs over Vd, fp32)':<44} {probs_bytes / GIB:8.2f} GiB "
          f"[{B}, {T}, {args.vd}] kept through backward")
    print("  saved for backward at the end of the forward:")
    for name in FORWARD_CATEGORIES:
        print(f"    {name:<42} {saved.get(name, 0) / GIB:8.2f} GiB")
    gradients = held["trainable weights (fp32)"]  # float32, shaped as the weights
    print(f"  {'gradients (fp32, until the AdamW step)':<44} {gradients / GIB:8.2f} GiB")
    print(f"  {'AdamW state (made by the first step, kept)':<44} {adam / GIB:8.2f} GiB")
    print("  peak of live step tensors by phase (the AdamW state included): " + ", ".join(
        f"{phase} {size / GIB:.2f} GiB" for phase, size in tracker.phase_peaks.items()))

    total = persistent + tracker.peak
    at_peak = {k: v for k, v in tracker.at_peak.items() if k != "(phase)" and v > 0}
    print(f"\npeak: {total / GIB:.2f} GiB = {persistent / GIB:.2f} held + {tracker.peak / GIB:.2f} GiB of "
          f"step tensors, reached during the {tracker.at_peak['(phase)']}; alive at the peak:")
    terms = {**held, **at_peak}
    for name, size in sorted(terms.items(), key=lambda item: -item[1]):
        print(f"  {name:<44} {size / GIB:8.2f} GiB  {100 * size / total:5.1f} %")
    weights = held["trainable weights (fp32)"]
    activations = sum(at_peak.get(name, 0) for name in FORWARD_CATEGORIES)
    print(f"\nin the issue's terms, at the peak: weights {weights / GIB:.2f} GiB trainable + "
          f"{(persistent - weights) / GIB:.2f} GiB frozen or held (the target embedding, the draft head, the "
          f"batch); optimizer state {adam / GIB:.2f} GiB (+ gradients "
          f"{at_peak.get('gradients and backward temporaries', 0) / GIB:.2f} GiB with backward temporaries); "
          f"activations {activations / GIB:.2f} GiB; verifier logits {probs_bytes / GIB:.2f} GiB")
    largest = max(terms, key=terms.get)
    print(f"largest term: {largest} ({terms[largest] / GIB:.2f} GiB). Knob: {KNOBS.get(largest, '-')}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--vt", type=int, default=163_840)
    parser.add_argument("--vd", type=int, default=32_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="train.dtype (autocast)")
    parser.add_argument("--data-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--train-lm-head", choices=["true", "false"], help="default: the params' default")
    parser.add_argument("--attention", default="blocks", choices=["blocks", "fused"],
                        help="the TTT prefix attention: in blocks of query rows (what a GPU run takes) or "
                        "the fused CPU kernel")
    args = parser.parse_args()
    if args.train_lm_head is not None:
        args.train_lm_head = args.train_lm_head == "true"
    if args.attention == "blocks":  # fake tensors are CPU tensors; a GPU run takes the blocked path
        ttt_attention.causal_attention_with_lse = ttt_attention.BlockedCausalAttention.forward
        ttt_attention.causal_attention_backward = ttt_attention.BlockedCausalAttention.backward
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    trainer, head, batch = build_trainer(args, fake)
    with fake:
        tracker, saved = trace_steps(trainer, head, batch, args)
        report(trainer, head, batch, tracker, saved, args)


if __name__ == "__main__":
    main()
