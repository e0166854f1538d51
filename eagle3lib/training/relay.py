"""A long training run carried from machine to machine: its relay, the smallest folder from which `eagle3
train --resume` continues the run elsewhere.

A run of many CPU hours outlasts one machine's session, and only what is committed outlives a machine. A
full checkpoint holds fp32 weights and AdamW's two moments (about 115 MB for the chat drafter); the relay
keeps, for each arm, the latest checkpoint's weights in bf16 and its training state without the moments
(the data position, the schedule, the step, the token count, the random state), the measured drafter
`train.select_by` has chosen so far (bf16), the logs and the curve, and the run's params and provenance:
about 19 MB a drafter. The online text (hundreds of MB) is not carried: `restore` rebuilds it from the
corpus and refuses to go on unless its hash is the relay's, since another text would continue in another
data order.

What a relayed resume loses, and logs: the moments (they re-form within tens of steps at AdamW's beta2 0.95,
while the learning rate rewarms over `train.warmup_steps` to where the schedule stands) and the weights'
bits below bf16. Everything else continues as an uninterrupted run would have it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
import yaml

from eagle3lib import files, runs
from eagle3lib.decoding.curves import CURVE_FILE, chosen_point
from eagle3lib.drafter.checkpoint import load_drafter, save_drafter
from eagle3lib.generation import online
from eagle3lib.target.model import Target
from eagle3lib.training.trainer import STATE_FILE, load_state, save_state

RELAY_FILE = "relay.json"
FORMAT = "eagle3lib-relay"
TEXT_FILES = (online.TEXT_FILE, "token_counts.safetensors", "vocab_map.safetensors")  # rebuilt, then checked
MAX_CARRIED_BYTES = 4 << 20  # logs, curves and manifests; weights go through the bf16 copies below
NOT_CARRIED = ("html", "screenshots")  # rendered reports, made again from the run


class RelayError(ValueError):
    pass


def save(run_dir: Path, out: Path, command: str) -> dict:
    """Write the relay of the unfinished online run `run_dir` to `out` (replacing an older relay of the same
    run, never a newer one). Safe beside the running trainer: every arm is carried at its latest complete
    checkpoint, with the curve and metrics cut there. Returns the relay's record."""
    run_dir, out = Path(run_dir), Path(out)
    finetune = run_dir / runs.FINETUNE
    text = finetune / online.FOLDER / online.TEXT_FILE
    if not text.is_file():
        raise RelayError(f"{run_dir}: no online text ({text}); a relay carries online runs (train.data_mode: "
                         "online), whose data is rebuilt from the corpus, not captured hidden states")
    arms = {arm.name: _arm_state(arm) for arm in sorted(finetune.iterdir())
            if arm.is_dir() and arm.name != online.FOLDER}
    if not arms:
        raise RelayError(f"{finetune}: no arm folder to relay")
    previous = out / RELAY_FILE
    if previous.exists():
        _refuse_going_back(json.loads(previous.read_text()), run_dir.name, arms, previous)
    with files.staged_folder(out, replace=True) as staging:
        for path in sorted(run_dir.rglob("*")):
            rel = path.relative_to(run_dir)
            if path.is_file() and _carried_as_is(rel, arms):
                if path.stat().st_size > MAX_CARRIED_BYTES:
                    raise RelayError(f"{path}: {path.stat().st_size:,} bytes; a relay carries weights only "
                                     "as the bf16 copies of an arm's checkpoint and chosen point")
                destination = staging / rel
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, destination)
        for arm, state in arms.items():
            _carry_arm(finetune / arm, staging / runs.FINETUNE / arm, state)
        record = {
            "format": FORMAT,
            "run": run_dir.name,
            "command": command,
            "commit": runs.git_commit(),
            "machine": runs.provenance()["machine"],
            "saved": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "arms": {arm: {key: state[key] for key in ("step", "steps", "tokens", "chosen")}
                     for arm, state in arms.items()},
            "text_sha256": {name: tensors_sha256(text.parent / name) for name in TEXT_FILES},
            "sha256": {str(p.relative_to(staging)): files.file_sha256(p)
                       for p in sorted(staging.rglob("*")) if p.is_file()},
        }
        files.atomic_write_text(staging / RELAY_FILE, json.dumps(record, indent=1) + "\n")
    return record


def restore(relay_dir: Path, run_dir: Path | None = None, device: str = "cpu") -> tuple[Path, dict]:
    """Make the run folder the relay `relay_dir` carries (default `outputs/<run>/`, which must not exist):
    every file checked against its recorded hash, the online text rebuilt from the corpus and checked
    against the relay's. `eagle3 train <recipe> --resume` then continues it. Returns the folder and the
    relay's record."""
    relay_dir = Path(relay_dir)
    record = read_record(relay_dir)
    run_dir = Path(run_dir) if run_dir else runs.OUTPUTS_DIR / record["run"]
    if run_dir.exists():
        raise runs.RunExistsError(f"{run_dir} already exists; restore the relay into another folder "
                                  "(--run-dir) or move that one aside")
    with files.staged_folder(run_dir) as staging:
        for rel in record["sha256"]:
            if rel.startswith(f"{runs.FINETUNE}/{online.FOLDER}/"):
                continue  # its manifest names the corpus path of the machine that saved it: rebuilt here
            destination = staging / rel
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(relay_dir / rel, destination)
        params = yaml.safe_load((staging / "params.yaml").read_text())
        target = Target.from_params(params["target"], device)
        folder = staging / runs.FINETUNE / online.FOLDER
        online.make_text(target, params["data"], params["run"]["seed"], folder)
        for name, recorded in record["text_sha256"].items():
            rebuilt = tensors_sha256(folder / name)
            if rebuilt != recorded:
                raise RelayError(
                    f"{relay_dir}: the online text rebuilt here differs from the relay's in {name} (sha256 "
                    f"{rebuilt[:12]}, the relay's {recorded[:12]}): another corpus or tokenizer, so the run "
                    "would continue in another data order. Restore it where the corpus and the target's "
                    "tokenizer are the relay's"
                )
    return run_dir, record


def read_record(relay_dir: Path) -> dict:
    """The relay's record, after checking that it holds exactly the files it lists, with their hashes."""
    path = Path(relay_dir) / RELAY_FILE
    if not path.is_file():
        raise RelayError(f"{relay_dir}: no {RELAY_FILE}; not a relay (made by `eagle3 relay`)")
    record = json.loads(path.read_text())
    if record.get("format") != FORMAT:
        raise RelayError(f"{path}: format {record.get('format')!r}, not {FORMAT!r}")
    present = {str(p.relative_to(relay_dir)) for p in Path(relay_dir).rglob("*") if p.is_file()}
    present.discard(RELAY_FILE)
    if present != set(record["sha256"]):
        extra, missing = sorted(present - set(record["sha256"])), sorted(set(record["sha256"]) - present)
        raise RelayError(f"{relay_dir}: files not in {RELAY_FILE}: {extra or 'none'}; listed but missing: "
                         f"{missing or 'none'}")
    for rel, recorded in record["sha256"].items():
        file = Path(relay_dir) / rel
        found = files.file_sha256(file)
        if found != recorded:
            raise RelayError(f"{file}: SHA-256 {found} is not the {recorded} recorded in {path}: the file "
                             "changed since the relay was saved; check it out again as committed")
    return record


def tensors_sha256(file: Path) -> str:
    """SHA-256 of a safetensors file's tensors (names, dtypes, shapes, values) and metadata, in a fixed order:
    the file's bytes are not fixed, as safetensors writes its metadata in a hash map's order."""
    digest = hashlib.sha256()
    header = files.read_safetensors_header(file, RelayError)
    digest.update(json.dumps([sorted(header.metadata.items()), sorted(header.tensors.items())]).encode())
    tensors = files.read_safetensors(file, error=RelayError)
    for name in sorted(tensors):
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- one arm


def _arm_state(arm: Path) -> dict:
    """What an arm's relay holds: its latest checkpoint, and the chosen point among those measured by then."""
    if (arm / "summary.json").exists():
        raise RelayError(f"{arm}: the arm is finished (summary.json); publish its drafter (eagle3 publish) "
                         "instead of relaying it")
    checkpoints = sorted(p for p in (arm / "checkpoints").glob("step_*") if (p / STATE_FILE).is_file())
    if not checkpoints:
        raise RelayError(f"{arm}: no checkpoint yet ({arm / 'checkpoints'}); a relay continues from one")
    state = load_state(checkpoints[-1] / STATE_FILE)
    step = state["step"]
    points = [p for p in _json_lines(arm / CURVE_FILE) if p["step"] <= step]
    chosen = chosen_point(points, state["train"]["select_by"]) if points else None
    return {"checkpoint": checkpoints[-1], "state": state, "step": step, "steps": state["train"]["steps"],
            "tokens": state["tokens"], "points": points,
            "chosen": chosen and {"step": chosen["step"], "tokens": chosen["tokens"],
                                  "benchmarks": {name: m["tau"] for name, m in chosen["benchmarks"].items()}}}


def _carried_as_is(rel: Path, arms: dict) -> bool:
    """Files copied unchanged: all but locks, rendered reports, the online text, checkpoints and points
    (carried by `_carry_arm`) and the metrics and curve (cut at the checkpoint)."""
    parts = rel.parts
    if any(part.startswith(".") for part in parts) or parts[0] in NOT_CARRIED:
        return False
    if len(parts) >= 3 and parts[0] == runs.FINETUNE and parts[1] == online.FOLDER:
        return parts[2] == "manifest.json"
    if len(parts) >= 3 and parts[0] == runs.FINETUNE and parts[1] in arms:
        return parts[2] not in ("checkpoints", "points", "metrics.jsonl", CURVE_FILE)
    return True


def _carry_arm(arm: Path, out: Path, state: dict) -> None:
    step = state["step"]
    checkpoint = out / "checkpoints" / state["checkpoint"].name
    _bf16_copy(state["checkpoint"] / "drafter", checkpoint / "drafter")
    training_state = {key: value for key, value in state["state"].items() if key != "optimizer"}
    training_state["relayed"] = {"from": str(state["checkpoint"]), "machine": runs.provenance()["machine"],
                                 "dropped": "AdamW's moments; the weights' bits below bf16"}
    save_state(training_state, checkpoint / STATE_FILE)
    if state["chosen"]:
        name = f"step_{state['chosen']['step']:06d}"
        _bf16_copy(arm / "points" / name, out / "points" / name)
        files.atomic_write_text(out / CURVE_FILE, "".join(json.dumps(p) + "\n" for p in state["points"]))
    metrics = _json_lines(arm / "metrics.jsonl")
    files.atomic_write_text(out / "metrics.jsonl",
                            "".join(json.dumps(m) + "\n" for m in metrics if m["step"] <= step))


def _bf16_copy(source: Path, destination: Path) -> None:
    drafter, _ = load_drafter(source, strict=True, dtype=torch.bfloat16)
    save_drafter(drafter, destination, layout="sglang")


def _json_lines(path: Path) -> list[dict]:
    """An arm's jsonl log; its last line may be torn when the trainer is writing it (the trainer drops
    such a line on resume, and so does the relay)."""
    if not path.exists():
        return []
    whole, _, _torn = path.read_text().rpartition("\n")
    return [files.json_line(line, path, number) for number, line in enumerate(whole.splitlines(), 1)]


def _refuse_going_back(previous: dict, run: str, arms: dict, path: Path) -> None:
    if previous.get("run") != run:
        raise RelayError(f"{path} relays run {previous.get('run')!r}, not {run!r}; choose another folder")
    for arm, state in arms.items():
        before = previous["arms"].get(arm, {}).get("step", 0)
        if state["step"] < before:
            raise RelayError(f"{path}: arm {arm} is relayed at step {before}; this run's latest checkpoint "
                             f"is step {state['step']}, older: refusing to replace the relay with it")
