"""The fine-tuning experiment: arms of drafters trained with train-time test (TTT) by `training.trainer`.

One call trains every arm in `train.arms` (`training.arms`: scratch, a remapped warm start, the seed bug
reproduced, L2-SP), each into its own folder, with the same data, schedule and budget, after the step-0
check.

With `train.validation_prompts` > 0 every arm is measured as it trains (`decoding.curves`): τ on each
benchmark's validation prompts (never 05's) at the start and at steps doubling up to the last, one line a
point in `curve.jsonl`; `drafter/` is then the measured drafter `train.select_by` picks and `drafter-last/`
the last weights, and `train.early_stop` may end an arm that stopped improving. The source drafter as-is
is measured once on the same prompts (`validation.json`).

Outputs of an arm (folder `<out>/<arm>/`): `log.txt`, `load_report.txt`, `check.json`,
`metrics.jsonl` (every `log_every` steps), `checkpoints/step_NNNNNN/` (the drafter in SGLang layout +
`training_state.pt`; written atomically, the last `keep_checkpoints` kept), `curve.jsonl` and
`points/step_NNNNNN/` (the chosen and the latest measured drafters), `drafter/` (SGLang layout),
`drafter-last/`, `drafter-speculators/` on request, and `summary.json`.

Command line (torchrun-able; gloo on CPU, nccl on GPU):
    python -m eagle3lib.training.train --params FILE [-p train.steps=50 ...] --out DIR [--resume]
    torchrun --nproc_per_node 2 -m eagle3lib.training.train --params FILE --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from eagle3lib import files, runs
from eagle3lib.data.benchmarks import Benchmark, check_disjoint_draws
from eagle3lib.data.layout import prepared_dir
from eagle3lib.data.readers import TrainingData, offline_training_data
from eagle3lib.decoding.curves import (
    CURVE_FILE,
    SELECT_RULES,
    VALIDATION_FILE,
    Validation,
    chosen_point,
    curve_steps,
    measurements_without_gain,
    score,
)
from eagle3lib.decoding.speculate import DraftSettings
from eagle3lib.drafter.checkpoint import load_drafter, save_drafter
from eagle3lib.drafter.config import LAYOUT_READERS
from eagle3lib.generation.online import ensure_text, online_training_data
from eagle3lib.params import STAND_IN_DATA_KEYS, STAND_IN_TRAIN_KEYS, load_params, minimums
from eagle3lib.target.model import Target
from eagle3lib.training import audit
from eagle3lib.training.arms import ARMS, CheckResult, StepZeroCheckFailed, arm_l2sp, diagnose, init_drafter
from eagle3lib.training.remap import MISSING_POLICIES
from eagle3lib.training.trainer import Processes, Trainer, TrainingError, micro_batches_per_rank

# ----------------------------------------------------------------------------- settings


def check_settings(train: dict) -> None:
    """Refuse train params that cannot work, naming the key, before anything is loaded."""
    problems = [
        f"train.{key} must be an integer >= {low}, got {train[key]!r}"
        for key, low in minimums("train").items() if not isinstance(train[key], int) or train[key] < low
    ]
    if not train["lr"] > 0 or not train["step_decay"] > 0 or train["max_grad_norm"] < 0:
        problems.append(f"train.lr ({train['lr']}) and train.step_decay ({train['step_decay']}) must be "
                        f"positive, train.max_grad_norm ({train['max_grad_norm']}) not negative")
    if not 0 <= train["min_lr_ratio"] <= 1:
        problems.append(f"train.min_lr_ratio must lie in [0, 1], got {train['min_lr_ratio']}")
    if train["data_mode"] not in ("offline", "online"):
        problems.append(f"train.data_mode must be offline or online, got {train['data_mode']!r}")
    elif train["data_mode"] == "online" and (train["data"] or train["target_head"]):
        problems.append("train.data and train.target_head name offline data; an online run takes its text "
                        "from the data section and its target from the target section")
    if train["dtype"] not in ("auto", "fp32", "bf16"):
        problems.append(f"train.dtype must be auto, fp32 or bf16, got {train['dtype']!r}")
    if train["remap_missing"] not in MISSING_POLICIES:
        problems.append(f"train.remap_missing must be one of {', '.join(MISSING_POLICIES)}, "
                        f"got {train['remap_missing']!r}")
    unknown = [arm for arm in train["arms"] if arm not in ARMS]
    if unknown or not train["arms"]:
        problems.append(f"train.arms {train['arms']!r}: each must be one of {', '.join(ARMS)}")
    if not train["l2sp"] >= 0 or ("drafter-l2sp" in train["arms"] and not train["l2sp"] > 0):
        problems.append(f"train.l2sp must be >= 0, and > 0 for the arm drafter-l2sp, got {train['l2sp']}")
    if train["select_by"] not in SELECT_RULES:
        problems.append(f"train.select_by must be one of {', '.join(SELECT_RULES)}, "
                        f"got {train['select_by']!r}")
    if problems:
        raise TrainingError("; ".join(problems))
    micro_batches_per_rank(train, train["nproc"])


# ----------------------------------------------------------------------------- arms


@dataclass
class ArmResult:
    arm: str
    folder: str
    init_report: str
    check: dict
    final: dict  # last logged training metrics
    final_check: dict  # the step-0 check's batches after training
    drafter: str  # what 05 evaluates and publish ships (SGLang layout): the chosen measured one, or the last
    steps: int
    seconds: float  # this leg's wall time (a resumed run's every leg: reports.publish.training_seconds)
    chosen: dict | None = None  # the measured point drafter/ is, and the rule that chose it (validation on)
    passes: float | None = None  # steps over one pass's batches; None where the reader cannot count a pass

    @property
    def metrics(self) -> list[dict]:
        path = Path(self.folder) / "metrics.jsonl"
        return files.read_json_lines(path) if path.exists() else []

    def key_numbers(self) -> dict:
        """What the run summary and report tables show for this arm."""
        return {
            "initial_loss": self.check["loss_0"],
            "initial_acc_0": self.check["acc_0"],
            "final_loss": self.final_check["loss_0"],
            "final_acc_0": self.final_check["acc_0"],
            "predicted_tau": self.final_check["metrics"]["tau"],
            "check_passed": self.check["passed"],
            "drafter": self.drafter,
            "chosen_step": self.chosen["step"] if self.chosen else self.steps,
        }

    @classmethod
    def read(cls, folder: Path) -> ArmResult:
        return cls(**json.loads((folder / "summary.json").read_text()))


def findings(results: dict[str, ArmResult]) -> str:
    """One sentence per arm: where it started, where it ended, on the step-0 check's batches."""
    parts = []
    for arm, result in results.items():
        start, end = result.check, result.final_check
        if arm == "scratch":
            verdict = ""
        elif arm == "drafter-no-remap":  # the bug reproduced on purpose: failing is the expected outcome
            verdict = (", step-0 check failed as the scrambled-labels bug predicts" if not start["passed"]
                       else ", step-0 check passed although the labels are scrambled")
        else:
            verdict = f", step-0 check {'passed' if start['passed'] else 'FAILED'}"
        parts.append(
            f"{arm}: loss_0 {start['loss_0']:.2f} → {end['loss_0']:.2f} (ln Vd = {start['chance_loss']:.2f}"
            f"{verdict}), acc_0 {start['acc_0']:.1%} → {end['acc_0']:.1%}, predicted τ "
            f"{start['metrics']['tau']:.2f} → {end['metrics']['tau']:.2f}"
        )
    steps = "/".join(str(s) for s in sorted({result.steps for result in results.values()}))
    return f"After {steps} optimizer steps on the same data: " + "; ".join(parts) + "."


class CurveRecorder:
    """An arm's τ along training (`Trainer.fit`'s `curve`): at each of `steps` the drafter is saved under
    `points/step_NNNNNN/`, measured on the validation prompts and appended to `curve.jsonl`; only the chosen
    point's and the latest point's folders are kept. Measured by the main process; the others learn whether
    to stop early."""

    def __init__(self, folder: Path, trainer: Trainer, validation: Validation | None, train: dict,
                 procs: Processes, log):
        self.folder, self.trainer, self.validation = folder, trainer, validation
        self.procs, self.log = procs, log
        self.rule, self.early_stop = train["select_by"], train["early_stop"]
        self.steps = curve_steps(train["steps"], train["curve_points"])
        self.path, self.points_dir = folder / CURVE_FILE, folder / "points"
        self.points: list[dict] = []

    def restore(self, step: int) -> None:
        """Forget what was measured after `step` (the run resumes there): lines and folders."""
        if self.procs.main and self.path.exists():
            self.points = [p for p in files.read_json_lines(self.path) if p["step"] <= step]
            files.atomic_write_text(self.path, "".join(json.dumps(p) + "\n" for p in self.points))
            for old in self.points_dir.glob("step_*"):
                if int(old.name.removeprefix("step_")) > step:
                    shutil.rmtree(old)

    def measure(self, step: int, tokens: int) -> bool:
        stop = torch.zeros(1)
        if self.procs.main and all(p["step"] != step for p in self.points):
            folder = self.points_dir / f"step_{step:06d}"
            save_drafter(self.trainer.drafter, folder, layout="sglang", overwrite=True)
            point = {"step": step, "tokens": tokens, "benchmarks": self.validation.measure(folder)}
            files.append_line(self.path, json.dumps(point))
            self.points.append(point)
            chosen = chosen_point(self.points, self.rule)
            for old in self.points_dir.glob("step_*"):
                if old.name not in (f"step_{chosen['step']:06d}", folder.name):
                    shutil.rmtree(old)
            taus = ", ".join(f"{name} {m['tau']:.3f}" for name, m in point["benchmarks"].items())
            self.log(f"[{self.folder.name}] validation τ at step {step} ({tokens:,} tokens): {taus}")
            waited = measurements_without_gain(self.points, self.rule)
            stop[0] = bool(self.early_stop) and waited >= self.early_stop
        return bool(self.procs.broadcast(stop.to(self.procs.device)).item())

    def chosen(self) -> dict:
        point = chosen_point(self.points, self.rule)
        return {"step": point["step"], "tokens": point["tokens"], "rule": self.rule,
                "score": score(point, "first" if self.rule == "last" else self.rule),
                "drafter": str(self.points_dir / f"step_{point['step']:06d}"),
                "measured": len(self.points)}


def train_arm(arm: str, params: dict, out: Path, data: TrainingData, procs: Processes,
              resume: bool = False, validation: Validation | None = None) -> ArmResult:
    """Train one arm into `out/<arm>/` and return its result (also written to summary.json); `validation`
    measures it along the way when `train.validation_prompts` asks for it."""
    train, seed = {**params["train"], "l2sp": arm_l2sp(arm, params["train"])}, params["run"]["seed"]
    folder = Path(out) / arm
    with arm_lock(folder, procs):
        if (folder / "summary.json").exists():
            if resume:
                return ArmResult.read(folder)
            raise runs.RunExistsError(f"{folder} already holds a finished arm; use another output folder")
        if folder.exists() and any(folder.iterdir()) and not resume:
            raise runs.RunExistsError(f"{folder} already holds a run; pass --resume to continue it")
        procs.barrier()  # every rank has looked before rank 0 writes
        return _train_arm(arm, params, train, seed, folder, data, procs, resume, validation)


def arm_lock(folder: Path, procs: Processes):
    """Hold an arm for its training: a second process training or resuming the same arm is refused before
    it writes (the lock, `.<arm>.lock` beside the arm's folder, is the main process's)."""
    if not procs.main:
        return contextlib.nullcontext()
    return files.held(folder.parent / f".{folder.name}.lock", lambda holder: runs.RunExistsError(
        f"{folder} is being trained by another process ({holder}); let it end before resuming it"))


def _train_arm(arm: str, params: dict, train: dict, seed: int, folder: Path, data: TrainingData,
               procs: Processes, resume: bool, validation: Validation | None) -> ArmResult:
    files.make_folder(folder)
    log = _logger(folder / "log.txt", procs)
    start = time.perf_counter()

    drafter, init_report = init_drafter(arm, train, data, seed)
    # the drafter's verifier is the target its data was captured from, as the data names it (a SpecForge or
    # speculators dump names none: a warm start's own verifier is kept, with a note)
    verifier = data.verifier
    if verifier:
        drafter.config.verifier = verifier
    speculators_copy = folder / "drafter-speculators"
    # `drafter/` is eagle3lib's own checkpoint (read back by eagle3lib); the speculators copy is an export:
    # refused now, by name, when a project reading it would compute another function
    export_engines = LAYOUT_READERS["speculators"] if drafter.config.verifier else ("vLLM",)
    if train["save_speculators"]:
        drafter.config.check_engines("speculators", f"train.save_speculators ({speculators_copy})",
                                     engines=export_engines)
        if not verifier:
            init_report += f"\nnote: the data ({data.target}) names no target model: " + (
                f"{speculators_copy} names the warm start's verifier {drafter.config.verifier}"
                if drafter.config.verifier else
                f"{speculators_copy} is written for vLLM only (verifier.name_or_path null; speculators' "
                "from_pretrained needs it)"
            )
    trainer = Trainer(drafter, data, train, seed, folder, procs, log=log)
    check_batches = trainer.check_batches()
    check_file = folder / "check.json"
    if resume and trainer.checkpoints() and check_file.is_file():
        # the checkpoint's weights replace this start (the same seed and params: the checkpoint refuses
        # others), so the report and check of the run's first leg stand, and are not repeated per leg
        check = CheckResult(**json.loads(check_file.read_text()))
        log(f"[{arm}] resuming: initialised and checked when the run began ({folder / 'load_report.txt'}; "
            f"{check.message})")
    else:
        # the whole report goes to log.txt and load_report.txt; the console (and notebook 04, which shows
        # the reports after training) gets its first line
        log(f"[{arm}] initialisation:\n{init_report}", echo=False)
        log(f"[{arm}] {init_report.splitlines()[0]} (the whole report: {folder / 'load_report.txt'})")
        if procs.main:
            files.atomic_write_text(folder / "load_report.txt", init_report + "\n")
        metrics, baseline = trainer.evaluate(check_batches)
        check = diagnose(metrics, baseline, data.vocab_map.vd, warm_start=arm != "scratch")
        log(f"[{arm}] {check.message}")
        if procs.main:
            files.atomic_write_text(check_file, json.dumps(asdict(check), indent=2) + "\n")
    if not check.passed:
        if arm == "drafter-no-remap":
            log(f"[{arm}] trained anyway: this arm reproduces the bug on purpose (train.allow_no_remap)")
        elif train["check_enforce"]:
            raise StepZeroCheckFailed(
                f"[{arm}] {check.message} (set train.check_enforce=false to train anyway)"
            )
        else:
            log(f"[{arm}] trained anyway: train.check_enforce is false")

    measuring = train["validation_prompts"] > 0
    curve = CurveRecorder(folder, trainer, validation, train, procs, log) if measuring else None
    final = trainer.fit(resume=resume, curve=curve)
    final_metrics, final_baseline = trainer.evaluate(check_batches)
    final_check = diagnose(final_metrics, final_baseline, data.vocab_map.vd, warm_start=False)
    drafter_path = folder / "drafter"
    chosen = curve.chosen() if curve is not None and procs.main else None
    if procs.main:  # a resumed arm may have saved them before it was stopped: the same weights, replaced
        if chosen:  # the measured drafter the rule picked; the last weights beside it
            save_drafter(trainer.drafter, folder / "drafter-last", layout="sglang", overwrite=resume)
            with files.staged_folder(drafter_path, replace=resume) as staging:
                shutil.copytree(chosen["drafter"], staging, dirs_exist_ok=True)
            log(f"[{arm}] drafter/ is the drafter of step {chosen['step']} ({chosen['tokens']:,} tokens), "
                f"the {'last' if chosen['rule'] == 'last' else 'best'} of {chosen['measured']} measured by "
                f"train.select_by {chosen['rule']} (score {chosen['score']:.3f}); drafter-last/ holds step "
                f"{trainer.step}")
        else:
            save_drafter(trainer.drafter, drafter_path, layout="sglang", overwrite=resume)
        if train["save_speculators"]:
            chosen_drafter = load_drafter(drafter_path, strict=True)[0] if chosen else trainer.drafter
            save_drafter(chosen_drafter, speculators_copy, layout="speculators", engines=export_engines,
                         overwrite=resume)
    result = ArmResult(
        arm=arm, folder=str(folder), init_report=init_report, check=asdict(check), final=final,
        final_check=asdict(final_check), drafter=str(drafter_path), steps=trainer.step,
        seconds=time.perf_counter() - start, chosen=chosen,
        passes=trainer.step / trainer.pass_batches if trainer.pass_batches else None,
    )
    covered = f" after {result.passes:.2f} passes over the data" if result.passes else ""
    log(f"[{arm}] done{covered}: loss {final_check.loss_0:.3f}, acc_0 {final_check.acc_0:.2%}, predicted tau "
        f"{final_metrics['tau']:.2f} on the check batches; drafter saved at {drafter_path}")
    if procs.main:
        files.atomic_write_text(folder / "summary.json", json.dumps(asdict(result), indent=2) + "\n")
    procs.barrier()
    return result


def _logger(path: Path, procs: Processes):
    def log(message: str, echo: bool = True) -> None:
        if procs.main:
            if echo:
                print(message, flush=True)
            files.append_line(path, message)

    return log


def train_arms(
    params: dict, out: Path, run_dir: Path | None = None, resume: bool = False
) -> dict[str, ArmResult]:
    """Train every arm in `train.arms` into `out/<arm>/`: in this process, or under torchrun when
    `train.nproc` > 1 (the launched job's log is followed here)."""
    train = params["train"]
    check_recipe(params)
    out = Path(out)
    if train["nproc"] > 1:
        if train["data_mode"] == "online":  # the text first, in one process (self-distillation is long)
            ensure_text(params, out, Target.from_params(params["target"], params["run"]["device"]))
        launch(params, out, run_dir, resume=resume)
        return {arm: ArmResult.read(out / arm) for arm in train["arms"]}
    procs = Processes.start(params["run"]["device"])
    data = arms_data(params, out, run_dir, procs)
    audit_warm_start(params, data, out, procs)
    validation = validation_of(params, data, out, procs)
    return {arm: train_arm(arm, params, out, data, procs, resume=resume, validation=validation)
            for arm in train["arms"]}


AUDIT_FILE = "audit.json"
NOT_ENFORCED = ("chat template and thinking mode",)  # fine-tuning in the new mode is what mends it


def audit_warm_start(params: dict, data: TrainingData, out: Path, procs: Processes) -> list[audit.Row] | None:
    """The audit of the warm-start drafter against the recipe's target (`training.audit`), before any step:
    printed, kept in `<out>/audit.json`, and a FAIL refused as the step-0 check refuses (unless
    `train.check_enforce` is false). Skipped, with the reason, where the target's config cannot be read or is
    not the one the data came from."""
    train = params["train"]
    if not procs.main or not train["drafter"] or set(train["arms"]) <= {"scratch"}:
        return None
    try:
        target = audit.TargetConfig.read(params["target"]["spec"])
    except (OSError, ValueError) as err:
        print(f"audit of the warm start skipped: the recipe's target cannot be read ({err})", flush=True)
        return None
    if (target.hidden_size, target.vocab_size) != (data.target_hidden_size, data.vocab_size):
        print(f"audit of the warm start skipped: target {target.name} (H {target.hidden_size}, Vt "
              f"{target.vocab_size}) is not the data's (H {data.target_hidden_size}, Vt {data.vocab_size})",
              flush=True)
        return None
    rows = audit.audit(files.resolve_path(train["drafter"]), target, data_map=data.vocab_map,
                       serve_template_kwargs=params["data"]["chat_template_kwargs"])
    files.make_folder(out)
    files.atomic_write_text(out / AUDIT_FILE, json.dumps(audit.as_json(rows), indent=1) + "\n")
    print(f"audit of the warm start {train['drafter']} against {target.name}:\n{audit.report(rows)}",
          flush=True)
    failed = [r for r in rows if r.status == "FAIL" and r.check not in NOT_ENFORCED]
    if failed and train["check_enforce"]:
        raise TrainingError("the warm start fails its audit: " + "; ".join(r.line() for r in failed)
                            + " (set train.check_enforce=false to train anyway)")
    return rows


def check_recipe(params: dict) -> None:
    """Everything about a training recipe that can be refused before anything is written or loaded: the
    settings, the validation draws, and the files it names."""
    train = params["train"]
    check_settings(train)
    check_validation(params)
    named = {"train.data": train["data"], "train.vocab_map": train["vocab_map"],
             "train.target_head": train["target_head"],
             "train.drafter": train["drafter"] if set(train["arms"]) - {"scratch"} else ""}
    missing = [f"{key} {value} does not exist" for key, value in named.items()
               if value and not str(value).startswith("@") and not files.resolve_path(value).exists()]
    if missing:
        raise TrainingError("; ".join(missing))


def validation_benchmarks(params: dict) -> list[Benchmark]:
    """The benchmarks training is measured on: 05's (`evaluate.benchmarks`), drawn from their other end."""
    return [Benchmark.from_params(entry, f"evaluate.benchmarks[{i}]")
            for i, entry in enumerate(params["evaluate"]["benchmarks"])]


def check_validation(params: dict) -> None:
    """Refuse validation settings that cannot work before training: no benchmark to measure on, or a
    validation draw that would share prompts with what 05 reports."""
    train = params["train"]
    if not train["validation_prompts"]:
        return
    benchmarks = validation_benchmarks(params)
    if not benchmarks:
        raise TrainingError("train.validation_prompts needs evaluate.benchmarks, the benchmarks to measure")
    for b in benchmarks:
        check_disjoint_draws(b.corpus, b.num_prompts, train["validation_prompts"],
                             params["probe"]["prompt_chars"], turns=b.turns)


def validation_of(params: dict, data: TrainingData, out: Path, procs: Processes) -> Validation | None:
    """The validation prompts and target of every arm (main process only), when `train.validation_prompts`
    asks for it; what a point costs and the source drafter as-is, measured once, go to validation.json."""
    train, probe = params["train"], params["probe"]
    if not train["validation_prompts"] or not procs.main:
        return None
    target = getattr(data.reader, "target", None) or Target.from_params(params["target"], procs.device)
    validation = Validation(target, validation_benchmarks(params), train["validation_prompts"],
                            train["validation_new_tokens"], DraftSettings.from_probe(probe),
                            probe["batch_size"], seed=params["run"]["seed"],
                            prompt_chars=probe["prompt_chars"],
                            template_kwargs=params["data"]["chat_template_kwargs"],
                            compiled=probe["compiled"])
    record = Path(out) / VALIDATION_FILE
    if not record.exists():  # once per run: a resumed one keeps what it measured
        source = None
        if train["drafter"]:
            source = {"drafter": train["drafter"],
                      "benchmarks": validation.measure(files.resolve_path(train["drafter"]))}
        files.atomic_write_text(record, json.dumps({"budget": validation.budget, "source": source}) + "\n")
    return validation


def arms_data(params: dict, out: Path, run_dir: Path | None, procs: Processes) -> TrainingData:
    """What every arm trains on: captured hidden states (offline), or the target in the loop (online)."""
    if params["train"]["data_mode"] == "online":
        return online_training_data(params, out, procs.device, procs.main, procs.barrier)
    return offline_training_data(params["train"], run_dir)


def stand_in_key(params: dict, target_fingerprint: str) -> str:
    """What decides a stand-in source drafter's weights: the target, the source data, the schedule."""
    decisive = {
        "target": target_fingerprint,
        "seed": params["run"]["seed"],
        "data": {key: params["data"][key] for key in STAND_IN_DATA_KEYS},
        "train": {key: params["train"][key] for key in STAND_IN_TRAIN_KEYS},
        "steps": params["stand_in"]["steps"],
    }
    return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()[:16]


def stand_in_path(params: dict, target_fingerprint: str, cache: Path) -> Path:
    return Path(cache) / "drafters" / f"stand-in-{stand_in_key(params, target_fingerprint)}"


def stand_in_settings(params: dict, data: str = "") -> dict:
    """The stand-in source drafter's train settings: `train`'s, for one scratch arm of `stand_in.steps` steps
    in one process on `data`."""
    return {**params["train"], "arms": ["scratch"], "data": data, "vocab_map": "", "drafter": "",
            "steps": params["stand_in"]["steps"], "nproc": 1}


def check_stand_in_settings(params: dict) -> None:
    """Refuse, before 00_prepare_data captures anything, train settings the stand-in source drafter
    (`data.source_corpus`) cannot train with."""
    if params["data"]["source_corpus"]:
        try:
            check_settings(stand_in_settings(params))
        except TrainingError as err:
            raise TrainingError(f"the stand-in source drafter (data.source_corpus) trains with {err}") \
                from err


def train_stand_in(params: dict, run_dir: Path, target_fingerprint: str, cache: Path) -> Path:
    """Train the demo's source drafter and cache it; returns the cached checkpoint folder.

    It stands in for a drafter trained for another target: a scratch arm on this run's
    `00_prepare_data/source/` data (`data.source_corpus`, with that corpus's own vocab map), with the
    `train` settings for `stand_in.steps` steps. Reruns with the same target, data and schedule reuse it.
    """
    cached = stand_in_path(params, target_fingerprint, cache)
    if cached.exists():
        return cached
    stand_in = {**params, "train": stand_in_settings(params, str(prepared_dir(run_dir, "source")))}
    files.make_folder(cached.parent)
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".stand-in-") as work:
        result = train_arms(stand_in, Path(work) / "train", run_dir)["scratch"]
        staged = Path(work) / "drafter"
        shutil.copytree(result.drafter, staged)
        files.atomic_write_text(staged / "stand_in.json", json.dumps(
            {"key_numbers": result.key_numbers(), "steps": result.steps, "seconds": result.seconds,
             "source_corpus": params["data"]["source_corpus"]}, indent=2) + "\n")
        os.replace(staged, cached)  # the cache never holds a half-written drafter
    return cached


def launch(params: dict, out: Path, run_dir: Path | None = None, resume: bool = False) -> None:
    """Run `torchrun --nproc_per_node N -m eagle3lib.training.train` on these params, echoing its log."""
    files.make_folder(out)
    params_file = out / "train_params.yaml"
    files.atomic_write_text(params_file, yaml.safe_dump(params, sort_keys=False))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={params['train']['nproc']}",
        "-m", "eagle3lib.training.train", "--params", str(params_file), "--out", str(out),
    ]
    if run_dir is not None:
        command += ["--run-dir", str(run_dir)]
    if resume:
        command.append("--resume")
    log_path = out / "torchrun.log"
    print("launching:", " ".join(command), flush=True)
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=files.REPO_ROOT)
        with log_path.open() as follow:
            while process.poll() is None:
                _echo(follow)
                time.sleep(1.0)
            _echo(follow)
    if process.returncode:
        lines = log_path.read_text().splitlines()
        errors = [line for line in lines if line.startswith("error (rank")] or lines[-30:]
        raise TrainingError(
            f"torchrun exited with code {process.returncode} (log: {log_path}):\n" + "\n".join(errors)
        )


def _echo(follow) -> None:
    text = follow.read()
    if text:
        print(text.replace("\r", "\n"), end="", flush=True)


def recipe_for_training(
    params_file: str, overrides: list[str], out: str | None, run_dir: str | None
) -> tuple[dict, Path, Path]:
    """(params with '@' paths resolved, the arms' output folder, the run folder) for a training command:
    output by default `outputs/<run.name>/04_finetune`, run folder by default the output's parent."""
    params = load_params(params_file, overrides)
    out = files.resolve_path(out or Path(runs.OUTPUTS_DIR, params["run"]["name"], runs.FINETUNE))
    run_dir = files.resolve_path(run_dir) if run_dir else out.parent
    return runs.resolve_run_paths(params, run_dir), out, run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3lib.training.train",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--params", required=True, help="a recipe under params/")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="output folder (default: outputs/<run.name>/04_finetune)")
    parser.add_argument("--run-dir", help="the run whose 00_prepare_data holds the data (default: --out/..)")
    parser.add_argument("--resume", action="store_true", help="continue each arm from its latest checkpoint")
    args = parser.parse_args(argv)
    params, out, run_dir = recipe_for_training(args.params, args.param, args.out, args.run_dir)
    procs = Processes.start(params["run"]["device"])
    try:
        check_recipe(params)
        data = arms_data(params, out, run_dir, procs)
        audit_warm_start(params, data, out, procs)
        validation = validation_of(params, data, out, procs)
        for arm in params["train"]["arms"]:
            train_arm(arm, params, out, data, procs, resume=args.resume, validation=validation)
        procs.barrier()  # no rank tears down its connections while rank 0 still writes
    except (ValueError, FileExistsError) as err:  # bad input: params, data, checkpoints, a diverged run
        print(f"error (rank {procs.rank}): {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            # a trainer outlives its arm in a reference cycle (its lr schedule is a bound method), and with it
            # the DDP wrapper that holds the group: collected at interpreter teardown instead, the group's
            # threads once aborted a rank ("terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
