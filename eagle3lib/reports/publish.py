"""Ship a drafter this project trained: its weights (bfloat16 by default) and the provenance that made it.

A published folder is an ordinary SGLang-layout checkpoint plus `provenance.json`: the command and git commit
that trained it (as `eagle3 run` recorded it for notebook 04; the commit it was published at too), the
recipe, its training curve and last training metrics (which notebook 05 turns into a predicted τ), what
notebook 05 measured for it, and the SHA-256 of its weights, which `verify` checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from eagle3lib import files, runs
from eagle3lib.drafter.checkpoint import PROVENANCE, check_published, load_drafter, save_drafter
from eagle3lib.reports import plots

WEIGHTS = "model.safetensors"
DEMO_SOURCE_DRAFTER = files.REPO_ROOT / "drafters" / "smollm2-135m-chat"  # params/demo.yaml's source drafter


class PublishError(ValueError):
    """A run that cannot be published, or a published folder that does not match its record."""


def publish(run_dir: Path, arm: str, out: Path, *, command: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy the drafter of `run_dir/04_finetune/<arm>/` to `out/` in `dtype`, with its provenance."""
    arm_folder = Path(run_dir) / runs.FINETUNE / arm
    summary_path = arm_folder / "summary.json"
    if not summary_path.is_file():
        raise PublishError(f"{summary_path}: no finished arm to publish (run notebook 04 first)")
    summary = json.loads(summary_path.read_text())
    drafter, report = load_drafter(arm_folder / "drafter", strict=True, dtype=dtype)
    metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    curve = files.read_json_lines(arm_folder / "metrics.jsonl")
    with files.staged_folder(Path(out)) as staging:
        save_drafter(drafter, staging / "drafter")
        for item in (staging / "drafter").iterdir():
            item.rename(staging / item.name)
        (staging / "drafter").rmdir()
        plots.ttt_step_curves({arm: [{"step": 0, **summary["check"]["metrics"]}, *curve]},
                              staging / "training_curve.png")
        record = {
            "command": command,
            "commit": training_commit(metrics),
            "published_at_commit": runs.git_commit(),
            "dtype": str(dtype).removeprefix("torch."),
            "load_report": report.summary(),
            "recipe": yaml.safe_load((Path(run_dir) / "params.yaml").read_text()),
            "data": metrics.get(runs.PREPARE_DATA),
            "steps": summary["steps"],
            "training_seconds": summary["seconds"],
            "final_check": summary["final_check"],
            "training_curve": curve,
            "measured": metrics.get(runs.EVALUATE),
            "learning_curve": _read_json(arm_folder / "learning_curve.json"),
            "sha256": {WEIGHTS: files.file_sha256(staging / WEIGHTS)},
        }
        files.atomic_write_text(staging / PROVENANCE, json.dumps(record, indent=1) + "\n")
    return Path(out)


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def training_commit(metrics: dict) -> str:
    """The git commit `eagle3 run` recorded when it ran notebook 04 ("+changes": with uncommitted edits)."""
    runs_of_04 = [p for p in metrics.get("provenance", []) if runs.FINETUNE in p.get("notebooks", [])]
    if not runs_of_04:
        raise PublishError("the run's metrics.json records no provenance for 04_finetune (use eagle3 run)")
    return runs_of_04[-1]["git commit"]


def verify(folder: Path) -> dict:
    """The provenance of a published drafter, after checking its weights against the recorded hash."""
    folder = Path(folder)
    check_published(folder)
    return json.loads((folder / PROVENANCE).read_text())


def measured_metrics(record: dict) -> dict[str, dict]:
    """What notebook 05 measured for a published drafter, flat: {"benchmark: drafter": metrics}."""
    benchmarks = (record.get("measured") or {}).get("benchmarks", {})
    return {f"{name}: {drafter}": m for name, found in benchmarks.items() for drafter, m in found.items()}
