"""Train-time-test (TTT) loss and metrics: what a drafter is graded on at each of its K unrolled steps.

Alignment (docs/formats.md §1 and §5). A sample holds T positions, tokens x_0..x_{T-1} with the
target's states at each. The drafter gets R = T - 1 rows: row t pairs the aux state of position t
with token x_{t+1}. At TTT step k (k = 0..K-1) row t predicts token x_{t+2+k}; the target's
distribution for that token is the verifier's at position p = t+1+k, restricted to the draft vocab
and renormalised. Row t counts at step k when x_{p+1} is in the loss (`loss_mask` and
`attention_mask` at p+1); rows whose token lies past the end never count, nor, in a packed row of several
documents, rows whose token lies in another document than the row's own (the TTT gate: a document is
graded as it would be alone). The cross-entropy also
drops rows whose target argmax (over the full Vt) is outside the draft vocab: the drafter cannot
propose that token, so there is nothing to learn. Accuracy keeps them, as wrong, because serving
rejects them too.

Every quantity is a sum over rows, so sums add up across micro-batches and data-parallel ranks and
the loss can be normalised by the global row count (see `weighted_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def drafter_rows(input_ids: Tensor, aux_hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """Unshifted data [B, T] / [B, T, A*Ht] → the drafter's R = T-1 rows: tokens x_1.., aux states g_0.."""
    return input_ids[:, 1:], aux_hidden_states[:, :-1]


def verifier_draft_logits(last_hidden_state: Tensor, draft_head: Tensor) -> Tensor:
    """The verifier's logits on the draft vocab only: last_hidden_state (post final norm) @ lm_head[ids].T.

    `draft_head` is [Vd, Ht], the target's lm_head rows of the draft tokens, so the full [Vt, Ht]
    head (163,840 rows for Kimi) is never multiplied at train time. Computed in float32.
    """
    return last_hidden_state.float() @ draft_head.float().T


@dataclass
class Targets:
    """What the verifier says at each of the T positions of a batch (no gradient flows here)."""

    probs: Tensor  # [B, T, Vd] float32: verifier distribution renormalised over the draft vocab
    argmax: Tensor  # [B, T] int64: the verifier's argmax over the full Vt (target ids)
    in_draft: Tensor  # [B, T] bool: that argmax is a draft-vocab token
    counted: Tensor  # [B, T] bool: the token after position p is in the loss; False at p = T-1
    documents: Tensor | None = None  # [B, T] int64: which document of a packed row position p is in

    @classmethod
    def from_batch(cls, batch: dict, draft_head: Tensor, t2d: Tensor) -> Targets:
        """From a data batch (`last_hidden_state`, `target_argmax`, `loss_mask`, `attention_mask`)."""
        masks = position_masks(batch, t2d)
        probs = torch.softmax(verifier_draft_logits(batch["last_hidden_state"], draft_head), dim=-1)
        return cls(probs=probs, argmax=batch["target_argmax"], **masks)


def position_masks(batch: dict, t2d: Tensor) -> dict[str, Tensor]:
    """`in_draft` and `counted` [B, T] from a batch: cheap, no verifier logits needed."""
    argmax = batch["target_argmax"]
    if int(argmax.max()) >= t2d.numel() or int(argmax.min()) < 0:
        raise ValueError(
            f"target_argmax holds ids outside [0, {t2d.numel()}) (range {int(argmax.min())}.."
            f"{int(argmax.max())}): the data was made with another target vocabulary than the map's Vt "
            f"{t2d.numel()}"
        )
    in_loss = batch["loss_mask"].bool()
    if "attention_mask" in batch:
        in_loss = in_loss & batch["attention_mask"].bool()
    counted = torch.zeros_like(in_loss)
    counted[:, :-1] = in_loss[:, 1:]
    return {"in_draft": t2d[argmax], "counted": counted, "documents": documents(batch)}


def documents(batch: dict) -> Tensor | None:
    """[B, T] document numbers of a packed batch (`position_ids` restart at 0 with each document, and with
    the padding after the last), None for rows of one sample each."""
    if "position_ids" not in batch:
        return None
    return (batch["position_ids"] == 0).cumsum(1)


def step_counted(counted: Tensor, documents: Tensor | None, k: int) -> Tensor:
    """[B, R-k]: does row t count at TTT step k: the token after position t+1+k is in the loss, and it lies
    in row t's own document (the gate of packed rows; row t's document is position t's)."""
    counted = counted[:, 1 + k :]
    if documents is None:
        return counted
    same = torch.zeros_like(counted)
    same[:, :-1] = documents[:, : same.shape[1] - 1] == documents[:, 2 + k :]
    return counted & same


def ce_row_counts(in_draft: Tensor, counted: Tensor, steps: int, documents: Tensor | None = None) -> Tensor:
    """[K]: rows in the cross-entropy at each TTT step (counted, target argmax in the draft vocab)."""
    return torch.stack([(step_counted(counted, documents, k) & in_draft[:, 1 + k :]).sum()
                        for k in range(steps)])


@dataclass
class StepSums:
    """Per-step sums over rows, [K] each; only `ce` carries a gradient."""

    ce: Tensor  # soft cross-entropy summed over the rows in the CE
    ce_rows: Tensor
    rows: Tensor  # rows that count (accuracy denominators)
    correct: Tensor  # counted rows whose draft argmax, mapped to a target id, is the verifier's argmax
    full_correct: Tensor  # counted rows right at every step 0..k (the chain survives k+1 drafts)

    def detached(self) -> Tensor:
        """All five as one float64 [5, K] tensor: what gets all-reduced and logged."""
        return torch.stack([self.ce.detach().double(), *(t.double() for t in
                            (self.ce_rows, self.rows, self.correct, self.full_correct))])


def ttt_sums(step_logits: Iterable[Tensor], targets: Targets, draft_ids: Tensor) -> StepSums:
    """Sums for the logits of TTT steps 0, 1, .. against the batch's `targets` (T = R + 1 positions).

    Step k's logits are [B, R, Vd] (e.g. `Eagle3Drafter.unroll`, or a [K, B, R, Vd] tensor), or only the
    rows it is graded on, [B, R-k, Vd]: rows t = 0..R-1-k have a verifier position p = t+1+k inside the
    sample. `draft_ids` [Vd] maps draft positions to target ids (the training map's `draft_ids`).
    """
    rows_per_sample = targets.probs.shape[1] - 1
    ce, ce_rows, rows, correct, full_correct = [], [], [], [], []
    survived = None
    for k, logits in enumerate(step_logits):
        graded = rows_per_sample - k
        if logits.shape[0] != targets.argmax.shape[0] or logits.shape[1] not in (rows_per_sample, graded):
            raise ValueError(
                f"step {k} logits have shape {list(logits.shape)}; the targets hold "
                f"{list(targets.argmax.shape)} positions, so expected [B, {rows_per_sample}, Vd] or the "
                f"graded rows [B, {graded}, Vd]"
            )
        # no slice when only graded rows came: a slice's backward would zero-fill a full-size gradient
        logits = logits[:, :graded].float() if logits.shape[1] != graded else logits.float()
        probs = targets.probs[:, 1 + k :]
        counted = step_counted(targets.counted, targets.documents, k)
        in_ce = counted & targets.in_draft[:, 1 + k :]
        row_ce = -(probs * F.log_softmax(logits, dim=-1)).sum(-1)
        ce.append((row_ce * in_ce).sum())
        hit = draft_ids[logits.argmax(-1)] == targets.argmax[:, 1 + k :]
        survived = hit if survived is None else survived[:, :graded] & hit
        ce_rows.append(in_ce.sum())
        rows.append(counted.sum())
        correct.append((hit & counted).sum())
        full_correct.append((survived & counted).sum())
    return StepSums(*(torch.stack(t) for t in (ce, ce_rows, rows, correct, full_correct)))


def step_weights(steps: int, decay: float) -> Tensor:
    """decay^k for k = 0..K-1 (SpecForge: 0.8; speculators: 1.0)."""
    return torch.tensor([decay**k for k in range(steps)], dtype=torch.float64)


def weighted_loss(ce: Tensor, ce_rows_total: Tensor, weights: Tensor) -> Tensor:
    """Σ_k w_k · ce_k / N_k, where N_k counts the CE rows of the whole (global) batch, so that the
    gradients of micro-batches and ranks add up to the gradient of the global mean."""
    scale = weights.to(ce.device) / ce_rows_total.to(ce.device).clamp(min=1)
    return (ce * scale.to(ce.dtype)).sum()


def summarize(sums: Tensor, weights: Tensor) -> dict[str, float]:
    """Metrics from accumulated `StepSums.detached()` sums [5, K]: loss, loss_k, acc_k, full_acc_k, tau. A
    loss with no row in it is None (with a `note`), never 0.0.

    tau = 1 + Σ_k full_acc_k, the mean acceptance length these accuracies predict for chain drafting
    with K steps (each full_acc_k estimates P(at least k+1 drafts accepted)).
    """
    ce, ce_rows, rows, correct, full_correct = sums.double()
    loss_k = ce / ce_rows.clamp(min=1)
    acc_k = correct / rows.clamp(min=1)
    full_acc_k = full_correct / rows.clamp(min=1)
    # no row in the cross-entropy (no target in the draft vocab): no loss; 0.0 would read as a perfect step
    out = {"loss": float((loss_k * weights.double()).sum()) if ce_rows.sum() else None}
    if not ce_rows.sum():
        out["note"] = "no loss tokens: no target of these rows is in the draft vocabulary"
    for k in range(sums.shape[1]):
        out[f"loss_{k}"] = float(loss_k[k]) if ce_rows[k] else None
        out[f"acc_{k}"] = float(acc_k[k])
        out[f"full_acc_{k}"] = float(full_acc_k[k])
    out["tau"] = 1.0 + float(full_acc_k.sum())
    out["rows"] = int(rows[0])
    return out


def chance_loss(draft_vocab_size: int) -> float:
    """ln(Vd): the cross-entropy of a drafter that spreads its probability evenly over the draft vocab."""
    return math.log(draft_vocab_size)
