"""Ship a drafter this project trained: its weights (bfloat16 by default) and the provenance that made it.

A published folder is an ordinary SGLang-layout checkpoint plus `provenance.json`: the command and git commit
that trained it (as `eagle3 run` recorded it for notebook 04; the commit it was published at too), the
recipe, its training curve and last training metrics (which notebook 05 turns into a predicted τ), its
validation τ along training (with its figure) or `eagle3 curve`'s learning curve, what notebook 05 measured
for it, and the SHA-256 of its weights, which `verify` checks.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import yaml

from eagle3lib import devices, files, runs
from eagle3lib.data import conversations
from eagle3lib.decoding import curves, intervals
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
        validation = validation_curve(arm_folder)
        if validation:
            plots.training_curves({arm: validation["points"]}, None, curves.title(arm_folder.parent),
                                  staging / VALIDATION_FIGURE)
        record = {
            "command": command,
            "commit": training_provenance(metrics)["git commit"],
            "published_at_commit": runs.git_commit(),
            "dtype": str(dtype).removeprefix("torch."),
            "load_report": report.summary(),
            "recipe": yaml.safe_load((Path(run_dir) / "params.yaml").read_text()),
            "data": metrics.get(runs.PREPARE_DATA),
            "steps": summary["steps"],
            "passes": summary.get("passes"),  # over the training data; None where not counted
            "training_seconds": training_seconds(arm_folder),  # every leg of a resumed run, from its log
            "last_leg_seconds": summary["seconds"],  # the finishing leg's wall time, measuring included
            "final_check": summary["final_check"],
            "training_curve": curve,
            "measured": metrics.get(runs.EVALUATE),
            "learning_curve": _read_json(arm_folder / "learning_curve.json"),
            "validation_curve": validation,
            "sha256": {WEIGHTS: files.file_sha256(staging / WEIGHTS)},
        }
        files.atomic_write_text(staging / PROVENANCE, json.dumps(record, indent=1) + "\n")
    return Path(out)


def validation_curve(arm_folder: Path) -> dict | None:
    """The arm's validation τ along training (`train.validation_prompts`) as its learning curve: every point
    measured fresh data up to its step within a pass. None when the arm was not measured along training."""
    points = curves.read_points(arm_folder)
    if not points:
        return None
    kept = ("tau", "tau_low", "tau_high")
    return {"budget": json.loads((arm_folder.parent / curves.VALIDATION_FILE).read_text())["budget"],
            "points": [{"step": p["step"], "tokens": p["tokens"],
                        "benchmarks": {name: {k: m[k] for k in kept} for name, m in p["benchmarks"].items()}}
                       for p in points]}


VALIDATION_FIGURE = "validation_curve.png"
CURVES = "curves.json"
CURVES_FIGURE = "training_curves.png"


def publish_curves(run_dir: Path, out: Path, *, command: str) -> Path:
    """A run's τ along training as a committed record `out/`: `curves.json` (every measured arm's points,
    the source drafter as-is, what a point cost, what the curves say in training tokens, the recipe, the
    command, the commit 04 ran at, the machine, each arm's training seconds), the figure, and
    `provenance.json` with both files' SHA-256, which `read_record` checks. An arm stopped before its last
    step (a session's end) keeps the points it measured; `stopped` gives the step its log reached."""
    finetune = Path(run_dir) / runs.FINETUNE
    arms = sorted(p.name for p in finetune.iterdir() if (p / curves.CURVE_FILE).is_file())
    points, source = curves.read_curves(finetune, arms)
    if not points:
        raise PublishError(f"{finetune}: no arm was measured along training (train.validation_prompts)")
    trained = training_provenance(json.loads((Path(run_dir) / "metrics.json").read_text()))
    summaries = {arm: finetune / arm / "summary.json" for arm in arms}
    record = {
        "command": command,
        "commit": trained["git commit"],
        "machine": trained.get("machine", "not recorded"),
        "budget": json.loads((finetune / curves.VALIDATION_FILE).read_text())["budget"],
        "recipe": yaml.safe_load((Path(run_dir) / "params.yaml").read_text()),
        # the finishing leg's wall time, measuring included (every leg's training: training_seconds)
        "last_leg_seconds": {arm: json.loads(path.read_text())["seconds"] if path.is_file() else None
                             for arm, path in summaries.items()},
        "stopped": {arm: files.read_json_lines(finetune / arm / "metrics.jsonl")[-1]["step"]
                    for arm, path in summaries.items() if not path.is_file()},
        "training_seconds": {arm: training_seconds(finetune / arm) for arm in arms},
        "findings": curves.findings(points, source),
        "arms": points,
        "source": source,
    }
    with files.staged_folder(Path(out)) as staging:
        files.atomic_write_text(staging / CURVES, json.dumps(record, indent=1) + "\n")
        plots.training_curves(points, source, record_title(record), staging / CURVES_FIGURE)
        sha = {name: files.file_sha256(staging / name) for name in (CURVES, CURVES_FIGURE)}
        provenance = {"command": command, "commit": record["commit"], "sha256": sha}
        files.atomic_write_text(staging / PROVENANCE, json.dumps(provenance, indent=1) + "\n")
    return Path(out)


def training_seconds(arm_folder: Path) -> float:
    """The seconds an arm spent training, without its validation measurements: each logged window's tokens
    over its tokens/s."""
    seconds, before = 0.0, 0
    for entry in files.read_json_lines(arm_folder / "metrics.jsonl"):
        seconds += (entry["tokens"] - before) / entry["tokens_per_s"]
        before = entry["tokens"]
    return seconds


COMPARISON = "comparison.json"
COMPARISON_FIGURE = "comparison.png"


def regeneration_cost(corpus: str, cores: int) -> dict | None:
    """What making a regenerated corpus took, from the manifests beside its files: core-seconds (its
    seconds x `cores`, the cores regeneration ran on) and template tokens; None for a corpus without
    manifests (original replies cost nothing to make)."""
    path = files.resolve_path(corpus)
    if not path.exists():
        return None
    manifests = [conversations.manifest_path(f) for f in conversations.conversation_files(path)]
    if not manifests or not all(m.is_file() for m in manifests):
        return None
    counts = [json.loads(m.read_text())["counts"] for m in manifests]
    return {"core_seconds": cores * sum(c["seconds"] for c in counts),
            "template_tokens": sum(c["template_tokens"] for c in counts), "files": len(manifests)}


def publish_cost_comparison(records: dict[str, Path], out: Path, *, command: str, regeneration_cores: int
                            ) -> Path:
    """τ per CPU core-hour of committed curves records whose arms trained on different data, as a record
    `out/` (comparison.json, the figure, provenance with their hashes). A point's cost is its training tokens
    x the core-seconds a token took to train (the arm's training seconds x its threads / its tokens), plus,
    where the data was regenerated, its share of what regeneration took (core-seconds / template tokens,
    charged once per token of the data: a second pass costs no more regeneration)."""
    found = {label: read_record(folder) for label, folder in records.items()}
    cpus = {label: record["machine"].partition(",")[0] for label, record in found.items()}
    if len(set(cpus.values())) > 1:  # a core-second on one CPU buys other work than on another
        raise PublishError(
            "core-hours from different CPUs are not comparable: "
            + "; ".join(f"{label} ({records[label]}) trained on {cpu}" for label, cpu in cpus.items())
            + ". Train every arm on one machine")
    arms = {}
    for label, record in found.items():
        folder = records[label]
        threads = re.search(r"(\d+) threads?", record["machine"])
        if threads is None:
            raise PublishError(f"{folder}: its machine ({record['machine']!r}) names no thread count")
        corpus = record["recipe"]["data"]["corpus"]
        made = regeneration_cost(corpus, regeneration_cores)
        data_cost = made["core_seconds"] / made["template_tokens"] if made else 0.0
        cap = made["template_tokens"] if made else 0
        for arm, points in record["arms"].items():
            # records made before training_seconds held only a leg's wall time, under `seconds`
            seconds = (record["training_seconds"] if "training_seconds" in record else record["seconds"])[arm]
            train_cost = seconds * int(threads.group(1)) / points[-1]["tokens"]
            name = label if len(record["arms"]) == 1 else f"{label} {arm}"
            arms[name] = {
                "record": str(folder), "arm": arm, "corpus": corpus, "regeneration": made,
                "train_core_seconds_per_token": train_cost, "data_core_seconds_per_token": data_cost,
                "points": [{**p, "core_hours": (p["tokens"] * train_cost + min(p["tokens"], cap) * data_cost)
                            / 3600} for p in points],
            }
    comparison = {"command": command, "commit": runs.git_commit(), "regeneration_cores": regeneration_cores,
                  "machine": devices.machine_description(), "arms": arms,
                  "paired": paired_at_equal_steps(arms)}
    with files.staged_folder(Path(out)) as staging:
        files.atomic_write_text(staging / COMPARISON, json.dumps(comparison, indent=1) + "\n")
        plots.cost_curves({name: a["points"] for name, a in arms.items()}, staging / COMPARISON_FIGURE)
        sha = {name: files.file_sha256(staging / name) for name in (COMPARISON, COMPARISON_FIGURE)}
        provenance = {"command": command, "commit": comparison["commit"], "sha256": sha}
        files.atomic_write_text(staging / PROVENANCE, json.dumps(provenance, indent=1) + "\n")
    return Path(out)


COVERAGE = "coverage.json"
COVERAGE_FIGURE = "coverage.png"


def publish_coverage(record: dict, out: Path) -> Path:
    """`eagle3 coverage`'s measurement (`evaluate.vocab_coverage`, with its command, commit and machine) as a
    committed record `out/`: coverage.json, the figure and provenance with their SHA-256."""
    with files.staged_folder(Path(out)) as staging:
        files.atomic_write_text(staging / COVERAGE, json.dumps(record, indent=1) + "\n")
        plots.coverage_by_vd(record, staging / COVERAGE_FIGURE)
        sha = {name: files.file_sha256(staging / name) for name in (COVERAGE, COVERAGE_FIGURE)}
        provenance = {"command": record["command"], "commit": record["commit"], "sha256": sha}
        files.atomic_write_text(staging / PROVENANCE, json.dumps(provenance, indent=1) + "\n")
    return Path(out)


def paired_at_equal_steps(arms: dict[str, dict]) -> list[str]:
    """Each arm against the first at every step both measured, on each benchmark: τ difference with its paired
    95 % interval (the same validation prompts, the same target outputs)."""
    (first, base), *others = arms.items()
    theirs = {p["step"]: p for p in base["points"]}
    lines = []
    for name, arm in others:
        for point in arm["points"]:
            other = theirs.get(point["step"])
            if other is None or point["step"] == 0:
                continue
            for benchmark, measured in point["benchmarks"].items():
                change = intervals.paired_comparison(name, measured["accepted_per_prompt"], first,
                                                     other["benchmarks"][benchmark]["accepted_per_prompt"])
                lines.append(f"step {point['step']}, {benchmark}: {change.sentence()}")
    return lines


def record_title(record: dict) -> str:
    """The figure title of a committed record: what a point measured, where and at which commit."""
    train, probe = record["recipe"]["train"], record["recipe"]["probe"]
    return (f"committed record, 04 at {record['commit'][:7]}: {train['validation_prompts']} validation "
            f"prompts x {train['validation_new_tokens']} new tokens a benchmark, chain K {probe['steps']}\n"
            f"measured on {record['machine']}")


def read_record(folder: str | os.PathLike) -> dict:
    """A committed curves record, after checking its files against the hashes its provenance holds."""
    folder = files.resolve_path(folder)
    check_published(folder)
    return json.loads((folder / CURVES).read_text())


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def training_provenance(metrics: dict) -> dict:
    """What `eagle3 run` recorded when it ran notebook 04: the git commit ("+changes": with uncommitted
    edits), the machine, the package versions."""
    runs_of_04 = [p for p in metrics.get("provenance", []) if runs.FINETUNE in p.get("notebooks", [])]
    if not runs_of_04:
        raise PublishError("the run's metrics.json records no provenance for 04_finetune (use eagle3 run)")
    return runs_of_04[-1]



def verify(folder: Path) -> dict:
    """The provenance of a published drafter, after checking its weights against the recorded hash."""
    folder = Path(folder)
    check_published(folder)
    return json.loads((folder / PROVENANCE).read_text())


def measured_metrics(record: dict) -> dict[str, dict]:
    """What notebook 05 measured for a published drafter, flat: {"benchmark: drafter": metrics}."""
    benchmarks = (record.get("measured") or {}).get("benchmarks", {})
    return {f"{name}: {drafter}": m for name, found in benchmarks.items() for drafter, m in found.items()}
