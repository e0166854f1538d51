"""The fine-tuning experiment: arms of drafters trained with train-time test (TTT) by `training.trainer`.

One call trains every arm in `train.arms`, each into its own folder, with the same data, schedule and
budget:
- `scratch`: a fresh drafter whose `lm_head` is the target's `lm_head` rows of the draft vocab;
- `drafter`: the checkpoint in `train.drafter`; when its vocab map differs from the training map its
  `lm_head` rows are moved with `remap.remap_drafter`, and the remap's proof is logged;
- `drafter-no-remap`: the same checkpoint with the training map put in place and the rows left where
  they were. This is the seed bug (labels scrambled), refused unless `train.allow_no_remap`; its
  step-0 check is reported, not enforced, since the arm exists to show that failure.
The token embedding is always the target's (from the data folder's `target_head.safetensors`), frozen.

Before the first step every arm runs the step-0 check on a few batches: loss and acc_0 against ln(Vd)
and against always proposing the most frequent token. A warm start that begins at or above ln(Vd), or
no better than that baseline, has scrambled labels or mismatched inputs; it stops the arm unless
`train.check_enforce` is false.

Outputs of an arm (folder `<out>/<arm>/`): `log.txt`, `load_report.txt`, `check.json`,
`metrics.jsonl` (every `log_every` steps), `checkpoints/step_NNNNNN/` (the drafter in SGLang layout +
`training_state.pt`; written atomically, the last `keep_checkpoints` kept), `drafter/` (final, SGLang
layout), `drafter-speculators/` on request, and `summary.json`.

Command line (torchrun-able; gloo on CPU, nccl on GPU):
    python -m eagle3lib.training.train --params FILE [-p train.steps=50 ...] --out DIR [--resume]
    torchrun --nproc_per_node 2 -m eagle3lib.training.train --params FILE --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
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
from eagle3lib.data.layout import prepared_dir
from eagle3lib.data.readers import TrainingData, offline_training_data
from eagle3lib.drafter.checkpoint import load_drafter, save_drafter
from eagle3lib.drafter.config import LAYOUT_READERS, DrafterConfig, read_config
from eagle3lib.drafter.model import Eagle3Drafter
from eagle3lib.generation.online import ensure_text, online_training_data
from eagle3lib.params import STAND_IN_DATA_KEYS, STAND_IN_TRAIN_KEYS, load_params, minimums
from eagle3lib.target.model import Target
from eagle3lib.training.loss import (
    chance_loss,
)
from eagle3lib.training.remap import MISSING_POLICIES, drafter_map, remap_drafter
from eagle3lib.training.trainer import Processes, Trainer, TrainingError, micro_batches_per_rank

ARMS = ("scratch", "drafter", "drafter-no-remap")


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
    elif arm in ("drafter", "drafter-no-remap"):
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
        elif arm == "drafter":
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
    drafter: str  # the final checkpoint (SGLang layout)
    steps: int
    seconds: float

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


def train_arm(arm: str, params: dict, out: Path, data: TrainingData, procs: Processes,
              resume: bool = False) -> ArmResult:
    """Train one arm into `out/<arm>/` and return its result (also written to summary.json)."""
    train, seed = params["train"], params["run"]["seed"]
    folder = Path(out) / arm
    if (folder / "summary.json").exists():
        if resume:
            return ArmResult.read(folder)
        raise runs.RunExistsError(f"{folder} already holds a finished arm; use another output folder")
    if folder.exists() and any(folder.iterdir()) and not resume:
        raise runs.RunExistsError(f"{folder} already holds a run; pass --resume to continue it")
    procs.barrier()  # every rank has looked before rank 0 writes
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
    # the whole report goes to log.txt and load_report.txt; the console (and notebook 04, which shows the
    # reports after training) gets its first line
    log(f"[{arm}] initialisation:\n{init_report}", echo=False)
    log(f"[{arm}] {init_report.splitlines()[0]} (the whole report: {folder / 'load_report.txt'})")
    if procs.main:
        files.atomic_write_text(folder / "load_report.txt", init_report + "\n")
    trainer = Trainer(drafter, data, train, seed, folder, procs, log=log)
    check_batches = trainer.check_batches()
    metrics, baseline = trainer.evaluate(check_batches)
    check = diagnose(metrics, baseline, data.vocab_map.vd, warm_start=arm != "scratch")
    log(f"[{arm}] {check.message}")
    if procs.main:
        files.atomic_write_text(folder / "check.json", json.dumps(asdict(check), indent=2) + "\n")
    if not check.passed:
        if arm == "drafter-no-remap":
            log(f"[{arm}] trained anyway: this arm reproduces the bug on purpose (train.allow_no_remap)")
        elif train["check_enforce"]:
            raise StepZeroCheckFailed(
                f"[{arm}] {check.message} (set train.check_enforce=false to train anyway)"
            )
        else:
            log(f"[{arm}] trained anyway: train.check_enforce is false")

    final = trainer.fit(resume=resume)
    final_metrics, final_baseline = trainer.evaluate(check_batches)
    final_check = diagnose(final_metrics, final_baseline, data.vocab_map.vd, warm_start=False)
    drafter_path = folder / "drafter"
    if procs.main:  # a resumed arm may have saved them before it was stopped: the same weights, replaced
        save_drafter(trainer.drafter, drafter_path, layout="sglang", overwrite=resume)
        if train["save_speculators"]:
            save_drafter(trainer.drafter, speculators_copy, layout="speculators", engines=export_engines,
                         overwrite=resume)
    result = ArmResult(
        arm=arm, folder=str(folder), init_report=init_report, check=asdict(check), final=final,
        final_check=asdict(final_check), drafter=str(drafter_path), steps=trainer.step,
        seconds=time.perf_counter() - start,
    )
    log(f"[{arm}] done: loss {final_check.loss_0:.3f}, acc_0 {final_check.acc_0:.2%}, predicted tau "
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
    check_settings(train)
    out = Path(out)
    if train["nproc"] > 1:
        if train["data_mode"] == "online":  # the text first, in one process (self-distillation is long)
            ensure_text(params, out, Target.from_params(params["target"], params["run"]["device"]))
        launch(params, out, run_dir, resume=resume)
        return {arm: ArmResult.read(out / arm) for arm in train["arms"]}
    procs = Processes.start(params["run"]["device"])
    data = arms_data(params, out, run_dir, procs)
    return {arm: train_arm(arm, params, out, data, procs, resume=resume) for arm in train["arms"]}


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
    cached.parent.mkdir(parents=True, exist_ok=True)
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
        check_settings(params["train"])
        data = arms_data(params, out, run_dir, procs)
        for arm in params["train"]["arms"]:
            train_arm(arm, params, out, data, procs, resume=args.resume)
    except (ValueError, FileExistsError) as err:  # bad input: params, data, checkpoints, a diverged run
        print(f"error (rank {procs.rank}): {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
