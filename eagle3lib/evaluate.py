"""Drafters side by side on the same prompts (notebook 05): τ with intervals, paired verdicts, the draft
depth that pays on this machine, and the τ training predicted against the τ decoding measured."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3lib import intervals
from eagle3lib.speculate import DraftSettings


def depth_grid(steps: list[int], tree: dict, temperature: float = 0.0) -> dict[str, DraftSettings]:
    """The K sweep: one chain per depth in `steps`, plus one small tree (`tree.steps` 0: none)."""
    grid = {f"chain K={k}": DraftSettings(steps=k, temperature=temperature) for k in steps}
    if tree["steps"]:
        settings = DraftSettings(steps=tree["steps"], topk=tree["topk"],
                                 num_draft_tokens=tree["num_draft_tokens"], temperature=temperature)
        grid[f"tree {settings.steps}x{settings.topk} ({settings.num_draft_tokens})"] = settings
    return grid


def best_setting(sweep: dict[str, dict]) -> str:
    """The setting with the highest wall-clock speedup over the target alone (the same setting in decoding
    alone: the prefill both share is the same for every setting)."""
    return max(sweep, key=lambda label: sweep[label]["speedup"])


def training_metrics(drafter: str | Path) -> dict | None:
    """The metrics training recorded for a drafter on its own data after its last step (the step-0 check's
    batches, teacher-forced): from its arm's summary.json beside it (notebook 04) or the provenance.json a
    shipped drafter carries; None when neither is there."""
    folder = Path(drafter)
    for path in (folder.parent / "summary.json", folder / "provenance.json"):
        if path.is_file():
            return json.loads(path.read_text())["final_check"]["metrics"]
    return None


def predicted_tau(metrics: dict, steps: int) -> float | None:
    """Chain τ at depth `steps` from training's per-step accuracies: 1 + Σ_{k<steps} full_acc_k (None when
    training unrolled fewer steps)."""
    if f"full_acc_{steps - 1}" not in metrics:
        return None
    return 1.0 + sum(metrics[f"full_acc_{k}"] for k in range(steps))


def calibration(measured: dict[str, dict], drafters: dict[str, Path], steps: int) -> dict[str, dict]:
    """Per drafter with training metrics: predicted τ, measured τ with its interval, relative error."""
    rows = {}
    for name, path in drafters.items():
        found = training_metrics(path)
        predicted = predicted_tau(found, steps) if found else None
        if predicted is None:
            continue
        m = measured[name]
        rows[name] = {
            "predicted_tau": predicted,
            "measured_tau": m["tau"],
            "tau_low": m.get("tau_low"),
            "tau_high": m.get("tau_high"),
            "relative_error": predicted / m["tau"] - 1,
            "acc_0": found["acc_0"],
            "acceptance_1": m["acceptance_per_position"][0],
        }
    return rows


def comparisons(measured: dict[str, dict], seed: int = 0) -> list[intervals.Comparison]:
    """Every pair of drafters by a paired bootstrap over the prompts they all decoded."""
    per_prompt = {name: m["accepted_per_prompt"] for name, m in measured.items()
                  if m.get("accepted_per_prompt")}
    return intervals.pairwise(per_prompt, seed=seed)


def tau_text(metrics: dict) -> str:
    """'1.52 [1.41, 1.63]' where an interval was measured, else '1.52'."""
    if metrics.get("tau_low") is None:
        return f"{metrics['tau']:.2f}"
    return f"{metrics['tau']:.2f} [{metrics['tau_low']:.2f}, {metrics['tau_high']:.2f}]"


def speedup_text(metrics: dict) -> str:
    """'1.05x (1.31x in decoding)': end to end, and without the shared prefill where that was measured."""
    text = f"{metrics['speedup']:.2f}x"
    if metrics.get("decode_speedup") is not None:
        text += f" ({metrics['decode_speedup']:.2f}x in decoding)"
    return text


def calibration_sentence(name: str, row: dict) -> str:
    """Where a prediction's gap comes from, in numbers: the first draft position (training's acc_0 on its own
    batches vs acceptance at position 1 on held-out prompts: a shift of data) against the later positions
    (teacher forcing in training, the drafter's own drafts when decoding)."""
    first_gap = row["acc_0"] - row["acceptance_1"]
    text = (f"{name}: predicted τ {row['predicted_tau']:.2f}, measured {row['measured_tau']:.2f} "
            f"({row['relative_error']:+.0%}); position 1: {row['acc_0']:.0%} on training batches vs "
            f"{row['acceptance_1']:.0%} accepted on held-out prompts")
    if abs(row["relative_error"]) <= 0.10:
        return text + " — within 10 %."
    if abs(first_gap) >= 0.05:
        return text + (" — most of the gap is already at position 1: the held-out prompts are not the "
                       "training data.")
    return text + (" — position 1 agrees, so the gap is in the later positions: training feeds them the true "
                   "tokens (teacher forcing), decoding feeds the drafter's own drafts.")


def best_settings(sweeps: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per drafter: its fastest setting, with τ and speedup there and at the probe's own setting."""
    found = {}
    for name, sweep in sweeps.items():
        label = best_setting(sweep)
        keys = ("tau", "tau_low", "tau_high", "speedup", "decode_speedup")
        found[name] = {"setting": label} | {key: sweep[label][key] for key in keys}
    return found
