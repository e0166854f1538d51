"""The arms of the fine-tuning experiment: the drafter each starts from, and the step-0 check that judges
that start.

- `scratch`: a fresh drafter whose `lm_head` is the target's `lm_head` rows of the draft vocab;
- `drafter`: the checkpoint in `train.drafter`; when its vocab map differs from the training map its
  `lm_head` rows are moved with `remap.remap_drafter`, and the remap's proof is logged;
- `drafter-no-remap`: the same checkpoint with the training map put in place and the rows left where
  they were. This is the seed bug (labels scrambled), refused unless `train.allow_no_remap`; its
  step-0 check is reported, not enforced, since the arm exists to show that failure;
- `drafter-l2sp`: the `drafter` arm trained with L2-SP (`train.l2sp` > 0, which then applies to this arm
  alone), pulled towards the remapped warm start: what it keeps of the old domain beside the plain one.
The token embedding is always the target's (from the data folder's `target_head.safetensors`), frozen.

Before the first step every arm runs the step-0 check on a few batches: loss and acc_0 against ln(Vd)
and against always proposing the most frequent token. A warm start that begins at or above ln(Vd), or
no better than that baseline, has scrambled labels or mismatched inputs; it stops the arm unless
`train.check_enforce` is false.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle3lib import files
from eagle3lib.data.readers import TrainingData
from eagle3lib.drafter.checkpoint import load_drafter
from eagle3lib.drafter.config import DrafterConfig, read_config
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.training.loss import chance_loss
from eagle3lib.training.remap import drafter_map, remap_drafter
from eagle3lib.training.trainer import TrainingError

ARMS = ("scratch", "drafter", "drafter-no-remap", "drafter-l2sp")
WARM_ARMS = ("drafter", "drafter-l2sp")  # the warm starts whose lm_head rows are remapped


class StepZeroCheckFailed(TrainingError):
    pass


@dataclass
class CheckResult:
    """The step-0 check: the drafter's loss and acc_0 before any training, and what they say."""

    loss_0: float
    acc_0: float
    chance_loss: float  # ln(Vd)
    baseline_acc: float  # always proposing the most frequent target token of these rows
    metrics: dict
    warm_start: bool  # only a warm start can fail: a fresh drafter is checked for reference
    passed: bool
    message: str


def diagnose(metrics: dict, baseline_acc: float, vd: int, warm_start: bool) -> CheckResult:
    loss_0, acc_0, ln_vd = metrics["loss_0"], metrics["acc_0"], chance_loss(vd)
    if loss_0 is None:
        message = (f"step-0 check: the check batches hold no loss token (no target in the draft vocabulary "
                   f"of {vd}): nothing to judge; check the vocab map against the data")
        return CheckResult(math.nan, acc_0, ln_vd, baseline_acc, metrics, warm_start, not warm_start, message)
    failures = []
    if not math.isfinite(loss_0) or loss_0 >= ln_vd:
        failures.append(f"loss_0 {loss_0:.3f} >= ln(Vd) = ln({vd}) = {ln_vd:.3f}")
    if acc_0 <= baseline_acc:
        failures.append(
            f"acc_0 {acc_0:.2%} is no better than always proposing the most frequent token "
            f"({baseline_acc:.2%})"
        )
    numbers = f"loss_0 {loss_0:.3f} (ln Vd = {ln_vd:.3f}), acc_0 {acc_0:.2%} (baseline {baseline_acc:.2%})"
    if not warm_start:
        return CheckResult(loss_0, acc_0, ln_vd, baseline_acc, metrics, False, True,
                           f"step-0 check (fresh drafter, for reference): {numbers}")
    if not failures:
        return CheckResult(loss_0, acc_0, ln_vd, baseline_acc, metrics, True, True,
                           f"step-0 check passed: {numbers}")
    message = (
        f"step-0 check FAILED for a warm start: {'; '.join(failures)}. A drafter that knows its job starts "
        "well below ln(Vd) and well above the baseline; this one predicts confidently wrong tokens. Check: "
        "(1) the vocab maps: the checkpoint's d2t/t2d against the training map (`eagle3 diff-vocab`), and "
        "that lm_head rows were remapped (arm `drafter`, not `drafter-no-remap`); (2) key names: the load "
        "report must show every weight loaded, none missing or initialised; (3) aux layer ids and hidden "
        "sizes: the data's aux ids must be the drafter's (eagle3lib numbering = output of layer i)."
    )
    return CheckResult(loss_0, acc_0, ln_vd, baseline_acc, metrics, True, False, message)


# ----------------------------------------------------------------------------- inputs of an arm


def _check_drafter_fits(drafter: Eagle3Drafter, source: str, data: TrainingData) -> None:
    c = drafter.config
    problems = []
    if c.vocab_size != data.vocab_size:
        problems.append(f"its Vt is {c.vocab_size}, the data's target has {data.vocab_size}")
    if c.target_hidden_size != data.target_hidden_size:
        problems.append(
            f"it reads target hidden size {c.target_hidden_size}, the data has {data.target_hidden_size}"
        )
    if c.hidden_size != data.head["embed_tokens.weight"].shape[1]:
        problems.append(
            f"its hidden size {c.hidden_size} differs from the target embedding's "
            f"{data.head['embed_tokens.weight'].shape[1]}"
        )
    if c.aux_layer_ids is not None and list(c.aux_layer_ids) != list(data.aux_layer_ids):
        problems.append(
            f"it was trained on aux layers {c.aux_layer_ids}, the data holds layers {data.aux_layer_ids} "
            "(eagle3lib numbering)"
        )
    if problems:
        raise TrainingError(
            f"drafter {source} does not fit the data of {data.target}: " + "; ".join(problems)
        )


def scratch_config(train: dict, data: TrainingData) -> DrafterConfig:
    """A fresh drafter's config: train.scratch sizes, else those of the warm-start drafter (same budget,
    same architecture), with the target's hidden size, vocab and aux layers."""
    sizes = dict(train["scratch"])
    missing = [key for key, value in sizes.items() if value is None]
    if missing and train["drafter"]:
        source = read_config(files.resolve_path(train["drafter"]))[0]
        sizes.update({key: getattr(source, key) for key in missing})
    elif missing:
        raise TrainingError(
            f"the scratch arm needs train.scratch.{', train.scratch.'.join(missing)}, or a train.drafter "
            "whose architecture it copies"
        )
    hidden = data.head["embed_tokens.weight"].shape[1]
    return DrafterConfig(
        hidden_size=hidden,
        vocab_size=data.vocab_size,
        draft_vocab_size=data.vocab_map.vd,
        target_hidden_size=data.target_hidden_size,
        aux_layer_ids=list(data.aux_layer_ids),
        **sizes,
    )


def init_drafter(arm: str, train: dict, data: TrainingData, seed: int) -> tuple[Eagle3Drafter, str]:
    """The drafter an arm starts from, on CPU in float32, and a report of how it was made."""
    new_map = data.vocab_map
    if arm == "scratch":
        torch.manual_seed(seed)
        drafter = Eagle3Drafter(scratch_config(train, data))
        with torch.no_grad():
            drafter.lm_head.weight.copy_(data.head["lm_head.weight"][new_map.draft_ids])
            drafter.d2t.copy_(new_map.d2t)
            drafter.t2d.copy_(new_map.t2d)
        report = (
            f"scratch: fresh drafter (seed {seed}), lm_head = the target's lm_head rows of the {new_map.vd} "
            f"draft tokens; fc, midlayer and norm freshly initialised\n{_describe_config(drafter.config)}"
        )
    elif arm in (*WARM_ARMS, "drafter-no-remap"):
        if not train["drafter"]:
            raise TrainingError(f"arm {arm!r} needs train.drafter, the checkpoint to start from")
        if arm == "drafter-no-remap" and not train["allow_no_remap"]:
            raise TrainingError(
                "arm 'drafter-no-remap' keeps the checkpoint's lm_head rows under a different vocab map: the "
                "scrambled-labels bug. It exists only to reproduce that bug; set train.allow_no_remap=true"
            )
        path = files.resolve_path(train["drafter"])
        drafter, load_report = load_drafter(path, strict=True, dtype=torch.float32)
        _check_drafter_fits(drafter, str(path), data)
        old_map = drafter_map(drafter, str(path))
        lines = [f"load report: {load_report}"]
        verifier = drafter.config.verifier
        if verifier and verifier != data.target:
            lines.append(f"note: the checkpoint was made for {verifier}; the data comes from {data.target}")
        if old_map == new_map:
            lines.append("vocab map: the checkpoint's map is the training map; nothing to move")
        elif arm in WARM_ARMS:
            drafter, remap_report = remap_drafter(
                drafter, new_map, missing=train["remap_missing"], target_head=data.head["lm_head.weight"],
                seed=seed,
            )
            lines.append(f"vocab map differs from the training map: {remap_report.summary()}")
            if not remap_report.proof.passed:
                raise TrainingError(f"remap of {path} failed its proof: {remap_report.proof.summary()}")
        else:
            agree = int((old_map.draft_ids == new_map.draft_ids).sum()) if old_map.vd == new_map.vd else 0
            if old_map.vd != new_map.vd:
                raise TrainingError(
                    f"drafter-no-remap needs equal draft vocab sizes: the checkpoint has {old_map.vd}, the "
                    f"training map {new_map.vd}"
                )
            with torch.no_grad():
                drafter.d2t.copy_(new_map.d2t)
                drafter.t2d.copy_(new_map.t2d)
            lines.append(
                f"vocab map REPLACED WITHOUT REMAP (seed bug reproduced on purpose): lm_head rows kept, only "
                f"{agree} of {new_map.vd} draft positions still name the same token"
            )
        report = "\n".join(lines)
    else:
        raise TrainingError(f"unknown arm {arm!r}; expected one of {', '.join(ARMS)}")
    carried = "; the checkpoint's own copy is set aside" if hasattr(drafter, "embed_tokens") else ""
    drafter = drafter.float()
    drafter.attach_embedding(data.head["embed_tokens.weight"])  # frozen: no float32 copy of [Vt, H]
    report += f"\nembedding: the target's (target_head.safetensors), frozen{carried}"
    return drafter, report


def _describe_config(c: DrafterConfig) -> str:
    return (
        f"H {c.hidden_size}, heads {c.num_attention_heads}/{c.num_key_value_heads} x {c.head_dim}, "
        f"intermediate {c.intermediate_size}, Vt {c.vocab_size}, Vd {c.draft_vocab_size}, "
        f"aux layers {c.aux_layer_ids}"
    )



def arm_l2sp(arm: str, train: dict) -> float:
    """λ of L2-SP for an arm: train.l2sp for the warm starts, for drafter-l2sp alone when that arm is trained
    beside them; never for scratch (it has no warm start to stay near)."""
    if arm == "scratch" or ("drafter-l2sp" in train["arms"] and arm != "drafter-l2sp"):
        return 0.0
    return train["l2sp"]
